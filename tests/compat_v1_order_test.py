"""TF1 programs as written: the chief's calls in a TF1 user's orders.

A TF1 program ported to the shim keeps its chief's calls wherever they
were: `get_chief_queue_runner()` and `get_init_tokens_op()` (TF's
`mnist_replica.py`), or `make_session_run_hook` (TF's tests), which need
the step traced first, or none of them. Each test runs one such order in
a program written as a user writes it (the step's data given as its
arguments, as TF1's `feed_dict`; no worker index given to the step;
everything built, and the step traced, under `strategy.scope()`), Adam
inside, 2 workers and 1 ps, the workers in lockstep, and compares every
phase with TF1's real SyncReplicasOptimizer in graph mode
(`compat_v1_tf1_reference.py`, run once per global step dtype): global
step, every weight and each worker's local step.

Each phase schedules two steps, one with TF1's worker 0's gradients and
one with worker 1's; the coordinator picks which worker runs which. In
lockstep each round averages one push of each, so the weights do not
depend on that choice, and each worker's local step must be its own.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import tensorflow as tf
import testutil
from absl.testing import absltest

from tf2sync.compat import v1 as compat_v1

NUM_WORKERS, NUM_PS = 2, 1
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PHASES = [[0, 1]] * 8  # lockstep: both workers step in every phase
ADAM_LR = 0.1  # compat_v1_tf1_reference.ADAM_LR
# Each step sleeps this long before it pushes, so that each of a phase's
# two scheduled steps goes to its own idle worker (not both to one).
STEP_SECONDS = 0.2

_REFERENCE = {}  # global step dtype name -> TF1's lines, one per phase


def tf1_lines(step_dtype):
    """TF1's lines for `PHASES` (a subprocess, run once per dtype)."""
    if step_dtype in _REFERENCE:
        return _REFERENCE[step_dtype]
    config = {"inner": "adam", "step_dtype": step_dtype}
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "compat_v1_tf1_reference.py"),
            json.dumps(PHASES),
            json.dumps(config),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=ROOT),
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:
        raise AssertionError(err[-3000:])
    lines = [[float(x) for x in line.split()] for line in out.splitlines()]
    _REFERENCE[step_dtype] = lines
    return lines


class _Program:
    """TF's `get_workers` fixture, ported as a TF1 user ports it.

    v0 and v1 (dense) and v_sparse (row 1 through `IndexedSlices`) on the
    one ps; TF1's worker w's gradients are 0.1 + 0.2w, 0.9 + 0.2w and
    0.1 + 0.2w (`gradients(w)`), given to the step as arguments.
    """

    def __init__(self, step_dtype):
        strategy = self.strategy = testutil.strategy(
            NUM_WORKERS,
            NUM_PS,
            replicas_to_aggregate=2,
            total_num_replicas=2,
            token_timeout=60.0,
        )
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(
            strategy
        )
        with strategy.scope():
            self.global_step = tf.Variable(
                tf.constant(0, step_dtype), name="global_step", trainable=False
            )
            self.v0 = tf.Variable(0.0, name="v0")
            self.v1 = tf.Variable(1.0, name="v1")
            self.v_sparse = tf.Variable([[3.0], [4.0]], name="v_sparse")
            self.opt = compat_v1.SyncReplicasOptimizer(
                tf.compat.v1.train.AdamOptimizer(ADAM_LR),
                replicas_to_aggregate=2,
                total_num_replicas=2,
            )
        variables = [self.v0, self.v1, self.v_sparse]
        opt, gs = self.opt, self.global_step

        def replica(g0, g1, rows):
            slept = tf.py_function(
                lambda: time.sleep(STEP_SECONDS) or 0.0, [], tf.float32
            )
            g_sparse = tf.IndexedSlices(
                rows + slept * 0.0,
                tf.constant([1], tf.int64),
                tf.constant([2, 1], tf.int64),
            )
            return opt.apply_gradients(zip([g0, g1, g_sparse], variables), gs)

        @tf.function
        def step(g0, g1, rows):
            return strategy.run(replica, args=(g0, g1, rows))

        self.step = step

    @staticmethod
    def gradients(w):
        """TF1's worker `w`'s gradients (float32, from the same doubles)."""
        return (
            tf.constant(0.1 + 0.2 * w),
            tf.constant(0.9 + 0.2 * w),
            tf.constant([[0.1 + 0.2 * w]]),
        )

    def trace(self):
        """The step traced before the chief's calls (they need it)."""
        with self.strategy.scope():
            self.step.get_concrete_function(*self.gradients(0))

    def phase(self, workers):
        """One lockstep phase; returns the tokens the steps returned."""
        results = [
            self.coordinator.schedule(self.step, args=self.gradients(w))
            for w in workers
        ]
        self.coordinator.join()
        return [r.fetch() for r in results]

    def line(self):
        """This side's line: global step, v0, v1, v_sparse, local steps."""
        return (
            [
                float(self.global_step.numpy()),
                float(self.v0.numpy()),
                float(self.v1.numpy()),
            ]
            + self.v_sparse.numpy()[:, 0].tolist()
            + self.opt.local_steps.numpy().tolist()
        )

    def close(self):
        if self.opt._protocol is not None:  # stop the watchdog
            self.opt.make_session_run_hook(True).end()


