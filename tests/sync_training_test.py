"""The synchronous contract, in the custom loop on ClusterCoordinator.

Each test compares against a single-process reference: synchronous training
with N replicas at batch B must follow single-process training at batch N*B.
"""

import collections
import os
import tempfile
from unittest import mock

import numpy as np
import tensorflow as tf
import testutil
from absl.testing import absltest
from absl.testing import parameterized

import tf2sync

OPTIMIZERS = {
    "sgd": lambda: tf.keras.optimizers.SGD(0.1),
    "momentum": lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: tf.keras.optimizers.Adam(0.01),
    "legacy_momentum": lambda: tf.keras.optimizers.legacy.SGD(
        0.1, momentum=0.9
    ),
    "legacy_adam": lambda: tf.keras.optimizers.legacy.Adam(0.01),
}


_reference = testutil.one_process


class EquivalenceTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("dense_sgd", "dense", "sgd"),
        ("dense_momentum", "dense", "momentum"),
        ("dense_adam", "dense", "adam"),
        ("dense_legacy_momentum", "dense", "legacy_momentum"),
        ("dense_legacy_adam", "dense", "legacy_adam"),
        ("sparse_momentum", "sparse", "momentum"),
        ("sparse_adam", "sparse", "adam"),
        ("sparse_legacy_momentum", "sparse", "legacy_momentum"),
        # Variables on both ps: reads, lookups and pushes split by ps.
        ("sparse_momentum_2ps", "sparse", "momentum", 2),
    )
    def test_n_workers_at_b_equal_one_process_at_nb(
        self, kind, opt_name, num_ps=1
    ):
        num_workers, batch, rounds = 2, 8, 4
        model_fn = getattr(testutil, f"{kind}_model")
        strategy = testutil.strategy(
            num_workers, num_ps, replicas_to_aggregate=2
        )
        with strategy.scope():
            model = model_fn()
            opt = tf2sync.SyncOptimizer(OPTIMIZERS[opt_name]())
            opt.build(model.trainable_variables)
        if num_ps > 1:
            devices = {v.device for v in model.trainable_variables}
            self.assertLen({d.split("/device")[0] for d in devices}, 2)
        x, y = testutil.data(kind, num_workers * batch * rounds)
        loop = testutil.Loop(strategy, model, opt)
        global_batches = []
        for r in range(rounds):
            lo = r * num_workers * batch
            parts = [
                (
                    x[lo + i * batch : lo + (i + 1) * batch],
                    y[lo + i * batch : lo + (i + 1) * batch],
                )
                for i in range(num_workers)
            ]
            loop.round(parts)
            global_batches.append(
                (
                    x[lo : lo + num_workers * batch],
                    y[lo : lo + num_workers * batch],
                )
            )
        expected = _reference(model_fn, OPTIMIZERS[opt_name], global_batches)
        self.assertEqual(int(opt.iterations.numpy()), rounds)
        self.assertEqual(int(opt.gradients_accepted.numpy()), 2 * rounds)
        self.assertEqual(int(opt.stale_dropped.numpy()), 0)
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), expected), 1e-5
        )

    def test_accumulation_several_gradients_per_replica(self):
        # replicas_to_aggregate=4 > total_num_replicas=2: each update is the
        # mean of 4 gradients, so 2 workers train at an effective batch 4*B.
        batch, rounds = 4, 3
        strategy = testutil.strategy(
            2, replicas_to_aggregate=4, total_num_replicas=2
        )
        with strategy.scope():
            model = testutil.dense_model()
            opt = tf2sync.SyncOptimizer(OPTIMIZERS["momentum"]())
        x, y = testutil.data("dense", 4 * batch * rounds)
        loop = testutil.Loop(strategy, model, opt)
        global_batches = []
        for r in range(rounds):
            lo = r * 4 * batch
            loop.round(
                [
                    (
                        x[lo + i * batch : lo + (i + 1) * batch],
                        y[lo + i * batch : lo + (i + 1) * batch],
                    )
                    for i in range(4)
                ]
            )
            global_batches.append(
                (x[lo : lo + 4 * batch], y[lo : lo + 4 * batch])
            )
        expected = _reference(
            testutil.dense_model, OPTIMIZERS["momentum"], global_batches
        )
        self.assertEqual(int(opt.iterations.numpy()), rounds)
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), expected), 1e-5
        )


