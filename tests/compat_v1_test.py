"""tf2sync.compat.v1.SyncReplicasOptimizer against TF1's own numbers.

Every in-process test uses one cluster shape (3 workers, 2 ps); each test
builds a fresh strategy on it. A replica step runs with an explicit worker
index (`_Harness.run`), so the spec's sequential `s0.run`/`s1.run` phases
are reproduced exactly.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
import testutil
from absl.testing import absltest

import tf2sync
from tf2sync._src import strategy as strategy_lib
from tf2sync.compat import v1 as compat_v1

# Multi-process: TF1's reference and the 1-ps cells run in subprocesses;
# run by `pytest -m slow` and CI.
pytestmark = pytest.mark.slow

NUM_WORKERS, NUM_PS = 3, 2
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class _Harness:
    """TF's `get_workers` fixture: v0/global_step on ps0, v1/v_sparse on ps1."""

    def __init__(
        self, rta, total, num_tokens=-1, inner=None, ema=None, timeout=60.0
    ):
        self.strategy = testutil.strategy(
            NUM_WORKERS,
            NUM_PS,
            replicas_to_aggregate=rta,
            total_num_replicas=total,
            token_timeout=timeout,
        )
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(
            self.strategy
        )
        with self.strategy.scope():
            # Round robin: ps0, ps1, ps0, ps1.
            self.global_step = tf.Variable(
                0, name="global_step", trainable=False
            )
            self.v1 = tf.Variable(1.0, name="v1")
            self.v0 = tf.Variable(0.0, name="v0")
            self.v_sparse = tf.Variable([[3.0], [4.0]], name="v_sparse")
            self.opt = compat_v1.SyncReplicasOptimizer(
                inner()
                if inner
                else tf.compat.v1.train.GradientDescentOptimizer(2.0),
                replicas_to_aggregate=rta,
                total_num_replicas=total,
                variable_averages=ema,
                variables_to_average=[self.v0, self.v1] if ema else None,
            )
        assert self.global_step.device.endswith(
            "ps/replica:0/task:0/device:CPU:0"
        )
        assert self.v0.device == self.global_step.device
        assert self.v_sparse.device == self.v1.device != self.v0.device
        self.num_tokens = num_tokens
        self.hook = None

        strategy, opt = self.strategy, self.opt
        gs = self.global_step
        variables = self.variables = [self.v0, self.v1, self.v_sparse]

        @tf.function
        def step(w):
            def replica(w):
                wf = tf.cast(w, tf.float32)
                g0 = 0.1 + 0.2 * wf
                g1 = 0.9 + 0.2 * wf
                g_sparse = tf.IndexedSlices(
                    tf.reshape(0.1 + 0.2 * wf, [1, 1]),
                    tf.constant([1], tf.int64),
                    tf.constant([2, 1], tf.int64),
                )
                return opt.apply_gradients(
                    zip([g0, g1, g_sparse], variables), gs
                )

            with strategy_lib._WorkerScope(w):
                return strategy.run(replica, args=(w,))

        self.step = step

    def trace(self):
        self.step.get_concrete_function(tf.TensorSpec([], tf.int64))

    def start(self, is_chief=True):
        self.trace()
        self.hook = self.opt.make_session_run_hook(is_chief, self.num_tokens)
        self.hook.begin()
        self.hook.after_create_session()

    def schedule(self, w):
        return self.coordinator.schedule(
            self.step, args=(tf.constant(w, tf.int64),)
        )

    def run(self, w):
        """One replica step of worker `w`, to completion (like `s_w.run`)."""
        result = self.schedule(w)
        self.coordinator.join()
        return int(result.fetch())

    def wait_global_step(self, value, timeout=60.0):
        deadline = time.time() + timeout
        while int(self.global_step.numpy()) != value:
            error = self.opt.get_chief_queue_runner().error
            if error is not None:
                raise error
            if time.time() > deadline:
                raise AssertionError(
                    f"global_step {int(self.global_step.numpy())} != {value}"
                )
            time.sleep(0.01)

    def settle(self, accumulator, rta=2):
        """Waits until no round is pending and the global step is still."""
        previous = None
        while True:
            state = (
                int(self.global_step.numpy()),
                int(accumulator.num_accumulated()),
            )
            if state[1] < rta and state == previous:
                return
            previous = state
            time.sleep(0.3)

    def wait_rounds(self, value, timeout=60.0):
        deadline = time.time() + timeout
        while int(self.opt.rounds.numpy()) < value:
            if time.time() > deadline:
                raise AssertionError(f"rounds < {value}")
            time.sleep(0.01)

    def local_step(self, w):
        return int(self.opt.local_steps.numpy()[w])

    def close(self):
        if self.opt._protocol is not None:  # stop the watchdog, hooks or not
            self.opt.make_session_run_hook(True).end()


