"""Sharded variables under SyncParameterServerStrategy(variable_partitioner).

One in-process cluster of 2 workers and 3 ps hosts every test here (in-process
servers cannot be stopped): 2 shards take 2 of the 3 ps, 3 shards one each,
and unsharded scalars (the global step, metric totals) go round robin
beside them.

The headline test: 2 workers at batch B over S shards follow one process at
2B (float32 tolerance), dense and sparse, SGD, momentum and Adam, S in
{2, 3}. A sharded model starts from per-shard initial values, so the
one-process reference starts from the sharded model's weights, the shards
of each variable concatenated.
"""

import collections
import os
import tempfile
import time

import numpy as np
import pytest
import tensorflow as tf
import testutil
from absl.testing import absltest
from absl.testing import parameterized

import tf2sync
from tf2sync._src import sharding
from tf2sync._src import step_context
from tf2sync._src.internals import ps_variables

# Long: the suite's longest file (about 9 minutes on 2 cores); run by
# `pytest -m slow` and CI.
pytestmark = pytest.mark.slow

NUM_WORKERS, NUM_PS = 2, 3
VOCAB_A, VOCAB_B = 50, 31

OPTIMIZERS = {
    "sgd": lambda: tf.keras.optimizers.SGD(0.1),
    "momentum": lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: tf.keras.optimizers.Adam(0.01),
    "legacy_adam": lambda: tf.keras.optimizers.legacy.Adam(0.01),
    "legacy_momentum": lambda: tf.keras.optimizers.legacy.SGD(
        0.1, momentum=0.9
    ),
    "legacy_adagrad": lambda: tf.keras.optimizers.legacy.Adagrad(0.1),
}


def fixed(shards):
    return tf.distribute.experimental.partitioners.FixedShardsPartitioner(
        shards
    )


def strategy(shards, replicas_to_aggregate=2, **kwargs):
    partitioner = fixed(shards) if shards > 1 else None
    return testutil.strategy(
        NUM_WORKERS,
        NUM_PS,
        replicas_to_aggregate=replicas_to_aggregate,
        variable_partitioner=partitioner,
        **kwargs,
    )


def two_tables_model(seed=0, vocab_a=VOCAB_A):
    return testutil.two_tables_model(seed, vocab_a, VOCAB_B)


MODELS = {
    "dense": testutil.dense_model,
    "sparse": testutil.sparse_model,
    "two_tables": two_tables_model,
}
DATA = {"dense": "dense", "sparse": "sparse", "two_tables": "sparse"}


def full_weights(model):
    """The model's weights with each variable's shards concatenated."""
    return sharding.whole_weights(model.weights)


def shard_counts(model):
    """{variable name: number of shards} for the model's weights."""
    counts = collections.Counter()
    for var in model.weights:
        counts[var.name.split(":")[0].rsplit("/part_", 1)[0]] += 1
    return dict(counts)


def reference(kind, opt_fn, batches, initial):
    """One process, one step per global batch, from `initial` weights."""
    return testutil.one_process(MODELS[kind], opt_fn, batches, initial)


def split(x, y, rounds, batch):
    """Per round: each worker's batch, and the global batch."""
    out = []
    for r in range(rounds):
        lo = r * NUM_WORKERS * batch
        parts = [
            (
                x[lo + i * batch : lo + (i + 1) * batch],
                y[lo + i * batch : lo + (i + 1) * batch],
            )
            for i in range(NUM_WORKERS)
        ]
        out.append(
            (
                parts,
                (
                    x[lo : lo + NUM_WORKERS * batch],
                    y[lo : lo + NUM_WORKERS * batch],
                ),
            )
        )
    return out


