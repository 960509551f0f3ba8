"""Three TF1 programs ported twice each, against TF1 running them.

compat_v1_order_test.py checks the chief's calls on TF's test fixture;
this file checks whole programs of the shapes TF1 users migrate
(tests/testdata/migrate/): `mnist_replica.py` (per-worker processes under
a `Supervisor`, the chief running `get_init_tokens_op()` and starting
`get_chief_queue_runner()`), `monitored_sync.py` (a dataset per worker,
`MonitoredTrainingSession` with the optimizer's hook, `num_tokens=0`) and
`three_optimizers.py` (three optimizers at lr, 10 lr and 20 lr, one
global step). Each is ported twice, in one coordinator program (TF2's
form of the chief; the workers run only the scheduled steps):

* "as written": the TF1 calls kept where the program made them, after
  the step was traced (TF1 built its graph first): the runner and the
  init-tokens op, or the hooks' `begin()` then `after_create_session()`,
  as `MonitoredTrainingSession` called them;
* "minimal": nothing started by hand (the coordinator starts the round).
  The coordinator enqueues TF1's default tokens, so the minimal port of
  `monitored_sync.py` is TF1's program with the hook's default
  `num_tokens`, one round behind the program's `num_tokens=0` (checked).

compat_v1_programs_reference.py runs the TF1 program with TF1's real
optimizer in graph mode (one graph and session per worker, as TF1's
processes had), from the same initial values and data. Both sides run
the same phases, both workers stepping once in each (lockstep), and after
each phase the global step (and the three-optimizer program's other step
counters), every weight (bit for bit) and each worker's local step must
be TF1's. Each phase schedules one step per worker; a step sleeps before
it pushes so that each goes to its own idle worker (a dataset's elements
are per worker), and with one push of each worker per round the weights
do not depend on which worker runs which fed step.
"""

import json
import os
import signal
import subprocess
import sys
import time

import compat_v1_programs_reference as reference
import numpy as np
import pytest
import tensorflow as tf
import testutil
from absl.testing import absltest

from tf2sync.compat import v1 as compat_v1

# Multi-process: TF1's reference runs in a subprocess; run by
# `pytest -m slow` and CI.
pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NUM_WORKERS = reference.NUM_WORKERS
PHASES = [[0, 1]] * 6  # lockstep: both workers step in every phase
STEP_SECONDS = 0.2  # see the top: one scheduled step per idle worker
REFERENCE_TIMEOUT = 240
# A phase takes a few seconds at most (its first traces the step); a
# phase still running after this long waits for a token that only the
# watchdog's timeout (60 s) would give: the port hung, and fails.
PHASE_TIMEOUT = 50.0
# Longer than the shim's drain timeout (1 s): see `SlowStepTest`.
SLOW_STEP_SECONDS = 1.5

_REFERENCE = {}  # (shape, num_tokens) -> TF1's lines, one per phase


def tf1_lines(shape, num_tokens=0):
    """TF1's lines for `PHASES` (a subprocess, run once per program)."""
    key = (shape, num_tokens)
    if key in _REFERENCE:
        return _REFERENCE[key]
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "compat_v1_programs_reference.py"),
            shape,
            json.dumps(PHASES),
            json.dumps({"num_tokens": num_tokens}),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=ROOT),
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=REFERENCE_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:
        raise AssertionError(err[-3000:])
    lines = [json.loads(line) for line in out.splitlines()]
    _REFERENCE[key] = lines
    return lines


def _after_sleep(tensor, seconds):
    """`tensor`, once the step has slept `seconds` (same values)."""
    slept = tf.py_function(lambda: time.sleep(seconds) or 0.0, [], tf.float32)
    with tf.control_dependencies([slept]):
        return tf.identity(tensor)


