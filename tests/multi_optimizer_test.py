"""MultiOptimizer: routing by identity, and groups inside one sync step."""

import tempfile

import numpy as np
import tensorflow as tf
import testutil
from absl.testing import absltest

import tf2sync
from tf2sync._src.internals import ps_variables


def _two_towers():
    """Two sub-models whose layers share names: a trap for name routing."""
    tf.keras.utils.set_random_seed(0)
    a = tf.keras.Sequential(
        [tf.keras.layers.Dense(3, name="fc", input_shape=(4,))], name="a"
    )
    b = tf.keras.Sequential(
        [tf.keras.layers.Dense(3, name="fc", input_shape=(4,))], name="b"
    )
    x = tf.keras.Input((4,))
    model = tf.keras.Model(x, a(x) + b(x))
    return model, a, b


class RoutingTest(absltest.TestCase):
    def test_same_name_layers_go_to_their_own_group(self):
        model, a, b = _two_towers()
        self.assertEqual(
            a.trainable_weights[0].name, b.trainable_weights[0].name
        )
        opt_a = tf.keras.optimizers.SGD(0.1)
        opt_b = tf.keras.optimizers.SGD(0.0)
        multi = tf2sync.MultiOptimizer([(opt_a, a), (opt_b, b)])
        routes = multi.route(model.trainable_variables)
        self.assertEqual(
            [id(v) for v in routes[0]], [id(v) for v in a.trainable_weights]
        )
        self.assertEqual(
            [id(v) for v in routes[1]], [id(v) for v in b.trainable_weights]
        )

    def test_two_groups_match_one_variable(self):
        model = testutil.dense_model()
        multi = tf2sync.MultiOptimizer(
            groups={
                "kernel": tf.keras.optimizers.SGD(0.1),
                "dense": tf.keras.optimizers.SGD(0.2),
            }
        )
        with self.assertRaisesRegex(
            ValueError,
            r"Variable dense\S*/kernel:0 is matched by several groups: "
            r"\[\"group 0 \(regex 'kernel'\)\", "
            r"\"group 1 \(regex 'dense'\)\"\]",
        ):
            multi.route(model.trainable_variables)

    def test_unmatched_without_default(self):
        model = testutil.dense_model()
        multi = tf2sync.MultiOptimizer(
            groups={"kernel": tf.keras.optimizers.SGD(0.1)}
        )
        with self.assertRaisesRegex(
            ValueError,
            r"Variable dense\S*/bias:0 is matched by no group and there is "
            r"no `default` optimizer. Groups: "
            r"\[\"group 0 \(regex 'kernel'\)\"\]",
        ):
            multi.route(model.trainable_variables)

    def test_default_catches_the_rest(self):
        model = testutil.dense_model()
        multi = tf2sync.MultiOptimizer(
            groups={lambda v: "kernel" in v.name: tf.keras.optimizers.SGD()},
            default=tf.keras.optimizers.Adam(),
        )
        routes = multi.route(model.trainable_variables)
        self.assertLen(routes[0], 2)
        self.assertLen(routes[1], 2)

    def test_a_plain_apply_routes_every_variable_given(self):
        # What get_config saves: the biases get no gradient here, yet a
        # model loaded with this optimizer has them.
        model = testutil.dense_model()
        variables = model.trainable_variables
        multi = tf2sync.MultiOptimizer(
            groups={"kernel": tf.keras.optimizers.SGD(0.1)},
            default=tf.keras.optimizers.SGD(0.2),
        )
        grads = [
            tf.ones_like(v) if "kernel" in v.name else None for v in variables
        ]
        multi.apply_gradients(zip(grads, variables))
        self.assertEqual(multi.get_config()["num_variables"], 4)
        self.assertEqual(multi.get_config()["groups"][0]["variables"], [0, 2])
        # A layer frozen since: routed again over what is given.
        multi.apply_gradients(zip(grads[2:], variables[2:]))
        self.assertEqual(multi.get_config()["num_variables"], 2)

    def test_not_an_optimizer(self):
        with self.assertRaisesRegex(TypeError, "`group optimizer` must be"):
            tf2sync.MultiOptimizer(groups={"x": "sgd"})