class EquivalenceTest(parameterized.TestCase):
    @parameterized.product(
        kind=("dense", "sparse", "two_tables"),
        opt_name=("sgd", "momentum", "adam"),
        shards=(2, 3),
    )
    def test_n_workers_at_b_over_s_shards_equal_one_process_at_nb(
        self, kind, opt_name, shards
    ):
        batch, rounds = 8, 4
        sync = strategy(shards)
        with sync.scope():
            model = MODELS[kind]()
            opt = tf2sync.SyncOptimizer(OPTIMIZERS[opt_name]())
            opt.build(model.trainable_variables)
        # Every variable of rank >= 1 is split, each shard on its own ps.
        counts = shard_counts(model)
        self.assertEqual(set(counts.values()), {shards}, counts)
        for name in counts:
            devices = [
                v.device for v in model.weights if v.name.startswith(name)
            ]
            self.assertLen(set(devices), shards, devices)
        initial = full_weights(model)
        x, y = testutil.data(DATA[kind], NUM_WORKERS * batch * rounds)
        loop = testutil.Loop(sync, model, opt)
        global_batches = []
        for parts, whole in split(x, y, rounds, batch):
            loop.round(parts)
            global_batches.append(whole)
        expected = reference(
            kind, OPTIMIZERS[opt_name], global_batches, initial
        )
        self.assertEqual(int(opt.iterations.numpy()), rounds)
        self.assertEqual(int(opt.gradients_accepted.numpy()), 2 * rounds)
        self.assertEqual(int(opt.stale_dropped.numpy()), 0)
        self.assertLess(
            testutil.max_abs_diff(full_weights(model), expected), 1e-5
        )

    def test_sparse_gradients_stay_sparse_on_each_shards_ps(self):
        sync = strategy(3)
        with sync.scope():
            model = two_tables_model()
            opt = tf2sync.SyncOptimizer(OPTIMIZERS["momentum"]())
            opt.build(model.trainable_variables)
        loop = testutil.Loop(sync, model, opt)
        x, y = testutil.data("sparse", 2 * 8)
        loop.round(split(x, y, 1, 8)[0][0])
        layout = opt._aggregator._layout
        tables = [v for v in model.trainable_variables if "table" in v.name]
        # Each table shard's (ids, rows) wait on that shard's ps, in its
        # staging queue; no dense buffer holds a row of a table.
        self.assertEqual(
            [s.variable for s in layout.sparse], tables, layout.sparse
        )
        stagings = opt._aggregator._scale_out.stagings
        for slot in layout.sparse:
            self.assertIsNone(slot.queue)
            (staging,) = [
                st for st in stagings if any(s is slot for s in st.sparse)
            ]
            self.assertEqual(staging.device, slot.variable.device)
            self.assertEqual(staging.queue.queue_ref.device, staging.device)
        for group in layout.dense:
            for var in group.variables:
                self.assertNotIn("table", var.name)
                self.assertEqual(var.device, group.device)
        self.assertEqual(int(opt.iterations.numpy()), 1)


class ConsistentReadTest(parameterized.TestCase):
    """A step tagged t reads every shard as of step t, never older.

    `w` ([12, 1], 3 shards, one per ps) trains by SGD(1.0) on the loss
    `sum(w * c)`: every push's gradient is `c`, so after t updates
    `w = w0 - t * c` exactly, on every shard. Each step returns its tag and
    what it read of each shard; a read of a shard not yet (or no longer)
    at the tag's step shows as a shard whose value names another step.
    Steps sleep between tag and reads, so that the other worker's push,
    and with a backup worker its update, land while they read.
    """

    @parameterized.named_parameters(
        ("all_aggregated", 2, 2),
        # 1 of 2: an update can land between a step's tag and its reads;
        # such a step is stale, and is dropped.
        ("backup", 1, 2),
    )
    def test_reads_after_the_tag_see_that_step_on_every_shard(self, rta, total):
        sync = strategy(3, replicas_to_aggregate=rta, total_num_replicas=total)
        c = np.arange(1, 13, dtype=np.float32).reshape(12, 1) / 8.0
        with sync.scope():
            w = tf.Variable(np.zeros([12, 1], np.float32), name="w")
            opt = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(1.0))
            opt.build(w.variables)
        self.assertLen(w.variables, 3)
        self.assertLen({v.device for v in w.variables}, 3)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(sync)

        def replica(seconds):
            tag = step_context.current_step().tag
            slept = tf.py_function(
                lambda s: time.sleep(float(s)) or 0.0, [seconds], tf.float32
            )
            with tf.control_dependencies([slept]):
                reads = [tf.identity(v.read_value()) for v in w.variables]
            with tf.GradientTape() as tape:
                tape.watch(reads)
                loss = tf.add_n(
                    [
                        tf.reduce_sum(r * part)
                        for r, part in zip(reads, np.split(c, [4, 8]))
                    ]
                )
            grads = tape.gradient(loss, reads)
            applied = opt.apply_gradients(zip(grads, w.variables))
            return tag, tf.concat(reads, 0), applied

        @tf.function
        def step(seconds):
            return sync.run(replica, args=(seconds,))

        rng = np.random.RandomState(0)
        results = [
            coordinator.schedule(
                step, args=(tf.constant(rng.uniform(0, 0.02), tf.float32),)
            )
            for _ in range(40)
        ]
        coordinator.join()
        fresh = 0
        for result in results:
            tag, read, applied = (np.asarray(v) for v in result.fetch())
            steps = np.round(-read[:, 0] / c[:, 0]).astype(int)
            np.testing.assert_allclose(-read, steps[:, None] * c, atol=1e-5)
            # Never older than the tag, on any shard.
            self.assertTrue(np.all(steps >= int(tag)), (int(tag), steps))
            if np.all(steps == int(tag)):
                fresh += 1
        final = int(opt.iterations.numpy())
        np.testing.assert_allclose(
            tf.concat(w.variables, 0).numpy(), -final * c, atol=1e-4
        )
        self.assertEqual(
            int(opt.gradients_accepted.numpy()) // rta * rta,
            final * rta,
        )
        self.assertGreaterEqual(fresh, int(opt.gradients_accepted.numpy()))
        if rta == total:
            self.assertEqual(final, 20)
            self.assertEqual(int(opt.stale_dropped.numpy()), 0)