class _MultiHarness(_Harness):
    """The same fixture, three Momentum shims at lr, 10 lr, 20 lr.

    Group A is v0, B is v1, C is v_sparse; `given[i]` says whether group i
    passes `global_step` (else None).
    """

    LR, MOMENTUM = 0.1, 0.9

    def __init__(self, given, rta=2, total=2, num_tokens=2):
        super().__init__(rta, total, num_tokens)
        with self.strategy.scope():
            self.opts = [
                compat_v1.SyncReplicasOptimizer(
                    tf.compat.v1.train.MomentumOptimizer(
                        self.LR * k, self.MOMENTUM
                    ),
                    replicas_to_aggregate=rta,
                    total_num_replicas=total,
                    name=f"sync_{k}",
                )
                for k in (1, 10, 20)
            ]
        self.opt = self.opts[0]
        strategy, opts, gs = self.strategy, self.opts, self.global_step
        variables = [self.v0, self.v1, self.v_sparse]
        steps = [gs if g else None for g in given]

        @tf.function
        def step(w):
            def replica(w):
                wf = tf.cast(w, tf.float32)
                grads = [
                    0.1 + 0.2 * wf,
                    0.9 + 0.2 * wf,
                    tf.IndexedSlices(
                        tf.reshape(0.1 + 0.2 * wf, [1, 1]),
                        tf.constant([1], tf.int64),
                        tf.constant([2, 1], tf.int64),
                    ),
                ]
                return [
                    o.apply_gradients([(g, v)], s)
                    for o, g, v, s in zip(opts, grads, variables, steps)
                ]

            with strategy_lib._WorkerScope(w):
                return strategy.run(replica, args=(w,))

        self.step = step

    def start(self, is_chief=True):
        self.trace()
        self.hooks = [
            o.make_session_run_hook(is_chief, self.num_tokens)
            for o in self.opts
        ]
        for hook in self.hooks:
            hook.begin()
            hook.after_create_session()
        self.hook = self.hooks[0]

    def run(self, w):
        result = self.schedule(w)
        self.coordinator.join()
        tokens = [int(t) for t in result.fetch()]
        assert len(set(tokens)) == 1, tokens  # one token per step
        return tokens[0]

    def values(self):
        return [
            float(self.v0.numpy()),
            float(self.v1.numpy()),
            self.v_sparse.numpy()[:, 0].tolist(),
        ]


class MultiOptimizerTest(absltest.TestCase):
    """Several shims in one step form one round (TF1 was wrong here)."""

    def setUp(self):
        super().setUp()
        self.harness = None

    def tearDown(self):
        if self.harness is not None:
            self.harness.close()
        super().tearDown()

    def _expected(self, rounds):
        lr, m = _MultiHarness.LR, _MultiHarness.MOMENTUM
        v = [0.0, 1.0, 4.0]  # v_sparse row 1; row 0 stays 3.0
        acc = [0.0, 0.0, 0.0]
        mean = [0.2, 1.0, 0.2]  # workers 0 and 1 averaged
        out = []
        for _ in range(rounds):
            for i, k in enumerate((1, 10, 20)):
                acc[i] = m * acc[i] + mean[i]
                v[i] -= lr * k * acc[i]
            out.append([v[0], v[1], [3.0, v[2]]])
        return out

    def _check(self, given, hooks=True):
        h = self.harness = _MultiHarness(given)
        if hooks:
            h.start()
            self.assertEqual(int(h.opt._sync_token_queue.size()), 2)
        else:  # the coordinator starts the round before the first step
            h.trace()
            self.assertFalse(h.opt._protocol.started)
        expected = self._expected(2)
        # One token queue, local steps and round for all three.
        self.assertLen({id(o._protocol) for o in h.opts}, 1)
        self.assertLen({id(o._sync_token_queue) for o in h.opts}, 1)

        # Phase 1: sequential, the initial tokens let both pass.
        self.assertEqual(h.run(0), 0)
        self.assertEqual(h.run(1), 0)
        h.wait_global_step(1)
        h.wait_rounds(1)
        np.testing.assert_allclose(
            _flat(h.values()), _flat(expected[0]), rtol=1e-5, atol=1e-6
        )

        # Phase 2: every group's gradients are stale and dropped.
        self.assertEqual(h.run(0), 1)
        self.assertEqual(h.run(1), 1)
        time.sleep(0.5)
        self.assertEqual(int(h.global_step.numpy()), 1)
        self.assertEqual(int(h.opt.rounds.numpy()), 1)
        np.testing.assert_allclose(
            _flat(h.values()), _flat(expected[0]), rtol=1e-5, atol=1e-6
        )
        self.assertEqual([h.local_step(0), h.local_step(1)], [1, 1])

        # Phase 3: concurrent; one round, every group moves once.
        h.schedule(0)
        h.schedule(1)
        h.coordinator.join()
        self.assertEqual(int(h.global_step.numpy()), 2)
        h.wait_rounds(2)
        np.testing.assert_allclose(
            _flat(h.values()), _flat(expected[1]), rtol=1e-5, atol=1e-6
        )
        # The barrier: tokens are released once per round (2), taken once
        # per worker step (2): none left over.
        self.assertEqual(int(h.opt._sync_token_queue.size()), 0)

    def test_only_first_given_global_step(self):
        self._check([True, False, False])

    def test_all_given_the_same_global_step(self):
        self._check([True, True, True])

    def test_only_a_later_optimizer_given_global_step(self):
        self._check([False, True, False])

    def test_no_hook_called(self):
        self._check([False, False, True], hooks=False)
        self.assertTrue(self.harness.opt._protocol.started)

    def test_no_global_step_in_the_step(self):
        h = self.harness = _MultiHarness([False, False, False])
        with self.assertRaisesRegex(
            ValueError, "Global step is required to check staleness"
        ):
            h.trace()