class _Port:
    """One TF1 program's port: one coordinator, 2 workers and 1 ps.

    The strategy's token watchdog is on, as a user's is: TF1 has none,
    and the port must still be TF1's run. Its drain (tokens for a round
    that no scheduled step will complete) once released tokens while a
    step was still computing before its push
    (`test_slow_steps_get_no_early_tokens`): each
    worker's next step was wasted, the run one round behind TF1's.
    """

    shape = None

    def __init__(self, token_timeout=60.0, step_seconds=STEP_SECONDS):
        self.step_seconds = step_seconds
        self.strategy = testutil.strategy(
            NUM_WORKERS,
            1,
            replicas_to_aggregate=NUM_WORKERS,
            total_num_replicas=NUM_WORKERS,
            token_timeout=token_timeout,
        )
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(
            self.strategy
        )
        self.phases = 0
        self.steps = []  # the step counters, as TF1's line lists them
        self.opts = []

    def _weights(self):
        """The program's variables, from TF1's initial values."""
        return [
            tf.Variable(value, name=name.replace("/", "_"))
            for name, value in reference.initial(self.shape)
        ]

    def schedule(self, worker):
        """Schedules the step of TF1's worker `worker` in this phase."""
        raise NotImplementedError

    def phase(self, workers, timeout=PHASE_TIMEOUT):
        """One phase: one step per worker in `workers`, joined.

        Raises:
          AssertionError: The phase hung (see `PHASE_TIMEOUT`). Its steps
            are given tokens first, so that they end and leave the cluster
            to the next test.
        """
        results = [self.schedule(w) for w in workers]
        deadline = time.monotonic() + timeout
        while not self.coordinator.done():
            if time.monotonic() > deadline:
                self.opts[0]._protocol.seed_tokens(2 * NUM_WORKERS)
                raise AssertionError(f"phase {self.phases} hung")
            time.sleep(0.05)
        self.coordinator.join()
        for r in results:
            r.fetch()  # raises the step's error, if any
        self.phases += 1

    def line(self):
        """This side's line, as TF1's: steps, weights, local steps."""
        local = self.opts[0].local_steps.numpy().tolist()
        return {
            "steps": [int(s.numpy()) for s in self.steps],
            "weights": [
                float(x) for v in self.weights for x in v.numpy().ravel()
            ],
            "local": [[int(s)] * len(self.opts) for s in local],
        }

    def close(self):
        if self.opts and self.opts[0]._protocol is not None:
            self.opts[0].make_session_run_hook(True).end()  # the watchdog


class _MnistReplica(_Port):
    """mnist_replica.py: each step fed its batch (TF1's `feed_dict`)."""

    shape = "supervisor"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        strategy = self.strategy
        with strategy.scope():
            global_step = tf.Variable(0, name="global_step", trainable=False)
            self.weights = self._weights()
            opt = compat_v1.SyncReplicasOptimizer(
                tf.compat.v1.train.AdamOptimizer(reference.MNIST_LR),
                replicas_to_aggregate=NUM_WORKERS,
                total_num_replicas=NUM_WORKERS,
                name="mnist_sync_replicas",
            )
        self.steps, self.opts = [global_step], [opt]
        weights = self.weights

        def replica(x, y_):
            cross_entropy = reference.mlp_loss(
                _after_sleep(x, self.step_seconds), y_, *weights
            )
            return opt.minimize(
                cross_entropy, global_step=global_step, var_list=weights
            )

        @tf.function
        def train_step(x, y_):
            return strategy.run(replica, args=(x, y_))

        self.train_step = train_step

    def batch(self, worker):
        return reference.batch(self.shape, worker, self.phases)

    def start_as_written(self):
        # The graph first, then, as mnist_replica's chief: the runner and
        # the op made, `sess.run(sync_init_op)`, the runner started.
        with self.strategy.scope():
            self.train_step.get_concrete_function(*self.batch(0))
        opt = self.opts[0]
        chief_queue_runner = opt.get_chief_queue_runner()
        sync_init_op = opt.get_init_tokens_op()
        sync_init_op()
        chief_queue_runner.start()

    def schedule(self, worker):
        return self.coordinator.schedule(
            self.train_step, args=self.batch(worker)
        )