class EverywhereTest(parameterized.TestCase):
    """fit, Trainer, MultiOptimizer, EMA, mixed precision on shards."""

    def _fit_reference(self, model, opt_fn, x, y, steps, kind="sparse"):
        return reference(kind, opt_fn, [(x, y)] * steps, full_weights(model))

    @parameterized.named_parameters(("repeated", True), ("keras_loop", False))
    def test_fit_matches_the_one_process_reference(self, repeated):
        sync = strategy(2)
        with sync.scope():
            model = two_tables_model()
            opt = tf2sync.SyncOptimizer(OPTIMIZERS["momentum"]())
            model.compile(optimizer=opt, loss=testutil.LOSS)
            if not repeated:
                tf2sync.unroll_fit_steps(model, False)
        x, y = testutil.data("sparse", 16)
        initial = full_weights(model)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        history = model.fit(
            ds,
            epochs=2,
            steps_per_epoch=6,
            verbose=0,
            callbacks=[tf2sync.SyncMetrics(batch_size=16)],
        )
        # 12 pushes of the same batch, 2 per update: 6 updates at that
        # batch (the mean of identical gradients is the gradient).
        self.assertEqual(int(opt.iterations.numpy()), 6)
        self.assertEqual(history.history["sync_steps"], [3, 6])
        self.assertEqual(history.history["stale_dropped"], [0, 0])
        expected = reference(
            "two_tables", OPTIMIZERS["momentum"], [(x, y)] * 6, initial
        )
        self.assertLess(
            testutil.max_abs_diff(full_weights(model), expected), 1e-5
        )

    def test_multi_optimizer_refuses_a_table_split_over_groups(self):
        # A pattern that matches one shard's name (`.../part_0`) would give
        # one table two optimizers; refused when the router is built.
        sync = strategy(3)
        with sync.scope():
            model = two_tables_model()
            multi = tf2sync.MultiOptimizer(
                groups={"table_a.*part_0": tf.keras.optimizers.Adam(0.01)},
                default=tf.keras.optimizers.SGD(0.1),
            )
            opt = tf2sync.SyncOptimizer(multi)
            with self.assertRaisesRegex(
                ValueError,
                r"The shards of sharded variable table_a/embeddings are "
                r"routed to several groups: \[\"group 0 \(regex "
                r"'table_a.\*part_0'\)\", 'default'\]",
            ):
                opt.build(model.trainable_variables)

    def test_multi_optimizer_routes_shards_by_identity(self):
        sync = strategy(3)
        groups = (
            lambda m: [  # noqa: E731
                (
                    tf.keras.optimizers.SGD(0.1, momentum=0.9),
                    m.get_layer("table_a"),
                ),
                (
                    tf.keras.optimizers.Adam(0.01),
                    [m.get_layer("table_b")] + m.layers[-2:],
                ),
            ]
        )
        with sync.scope():
            model = two_tables_model()
            multi = tf2sync.MultiOptimizer(groups(model))
            opt = tf2sync.SyncOptimizer(multi)
            opt.build(model.trainable_variables)
        initial = full_weights(model)
        x, y = testutil.data("sparse", 2 * 8 * 3)
        loop = testutil.Loop(sync, model, opt)
        global_batches = []
        for parts, whole in split(x, y, 3, 8):
            loop.round(parts)
            global_batches.append(whole)
        ref = two_tables_model()
        ref.set_weights(initial)
        ref_opt = tf2sync.MultiOptimizer(groups(ref))
        for bx, by in global_batches:
            with tf.GradientTape() as tape:
                loss = testutil.mean_loss(by, ref(bx))
            grads = tape.gradient(loss, ref.trainable_variables)
            ref_opt.apply_gradients(zip(grads, ref.trainable_variables))
        self.assertEqual(int(opt.iterations.numpy()), 3)
        self.assertLess(
            testutil.max_abs_diff(full_weights(model), ref.get_weights()),
            1e-5,
        )

        # Saved with a model, it routes by rank, a sharded table counting
        # once: the same groups over 3 shards and in the unsharded model.
        def groups_of(router, variables):
            index = {
                id(v): i
                for i, vs in router.route(variables).items()
                for v in vs
            }
            return [index[id(v)] for v in variables]

        loaded = tf2sync.MultiOptimizer.from_config(multi.get_config())
        self.assertEqual(
            groups_of(loaded, model.trainable_variables),
            groups_of(multi, model.trainable_variables),
        )
        self.assertEqual(
            groups_of(loaded, ref.trainable_variables),
            groups_of(ref_opt, ref.trainable_variables),
        )

    def test_ema_shadows_each_shard_beside_it(self):
        sync = strategy(2)
        with sync.scope():
            model = testutil.sparse_model()
            opt = tf2sync.SyncOptimizer(
                tf.keras.optimizers.SGD(0.5), ema_decay=0.5
            )
            model.compile(optimizer=opt, loss=testutil.LOSS)
        x, y = testutil.data("sparse", 16)
        w0 = full_weights(model)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(ds, epochs=1, steps_per_epoch=2, verbose=0)  # 1 update
        self.assertEqual(int(opt.iterations.numpy()), 1)
        for var, shadow in zip(opt._ema.variables, opt.ema_variables):
            self.assertEqual(shadow.device, var.device)
        w1 = full_weights(model)
        with opt.ema_weights():
            ema = full_weights(model)
        for a, b, e in zip(w0, w1, ema):
            np.testing.assert_allclose(e, 0.5 * a + 0.5 * b, atol=1e-6)

    def test_mixed_precision_trains_sharded_tables(self):
        sync = strategy(2)
        tf.keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            with sync.scope():
                model = two_tables_model()
                opt = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
                model.compile(optimizer=opt, loss=testutil.LOSS)
        finally:
            tf.keras.mixed_precision.set_global_policy("float32")
        # Every weight is sharded, float32 on its ps, read as float16.
        self.assertEqual(set(shard_counts(model).values()), {2})
        self.assertEqual({v.dtype for v in model.weights}, {tf.float32})
        self.assertEqual(model.layers[1].compute_dtype, "float16")
        x, y = testutil.data("sparse", 16)
        before = full_weights(model)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(ds, epochs=1, steps_per_epoch=8, verbose=0)
        self.assertEqual(int(opt.iterations.numpy()), 4)
        self.assertEqual(int(opt.nonfinite_dropped.numpy()), 0)
        after = full_weights(model)
        self.assertGreater(testutil.max_abs_diff(after, before), 0.0)
        for w in after:
            self.assertTrue(np.all(np.isfinite(w)))