class SyncMultiOptimizerTest(absltest.TestCase):
    def _groups(self, model):
        """The seed scenario: conv at lr, dense kernels 10*lr, biases 20*lr."""
        lr = 0.01
        return tf2sync.MultiOptimizer(
            groups={
                lambda v: "conv" in v.name and "kernel" in v.name: (
                    tf.keras.optimizers.SGD(lr, momentum=0.9)
                ),
                lambda v: "dense" in v.name and "kernel" in v.name: (
                    tf.keras.optimizers.SGD(10 * lr, momentum=0.9)
                ),
                lambda v: "bias" in v.name: tf.keras.optimizers.SGD(
                    20 * lr, momentum=0.9
                ),
            }
        )

    def _conv_model(self):
        tf.keras.utils.set_random_seed(0)
        return tf.keras.Sequential(
            [
                tf.keras.layers.Conv2D(4, 3, input_shape=(6, 6, 1)),
                tf.keras.layers.Flatten(),
                tf.keras.layers.Dense(3),
            ]
        )

    def test_three_groups_match_reference_and_step_once(self):
        rounds, batch = 3, 4
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = self._conv_model()
            multi = self._groups(model)
            opt = tf2sync.SyncOptimizer(multi)
            opt.build(model.trainable_variables)
        rng = np.random.RandomState(0)
        x = rng.randn(2 * batch * rounds, 6, 6, 1).astype("float32")
        y = rng.randint(0, 3, 2 * batch * rounds)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

        def replica(xb, yb):
            with tf.GradientTape() as tape:
                loss = testutil.mean_loss(yb, model(xb))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        @tf.function
        def step(xb, yb):
            strategy.run(replica, args=(xb, yb))

        for r in range(rounds):
            for i in range(2):
                lo = (2 * r + i) * batch
                coordinator.schedule(
                    step, args=(x[lo : lo + batch], y[lo : lo + batch])
                )
            coordinator.join()
        # Global step: +1 per synchronous step, not once per group.
        self.assertEqual(int(opt.iterations.numpy()), rounds)
        for group in multi.optimizers:
            self.assertEqual(int(group.iterations.numpy()), rounds)
        # Equivalence: one process, same groups, batch 2*B.
        ref = self._conv_model()
        ref_multi = self._groups(ref)
        for r in range(rounds):
            lo = 2 * r * batch
            with tf.GradientTape() as tape:
                loss = testutil.mean_loss(
                    y[lo : lo + 2 * batch], ref(x[lo : lo + 2 * batch])
                )
            grads = tape.gradient(loss, ref.trainable_variables)
            ref_multi.apply_gradients(zip(grads, ref.trainable_variables))
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), ref.get_weights()),
            1e-5,
        )

    def test_frozen_group_does_not_move(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model, a, b = _two_towers()
            multi = tf2sync.MultiOptimizer(
                [
                    (tf.keras.optimizers.SGD(0.1, momentum=0.9), a),
                    (tf.keras.optimizers.SGD(0.0, momentum=0.9), b),
                ]
            )
            model.compile(optimizer=tf2sync.SyncOptimizer(multi), loss="mse")
        before_a = [w.copy() for w in a.get_weights()]
        before_b = [w.copy() for w in b.get_weights()]
        rng = np.random.RandomState(0)
        x = rng.randn(16, 4).astype("float32")
        y = rng.randn(16, 3).astype("float32")
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(ds, epochs=1, steps_per_epoch=6, verbose=0)
        self.assertEqual(int(model.optimizer.iterations.numpy()), 3)
        self.assertEqual(testutil.max_abs_diff(b.get_weights(), before_b), 0.0)
        self.assertGreater(testutil.max_abs_diff(a.get_weights(), before_a), 0)


class GroupStateTest(absltest.TestCase):
    """Schedules, callbacks and checkpoints of per-group optimizers."""

    def _fit(self, model, steps, callbacks=(), epochs=1):
        rng = np.random.RandomState(0)
        x = rng.randn(16, 4).astype("float32")
        y = rng.randn(16, 3).astype("float32")
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(
            ds,
            epochs=epochs,
            steps_per_epoch=steps,
            verbose=0,
            callbacks=list(callbacks),
        )

    def test_group_schedule_follows_the_global_step(self):
        # Group a: rate 0.1 at steps 0 and 1 (step <= boundary 1), then 0.
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        schedule = tf.keras.optimizers.schedules.PiecewiseConstantDecay(
            [1], [0.1, 0.0]
        )
        with strategy.scope():
            model, a, b = _two_towers()
            multi = tf2sync.MultiOptimizer(
                [
                    (tf.keras.optimizers.SGD(schedule), a),
                    (tf.keras.optimizers.SGD(0.1), b),
                ]
            )
            model.compile(optimizer=tf2sync.SyncOptimizer(multi), loss="mse")
        self._fit(model, 4)  # 2 synchronous steps at rate 0.1
        self.assertEqual(int(multi.iterations.numpy()), 2)
        a_after, b_after = a.get_weights(), b.get_weights()
        self._fit(model, 4)  # 2 more: a's rate is now 0
        self.assertEqual(int(multi.iterations.numpy()), 4)
        self.assertEqual(testutil.max_abs_diff(a.get_weights(), a_after), 0.0)
        self.assertGreater(testutil.max_abs_diff(b.get_weights(), b_after), 0)

    def test_callback_changes_a_group_rate_between_epochs(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model, a, b = _two_towers()
            multi = tf2sync.MultiOptimizer(
                [
                    (tf.keras.optimizers.SGD(0.1), a),
                    (tf.keras.optimizers.SGD(0.1), b),
                ]
            )
            model.compile(optimizer=tf2sync.SyncOptimizer(multi), loss="mse")
        snapshots = {}

        class FreezeA(tf.keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                if epoch == 1:
                    multi.optimizers[0].learning_rate = 0.0
                    snapshots["a"] = a.get_weights()
                    snapshots["b"] = b.get_weights()

        self._fit(model, 4, callbacks=[FreezeA()], epochs=2)
        self.assertEqual(
            testutil.max_abs_diff(a.get_weights(), snapshots["a"]), 0.0
        )
        self.assertGreater(
            testutil.max_abs_diff(b.get_weights(), snapshots["b"]), 0
        )

    def test_learning_rate_scheduler_callback(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model, _, _ = _two_towers()
            model.compile(
                optimizer=tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1)),
                loss="mse",
            )
        seen = []

        class Record(tf.keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                seen.append(model.get_weights())

        scheduler = tf.keras.callbacks.LearningRateScheduler(
            lambda epoch, lr: 0.1 if epoch == 0 else 0.0
        )
        self._fit(model, 4, callbacks=[scheduler, Record()], epochs=2)
        self.assertGreater(testutil.max_abs_diff(seen[1], seen[0]), 0)
        self.assertEqual(testutil.max_abs_diff(model.get_weights(), seen[1]), 0)
        self.assertAlmostEqual(float(model.optimizer.lr.numpy()), 0.0)

    def test_checkpoint_restores_every_group_slot_and_the_step(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model, a, b = _two_towers()
            multi = tf2sync.MultiOptimizer(
                [
                    (tf.keras.optimizers.SGD(0.1, momentum=0.9), a),
                    (tf.keras.optimizers.Adam(0.01), b),
                ]
            )
            model.compile(optimizer=tf2sync.SyncOptimizer(multi), loss="mse")
        self._fit(model, 4)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        path = checkpoint.save(tempfile.mkdtemp() + "/ckpt")
        saved_weights = model.get_weights()
        saved_slots = [v.numpy() for v in multi.variables()]
        # Global step; SGD: step + 2 momenta; Adam: step + 2 m + 2 v.
        self.assertLen(saved_slots, 1 + 3 + 5)
        self._fit(model, 4)
        self.assertEqual(int(multi.iterations.numpy()), 4)
        checkpoint.restore(path).assert_existing_objects_matched()
        self.assertEqual(int(multi.iterations.numpy()), 2)
        self.assertEqual(
            testutil.max_abs_diff(model.get_weights(), saved_weights), 0.0
        )
        self.assertEqual(
            testutil.max_abs_diff(
                [v.numpy() for v in multi.variables()], saved_slots
            ),
            0.0,
        )
        # Training resumes from the restored step: no stale leftovers.
        self._fit(model, 2)
        self.assertEqual(int(multi.iterations.numpy()), 3)


class SlotTest(absltest.TestCase):
    def test_get_slot_reads_the_group_of_a_variable_its_shards_too(self):
        # TF1 code reads slots through the optimizer it holds (a shim or
        # SyncOptimizer around the router): the router raised KeyError.
        partitioner = (
            tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)
        )
        strategy = testutil.strategy(
            2, replicas_to_aggregate=2, variable_partitioner=partitioner
        )
        with strategy.scope():
            model = testutil.sparse_model()
            kernels = tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9)
            rest = tf.keras.optimizers.legacy.SGD(0.2, momentum=0.5)
            multi = tf2sync.MultiOptimizer(
                groups={"embeddings": kernels}, default=rest
            )
            opt = tf2sync.SyncOptimizer(multi)
            model.compile(optimizer=opt, loss=testutil.LOSS)
        x, y = testutil.data("sparse", 16)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(ds, epochs=1, steps_per_epoch=4, verbose=0)
        self.assertEqual(opt.get_slot_names(), ["momentum"])
        table = model.layers[0].embeddings  # a ShardedVariable of 2
        whole = opt.get_slot(table, "momentum")
        parts = [opt.get_slot(s, "momentum") for s in table.variables]
        self.assertLen(parts, 2)
        np.testing.assert_array_equal(
            tf.convert_to_tensor(whole).numpy(),
            np.concatenate([p.numpy() for p in parts]),
        )
        self.assertGreater(np.abs(tf.convert_to_tensor(whole).numpy()).sum(), 0)
        for shard in table.variables:  # each the group's own slot
            self.assertIs(
                opt.get_slot(shard, "momentum"),
                kernels.get_slot(shard, "momentum"),
            )
        kernel = model.layers[-1].kernel
        for shard in ps_variables.shards([kernel]):
            self.assertIs(
                opt.get_slot(shard, "momentum"),
                rest.get_slot(shard, "momentum"),
            )


class SavingTest(absltest.TestCase):
    def _model_and_groups(self):
        """Two same-name towers and a head: one group of each form."""
        model, a, b = _two_towers()
        x = tf.keras.Input((4,))
        model = tf.keras.Model(
            x, tf.keras.layers.Dense(2, name="head")(model(x))
        )
        b_kernel = b.trainable_weights[0]
        multi = tf2sync.MultiOptimizer(
            [(tf.keras.optimizers.SGD(0.1, momentum=0.9), a)],
            groups={
                "head": tf.keras.optimizers.Adam(0.01),
                (lambda v: v is b_kernel): tf.keras.optimizers.SGD(0.2),
            },
            default=tf.keras.optimizers.legacy.Adagrad(0.3),
        )
        return model, multi

    def _fit(self, model, steps):
        x, y = testutil.data("dense", 16)
        y = np.stack([y, y], axis=1).astype("float32")
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(ds, epochs=1, steps_per_epoch=2 * steps, verbose=0)
        return x, y

    @staticmethod
    def _groups_by_position(multi, model):
        index = {
            id(v): i
            for i, variables in multi.route(model.trainable_variables).items()
            for v in variables
        }
        return [index[id(v)] for v in model.trainable_variables]

    def test_every_group_form_routes_the_same_variables_after_a_load(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model, multi = self._model_and_groups()
            model.compile(optimizer=tf2sync.SyncOptimizer(multi), loss="mse")
        x, y = self._fit(model, 2)
        expected = self._groups_by_position(multi, model)
        # Tower a's variables, b's kernel, b's bias (default), the head.
        self.assertEqual(expected, [0, 0, 2, 3, 1, 1])
        directory = tempfile.mkdtemp()
        paths = [directory + "/model.keras", directory + "/savedmodel"]
        for path in paths:
            model.save(path)
            with testutil.strategy(2, replicas_to_aggregate=2).scope():
                loaded = tf.keras.models.load_model(path)
            loaded_multi = loaded.optimizer.inner_optimizer
            self.assertIsInstance(loaded_multi, tf2sync.MultiOptimizer)
            self.assertEqual(
                [type(o).__name__ for o in loaded_multi.optimizers],
                ["SGD", "Adam", "SGD", "Adagrad"],
            )
            self.assertEqual(
                [float(o.learning_rate) for o in loaded_multi.optimizers],
                [float(o.learning_rate) for o in multi.optimizers],
            )
            self._fit(loaded, 1)
            self.assertEqual(
                self._groups_by_position(loaded_multi, loaded), expected
            )
            self.assertEqual(int(loaded_multi.iterations.numpy()), 1)
        # Where no cluster is: the router alone, single-process.
        got = testutil.load_and_train_in_plain_process(self, paths, x, y)
        for path in paths:
            self.assertEqual(got[path]["optimizer"], "MultiOptimizer", path)
            self.assertGreater(got[path]["moved"], 0, path)

    def test_a_layer_group_saved_before_the_build_is_refused_by_name(self):
        _, multi = self._model_and_groups()
        with self.assertRaisesRegex(
            ValueError,
            r"MultiOptimizer 'MultiOptimizer': group 0 \(layers or a "
            r"callable\) was saved before the optimizer was built",
        ):
            tf2sync.MultiOptimizer.from_config(multi.get_config())
        # A built one's config rebuilds it, and again after a load.
        model, multi = self._model_and_groups()
        multi.build(model.trainable_variables)
        again = tf2sync.MultiOptimizer.from_config(multi.get_config())
        self.assertEqual(
            self._groups_by_position(again, model),
            self._groups_by_position(multi, model),
        )
        twice = tf2sync.MultiOptimizer.from_config(again.get_config())
        self.assertEqual(
            self._groups_by_position(twice, model),
            self._groups_by_position(multi, model),
        )
        with self.assertRaisesRegex(
            ValueError,
            r"group 0 \(saved variables \[0, 1\] of 6\) was saved routing "
            r"a model of 6 trainable variables; this one has 4",
        ):
            twice.route(testutil.dense_model().trainable_variables)


if __name__ == "__main__":
    absltest.main()