def _traced_step(kind, x_spec=None):
    """The graph of one synchronous step of the `kind` test model (SGD)."""
    strategy = testutil.strategy(2, replicas_to_aggregate=2)
    x, y = testutil.data(kind, 8)
    with strategy.scope():
        model = getattr(testutil, f"{kind}_model")()
        opt = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))

    def replica(x):
        with tf.GradientTape() as tape:
            loss = testutil.mean_loss(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    function = tf.function(lambda x: strategy.run(replica, args=(x,)))
    spec = tf.constant(x) if x_spec is None else x_spec
    return function.get_concrete_function(spec).graph


class PackedReadTest(absltest.TestCase):
    def test_a_step_reads_its_dense_variables_as_one_tensor_per_ps(self):
        # Four variables on one ps: one concatenation there, split on the
        # worker into the four values the layers use (the equivalence tests
        # above check the values).
        graph = _traced_step("dense")
        splits = [op for op in graph.get_operations() if op.type == "SplitV"]
        self.assertLen(splits, 1)
        concat = splits[0].inputs[0].op
        self.assertEqual(concat.type, "ConcatV2")
        self.assertIn("/job:ps/", concat.device)
        self.assertLen(concat.inputs, 4 + 1)  # the reads and the axis
        self.assertLen(splits[0].outputs, 4)


class ReadCacheTest(absltest.TestCase):
    def test_a_variable_is_read_once_in_a_step_and_its_cond_branches(self):
        # The step's one read per variable (which the packing builds on)
        # also serves a tf.cond branch, which captures it; a read first
        # made in the branch must not serve the step (fit_test covers that).
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        x, y = testutil.data("dense", 8)
        with strategy.scope():
            hidden = tf.keras.layers.Dense(3)
            hidden.build((None, 4))
            opt = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
        variables = hidden.trainable_variables

        def replica(x):
            with tf.GradientTape() as tape:
                first = hidden(x)
                branch = tf.cond(
                    tf.reduce_sum(x) > 0.0,
                    lambda: hidden(x),
                    lambda: hidden(-x),
                )
                logits = first + branch + hidden(x)
                loss = testutil.mean_loss(y, logits)
            grads = tape.gradient(loss, variables)
            opt.apply_gradients(zip(grads, variables))

        function = tf.function(lambda x: strategy.run(replica, args=(x,)))
        graph = function.get_concrete_function(tf.constant(x)).graph
        outer_of = {id(inner): outer for outer, inner in graph.captures}
        names = {id(v.handle): v.name for v in variables}
        reads = collections.Counter(
            names.get(id(outer_of.get(id(op.inputs[0]))))
            for op in graph.get_operations()
            if op.type == "ReadVariableOp"
        )
        for var in variables:
            self.assertEqual(reads[var.name], 1, var.name)
        # The cond's branches (those computing the layer: the push's own
        # conds read the ps) read nothing: they capture the step's reads.
        library = {
            f.signature.name: [node.op for node in f.node_def]
            for f in graph.as_graph_def().library.function
        }
        branches = [
            library[op.get_attr(attr).name]
            for op in graph.get_operations()
            if op.type in ("If", "StatelessIf")
            for attr in ("then_branch", "else_branch")
        ]
        layer_branches = [ops for ops in branches if "MatMul" in ops]
        self.assertLen(layer_branches, 4)  # the cond's and its gradient's
        for ops in layer_branches:
            self.assertNotIn("ReadVariableOp", ops)


class TagOrderTest(absltest.TestCase):
    def test_reads_follow_the_tag_and_pure_ops_do_not_wait_for_it(self):
        graph = _traced_step("sparse")
        ops = graph.get_operations()
        (dequeue,) = [op for op in ops if op.type == "QueueDequeueV2"]

        def ancestors(op):
            seen, stack = set(), [op]
            while stack:
                current = stack.pop()
                for parent in [t.op for t in current.inputs] + list(
                    current.control_inputs
                ):
                    if parent not in seen:
                        seen.add(parent)
                        stack.append(parent)
            return seen

        reads = [
            op for op in ops if op.type in ("ReadVariableOp", "ResourceGather")
        ]
        self.assertNotEmpty([op for op in reads if op.type == "ResourceGather"])
        # Every variable read of the step, the embedding's gather included,
        # waits for the token (and the tag read after it).
        for op in reads:
            self.assertIn(dequeue, ancestors(op), op.name)
        # A pure op (stateless, no resource input) has no control edge from
        # the tag: on the worker each such edge is a transfer from the ps.
        # The tag: the Identity of the step-counter read that follows the
        # token, on which the step's reads wait.
        tags = {c for op in reads for c in op.control_inputs}
        tags = {
            t for t in tags if t.type == "Identity" and dequeue in ancestors(t)
        }
        self.assertLen(tags, 1)
        waiting = [
            op.name
            for op in ops
            if tags & set(op.control_inputs)
            and not op._is_stateful
            and not any(t.dtype == tf.resource for t in op.inputs)
        ]
        self.assertEqual(waiting, [])


class PackedLookupTest(absltest.TestCase):
    def test_embedding_rows_travel_with_the_dense_reads(self):
        # The sparse model reads its dense kernel and bias and gathers
        # embedding rows: one concatenation on the ps carries all three,
        # and the gather's rows have no other use (no transfer of their
        # own). The equivalence tests check the values.
        graph = _traced_step("sparse", tf.TensorSpec([None, 5], tf.int64))
        ops = graph.get_operations()
        (gather,) = [
            op
            for op in ops
            if op.type == "ResourceGather" and "/job:ps" not in op.device
        ]
        (flat,) = gather.outputs[0].consumers()
        (concat,) = flat.outputs[0].consumers()
        self.assertEqual(concat.type, "ConcatV2")
        self.assertIn("/job:ps/", concat.device)
        self.assertLen(concat.inputs, 3 + 1)  # kernel, bias, rows; axis
        (split,) = concat.outputs[0].consumers()
        self.assertEqual(split.type, "SplitV")
        self.assertLen(split.outputs, 3)
        # The rows keep their static shape on the worker: [batch, 5, 4].
        (rows,) = [
            op.outputs[0]
            for op in ops
            if op.type == "Reshape"
            and any(t is split.outputs[2] for t in op.inputs)
        ]
        self.assertEqual(rows.shape.as_list(), [None, 5, 4])


class PushInputsTest(absltest.TestCase):
    def test_the_lock_waits_only_for_ps_side_copies_of_the_inputs(self):
        # The critical section locks once every input of its body exists;
        # each control edge from a worker tensor would be a second transfer
        # to the ps besides the data's.
        graph = _traced_step("sparse")
        (lock,) = [
            op for op in graph.get_operations() if op.type == "MutexLock"
        ]
        # The lock waits on groups (NoOps, one per device) of the inputs.
        waits, stack = [], list(lock.control_inputs)
        while stack:
            op = stack.pop()
            if op.type == "NoOp":
                stack += list(op.control_inputs) + [t.op for t in op.inputs]
            elif not (
                op.type == "Placeholder" and op.outputs[0].dtype == tf.resource
            ):  # a captured handle: an argument where its resource lives
                waits.append(op)
        self.assertNotEmpty(waits)
        for op in waits:
            self.assertIn("/job:ps/", op.device, op.name)


class EagerPushTest(absltest.TestCase):
    def test_eager_pushes_after_the_first_call_the_ps_function(self):
        # The TF1 shim's eager apply_gradients: the first push in the
        # (eager) graph runs inline, the next ones call the push function
        # of the ps, eagerly; on one ps the round applies once.
        from tf2sync import compat

        strategy = testutil.strategy(
            2, replicas_to_aggregate=2, total_num_replicas=2
        )
        with strategy.scope():
            step = tf.Variable(0, name="global_step", trainable=False)
            v0 = tf.Variable(0.0)
            v1 = tf.Variable(1.0)
            opt = compat.v1.SyncReplicasOptimizer(
                tf.compat.v1.train.GradientDescentOptimizer(2.0),
                replicas_to_aggregate=2,
                total_num_replicas=2,
            )
            tokens = [
                int(
                    opt.apply_gradients(
                        zip([tf.constant(0.1), tf.constant(0.9)], [v0, v1]),
                        step,
                    )
                )
                for _ in range(3)
            ]
        self.assertEqual(int(step.numpy()), 1)  # the third push waits
        self.assertEqual(tokens, [0, 0, 1])
        self.assertAlmostEqual(float(v0.numpy()), -0.2, places=6)
        self.assertAlmostEqual(float(v1.numpy()), -0.8, places=6)


class WireTest(absltest.TestCase):
    def test_a_push_crosses_as_one_tensor_and_arrives_exact(self):
        from tf2sync._src import wire as wire_lib

        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = testutil.sparse_model()
            opt = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
        model.build((None, 5))
        variables = model.trainable_variables  # embedding, kernel, bias
        # Row ids whose float32 halves are NaN, infinity and denormal bit
        # patterns: a bit-cast copy must keep them exact.
        ids = tf.constant([0x7FC00000, 0x7F800000, 3, 2**40 + 5], tf.int64)
        rows = tf.reshape(tf.range(16, dtype=tf.float32), [4, 4])
        grads = [
            tf.IndexedSlices(rows, ids, tf.constant([50, 4], tf.int64)),
            tf.ones(variables[1].shape) * 2.0,
            tf.ones(variables[2].shape) * 3.0,
        ]
        aggregator = opt._aggregator
        aggregator.build(list(zip(grads, variables)))
        layout = aggregator._layout
        packed = [
            tf.concat(
                [tf.reshape(grads[1], [-1]), tf.reshape(grads[2], [-1])], 0
            )
        ]
        sparse = [(ids, rows)]
        worker = tf.constant(1, tf.int64)
        # Riders follow the sparse rows, whose size is known only there.
        riders = [tf.constant([[1.5, -2.0]]), tf.constant(7.0)]
        wire = wire_lib.Wire(
            aggregator.device, layout, packed, sparse, worker, riders
        )
        self.assertEqual(wire.tensor.dtype, tf.float32)
        self.assertEqual(wire.tensor.shape.rank, 1)
        arrived = wire.unpack(**wire.inputs())
        self.assertEqual(int(arrived["worker"]), 1)
        np.testing.assert_array_equal(arrived["packed"][0], packed[0])
        got_ids, got_rows = arrived["sparse"][0]
        self.assertEqual(got_ids.dtype, tf.int64)
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_array_equal(got_rows, rows)
        for sent, got in zip(riders, wire.riders(wire.tensor)):
            self.assertEqual(got.shape, sent.shape)
            np.testing.assert_array_equal(got, sent)

    def test_the_accumulator_starts_on_its_ps_not_sent_there(self):
        # A dense accumulator holds the model's size: zeros made on the
        # chief would cross to the ps (ResNet-50: 100 MB, 0.3 s of the
        # first trace).
        from tf2sync._src import wire as wire_lib

        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            variable = tf.Variable(tf.zeros([6]))
        made = []
        real = wire_lib.ps_variable

        def recording(initial_value, device, name, dtype=None):
            made.append((initial_value.device, device))
            return real(initial_value, device, name, dtype)

        with mock.patch.object(wire_lib, "ps_variable", recording):
            wire_lib.Layout([(tf.ones([6]), variable)], "placed")
        ((value_device, device),) = made
        self.assertIn("/job:ps/", device)
        self.assertEqual(
            tf.DeviceSpec.from_string(value_device),
            tf.DeviceSpec.from_string(device),
        )


def _run_on(coordinator, strategy, replica, times):
    """Schedules `replica` as a function `times` and joins; returns it."""
    function = tf.function(lambda: strategy.run(replica))
    for _ in range(times):
        coordinator.schedule(function)
    coordinator.join()
    return function


class RiderTest(absltest.TestCase):
    """A step's metric writes take their values from the push, on the ps."""

    def _cluster(self):
        """`(strategy, coordinator, x, y, model, optimizer)`: 2 workers;
        learning rate 0, so every step's loss is the initial weights'."""
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        x, y = testutil.data("dense", 8)
        with strategy.scope():
            model = testutil.dense_model()
            opt = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.0))
        return strategy, coordinator, x, y, model, opt

    def _train(self, metric_before_gradients=False):
        strategy, coordinator, x, y, model, opt = self._cluster()
        with strategy.scope():
            mean = tf.keras.metrics.Mean()
            calls = tf.Variable(0, dtype=tf.int64)  # int64: never rides

        def replica():
            with tf.GradientTape() as tape:
                loss = testutil.mean_loss(y, model(x))
            update = mean.update_state(loss)
            calls.assign_add(1)
            grads = tape.gradient(loss, model.trainable_variables)
            if metric_before_gradients:  # riding would be a cycle
                with tf.control_dependencies([update]):
                    grads = [tf.identity(g) for g in grads]
            opt.apply_gradients(zip(grads, model.trainable_variables))

        function = _run_on(coordinator, strategy, replica, 6)
        expected = float(testutil.mean_loss(y, model(x)))
        self.assertAlmostEqual(float(mean.result()), expected, places=5)
        self.assertEqual(int(calls.numpy()), 6)
        writes = {}
        graph = function.get_concrete_function().graph
        for op in graph.get_operations():
            if op.type == "AssignAddVariableOp":
                value = op.inputs[1]
                writes.setdefault(value.dtype, []).append(
                    "/job:ps" in value.op.device
                )
        return writes

    def test_metric_writes_take_their_values_from_the_push(self):
        writes = self._train()
        self.assertEqual(writes[tf.float32], [True, True])  # total, count
        # The int64 count of calls is computed where it is written.
        self.assertNotIn(True, writes[tf.int64][-1:])

    def test_a_write_the_gradients_wait_for_stays_as_it_was(self):
        writes = self._train(metric_before_gradients=True)
        self.assertEqual(writes[tf.float32], [False, False])

    def test_writes_of_each_rank_ride_and_keep_their_values(self):
        # As batch norm's moving statistics (rank 1) beside a scalar and a
        # matrix: sliced apart on the ps by one split, reshaped back.
        strategy, coordinator, x, y, model, opt = self._cluster()
        with strategy.scope():
            scalar = tf.Variable(0.0)
            vector = tf.Variable(tf.zeros([3]))
            matrix = tf.Variable(tf.zeros([2, 2]))

        def replica():
            with tf.GradientTape() as tape:
                loss = testutil.mean_loss(y, model(x))
            scalar.assign_add(loss)
            vector.assign(loss * tf.constant([1.0, 2.0, 3.0]))
            matrix.assign(loss * tf.constant([[1.0, 2.0], [3.0, 4.0]]))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        function = _run_on(coordinator, strategy, replica, 4)
        loss = float(testutil.mean_loss(y, model(x)))
        np.testing.assert_allclose(scalar.numpy(), 4 * loss, rtol=1e-5)
        np.testing.assert_allclose(
            vector.numpy(), loss * np.arange(1, 4), rtol=1e-5
        )
        np.testing.assert_allclose(
            matrix.numpy(), loss * np.array([[1, 2], [3, 4]]), rtol=1e-5
        )
        graph = function.get_concrete_function().graph
        rode = [
            "/job:ps" in op.inputs[1].op.device
            for op in graph.get_operations()
            if op.type in ("AssignAddVariableOp", "AssignVariableOp")
            and op.inputs[1].dtype == tf.float32
            and op.inputs[1].shape.rank in (0, 1, 2)
        ]
        self.assertGreaterEqual(rode.count(True), 3, rode)