def trained(shards, steps=4, optimizer="momentum"):
    """A two-table model fit for `steps` updates over `shards` shards."""
    sync = strategy(shards)
    with sync.scope():
        model = two_tables_model()
        opt = tf2sync.SyncOptimizer(OPTIMIZERS[optimizer]())
        model.compile(optimizer=opt, loss=testutil.LOSS)
    x, y = testutil.data("sparse", 16)
    ds = tf.data.Dataset.from_tensors((x, y)).repeat()
    model.fit(ds, epochs=1, steps_per_epoch=2 * steps, verbose=0)
    return model, opt


class GuaranteesTest(absltest.TestCase):
    def test_a_non_finite_push_is_dropped_for_every_shard(self):
        sync = strategy(3)
        with sync.scope():
            model = testutil.dense_model()
            opt = tf2sync.SyncOptimizer(OPTIMIZERS["sgd"]())
            opt.build(model.trainable_variables)
        x, y = testutil.data("dense", 8)
        bad = x.copy()
        bad[0, 0] = np.nan
        before = full_weights(model)
        # 2 finite pushes and a NaN one: one update, of the finite pair.
        testutil.Loop(sync, model, opt).round([(x, y), (bad, y), (x, y)])
        self.assertEqual(int(opt.nonfinite_dropped.numpy()), 1)
        self.assertEqual(int(opt.iterations.numpy()), 1)
        expected = reference("dense", OPTIMIZERS["sgd"], [(x, y)], before)
        self.assertLess(
            testutil.max_abs_diff(full_weights(model), expected), 1e-5
        )

    def test_a_model_built_outside_the_scope_is_refused(self):
        sync = strategy(2)
        model = testutil.sparse_model()  # plain variables, in this process
        before = model.get_weights()
        with sync.scope():
            opt = tf2sync.SyncOptimizer(OPTIMIZERS["sgd"]())
            # tf_keras refuses it at compile, naming the table.
            with self.assertRaisesRegex(
                ValueError,
                r"(?s)embedding(_\d+)?/embeddings:0.*was not created in the "
                r"distribution strategy scope",
            ):
                model.compile(optimizer=opt, loss=testutil.LOSS)
        self.assertEqual(testutil.max_abs_diff(model.get_weights(), before), 0)
        # Built outside: one whole variable each (layer names vary with
        # the models built before in this process).
        self.assertEqual(list(shard_counts(model).values()), [1, 1, 1])