def _row(value):
    """The fixture's sparse gradient: `value` for row 1 of v_sparse."""
    return tf.IndexedSlices(
        tf.constant([[value]]),
        tf.constant([1], tf.int64),
        tf.constant([2, 1], tf.int64),
    )


def _flat(values):
    return [values[0], values[1]] + list(values[2])


class SyncReplicasTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        self.harness = None

    def tearDown(self):
        if self.harness is not None:
            self.harness.close()
        super().tearDown()

    def test_2_workers(self):
        h = self.harness = _Harness(rta=2, total=2, num_tokens=2)
        h.start()
        self.assertAlmostEqual(float(h.v0.numpy()), 0.0)
        self.assertAlmostEqual(float(h.v1.numpy()), 1.0)
        self.assertEqual(h.local_step(0), 0)
        self.assertEqual(int(h.global_step.numpy()), 0)
        self.assertEqual(h.local_step(1), 0)
        np.testing.assert_allclose(h.v_sparse.numpy(), [[3.0], [4.0]])

        # Phase 1: sequential, the initial tokens let both pass.
        h.run(0)
        h.run(1)
        h.wait_global_step(1)
        self.assertAlmostEqual(float(h.v0.numpy()), -0.4, places=5)
        self.assertAlmostEqual(float(h.v1.numpy()), -1.0, places=5)
        np.testing.assert_allclose(
            h.v_sparse.numpy(), [[3.0], [3.6]], rtol=1e-6
        )
        self.assertEqual(h.local_step(0), 0)
        self.assertEqual(h.local_step(1), 0)

        # Phase 2: stale gradients, dropped.
        h.run(0)
        h.run(1)
        self.assertEqual(int(h.global_step.numpy()), 1)
        self.assertEqual(h.local_step(0), 1)
        self.assertEqual(h.local_step(1), 1)
        self.assertAlmostEqual(float(h.v0.numpy()), -0.4, places=5)
        self.assertAlmostEqual(float(h.v1.numpy()), -1.0, places=5)

        # Phase 3: concurrent.
        h.schedule(0)
        h.schedule(1)
        h.coordinator.join()
        self.assertEqual(int(h.global_step.numpy()), 2)
        self.assertAlmostEqual(float(h.v0.numpy()), -0.8, places=5)
        self.assertAlmostEqual(float(h.v1.numpy()), -3.0, places=5)
        self.assertEqual(int(h.opt.rounds.numpy()), 2)

    def test_3_workers_1_backup(self):
        h = self.harness = _Harness(rta=2, total=3, num_tokens=3)
        h.start()
        self.assertEqual(int(h.global_step.numpy()), 0)
        self.assertEqual(h.local_step(1), 0)

        h.run(0)
        h.run(2)
        h.wait_global_step(1)
        self.assertAlmostEqual(float(h.v0.numpy()), -0.6, places=5)
        self.assertAlmostEqual(float(h.v1.numpy()), -1.2, places=5)

        h.run(1)  # late: dropped

        for w in range(3):  # all stale
            h.run(w)
        self.assertEqual(int(h.global_step.numpy()), 1)
        self.assertEqual(h.local_step(1), 1)

        h.schedule(0)
        time.sleep(0.5)
        self.assertEqual(int(h.global_step.numpy()), 1)
        h.schedule(1)
        h.coordinator.join()
        self.assertEqual(int(h.global_step.numpy()), 2)
        self.assertAlmostEqual(float(h.v0.numpy()), -1.0, places=5)
        self.assertAlmostEqual(float(h.v1.numpy()), -3.2, places=5)

    def test_retrace_does_not_duplicate_state(self):
        h = self.harness = _Harness(rta=2, total=2, num_tokens=2)
        h.trace()
        opt = h.opt
        self.assertLen(opt._accumulator_list, 3)
        aggregator, local_steps = opt._protocol.aggregator, opt.local_steps
        # A second input signature, and a new tf.function over the same
        # optimizer, both retrace apply_gradients.
        h.step.get_concrete_function(tf.TensorSpec([], tf.int32))
        step2 = tf.function(h.step.python_function)
        step2.get_concrete_function(tf.TensorSpec([], tf.int64))
        self.assertLen(opt._accumulator_list, 3)
        self.assertIs(opt._protocol.aggregator, aggregator)
        self.assertIs(opt.local_steps, local_steps)
        self.assertLen(opt._protocol.members, 1)
        h.start()
        # Training still matches test2Workers phase 1, across both traces.
        h.coordinator.schedule(step2, args=(tf.constant(0, tf.int64),))
        h.coordinator.join()
        h.run(1)
        h.wait_global_step(1)
        self.assertAlmostEqual(float(h.v0.numpy()), -0.4, places=5)
        self.assertAlmostEqual(float(h.v1.numpy()), -1.0, places=5)
        np.testing.assert_allclose(
            h.v_sparse.numpy(), [[3.0], [3.6]], rtol=1e-6
        )

    def test_keras_inner_optimizer(self):
        self._check_keras(lambda: tf.keras.optimizers.SGD(2.0))

    def test_keras_legacy_inner_optimizer(self):
        self._check_keras(lambda: tf.keras.optimizers.legacy.SGD(2.0))

    def _check_keras(self, inner):
        h = self.harness = _Harness(rta=2, total=2, num_tokens=2, inner=inner)
        h.start()
        h.run(0)
        h.run(1)
        h.wait_global_step(1)
        self.assertAlmostEqual(float(h.v0.numpy()), -0.4, places=5)
        self.assertAlmostEqual(float(h.v1.numpy()), -1.0, places=5)
        np.testing.assert_allclose(
            h.v_sparse.numpy(), [[3.0], [3.6]], rtol=1e-6
        )
        self.assertEqual(int(h.opt._opt.iterations.numpy()), 1)
        self.assertEqual(int(h.opt.rounds.numpy()), 1)

    def test_pass_throughs(self):
        h = self.harness = _Harness(
            rta=2,
            total=2,
            inner=lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
        )
        h.start()
        h.run(0)
        h.run(1)
        h.wait_global_step(1)
        self.assertEqual(h.opt.get_slot_names(), ["momentum"])
        slot = h.opt.get_slot(h.v0, "momentum")
        self.assertAlmostEqual(float(slot.numpy()), 0.2, places=5)
        names = sorted(v.name for v in h.opt.variables())
        self.assertLen(names, 3)
        self.assertTrue(all("Momentum" in n for n in names), names)

    def test_moving_averages_after_apply(self):
        ema = tf.compat.v1.train.ExponentialMovingAverage(0.5)
        h = self.harness = _Harness(rta=2, total=2, num_tokens=2, ema=ema)
        h.start()
        expected_ema_v1 = [0.0, -1.5]  # spec 1.9, resource variables
        for phase in range(2):
            if phase:
                h.run(0)  # the wasted post-start step
                h.run(1)
            h.schedule(0)
            h.schedule(1)
            h.coordinator.join()
            h.wait_global_step(phase + 1)
            h.wait_rounds(phase + 1)
            self.assertAlmostEqual(
                float(ema.average(h.v1).numpy()),
                expected_ema_v1[phase],
                places=5,
            )

    def test_one_apply_per_round(self):
        h = self.harness = _Harness(rta=2, total=2, num_tokens=2)
        h.start()
        rounds = 4
        accumulator = h.opt._accumulator_list[0][0]
        for _ in range(rounds):
            h.schedule(0)
            h.schedule(1)
            h.coordinator.join()
            # The sync round takes on a coordinator thread, as TF1's chief
            # queue runner: a take that comes after the next round's first
            # push averages 3 gradients (as TF1's would). Wait for it.
            h.settle(accumulator)
        h.wait_global_step(int(h.opt.rounds.numpy()))
        applied = int(h.opt.rounds.numpy())
        # Startup wastes one step per worker: at least rounds - 1 applies.
        self.assertGreaterEqual(applied, rounds - 1)
        self.assertEqual(int(h.global_step.numpy()), applied)
        # Once per round: v0 moves by lr * mean(g0) per round, not per push.
        self.assertAlmostEqual(float(h.v0.numpy()), -0.4 * applied, places=4)

    def test_tokens_lost_with_a_dead_worker_are_released(self):
        h = self.harness = _Harness(rta=2, total=2, num_tokens=2, timeout=2.0)
        h.start()
        # Another worker took both tokens and died: nobody can pass now.
        for _ in range(2):
            h.opt._sync_token_queue.dequeue()
        result = h.schedule(0)  # pushes, then waits for a token
        done = threading.Event()
        threading.Thread(
            target=lambda: (h.coordinator.join(), done.set()), daemon=True
        ).start()
        self.assertTrue(done.wait(60), "the step hung on the lost tokens")
        # One token is needed; two if the watchdog fired before the push
        # landed (a slow first dispatch): surplus tokens are safe.
        self.assertBetween(h.opt._protocol.watchdog.released, 1, 2)
        # The released token carries the current global step; the push
        # waits in the accumulator for the round's second gradient.
        self.assertEqual(int(result.fetch()), 0)
        self.assertEqual(int(h.global_step.numpy()), 0)
        pending = h.opt._accumulator_list[0][0].num_accumulated()
        self.assertEqual(int(pending), 1)
        h.run(1)
        h.wait_global_step(1)
        self.assertAlmostEqual(float(h.v0.numpy()), -0.4, places=5)

    def test_slots_and_variables_right_after_apply_gradients(self):
        # TF1 creates them when `apply_gradients` builds the train op; the
        # first trace is that moment here, before any round ran.
        h = self.harness = _Harness(
            rta=2,
            total=2,
            inner=lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
        )
        h.trace()
        self.assertEqual(h.opt.get_slot_names(), ["momentum"])
        for var in (h.v0, h.v1, h.v_sparse):
            slot = h.opt.get_slot(var, "momentum")
            self.assertIsNotNone(slot, var.name)
            self.assertEqual(slot.shape, var.shape)
        self.assertLen(h.opt.variables(), 3)
        self.assertEqual(int(h.opt.rounds.numpy()), 0)

    def test_eager_apply_gradients_after_the_round_started(self):
        h = self.harness = _Harness(rta=2, total=2, num_tokens=2)
        h.start()
        sparse = tf.IndexedSlices(
            tf.constant([[0.1]]),
            tf.constant([1], tf.int64),
            tf.constant([2, 1], tf.int64),
        )
        with h.strategy.scope():
            # Worker 0's gradients of the fixture, eagerly: one step, its
            # push first, then a token (one of the initial two).
            token = h.opt.apply_gradients(
                zip([tf.constant(0.1), tf.constant(0.9), sparse], h.variables),
                h.global_step,
            )
        self.assertEqual(int(token), 0)
        self.assertEqual(int(h.global_step.numpy()), 0)
        h.run(1)  # worker 1's push completes the round
        h.wait_global_step(1)
        self.assertAlmostEqual(float(h.v0.numpy()), -0.4, places=5)
        self.assertAlmostEqual(float(h.v1.numpy()), -1.0, places=5)
        np.testing.assert_allclose(
            h.v_sparse.numpy(), [[3.0], [3.6]], rtol=1e-6
        )

    def test_num_accumulated_counts_a_push_until_the_round_applies(self):
        h = self.harness = _Harness(rta=2, total=2, num_tokens=2)
        h.start()
        accumulators = [acc for acc, _ in h.opt._accumulator_list]
        self.assertLen(accumulators, 3)  # v0, v1 and the sparse one
        h.run(0)
        # Nothing takes the push away before the round: the sparse count
        # (and the watchdog's) still reads 1 later on.
        time.sleep(0.5)
        self.assertEqual(
            [int(a.num_accumulated()) for a in accumulators], [1] * 3
        )
        h.run(1)
        h.wait_global_step(1)
        self.assertEqual(
            [int(a.num_accumulated()) for a in accumulators], [0] * 3
        )

    def test_eager_apply_gradients_before_anything_started_the_chief(self):
        h = self.harness = _Harness(rta=2, total=2)
        with h.strategy.scope():
            # No hook, no dispatch: the eager step starts the chief's side
            # itself (TF1's default tokens), or it would wait forever.
            token = h.opt.apply_gradients(
                zip(
                    [tf.constant(0.1), tf.constant(0.9), _row(0.1)], h.variables
                ),
                h.global_step,
            )
        self.assertEqual(int(token), 0)
        self.assertEqual(int(h.opt._sync_token_queue.size()), 1)

    def test_tf1_init_tokens_then_chief_queue_runner_seed_once(self):
        h = self.harness = _Harness(rta=2, total=2)
        h.trace()
        h.opt.get_init_tokens_op(2)()  # TF1: sess.run(init_tokens_op)
        runner = h.opt.get_chief_queue_runner()
        runner.start()  # TF1: sv.start_queue_runners(sess, [runner])
        self.assertTrue(runner.running)
        self.assertEqual(int(h.opt._sync_token_queue.size()), 2)
        h.schedule(0)  # the dispatch seeds nothing more
        h.coordinator.join()
        self.assertEqual(int(h.opt._sync_token_queue.size()), 1)
        h.run(1)
        h.wait_global_step(1)
        self.assertAlmostEqual(float(h.v0.numpy()), -0.4, places=5)

    def _replica_step(self, h, replica):
        @tf.function
        def step(w):
            with strategy_lib._WorkerScope(w):
                return h.strategy.run(replica, args=(w,))

        return step.get_concrete_function(tf.TensorSpec([], tf.int64))

    def test_apply_gradients_in_a_cond_is_refused_by_name(self):
        h = self.harness = _Harness(rta=2, total=2)

        def replica(w):
            grads = [tf.constant(0.1), tf.constant(0.9), _row(0.1)]
            return tf.cond(
                w > 0,
                lambda: h.opt.apply_gradients(
                    zip(grads, h.variables), h.global_step
                ),
                lambda: tf.constant(-1, tf.int64),
            )

        with self.assertRaisesRegex(ValueError, "inside a tf.cond, loop"):
            self._replica_step(h, replica)

    def test_an_op_of_the_step_waiting_on_the_result_is_refused(self):
        h = self.harness = _Harness(rta=2, total=2)

        def replica(w):
            grads = [tf.constant(0.1), tf.constant(0.9), _row(0.1)]
            token = h.opt.apply_gradients(
                zip(grads, h.variables), h.global_step
            )
            with tf.control_dependencies([token]):
                return h.global_step.read_value()  # would wait on the push

        with self.assertRaisesRegex(ValueError, "waits on the result"):
            self._replica_step(h, replica)

    def test_a_step_over_other_variables_is_refused_by_name(self):
        h = self.harness = _Harness(rta=2, total=2)
        h.trace()

        def replica(w):
            return h.opt.apply_gradients(
                [(tf.constant(1.0), h.v0)], h.global_step
            )

        with self.assertRaisesRegex(ValueError, "this step applies others"):
            self._replica_step(h, replica)
        h.start()  # the refused trace changed nothing: training still works
        h.run(0)
        h.run(1)
        h.wait_global_step(1)
        self.assertAlmostEqual(float(h.v0.numpy()), -0.4, places=5)

    def test_errors(self):
        opt = compat_v1.SyncReplicasOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(1.0), 1, 1
        )
        hook = opt.make_session_run_hook(True)
        with self.assertRaisesRegex(
            ValueError,
            "^SyncReplicasOptimizer.apply_gradient should be called before "
            "using the hook.$",
        ):
            hook.begin()
        # TF1's words, then what to do in TF2.
        advice = (
            r" In TF2, trace the step first \(`step.get_concrete_function"
            r"\(...\)`, whose strategy.run calls apply_gradients\), or drop "
            r"the call: the coordinator starts the round before the first "
            r"scheduled step.$"
        )
        with self.assertRaisesRegex(
            ValueError,
            r"^get_init_tokens_op\(\) should be called after "
            r"apply_gradients\(\)\." + advice,
        ):
            opt.get_init_tokens_op()
        with self.assertRaisesRegex(
            ValueError,
            r"^Should be called after apply_gradients\(\)\." + advice,
        ):
            opt.get_chief_queue_runner()
        with self.assertRaisesRegex(
            ValueError, "^Must supply at least one variable$"
        ):
            opt.apply_gradients([], tf.Variable(0))
        with self.assertRaisesRegex(
            ValueError, "^Global step is required to check staleness$"
        ):
            opt.apply_gradients([(tf.constant(1.0), tf.Variable(1.0))])

    def test_bad_constructor_arguments_are_named(self):
        # TF1 accepted these and failed later, far from the cause.
        sgd = tf.compat.v1.train.GradientDescentOptimizer(1.0)
        for args, error, message in [
            ((sgd, 0), ValueError, r"Received: replicas_to_aggregate=0$"),
            ((sgd, "2"), TypeError, r"Received: replicas_to_aggregate='2'"),
            ((sgd, 2, -1), ValueError, r"Received: total_num_replicas=-1$"),
            (("sgd", 2), TypeError, r"`opt` must be .* Received: opt='sgd'"),
        ]:
            with self.assertRaisesRegex(error, message):
                compat_v1.SyncReplicasOptimizer(*args)
        keras = compat_v1.SyncReplicasOptimizer(
            tf.keras.optimizers.SGD(0.1), 3, 2
        )
        self.assertEqual(keras._tokens_per_step, 3)  # max(total, rta)

    def test_too_few_tokens_and_unknown_grad(self):
        h = self.harness = _Harness(rta=3, total=1, num_tokens=1)
        h.trace()
        hook = h.opt.make_session_run_hook(True, num_tokens=1)
        with self.assertRaisesRegex(
            ValueError,
            r"^Too few tokens to finish the first step: 1 \(given\) vs 2 "
            r"\(needed\)$",
        ):
            hook.begin()
        h.opt.get_init_tokens_op(2)  # enough
        sparse = tf.SparseTensor([[0, 0]], [1.0], [2, 1])
        with self.assertRaisesRegex(ValueError, "^Unknown grad type!$"):
            h.opt.apply_gradients([(sparse, h.v_sparse)], h.global_step)