class _Warnings(logging.Handler):
    """The warnings logged (absl's too) inside `with` blocks."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def saying(self, text):
        return [m for m in self.messages if text in m]

    def __enter__(self):
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger().removeHandler(self)


class CallOrderTest(absltest.TestCase):
    """Every order ends where TF1's real optimizer does, step by step."""

    def setUp(self):
        super().setUp()
        self.program = None

    def tearDown(self):
        if self.program is not None:
            self.program.close()
        super().tearDown()

    def _run(self, step_dtype, start=None, after_first_phase=None):
        """Runs `PHASES`, `start(program)` first; compares with TF1."""
        dtype = tf.as_dtype(step_dtype)
        p = self.program = _Program(dtype)
        if start is not None:
            start(p)
        got, tokens = [], []
        for i, workers in enumerate(PHASES):
            tokens += p.phase(workers)
            if i == 0 and after_first_phase is not None:
                after_first_phase(p)
            got.append(p.line())
        expected = tf1_lines(step_dtype)
        self.assertLen(expected, len(PHASES))
        # Not vacuous: one wasted phase, then one round per phase, and
        # each worker's local step is its own.
        self.assertEqual(expected[-1][0], len(PHASES) - 1)
        self.assertEqual(expected[-1][-2:], [len(PHASES) - 1] * 2)
        np.testing.assert_array_equal(got, expected)  # bit-identical
        # TF1's dtype: tokens and local steps are the global step's.
        self.assertEqual(p.opt.local_steps.dtype, dtype)
        self.assertEqual(p.opt._sync_token_queue.dtypes, [dtype])
        self.assertEqual(p.opt.get_init_tokens_op().dtype, dtype)
        self.assertEqual(
            {np.asarray(t).dtype for t in tokens}, {np.dtype(dtype.name)}
        )
        # Every token taken: none left over (no extra init tokens).
        self.assertEqual(int(p.opt._sync_token_queue.size()), 0)

    def test_traced_then_queue_runner_and_init_tokens(self):
        # TF's mnist_replica.py: the runner and the op made after the
        # graph, the op run, then the runner started.
        def start(p):
            p.trace()
            runner = p.opt.get_chief_queue_runner()
            init_tokens = p.opt.get_init_tokens_op()
            init_tokens()
            runner.start()

        self._run("int32", start)

    def test_traced_then_hooks(self):
        def start(p):
            p.trace()
            hook = p.opt.make_session_run_hook(True, num_tokens=2)
            hook.begin()
            hook.after_create_session()

        self._run("int64", start)

    def test_calls_before_tracing_say_what_to_do(self):
        # TF1 made the hook before the graph (allowed) and the rest after:
        # made before the step exists, TF1's calls fail with TF1's words,
        # then say what to do in TF2.
        p = self.program = _Program(tf.int32)
        hook = p.opt.make_session_run_hook(True, num_tokens=2)
        with self.assertRaisesRegex(
            ValueError,
            r"^Should be called after apply_gradients\(\)\. In TF2, trace "
            r"the step first .*or drop the call: the coordinator starts the "
            r"round",
        ):
            p.opt.get_chief_queue_runner()
        with self.assertRaisesRegex(
            ValueError,
            r"^get_init_tokens_op\(\) should be called after "
            r"apply_gradients\(\)\. In TF2, trace the step first",
        ):
            p.opt.get_init_tokens_op()
        with self.assertRaisesRegex(
            ValueError,
            "^SyncReplicasOptimizer.apply_gradient should be called before "
            "using the hook.$",
        ):
            hook.begin()

    def test_calls_after_the_coordinator_started_change_nothing(self):
        # The hook made before the step, as TF1 allowed; the first schedule
        # traces the step and starts the round; TF1's calls made after it
        # (the init tokens, the runner, the hook) add nothing.
        hooks, warnings = [], _Warnings()

        def start(p):
            hooks.append(p.opt.make_session_run_hook(True, num_tokens=2))

        def after_first_phase(p):
            with warnings:
                p.opt.get_init_tokens_op()()
            p.opt.get_chief_queue_runner().start()
            hooks[0].begin()
            hooks[0].after_create_session()

        self._run("int32", start, after_first_phase)
        self.assertLen(warnings.saying("enqueued nothing"), 1)

    def test_traced_and_nothing_started_by_hand(self):
        self._run("int64", lambda p: p.trace())

    def test_init_tokens_and_runner_called_twice(self):
        def start(p):
            p.trace()
            runner = p.opt.get_chief_queue_runner()
            runner.start()  # TF1's runner enqueued nothing itself
            init_tokens = p.opt.get_init_tokens_op()
            init_tokens()
            self.assertEqual(int(p.opt._sync_token_queue.size()), 2)
            with self.assertLogs(level="WARNING") as logs:
                init_tokens()
                p.opt.get_init_tokens_op()()
            self.assertLen(
                [m for m in logs.output if "enqueued nothing" in m], 2
            )
            self.assertEqual(int(p.opt._sync_token_queue.size()), 2)
            p.opt.get_chief_queue_runner().start()

        self._run("int32", start)


if __name__ == "__main__":
    absltest.main()