class CheckpointTest(parameterized.TestCase):
    @staticmethod
    def _momenta(opt, model):
        """Each model variable's slots, its shards' concatenated."""
        inner = opt.inner_optimizer
        if hasattr(inner, "get_slot_names"):  # the legacy family
            return [
                np.concatenate(
                    [inner.get_slot(part, name).numpy() for part in parts]
                )
                for name in inner.get_slot_names()
                for _, parts in ps_variables.group_shards(model.weights)
            ]
        out = []
        for var in inner.variables():
            if var is inner.iterations or var.shape.rank == 0:
                continue
            parts = getattr(var, "variables", [var])
            out.append(np.concatenate([p.numpy() for p in parts], axis=0))
        return out

    @parameterized.named_parameters(
        ("3_to_2", 3, 2),
        ("3_to_1", 3, 1),
        ("1_to_3", 1, 3),
        ("2_to_2", 2, 2),
        # The legacy family's slots belong to the inner optimizer alone
        # (its wrapper lists them too, for users).
        ("legacy_momentum_2_to_1", 2, 1, "legacy_momentum"),
        ("legacy_adagrad_1_to_2", 1, 2, "legacy_adagrad"),
    )
    def test_saved_with_s_shards_restores_with_s_prime(
        self, saved, restored, optimizer="momentum"
    ):
        model, opt = trained(saved, optimizer=optimizer)
        path = tf.train.Checkpoint(model=model, optimizer=opt).save(
            os.path.join(tempfile.mkdtemp(), "ckpt")
        )
        weights, momenta = full_weights(model), self._momenta(opt, model)
        self.assertGreater(max(float(np.abs(m).max()) for m in momenta), 0)
        sync = strategy(restored)
        with sync.scope():
            model2 = two_tables_model(seed=5)
            opt2 = tf2sync.SyncOptimizer(OPTIMIZERS[optimizer]())
            model2.compile(optimizer=opt2, loss=testutil.LOSS)
            opt2.build(model2.trainable_variables)
        self.assertEqual(set(shard_counts(model2).values()), {restored})
        tf.train.Checkpoint(model=model2, optimizer=opt2).restore(
            path
        ).assert_existing_objects_matched()
        self.assertEqual(int(opt2.iterations.numpy()), 4)
        self.assertEqual(
            testutil.max_abs_diff(full_weights(model2), weights), 0
        )
        self.assertEqual(
            testutil.max_abs_diff(self._momenta(opt2, model2), momenta), 0
        )

    @parameterized.named_parameters(("1_to_2", 1, 2), ("2_to_2", 2, 2))
    def test_a_legacy_restore_before_the_build_keeps_the_slots(
        self, saved, restored
    ):
        # `model.load_weights` before `fit` builds the optimizer: tf_keras
        # creates each restored slot of a sharded variable whole, then the
        # build made the shards' slots from zero and forgot the whole ones.
        model, opt = trained(saved, optimizer="legacy_momentum")
        path = tf.train.Checkpoint(model=model, optimizer=opt).save(
            os.path.join(tempfile.mkdtemp(), "ckpt")
        )
        momenta = self._momenta(opt, model)

        def restored_parts(build_first):
            sync = strategy(restored)
            with sync.scope():
                new_model = two_tables_model(seed=5)
                new_opt = tf2sync.SyncOptimizer(OPTIMIZERS["legacy_momentum"]())
                new_model.compile(optimizer=new_opt, loss=testutil.LOSS)
                if build_first:
                    new_opt.build(new_model.trainable_variables)
            tf.train.Checkpoint(model=new_model, optimizer=new_opt).restore(
                path
            )
            new_opt.build(new_model.trainable_variables)
            return new_model, new_opt

        late_model, late_opt = restored_parts(build_first=False)
        self.assertEqual(
            testutil.max_abs_diff(self._momenta(late_opt, late_model), momenta),
            0,
        )
        early_model, early_opt = restored_parts(build_first=True)
        # No whole slot is left beside the shards' ones.
        self.assertEqual(
            len(late_opt.inner_optimizer.weights),
            len(early_opt.inner_optimizer.weights),
        )
        x, y = testutil.data("sparse", 16)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        for each in (late_model, early_model):
            each.fit(ds, epochs=1, steps_per_epoch=2, verbose=0)
        self.assertLess(
            testutil.max_abs_diff(
                full_weights(late_model), full_weights(early_model)
            ),
            1e-6,
        )
        self.assertEqual(int(late_opt.iterations.numpy()), 5)
        # Another optimizer's slots (restored with expect_partial) are left
        # unused, as tf_keras leaves them: the build still works.
        sync = strategy(restored)
        with sync.scope():
            other_model = two_tables_model(seed=5)
            other = tf2sync.SyncOptimizer(OPTIMIZERS["legacy_adagrad"]())
            other_model.compile(optimizer=other, loss=testutil.LOSS)
        tf.train.Checkpoint(model=other_model, optimizer=other).restore(
            path
        ).expect_partial()
        other_model.fit(ds, epochs=1, steps_per_epoch=2, verbose=0)
        self.assertEqual(int(other.iterations.numpy()), 5)

    @parameterized.parameters("adam", "legacy_adagrad")
    def test_trainer_resume_with_the_same_shards_is_exact(self, optimizer):
        x, y = testutil.data("sparse", 16)

        def dataset_fn(_):
            return tf.data.Dataset.from_tensors((x, y)).repeat()

        def trainer(directory):
            sync = strategy(3)
            with sync.scope():
                model = two_tables_model()
                opt = tf2sync.SyncOptimizer(OPTIMIZERS[optimizer]())
            return tf2sync.Trainer(
                strategy=sync,
                model=model,
                optimizer=opt,
                loss_fn=testutil.mean_loss,
                steps_per_loop=2,
                checkpoint_dir=directory,
                verbose=0,
            )

        whole = trainer(tempfile.mkdtemp())
        whole.train(dataset_fn, epochs=2, steps_per_epoch=4)
        directory = tempfile.mkdtemp()
        trainer(directory).train(dataset_fn, epochs=1, steps_per_epoch=4)
        resumed = trainer(directory)
        resumed.train(dataset_fn, epochs=2, steps_per_epoch=4)
        self.assertEqual(int(resumed.optimizer.iterations.numpy()), 4)
        self.assertLess(
            testutil.max_abs_diff(
                full_weights(resumed.model), full_weights(whole.model)
            ),
            1e-6,
        )

    def test_a_table_of_another_vocabulary_size_is_named(self):
        model, opt = trained(2, steps=1)
        directory = tempfile.mkdtemp()
        tf.train.CheckpointManager(
            tf.train.Checkpoint(model=model, optimizer=opt), directory, 1
        ).save()
        sync = strategy(2)
        with sync.scope():
            other = two_tables_model(vocab_a=VOCAB_A + 10)
            opt2 = tf2sync.SyncOptimizer(OPTIMIZERS["momentum"]())
        before = full_weights(other)
        trainer = tf2sync.Trainer(
            strategy=sync,
            model=other,
            optimizer=opt2,
            loss_fn=testutil.mean_loss,
            steps_per_loop=2,
            checkpoint_dir=directory,
            verbose=0,
        )
        with self.assertRaisesRegex(
            ValueError,
            rf"checkpoint {directory}/ckpt-1 does not fit.*"
            r"table_a/embeddings.*shape \[50, 4\], the model.s has shape "
            r"\[60, 4\]",
        ):
            trainer.train(
                lambda _: tf.data.Dataset.from_tensors(
                    testutil.data("sparse", 16)
                ).repeat(),
                epochs=1,
                steps_per_epoch=2,
            )
        self.assertEqual(testutil.max_abs_diff(full_weights(other), before), 0)
        self.assertEqual(int(opt2.iterations.numpy()), 0)