class _MonitoredSync(_Port):
    """monitored_sync.py: each worker reads its shard of the dataset."""

    shape = "monitored"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        strategy = self.strategy
        with strategy.scope():
            # get_or_create_global_step's: int64.
            global_step = tf.Variable(
                tf.constant(0, tf.int64), name="global_step", trainable=False
            )
            self.weights = self._weights()
            opt = compat_v1.SyncReplicasOptimizer(
                tf.compat.v1.train.AdagradOptimizer(reference.ADAGRAD_LR),
                replicas_to_aggregate=NUM_WORKERS,
                total_num_replicas=NUM_WORKERS,
            )
        self.steps, self.opts = [global_step], [opt]
        weights = self.weights

        def dataset_fn(context):
            return reference.make_dataset(
                context.num_input_pipelines, context.input_pipeline_id
            )

        self.iterator = iter(
            self.coordinator.create_per_worker_dataset(
                lambda: strategy.distribute_datasets_from_function(dataset_fn)
            )
        )

        def replica(features, labels):
            loss = reference.dense_loss(
                _after_sleep(features, self.step_seconds), labels, *weights
            )
            return opt.minimize(loss, global_step=global_step, var_list=weights)

        @tf.function
        def train_op(iterator):
            features, labels = next(iterator)
            return strategy.run(replica, args=(features, labels))

        self.train_op = train_op

    def start_as_written(self, num_tokens):
        # The program's hook; MonitoredTrainingSession calls `begin()` once
        # the graph is built and `after_create_session` on the new session.
        sync_hook = self.opts[0].make_session_run_hook(True, num_tokens)
        with self.strategy.scope():
            self.train_op.get_concrete_function(self.iterator)
        sync_hook.begin()
        sync_hook.after_create_session()

    def schedule(self, worker):
        del worker  # the worker's iterator gives its data
        return self.coordinator.schedule(self.train_op, args=(self.iterator,))


class _ThreeOptimizers(_Port):
    """three_optimizers.py: three optimizers, one step of all three."""

    shape = "three"

    def __init__(self, private_steps, **kwargs):
        super().__init__(**kwargs)
        strategy = self.strategy
        with strategy.scope():
            global_step = tf.Variable(
                tf.constant(0, tf.int64), name="global_step", trainable=False
            )
            self.steps = [global_step]
            if private_steps:  # TF1's: it refuses global_step=None
                self.steps += [
                    tf.Variable(
                        tf.constant(0, tf.int64),
                        name=f"step_{g}",
                        trainable=False,
                    )
                    for g in "bc"
                ]
            self.weights = self._weights()
            self.opts = [
                compat_v1.SyncReplicasOptimizer(
                    tf.compat.v1.train.MomentumOptimizer(
                        reference.MOMENTUM_LR * k, 0.9
                    ),
                    NUM_WORKERS,
                )
                for k in reference.RATES
            ]
        weights, opts = self.weights, self.opts
        steps = self.steps if private_steps else [global_step, None, None]

        def replica(x):
            loss = reference.three_loss(
                _after_sleep(x, self.step_seconds), *weights
            )
            grads = tf.gradients(loss, weights)
            return [
                opt.apply_gradients([(g, v)], step)
                for opt, g, v, step in zip(opts, grads, weights, steps)
            ]

        @tf.function
        def update(x):
            return strategy.run(replica, args=(x,))

        self.update = update

    def batch(self, worker):
        return reference.batch(self.shape, worker, self.phases)

    def start_as_written(self):
        # The program's hooks, one per optimizer, called as
        # MonitoredTrainingSession calls them: every `begin()`, then every
        # `after_create_session`.
        hooks = [o.make_session_run_hook(True) for o in self.opts]
        with self.strategy.scope():
            self.update.get_concrete_function(*self.batch(0))
        for hook in hooks:
            hook.begin()
        for hook in hooks:
            hook.after_create_session()

    def schedule(self, worker):
        return self.coordinator.schedule(self.update, args=self.batch(worker))