class DifferentialTest(absltest.TestCase):
    """The shim and TF1's real optimizer, same replica-step sequence.

    Each line compared: global_step, v0, v1, v_sparse, the moving averages
    of v0 and v1 (if any) and every worker's local step, after each phase.
    """

    def _compare(self, sequence, config, final_step):
        env = dict(os.environ, PYTHONPATH=ROOT)
        proc = subprocess.Popen(
            [
                sys.executable,
                os.path.join(HERE, "compat_v1_tf1_reference.py"),
                json.dumps(sequence),
                json.dumps(config),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        try:
            out, err = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        self.assertEqual(proc.returncode, 0, err[-3000:])
        expected = [
            [float(x) for x in line.split()]
            for line in out.strip().splitlines()
        ]
        self.assertLen(expected, len(sequence))

        workers = config.get("workers", 2)
        rta = config.get("rta", 2)
        ema = None
        if config.get("ema") is not None:
            ema = tf.compat.v1.train.ExponentialMovingAverage(config["ema"])
        h = _Harness(
            rta=rta,
            total=config.get("total", workers),
            num_tokens=config.get("num_tokens", 2),
            ema=ema,
        )
        try:
            h.start()
            accumulator = h.opt._accumulator_list[0][0]
            got = []
            for phase in sequence:
                for w in phase:
                    h.schedule(w)
                h.coordinator.join()
                h.settle(accumulator, rta)
                line = [
                    float(h.global_step.numpy()),
                    float(h.v0.numpy()),
                    float(h.v1.numpy()),
                ] + h.v_sparse.numpy()[:, 0].tolist()
                if ema is not None:
                    line += [
                        float(ema.average(h.v0).numpy()),
                        float(ema.average(h.v1).numpy()),
                    ]
                got.append(line + [h.local_step(w) for w in range(workers)])
        finally:
            h.close()
        np.testing.assert_allclose(got, expected, atol=1e-5)
        # Not vacuous: the sequences include stale (dropped) steps.
        self.assertEqual(expected[-1][0], final_step)

    def test_dense_and_sparse_match_tf1(self):
        sequence = [[0], [1], [0], [1], [0, 1], [0, 1], [0, 1]]
        self._compare(sequence, {}, 4.0)

    def test_backup_worker_matches_tf1(self):
        # test3Workers1Backup's phases, then a late and a stale step.
        sequence = [[0], [2], [1], [0], [1], [2], [0, 1], [2], [0, 1]]
        config = {"workers": 3, "rta": 2, "total": 3, "num_tokens": 3}
        self._compare(sequence, config, 3.0)

    def test_more_replicas_to_aggregate_than_workers_matches_tf1(self):
        sequence = [[0]] * 7
        self._compare(sequence, {"workers": 1, "rta": 2, "total": 1}, 3.0)

    def test_moving_averages_match_tf1(self):
        sequence = [[0], [1], [0], [1], [0, 1], [0, 1], [0, 1]]
        self._compare(sequence, {"ema": 0.5}, 4.0)


def _run_example(name, steps):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "examples", f"{name}.py"),
            "--steps",
            str(steps),
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _import_example(name):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def _numpy_momentum(example, updates):
    """Synchronous, averaged momentum updates of the examples' model."""
    shards = [
        (x.astype("float64"), y.astype("float64")) for x, y in example.shards()
    ]
    w = {"a": np.zeros([3, 1]), "b": np.zeros([1]), "c": 0.0}
    acc = {"a": np.zeros([3, 1]), "b": np.zeros([1]), "c": 0.0}
    for _ in range(updates):
        grads = []
        for x, y in shards:
            r = x @ w["a"] + w["b"] + w["c"] * x[:, :1] - y
            d = 2.0 * r / len(x)
            grads.append(
                {
                    "a": x.T @ d,
                    "b": d.sum(0),
                    "c": float((d * x[:, :1]).sum()),
                }
            )
        for k, scale in example.SCALES.items():
            g = np.mean([gr[k] for gr in grads], axis=0)
            acc[k] = example.MOMENTUM * acc[k] + g
            w[k] = w[k] - example.LR * scale * acc[k]
    return w


class FitTest(absltest.TestCase):
    """`model.compile(optimizer=SyncReplicasOptimizer(...))`, no hooks.

    Every worker sees the same full batch, so any accepted gradient is the
    full-batch gradient at the current weights, and U rounds must give the
    weights of U single-process full-batch steps of TF1's momentum.
    """

    LR, MOMENTUM = 0.1, 0.9

    def _fit(self, rta, total, epochs, steps, spe, unroll=False):
        strategy = testutil.strategy(
            NUM_WORKERS,
            NUM_PS,
            replicas_to_aggregate=rta,
            total_num_replicas=total,
            token_timeout=5.0,
        )
        x, y = testutil.data("dense", 16)
        dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
        with strategy.scope():
            model = testutil.dense_model()
            initial = model.get_weights()
            opt = compat_v1.SyncReplicasOptimizer(
                tf.compat.v1.train.MomentumOptimizer(self.LR, self.MOMENTUM),
                replicas_to_aggregate=rta,
                total_num_replicas=total,
            )
            model.compile(
                optimizer=opt, loss=testutil.LOSS, steps_per_execution=spe
            )
        # fit repeats its steps by default; False keeps tf_keras's loop.
        tf2sync.unroll_fit_steps(model, unroll)
        history = model.fit(
            dataset, epochs=epochs, steps_per_epoch=steps, verbose=0
        )
        opt.make_session_run_hook(True).end()  # stop the token watchdog
        rounds = int(opt.rounds.numpy())
        return model, initial, opt, rounds, history

    def _reference(self, initial, updates):
        model = testutil.dense_model()
        model.set_weights(initial)
        opt = tf.compat.v1.train.MomentumOptimizer(self.LR, self.MOMENTUM)
        x, y = testutil.data("dense", 16)
        for _ in range(updates):
            with tf.GradientTape() as tape:
                loss = testutil.LOSS(y, model(x))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        return model.get_weights()

    def _check(self, rta, total, epochs=2, steps=12, spe=1, unroll=False):
        model, initial, opt, rounds, history = self._fit(
            rta, total, epochs, steps, spe, unroll
        )
        iterations = int(model.optimizer.iterations.numpy())
        # The model's step counter is TF1's global_step: +1 per round.
        self.assertEqual(iterations, rounds)
        worker_steps = epochs * steps
        # Each round takes `rta` fresh gradients: at most one per step.
        self.assertBetween(rounds, worker_steps // (2 * rta), worker_steps)
        for got, want in zip(
            model.get_weights(), self._reference(initial, rounds)
        ):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        self.assertLen(history.history["loss"], epochs)
        self.assertLess(history.history["loss"][-1], history.history["loss"][0])
        return rounds

    def test_fit_all_workers(self):
        self._check(rta=3, total=3)

    def test_fit_with_a_backup_worker_and_steps_per_execution(self):
        self._check(rta=2, total=3, steps=10, spe=5)

    def test_one_function_per_epoch_starts_the_round(self):
        # steps_per_epoch == steps_per_execution: the epoch's only function
        # is the one whose trace creates the round, and it must not wait
        # for a token nobody enqueues.
        self._check(rta=2, total=3, steps=5, spe=5)

    def test_unrolled_fit_keeps_tf1_order(self):
        # tf2sync.unroll_fit_steps: 5 shim steps in one graph. Each step's
        # reads follow the previous step's token, as in TF1's session runs;
        # without that, weights read early land off the TF1 trajectory.
        self._check(rta=2, total=3, steps=10, spe=5, unroll=True)

    def test_fit_with_a_multi_optimizer_inside_matches_tf1_per_group(self):
        # TF1's pattern of one rate per variable group under one shim:
        # a tf2sync.MultiOptimizer of momentum SGDs (kernels at LR, biases
        # at 2 LR) inside, against TF1's MomentumOptimizer per group.
        strategy = testutil.strategy(
            NUM_WORKERS, NUM_PS, replicas_to_aggregate=2, token_timeout=5.0
        )
        x, y = testutil.data("dense", 16)
        dataset = tf.data.Dataset.from_tensors((x, y)).repeat()

        def sgd(rate):
            return tf.keras.optimizers.legacy.SGD(rate, momentum=self.MOMENTUM)

        with strategy.scope():
            model = testutil.dense_model()
            initial = model.get_weights()
            multi = tf2sync.MultiOptimizer(
                groups={"kernel": sgd(self.LR), "bias": sgd(2 * self.LR)}
            )
            opt = compat_v1.SyncReplicasOptimizer(multi, 2)
            model.compile(optimizer=opt, loss=testutil.LOSS)
        model.fit(dataset, epochs=2, steps_per_epoch=8, verbose=0)
        opt.make_session_run_hook(True).end()
        rounds = int(opt.rounds.numpy())
        self.assertEqual(int(model.optimizer.iterations.numpy()), rounds)
        self.assertGreater(rounds, 0)
        reference = testutil.dense_model()
        reference.set_weights(initial)
        rates = {"kernel": self.LR, "bias": 2 * self.LR}
        per_group = testutil.tf1_momentum_per_group(
            reference, x, y, rates, self.MOMENTUM, rounds
        )
        for got, want in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        # TF1's get_slot through the shim: each variable's group's momentum
        # (the MultiOptimizer routes it; it raised KeyError). tf_keras keeps
        # the velocity, -rate x TF1's accumulator.
        self.assertEqual(opt.get_slot_names(), ["momentum"])
        for var, ref in zip(
            model.trainable_variables, reference.trainable_variables
        ):
            key = "kernel" if "kernel" in var.name else "bias"
            np.testing.assert_allclose(
                -opt.get_slot(var, "momentum").numpy() / rates[key],
                per_group[key].get_slot(ref, "momentum").numpy(),
                rtol=1e-4,
                atol=1e-5,
            )
        with self.assertRaisesRegex(KeyError, r"is in no group of"):
            opt.get_slot(reference.trainable_variables[0], "momentum")


class ExampleTest(absltest.TestCase):
    """The two migration examples against synchronous momentum in NumPy."""

    def _check_weights(self, got, w):
        np.testing.assert_allclose(got["w_a"], w["a"], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["w_b"], w["b"], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["w_c"], w["c"], rtol=1e-4, atol=1e-5)

    def test_shim_example_matches_numpy(self):
        steps = 6
        got = _run_example("tf1_migration_shim", steps)
        updates = steps - 1  # TF1's wasted post-start step
        example = _import_example("tf1_migration_shim")
        self._check_weights(got, _numpy_momentum(example, updates))
        for key in ("global_step", "rounds"):
            self.assertEqual(got[key], updates)

    def test_multi_optimizer_example_matches_numpy(self):
        steps = 6
        got = _run_example("tf1_migration_multi", steps)
        example = _import_example("tf1_migration_multi")
        self._check_weights(got, _numpy_momentum(example, steps))
        self.assertEqual(got["global_step"], steps)


if __name__ == "__main__":
    absltest.main()