class ExportTest(absltest.TestCase):
    def test_h5_of_a_sharded_model_is_refused_at_save(self):
        # h5 keeps one entry per shard: the file saved without a word and
        # failed to load into another sharding (issue 55).
        model, _ = trained(3)
        directory = tempfile.mkdtemp()
        for save, name, kwargs in (
            (model.save, "model.h5", {}),
            (model.save, "model", {"save_format": "h5"}),
            (model.save_weights, "weights.h5", {}),
            (model.save_weights, "weights.keras", {}),  # h5 for weights
            (model.save, "model_tf.h5", {"save_format": "tf"}),  # still h5
        ):
            path = os.path.join(directory, name)
            with self.assertRaisesRegex(
                ValueError,
                r"^A model with sharded variables cannot be saved as HDF5 "
                r"\(save(_weights)?\): .* Save it as \.keras .* Received: "
                r"filepath=",
            ):
                save(path, **kwargs)
            self.assertFalse(os.path.exists(path))
        # The formats it names save, and tf_keras's new weights file,
        # which keeps each table whole.
        model.save(os.path.join(directory, "model.keras"))
        model.save_weights(os.path.join(directory, "checkpoint"))
        model.save_weights(os.path.join(directory, "w.weights.h5"))

    def test_a_sharded_model_exports_and_loads_without_tf2sync(self):
        model, _ = trained(3)
        x, _ = testutil.data("sparse", 16)
        local = two_tables_model(seed=3)
        local.set_weights(full_weights(model))
        expected = local.predict(x, verbose=0)
        directory = tempfile.mkdtemp()
        paths = []
        for kind in ("model.keras", "savedmodel"):
            path = os.path.join(directory, kind)
            model.save(path)
            paths.append(path)
            # Without its optimizer, without tf2sync.
            np.testing.assert_allclose(
                testutil.predict_in_plain_process(self, path, x),
                expected,
                rtol=1e-5,
                atol=1e-6,
            )
        # For serving: tf.saved_model.save's signature reads whole tables.
        path = os.path.join(directory, "serving")
        tf.saved_model.save(model, path)
        np.testing.assert_allclose(
            testutil.serve_in_plain_process(self, path, x),
            expected,
            rtol=1e-5,
            atol=1e-6,
        )
        # With it, compiled: the inner optimizer trains the whole tables.
        _, y = testutil.data("sparse", 16)
        got = testutil.load_and_train_in_plain_process(self, paths, x, y)
        for path in paths:
            np.testing.assert_allclose(
                got[path]["predict"], expected, rtol=1e-5, atol=1e-6
            )
            self.assertGreater(got[path]["moved"], 0, path)


if __name__ == "__main__":
    absltest.main()