class SparseApplyPathTest(absltest.TestCase):
    def test_unique_rows_skip_only_a_pure_deduplication(self):
        from tf2sync._src import keras_compat

        legacy = tf.keras.optimizers.legacy

        class Own(legacy.SGD):
            def _resource_apply_sparse_duplicate_indices(self, *a, **k):
                return super()._resource_apply_sparse_duplicate_indices(*a, **k)

        check = keras_compat._dedups_then_applies
        self.assertTrue(check(legacy.SGD(0.1, momentum=0.9)))
        self.assertTrue(check(legacy.Adam(0.1)))
        self.assertFalse(check(legacy.SGD(0.1)))  # scatters: no slot
        self.assertFalse(check(Own(0.1, momentum=0.9)))  # its own override


class ApplyOrderTest(parameterized.TestCase):
    """The step increment waits for every write of the update.

    A lowered `tf.cond` (the push's apply) may yield its outputs before its
    side effects finish, so `keras_compat.apply` orders the increment of
    `iterations` after each variable, slot and constraint write it made;
    without that nothing in the graph would (they touch other resources).
    """

    _WRITES = (
        "Assign",
        "ResourceApply",
        "ResourceSparseApply",
        "ResourceScatter",
    )

    @parameterized.parameters(*OPTIMIZERS)
    def test_increment_follows_every_write(self, name):
        from tf2sync._src import keras_compat

        dense = tf.Variable(
            tf.ones([3, 2]), constraint=tf.keras.constraints.NonNeg()
        )
        bias = tf.Variable(tf.ones([2]))
        table = tf.Variable(tf.ones([5, 2]))
        opt = OPTIMIZERS[name]()
        keras_compat.build(opt, [dense, bias, table])
        increments = []

        @tf.function(autograph=False)
        def step():
            grads = [
                tf.ones([3, 2]),
                tf.ones([2]),
                tf.IndexedSlices(
                    tf.ones([2, 2]), tf.constant([0, 3], tf.int64), [5, 2]
                ),
            ]
            increments.append(
                keras_compat.apply(opt, zip(grads, [dense, bias, table]))
            )

        step.get_concrete_function()
        (increment,) = increments
        ancestors, stack = set(), [increment]
        while stack:
            op = stack.pop()
            for before in [t.op for t in op.inputs] + list(op.control_inputs):
                if before not in ancestors:
                    ancestors.add(before)
                    stack.append(before)
        writes = [
            op
            for op in increment.graph.get_operations()
            if op is not increment and op.type.startswith(self._WRITES)
        ]
        self.assertGreaterEqual(len(writes), 3, [o.type for o in writes])
        self.assertEmpty(
            [op.name for op in writes if op not in ancestors], name
        )


