"""The scale-out protocol (stage, commit, apply) on several parameter servers.

One in-process cluster of 2 workers and 3 ps hosts every test here. Models
without a partitioner spread their variables round robin over the 3 ps, so
every push stages on the ps other than the global step's and the push that
seals a step applies it there (`tf2sync/_src/sync/scale_out.py`).

What is checked: exactness against one process (N-of-N, and 1-of-2 with
backups, where both workers push the same batch so that any admitted push
gives the same update), the counts, a sealer that dies before applying
(the step stays sealed; `recover` and the watchdog apply it, once, with
the function the watchdog ran before the fault), a
push that stages and never commits (dropped), and that a repeated step's
push is a call of one function on the global step's ps, and that the
hold-time probe counts one commit per push and one finalize per update.
"""

import time
from unittest import mock

import pytest
import tensorflow as tf
import testutil
from absl.testing import absltest
from absl.testing import parameterized

import tf2sync
from tf2sync._src import aggregation
from tf2sync._src import watchdog
from tf2sync._src.sync import hold_time

# Long: a 3-ps cluster and about 3 minutes on 2 cores; run by
# `pytest -m slow` and CI.
pytestmark = pytest.mark.slow

NUM_WORKERS, NUM_PS = 2, 3


two_tables_model = testutil.two_tables_model


MODELS = {
    "dense": testutil.dense_model,
    "sparse": testutil.sparse_model,
    "two_tables": two_tables_model,
}
DATA = {"dense": "dense", "sparse": "sparse", "two_tables": "sparse"}
OPTIMIZERS = {
    "momentum": lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9),
    "adam_schedule": lambda: tf.keras.optimizers.Adam(
        tf.keras.optimizers.schedules.PiecewiseConstantDecay([2], [0.02, 0.005])
    ),
    "legacy_adagrad": lambda: tf.keras.optimizers.legacy.Adagrad(0.1),
}


def strategy(replicas_to_aggregate=2, **kwargs):
    return testutil.strategy(
        NUM_WORKERS,
        NUM_PS,
        replicas_to_aggregate=replicas_to_aggregate,
        **kwargs,
    )


def reference(kind, opt_name, batches):
    """One process, one step per global batch."""
    return testutil.one_process(MODELS[kind], OPTIMIZERS[opt_name], batches)


def halves(x, y):
    n = len(x) // NUM_WORKERS
    return [(x[i * n : (i + 1) * n], y[i * n : (i + 1) * n]) for i in (0, 1)]


def build(kind, opt_name, replicas_to_aggregate=2):
    sync = strategy(replicas_to_aggregate)
    with sync.scope():
        model = MODELS[kind]()
        opt = tf2sync.SyncOptimizer(OPTIMIZERS[opt_name]())
        opt.build(model.trainable_variables)
    return sync, model, opt


def devices(model):
    return {v.device for v in model.trainable_variables}


class ExactnessTest(parameterized.TestCase):
    @parameterized.product(
        kind=("dense", "sparse", "two_tables"),
        opt_name=("momentum", "adam_schedule", "legacy_adagrad"),
    )
    def test_two_workers_over_three_ps_equal_one_process(self, kind, opt_name):
        sync, model, opt = build(kind, opt_name)
        self.assertGreater(len(devices(model)), 1)  # round robin
        loop = testutil.Loop(sync, model, opt)
        x, y = testutil.data(DATA[kind], 4 * 16, seed=1)
        rounds = [
            (x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16])
            for i in range(4)
        ]
        for xb, yb in rounds:
            loop.round(halves(xb, yb))
        self.assertIsNotNone(opt._aggregator._scale_out)
        self.assertEqual(int(opt.iterations.numpy()), 4)
        expected = reference(kind, opt_name, rounds)
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), expected), 2e-5
        )
        # Two pushes, two ids, though the models set TF's global seed
        # (each worker's copy of a seeded op would draw the same ids).
        admitted = opt._aggregator._scale_out.admitted.numpy()
        self.assertLen(set(admitted.tolist()), 2)
        totals = opt._aggregator.totals()
        self.assertEqual(totals["accepted"], 8)
        self.assertEqual(totals["stale_dropped"], 0)
        self.assertFalse(opt._aggregator.watch_state().sealed)

    @parameterized.parameters("sparse", "two_tables")
    def test_one_of_two_with_a_backup_applies_each_update_once(self, kind):
        # Both workers push the same batch: whichever push an update
        # admits, it is that batch's gradient, so the weights are those of
        # one process after as many steps as the global step counts.
        sync, model, opt = build(kind, "momentum", replicas_to_aggregate=1)
        loop = testutil.Loop(sync, model, opt)
        x, y = testutil.data(DATA[kind], 8, seed=2)
        for _ in range(5):
            loop.round([(x, y), (x, y)])
        steps = int(opt.iterations.numpy())
        totals = opt._aggregator.totals()
        self.assertEqual(totals["accepted"], steps)
        self.assertEqual(
            totals["accepted"] + totals["stale_dropped"], 2 * 5, totals
        )
        expected = reference(kind, "momentum", [(x, y)] * steps)
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), expected), 2e-5
        )


class FitTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("repeated", 4, True),
        ("while_loop_of_groups", 2, True),
        ("keras_loop", None, False),
    )
    def test_fit_over_three_ps_equals_one_process(self, group, repeated):
        # The same batch on both workers: each update is that batch's
        # gradient, whichever pushes it admits.
        options = (
            tf2sync.SyncOptions(max_unrolled_steps=group) if group else None
        )
        sync = strategy(options=options)
        with sync.scope():
            model = two_tables_model()
            opt = tf2sync.SyncOptimizer(OPTIMIZERS["adam_schedule"]())
            model.compile(
                optimizer=opt, loss=testutil.LOSS, steps_per_execution=8
            )
            if not repeated:
                tf2sync.unroll_fit_steps(model, False)
        x, y = testutil.data("sparse", 16, seed=7)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(ds, epochs=2, steps_per_epoch=8, verbose=0)
        self.assertIsNotNone(opt._aggregator._scale_out)
        self.assertEqual(int(opt.iterations.numpy()), 8)
        expected = reference("two_tables", "adam_schedule", [(x, y)] * 8)
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), expected), 2e-5
        )


def _commit_only(self, committed, stats):
    """`Aggregator._apply_sealed` of a sealer that dies right after its
    commit: nothing is applied on the other ps, nothing ends the step."""
    del self, stats
    return tf.constant(False), committed[3]


class FaultTest(absltest.TestCase):
    def _sealed_not_applied(self):
        sync, model, opt = build("two_tables", "momentum")
        x, y = testutil.data("sparse", 16, seed=3)
        with mock.patch.object(
            aggregation.Aggregator, "_apply_sealed", _commit_only
        ):
            testutil.Loop(sync, model, opt).round(halves(x, y))
        return sync, model, opt, (x, y)

    def test_a_sealer_that_dies_leaves_the_step_to_recover_once(self):
        sync, model, opt, batch = self._sealed_not_applied()
        agg = opt._aggregator
        self.assertTrue(agg.watch_state().sealed)
        self.assertEqual(int(opt.iterations.numpy()), 0)
        self.assertTrue(agg.recover())
        self.assertEqual(int(opt.iterations.numpy()), 1)
        expected = reference("two_tables", "momentum", [batch])
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), expected), 2e-5
        )
        # A second applier (a late sealer, the watchdog again) adds nothing.
        self.assertFalse(agg.recover())
        self.assertEqual(int(opt.iterations.numpy()), 1)
        # Training goes on from the recovered step.
        x, y = testutil.data("sparse", 16, seed=4)
        testutil.Loop(sync, model, opt).round(halves(x, y))
        self.assertEqual(int(opt.iterations.numpy()), 2)
        expected = reference("two_tables", "momentum", [batch, (x, y)])
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), expected), 2e-5
        )

    def test_the_watchdog_recovers_a_sealed_step(self):
        _, model, opt, batch = self._sealed_not_applied()
        dog = watchdog.TokenWatchdog(opt._aggregator, timeout=0.5, poll=0.1)
        try:
            deadline = time.monotonic() + 30
            while int(opt.iterations.numpy()) == 0:
                self.assertLess(time.monotonic(), deadline)
                time.sleep(0.1)
        finally:
            dog.stop()
        self.assertEqual(int(opt.iterations.numpy()), 1)
        expected = reference("two_tables", "momentum", [batch])
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), expected), 2e-5
        )

    def test_recover_runs_the_function_prepared_before_the_fault(self):
        # A function's first run waits for every task, a frozen worker
        # too: `recover` must run the one `prepare_recover` ran.
        _, model, opt, batch = self._sealed_not_applied()
        agg = opt._aggregator
        self.assertTrue(agg.prepare_recover())
        self.assertTrue(agg.watch_state().sealed)  # no seal: a no-op
        self.assertEqual(int(opt.iterations.numpy()), 0)
        function = agg._recover_fn
        self.assertTrue(agg.recover())
        self.assertIs(agg._recover_fn, function)
        self.assertEqual(function.experimental_get_tracing_count(), 1)
        self.assertEqual(int(opt.iterations.numpy()), 1)
        expected = reference("two_tables", "momentum", [batch])
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), expected), 2e-5
        )

    def test_the_watchdog_prepares_recover_once_steps_are_applied(self):
        sync, model, opt = build("two_tables", "momentum")
        agg = opt._aggregator
        dog = watchdog.TokenWatchdog(agg, timeout=60, poll=0.1)
        try:
            time.sleep(0.5)
            self.assertIsNone(getattr(agg, "_recover_fn", None))
            x, y = testutil.data("sparse", 16, seed=8)
            testutil.Loop(sync, model, opt).round(halves(x, y))
            deadline = time.monotonic() + 30
            while getattr(agg, "_recover_fn", None) is None:
                self.assertLess(time.monotonic(), deadline)
                time.sleep(0.1)
        finally:
            dog.stop()
        self.assertEqual(int(opt.iterations.numpy()), 1)
        self.assertFalse(agg.watch_state().sealed)

    def test_a_push_staged_and_never_committed_is_dropped(self):
        sync, model, opt = build("two_tables", "momentum")
        loop = testutil.Loop(sync, model, opt)
        x, y = testutil.data("sparse", 32, seed=5)
        loop.round(halves(x[:16], y[:16]))  # builds the layout
        agg = opt._aggregator
        layout = agg._layout
        nan = float("nan")
        inputs = {
            "packed": [tf.fill([sum(g.sizes)], nan) for g in layout.dense],
            "sparse": [
                (
                    tf.constant([0, 1], tf.int64),
                    tf.fill([2] + s.variable.shape[1:].as_list(), nan),
                )
                for s in layout.sparse
            ],
        }
        # A worker that died after staging, before its commit.
        acks = agg._scale_out.stage(tf.constant(12345, tf.int64), inputs, True)
        self.assertFalse(bool(acks.numpy()))  # the NaN share said so
        loop.round(halves(x[16:], y[16:]))
        self.assertEqual(int(opt.iterations.numpy()), 2)
        expected = reference(
            "two_tables", "momentum", [(x[:16], y[:16]), (x[16:], y[16:])]
        )
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), expected), 2e-5
        )
        for st in agg._scale_out.stagings:
            self.assertEqual(int(st.queue.size().numpy()), 0)