class ProgramsTest(absltest.TestCase):
    """Each port ends every phase where TF1's program does, bit for bit."""

    def setUp(self):
        super().setUp()
        self.port = None

    def tearDown(self):
        if self.port is not None:
            self.port.close()
        super().tearDown()

    def _run(self, port, expected, wasted=1):
        """Runs `PHASES` on `port` (started); compares with `expected`.

        `wasted`: the phases TF1's program wasted at the start (its
        initial tokens carry the global step 0, so each worker's next
        gradients are stale: one phase, none without initial tokens).
        """
        self.port = port
        self.assertLen(expected, len(PHASES))
        got = []
        for workers in PHASES:
            port.phase(workers)
            got.append(port.line())
        for i, (mine, tf1) in enumerate(zip(got, expected)):
            msg = f"phase {i}"
            steps = tf1["steps"][: len(mine["steps"])]
            self.assertEqual(mine["steps"], steps, msg)
            self.assertEqual(mine["local"], tf1["local"], msg)
            np.testing.assert_array_equal(  # bit-identical
                np.array(mine["weights"], np.float32),
                np.array(tf1["weights"], np.float32),
                err_msg=msg,
            )
        # Not vacuous: one round per phase but the wasted ones, every step
        # counter and every local step at it, the weights moved each round.
        rounds = len(PHASES) - wasted
        self.assertEqual(
            expected[-1]["steps"], [rounds] * len(expected[-1]["steps"])
        )
        self.assertEqual(
            expected[-1]["local"],
            [[rounds] * len(port.opts)] * NUM_WORKERS,
        )
        weights = [np.array(line["weights"]) for line in expected]
        moved = [np.any(a != b) for a, b in zip(weights, weights[1:])]
        self.assertEqual(sum(moved), rounds - 1)
        # Every token taken: none left over (no extra init tokens).
        self.assertEqual(int(port.opts[0]._sync_token_queue.size()), 0)
        return got

    def test_mnist_replica_as_written(self):
        port = _MnistReplica()
        port.start_as_written()
        self._run(port, tf1_lines("supervisor"))

    def test_mnist_replica_minimal(self):
        # The port of examples/tf1_port: the Supervisor's init ops, the
        # runner and the init-tokens op deleted.
        self._run(_MnistReplica(), tf1_lines("supervisor"))

    def test_monitored_session_as_written(self):
        # The hook's num_tokens=0: no initial token, so no wasted step;
        # the first round's tokens end each worker's first step.
        port = _MonitoredSync()
        port.start_as_written(num_tokens=0)
        self._run(port, tf1_lines("monitored", num_tokens=0), wasted=0)

    def test_monitored_session_minimal(self):
        # Without the hook, the coordinator enqueues TF1's default tokens
        # (rta): the run is the program's with the hook's default
        # num_tokens, and one round behind the program as written
        # (num_tokens=0). Dropping a hook with its own num_tokens changes
        # the run (docs/migrating.md, "The chief's calls").
        default = tf1_lines("monitored", num_tokens=-1)
        self._run(_MonitoredSync(), default)
        as_written = tf1_lines("monitored", num_tokens=0)
        self.assertEqual(
            [line["steps"][0] for line in as_written][1:],
            [line["steps"][0] + 1 for line in default][1:],
        )

    def test_three_optimizers_as_written(self):
        # TF1's three hooks enqueue 2 tokens each into the one shared
        # queue and each worker step takes 3; the shim's round enqueues 2
        # once and a step takes 1. The private steps of B and C rise with
        # the global step, once per round.
        port = _ThreeOptimizers(private_steps=True)
        port.start_as_written()
        self._run(port, tf1_lines("three"))

    def test_three_optimizers_minimal(self):
        # docs/migrating.md's port: B and C given `global_step=None`.
        self._run(_ThreeOptimizers(private_steps=False), tf1_lines("three"))

    def test_slow_steps_get_no_early_tokens(self):
        # Every step computes longer than the drain timeout before its
        # push, with the queue empty (num_tokens=0, then each round's
        # tokens taken): no token may come before the pushes do.
        port = _MonitoredSync(step_seconds=SLOW_STEP_SECONDS)
        port.start_as_written(num_tokens=0)
        self._run(port, tf1_lines("monitored", num_tokens=0), wasted=0)
        self.assertEqual(port.opts[0]._protocol.watchdog.released, 0)

    def test_drain_releases_a_round_nobody_completes(self):
        # After TF1's phases, one step alone: its round needs a second
        # push that no scheduled step will make, so it waits for a token
        # TF1 would never give (TF1's program hangs there). The drain
        # gives it one, long before the 60 s timeout would.
        port = _MnistReplica()
        self._run(port, tf1_lines("supervisor"))
        port.phase([0], timeout=20.0)
        self.assertEqual(port.opts[0]._protocol.watchdog.released, 1)
        self.assertEqual(int(port.steps[0].numpy()), len(PHASES) - 1)


if __name__ == "__main__":
    absltest.main()