class RestoreTest(absltest.TestCase):
    def test_pushes_pending_at_a_restore_are_dropped_not_mixed_in(self):
        # 3 pushes: one update and one pending (sparse and dense parts).
        # Restoring step 0 makes it a leftover of another trajectory: the
        # next push drops it, and the update after the restore is exactly
        # one full-batch step from the restored weights. The dropped push's
        # token comes back: the watchdog never has to release one. Its
        # timeout is long (30 s) so that only a lost token makes it fire:
        # with 2 s, the second fit's set-up under CPU load (two busy loops)
        # outlasted it between the fits and it released tokens that were
        # not lost.
        strategy = testutil.strategy(
            2, replicas_to_aggregate=2, token_timeout=30.0
        )
        x, y = testutil.data("sparse", 16)
        dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
        with strategy.scope():
            model = testutil.sparse_model()
            opt = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
            model.compile(optimizer=opt, loss=testutil.LOSS)
        initial = model.get_weights()
        checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)
        path = checkpoint.save(tempfile.mkdtemp() + "/ckpt")
        model.fit(dataset, epochs=1, steps_per_epoch=3, verbose=0)
        self.assertEqual(int(opt.iterations.numpy()), 1)
        stale = int(opt.stale_dropped.numpy())
        checkpoint.restore(path)
        model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)
        self.assertEqual(int(opt.iterations.numpy()), 1)
        self.assertEqual(int(opt.stale_dropped.numpy()), stale + 1)
        self.assertEqual(strategy._watchdog.released, 0)
        reference = testutil.sparse_model()
        reference.set_weights(initial)
        reference.compile(
            optimizer=tf.keras.optimizers.SGD(0.1), loss=testutil.LOSS
        )
        reference.train_on_batch(x, y)
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), reference.get_weights()),
            1e-6,
        )