class HoldTimeTest(absltest.TestCase):
    def test_the_probe_counts_each_commit_and_finalize_and_changes_nothing(
        self,
    ):
        hold_time.enable()
        try:
            sync, model, opt = build("two_tables", "momentum")
        finally:
            hold_time.enable(False)
        probe = opt._aggregator.hold_probe
        self.assertIsNotNone(probe)
        loop = testutil.Loop(sync, model, opt)
        x, y = testutil.data("sparse", 3 * 16, seed=7)
        rounds = [
            (x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16])
            for i in range(3)
        ]
        for xb, yb in rounds:
            loop.round(halves(xb, yb))
        held = probe.read()
        self.assertEqual(held["push"][0], 2 * 3)  # one commit per push
        self.assertEqual(held["finalize"][0], 3)  # one per update
        self.assertGreater(held["push"][1], 0.0)
        self.assertLess(held["push"][1], 10.0)
        expected = reference("two_tables", "momentum", rounds)
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), expected), 2e-5
        )
        # Off again: aggregators created now carry no probe.
        _, _, plain = build("dense", "momentum")
        self.assertIsNone(plain._aggregator.hold_probe)


class StructureTest(absltest.TestCase):
    def test_a_repeated_step_commits_by_one_call_on_the_global_steps_ps(self):
        sync = strategy()
        with sync.scope():
            model = two_tables_model()
            model.compile(
                optimizer=tf2sync.SyncOptimizer(
                    tf.keras.optimizers.SGD(0.1, momentum=0.9)
                ),
                loss=tf.keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True
                ),
                steps_per_execution=4,
            )
        x, y = testutil.data("sparse", 64, seed=6)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
        model.fit(ds, epochs=1, steps_per_epoch=8, verbose=0)
        agg = model.optimizer._aggregator
        self.assertIsNotNone(agg._scale_out)
        self.assertEqual(int(model.optimizer.iterations.numpy()), 4)
        functions = [f for f in agg._push_functions.values() if f is not None]
        self.assertNotEmpty(functions)
        # The apply on each other ps and the finalize: calls too (their
        # reads of another ps's rate and momentum come in as inputs).
        appliers = list(agg._scale_out._appliers.values())
        self.assertLen(appliers, len(agg._scale_out.stagings) - 1)
        self.assertTrue(all(a.is_call for a in appliers))
        self.assertTrue(all(f.is_call for f in agg._finalizers.values()))


if __name__ == "__main__":
    absltest.main()