class BackupWorkerTest(absltest.TestCase):
    def test_slow_replica_is_dropped_as_stale_and_never_applied(self):
        # 3 workers, 2 aggregated: the replica delayed after reading its tag
        # pushes after the step was applied. Its gradient was computed from
        # the old weights: it must be dropped and counted, never applied.
        # The two others also wait a little after their tags: a worker
        # thread that picks up the slow step late (a loaded CI machine)
        # would otherwise read the next tag and push a fresh gradient.
        rounds = 3
        strategy = testutil.strategy(
            3, replicas_to_aggregate=2, total_num_replicas=3
        )
        with strategy.scope():
            model = testutil.dense_model()
            opt = tf2sync.SyncOptimizer(OPTIMIZERS["momentum"]())
        x, y = testutil.data("dense", 16)
        loop = testutil.Loop(strategy, model, opt, delay=True)
        for _ in range(rounds):
            loop.round([(x, y)] * 3, delays=[0.4, 0.4, 2.0])
        # Any two fresh gradients are equal (same batch, same weights), so
        # the trajectory is `rounds` full-batch steps; an applied stale
        # gradient (from older weights) would move it off.
        expected = _reference(
            testutil.dense_model, OPTIMIZERS["momentum"], [(x, y)] * rounds
        )
        self.assertEqual(int(opt.iterations.numpy()), rounds)
        self.assertEqual(int(opt.stale_dropped.numpy()), rounds)
        self.assertEqual(int(opt.gradients_accepted.numpy()), 2 * rounds)
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), expected), 1e-6
        )


class AutographTest(absltest.TestCase):
    def test_user_step_is_converted_and_tf2sync_code_is_not(self):
        # tf2sync's own Python (strategy.run, the push, the graph rewrites)
        # runs unconverted, as TensorFlow's does; the replica function the
        # user gives strategy.run is still converted, so a Python `if` on a
        # tensor works there as under stock PSS.
        from tensorflow.python.autograph.impl import conversion

        from tf2sync._src import aggregation
        from tf2sync._src import graph_rewrites

        for fn in (
            graph_rewrites.order_only_reads_after,
            aggregation.Aggregator.push,
            tf2sync.SyncParameterServerStrategy.run,
        ):
            self.assertTrue(conversion.is_allowlisted(fn), fn)

        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = testutil.dense_model()
            opt = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
            opt.build(model.trainable_variables)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        x, y = testutil.data("dense", 8)
        variables = model.trainable_variables

        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = testutil.mean_loss(y, model(x))
                if tf.reduce_sum(x) > 1e9:  # needs AutoGraph; never true
                    loss = loss * 0.0
            grads = tape.gradient(loss, variables)
            return opt.apply_gradients(zip(grads, variables))

        @tf.function
        def step(x, y):
            return strategy.run(replica, args=(x, y))

        from tensorflow.python.autograph.impl import api

        converted = []
        convert = api._convert_actual

        def recording(entity, program_ctx):
            converted.append(getattr(entity, "__code__", None))
            return convert(entity, program_ctx)

        def dataset_fn():  # the user's: converted, as under stock PSS
            return tf.data.Dataset.from_tensors((x, y)).repeat()

        with mock.patch.object(api, "_convert_actual", recording):
            for _ in range(2):
                coordinator.schedule(step, args=(x, y))
            coordinator.join()
            coordinator.create_per_worker_dataset(dataset_fn)
        # Nor are tf2sync's own tf.functions (the coordinator's worker ids,
        # its per-worker dataset functions).
        ours = os.path.dirname(tf2sync.__file__)
        self.assertIn(dataset_fn.__code__, converted)
        self.assertNotEmpty(converted)  # the user's step and replica
        for code in converted:
            self.assertFalse(code and code.co_filename.startswith(ours), code)
        expected = _reference(testutil.dense_model, OPTIMIZERS["sgd"], [(x, y)])
        self.assertEqual(int(opt.iterations.numpy()), 1)
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), expected), 1e-6
        )


class ConfigErrorTest(parameterized.TestCase):
    def test_plain_optimizer_is_refused_before_any_update(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = testutil.dense_model()
            model.compile(
                optimizer=tf.keras.optimizers.SGD(0.1), loss=testutil.LOSS
            )
        testutil.assert_fit_refused(
            self, model, TypeError, r"would train asynchronously. Wrap it"
        )

    def test_sync_optimizer_under_plain_pss_is_refused(self):
        plain = tf.distribute.experimental.ParameterServerStrategy(
            testutil.cluster(2, 1)
        )
        with plain.scope():
            with self.assertRaisesRegex(
                ValueError,
                r"SyncOptimizer must be created under "
                r"`tf2sync.SyncParameterServerStrategy\(...\).scope\(\)`. "
                r"Received strategy: ParameterServerStrategyV2",
            ):
                tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))

    def test_outside_any_scope_is_refused(self):
        with self.assertRaisesRegex(ValueError, "Received strategy: _Default"):
            tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))

    def test_a_saved_config_loads_as_the_inner_optimizer_outside_pss(self):
        with testutil.strategy(2, replicas_to_aggregate=2).scope():
            config = tf.keras.optimizers.serialize(
                tf2sync.SyncOptimizer(
                    tf.keras.optimizers.legacy.SGD(0.25, momentum=0.5),
                    ema_decay=0.9,
                )
            )
        # Where a saved model is loaded to evaluate, predict or export.
        with self.assertLogs(level="WARNING") as logs:
            loaded = tf.keras.optimizers.deserialize(config)
        self.assertIsInstance(loaded, tf.keras.optimizers.legacy.SGD)
        self.assertEqual(float(loaded.learning_rate), 0.25)
        self.assertIn(
            "as its inner SGD, which is not synchronous", logs.output[0]
        )
        # Under a plain PSS it is refused, as SyncOptimizer(...) is there.
        plain = tf.distribute.experimental.ParameterServerStrategy(
            testutil.cluster(2, 1)
        )
        with plain.scope():
            with self.assertRaisesRegex(ValueError, "must be created under"):
                tf.keras.optimizers.deserialize(config)
        with testutil.strategy(2, replicas_to_aggregate=2).scope():
            with self.assertLogs(level="WARNING") as logs:
                again = tf.keras.optimizers.deserialize(config)
        self.assertIsInstance(again, tf2sync.SyncOptimizer)
        # What load_model does under the strategy: nothing of the saved
        # state comes back, and the log says so.
        self.assertIn("with a fresh state", logs.output[0])
        self.assertEqual(int(again.iterations.numpy()), 0)
        self.assertEqual(
            again.get_config()["optimizer"]["config"],
            config["config"]["optimizer"]["config"],
        )
        self.assertEqual(again.get_config()["ema_decay"], 0.9)

    def test_not_an_optimizer(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            with self.assertRaisesRegex(
                TypeError,
                r"`optimizer` must be a tf_keras optimizer .* Received: "
                r"optimizer='sgd'",
            ):
                tf2sync.SyncOptimizer("sgd")
            sgd = tf.keras.optimizers.SGD(0.1)
            with self.assertRaisesRegex(
                TypeError,
                r"^`optimizers_and_layers` must be a list of \(optimizer, "
                r"layer or layers\) pairs. Received: "
                r"optimizers_and_layers\[0\]=<tf_keras.*SGD",
            ):
                tf2sync.MultiOptimizer([sgd])

    def test_an_optimizer_already_synchronous_is_refused_as_an_inner_one(
        self,
    ):
        # Each failed at its first step with tf_keras's "NotImplementedError:
        # `_resource_apply_dense` must be implemented in subclasses".
        already = r"is already (a tf2sync.SyncOptimizer|synchronous): give "
        with testutil.strategy(2, replicas_to_aggregate=2).scope():
            sync = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
            with self.assertRaisesRegex(TypeError, "^`optimizer` " + already):
                tf2sync.SyncOptimizer(sync)
            with self.assertRaisesRegex(
                TypeError, "^`group optimizer` " + already
            ):
                tf2sync.MultiOptimizer(groups={"kernel": sync})
            with self.assertRaisesRegex(TypeError, "^`opt` " + already):
                tf2sync.compat.v1.SyncReplicasOptimizer(
                    sync, replicas_to_aggregate=2
                )
        with testutil.strategy(2, replicas_to_aggregate=2).scope():
            shim = tf2sync.compat.v1.SyncReplicasOptimizer(
                tf.compat.v1.train.GradientDescentOptimizer(0.1),
                replicas_to_aggregate=2,
            )
            with self.assertRaisesRegex(
                TypeError, "^`opt` " + already + r".* Received: opt=<tf2sync"
            ):
                tf2sync.compat.v1.SyncReplicasOptimizer(
                    shim, replicas_to_aggregate=2
                )
            # TF1's own, left in while migrating.
            tf1 = tf.compat.v1.train.SyncReplicasOptimizer(
                tf.compat.v1.train.GradientDescentOptimizer(0.1), 2
            )
            with self.assertRaisesRegex(
                TypeError, "^`opt` " + already + r".* Received: opt=<tensorflow"
            ):
                tf2sync.compat.v1.SyncReplicasOptimizer(
                    tf1, replicas_to_aggregate=2
                )

    def test_model_built_outside_the_scope_fit(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        model = testutil.dense_model()  # outside strategy.scope()
        with strategy.scope():
            with self.assertRaisesRegex(
                ValueError, r"was not created in the distribution strategy"
            ):
                model.compile(
                    optimizer=tf2sync.SyncOptimizer(
                        tf.keras.optimizers.SGD(0.1)
                    ),
                    loss=testutil.LOSS,
                )

    def test_model_built_outside_the_scope_custom_loop(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        model = testutil.dense_model()  # outside strategy.scope()
        with strategy.scope():
            opt = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
        x, y = testutil.data("dense", 8)
        loop = testutil.Loop(strategy, model, opt)
        with self.assertRaisesRegex(
            ValueError,
            r"Variables \['dense.*/kernel:0', .*\] were created outside "
            r"`strategy.scope\(\)`",
        ):
            loop.round([(x, y)])

    @parameterized.named_parameters(
        (
            "zero",
            {"replicas_to_aggregate": 0},
            ValueError,
            r"`replicas_to_aggregate` must be a positive int. Received: "
            r"replicas_to_aggregate=0$",
        ),
        (
            "float",
            {"replicas_to_aggregate": 2.0},
            TypeError,
            r"Received: replicas_to_aggregate=2.0 \(of type float\)",
        ),
        (
            "string",
            {"replicas_to_aggregate": "2"},
            TypeError,
            r"Received: replicas_to_aggregate='2' \(of type str\)",
        ),
        (
            "total",
            {"replicas_to_aggregate": 2, "total_num_replicas": -1},
            ValueError,
            r"Received: total_num_replicas=-1$",
        ),
        (
            "partitioner_not_callable",
            {"replicas_to_aggregate": 2, "variable_partitioner": "fixed"},
            TypeError,
            r"Received: variable_partitioner='fixed'$",
        ),
        (
            "partitioner_zero",
            {
                "replicas_to_aggregate": 2,
                "variable_partitioner": lambda shape, dtype: [0, 1],
            },
            ValueError,
            r"It returned \[0, 1\] for a variable of shape \[1024, 8\]",
        ),
        (
            "partitioner_float",
            {
                "replicas_to_aggregate": 2,
                "variable_partitioner": lambda shape, dtype: [2.5, 1],
            },
            ValueError,
            r"It returned \[2.5, 1\]",
        ),
        (
            "partitioner_int",
            {
                "replicas_to_aggregate": 2,
                "variable_partitioner": lambda shape, dtype: 2,
            },
            ValueError,
            r"returned 2 for a variable",
        ),
        (
            "partitioner_second_axis",
            {
                "replicas_to_aggregate": 2,
                "variable_partitioner": lambda shape, dtype: [1, 2],
            },
            ValueError,
            r"split along axis 0 only\). It returned \[1, 2\]",
        ),
    )
    def test_bad_strategy_arguments(self, kwargs, error, message):
        with self.assertRaisesRegex(error, message):
            tf2sync.SyncParameterServerStrategy(
                testutil.cluster(2, 1), **kwargs
            )

    def test_no_cluster_resolver(self):
        # Was PSS's AttributeError: 'NoneType' ... 'cluster_spec'.
        for resolver in (None, "127.0.0.1:2222"):
            with self.assertRaisesRegex(
                TypeError,
                r"^`cluster_resolver` must be a tf.distribute.cluster_resolver"
                r"\.ClusterResolver .* Received: cluster_resolver=",
            ):
                tf2sync.SyncParameterServerStrategy(
                    resolver, replicas_to_aggregate=2
                )


if __name__ == "__main__":
    absltest.main()
