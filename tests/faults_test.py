"""Faults: lost tokens, bad input, checkpoints killed mid-write."""

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import tensorflow as tf
import testutil
from absl.testing import absltest

import tf2sync


def _replica_step(strategy, model, opt):
    """A scheduled step: one SyncOptimizer push of a dense batch."""
    x, y = testutil.data("dense", 8)

    def replica():
        with tf.GradientTape() as tape:
            loss = testutil.mean_loss(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def step():
        strategy.run(replica)

    return step


def _join_within(coordinator, seconds):
    """Whether `coordinator.join()` returned within `seconds`."""
    done = threading.Event()
    threading.Thread(
        target=lambda: (coordinator.join(), done.set()), daemon=True
    ).start()
    return done.wait(seconds)


class TokenWatchdogTest(absltest.TestCase):
    def test_a_token_lost_with_a_dead_worker_is_released(self):
        strategy = testutil.strategy(
            2, replicas_to_aggregate=2, token_timeout=1.0
        )
        with strategy.scope():
            model = testutil.dense_model()
            opt = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
        aggregator = opt._aggregator
        # A worker took a token and died before pushing: the token is gone.
        with tf.device(aggregator.device):
            aggregator.token_queue.dequeue()
        self.assertEqual(aggregator.tokens_available(), 1)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        step = _replica_step(strategy, model, opt)
        for _ in range(2):  # the second waits for the lost token
            coordinator.schedule(step)
        self.assertTrue(
            _join_within(coordinator, 60), "the step hung on the lost token"
        )
        self.assertEqual(int(opt.iterations.numpy()), 1)
        # 1, or more when a step took over 1 s to push (a loaded machine):
        # surplus tokens are safe (see watchdog.py).
        self.assertGreaterEqual(strategy._watchdog.released, 1)
        self.assertEqual(int(opt.gradients_accepted.numpy()), 2)

    def test_stop_all_ends_every_watchdog_before_a_new_cluster(self):
        # A poll through a previous cluster's handles would crash the
        # process once it connects elsewhere: the strategy stops them all.
        from tf2sync._src import watchdog

        class Barrier:
            polls = 0

            def watch_state(self):
                self.polls += 1
                return watchdog.WatchState((self.polls,), 0, 1, 0, 1)

            def seed_tokens(self, num):
                del num

        barrier = Barrier()
        dog = watchdog.TokenWatchdog(barrier, 60.0, poll=0.01)
        deadline = time.time() + 10
        while barrier.polls == 0 and time.time() < deadline:
            time.sleep(0.01)
        self.assertGreater(barrier.polls, 0)
        watchdog.stop_all()
        dog._thread.join(5)
        self.assertFalse(dog._thread.is_alive())
        polls = barrier.polls
        time.sleep(0.1)
        self.assertEqual(barrier.polls, polls)

    def test_bad_timeout(self):
        with self.assertRaisesRegex(
            ValueError,
            r"`token_timeout` must be a positive number of seconds or None. "
            r"Received: token_timeout=0",
        ):
            testutil.strategy(2, replicas_to_aggregate=2, token_timeout=0)


class BadInputTest(absltest.TestCase):
    def _compiled(self, model_fn=testutil.dense_model):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = model_fn()
            model.compile(
                optimizer=tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1)),
                loss=testutil.LOSS,
            )
        return model

    def test_data_of_the_wrong_shape_fails_before_training(self):
        model = self._compiled()
        before = model.get_weights()
        x, y = testutil.data("dense", 8)
        ds = tf.data.Dataset.from_tensors((x[:, :3], y)).repeat()
        with self.assertRaisesRegex(ValueError, "incompatible with the layer"):
            model.fit(ds, epochs=1, steps_per_epoch=2, verbose=0)
        self.assertEqual(testutil.max_abs_diff(model.get_weights(), before), 0)
        self.assertEqual(int(model.optimizer.iterations.numpy()), 0)

    def test_a_dataset_that_ends_is_refused_before_training(self):
        model = self._compiled()
        x, y = testutil.data("dense", 8)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat(3)
        with self.assertRaisesRegex(
            ValueError,
            r"The dataset must repeat: .* Add `.repeat\(\)` and pass "
            r"`steps_per_epoch`. Received: a dataset of 3 elements.",
        ):
            model.fit(ds, epochs=1, steps_per_epoch=10, verbose=0)

    def test_variables_without_gradients_are_left_alone(self):
        def model_fn():
            tf.keras.utils.set_random_seed(0)
            x = tf.keras.Input((4,))
            used = tf.keras.layers.Dense(3, name="used")(x)
            # In the model, but no gradient reaches it.
            unused = tf.stop_gradient(
                tf.keras.layers.Dense(3, name="unused")(x)
            )
            return tf.keras.Model(x, used + 0.0 * unused)

        model = self._compiled(model_fn)
        unused = model.get_layer("unused").get_weights()
        x, y = testutil.data("dense", 8)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(ds, epochs=1, steps_per_epoch=4, verbose=0)
        self.assertEqual(int(model.optimizer.iterations.numpy()), 2)
        self.assertEqual(
            testutil.max_abs_diff(
                model.get_layer("unused").get_weights(), unused
            ),
            0,
        )

    def test_no_gradient_at_all(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            v = tf.Variable(1.0)
            opt = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

        @tf.function
        def step():
            strategy.run(lambda: opt.apply_gradients([(None, v)]))

        with self.assertRaisesRegex(
            ValueError, r"No gradients provided for any variable: \['Variable"
        ):
            coordinator.schedule(step)

    def test_a_group_that_matches_nothing(self):
        multi = tf2sync.MultiOptimizer(
            groups={
                "kernel": tf.keras.optimizers.SGD(0.1),
                "conv": tf.keras.optimizers.SGD(0.2),
            },
            default=tf.keras.optimizers.SGD(0.3),
        )
        with self.assertRaisesRegex(
            ValueError,
            r"Groups \[\"group 1 \(regex 'conv'\)\"\] match no variable",
        ):
            multi.route(testutil.dense_model().trainable_variables)


_KILLED_WHILE_SAVING = """
import os, signal, sys
import numpy as np
import tf2sync
import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint_management

directory = sys.argv[1]
model = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,))])
model.compile(tf.keras.optimizers.SGD(0.1), "mse")
saver = tf2sync.SyncCheckpoint(directory)
saver.set_model(model)
saver.on_epoch_end(0)  # ckpt-1
np.save(os.path.join(directory, "saved.npy"), model.get_weights()[0])
model.set_weights([w + 1.0 for w in model.get_weights()])


def die(*args, **kwargs):  # ckpt-2 is written; the state file names ckpt-1
    os.kill(os.getpid(), signal.SIGKILL)


tf.io.gfile.rename = die  # the state file's atomic replace (OneTraceSaver)
checkpoint_management.update_checkpoint_state_internal = die
saver.on_epoch_end(1)
"""


class AtomicCheckpointTest(absltest.TestCase):
    def test_chief_killed_while_saving_leaves_the_previous_usable(self):
        directory = tempfile.mkdtemp()
        out = subprocess.run(
            [sys.executable, "-c", _KILLED_WHILE_SAVING, directory],
            capture_output=True,
            text=True,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
            timeout=120,
        )
        self.assertEqual(out.returncode, -signal.SIGKILL, out.stderr[-2000:])
        self.assertTrue(
            any(name.startswith("ckpt-2") for name in os.listdir(directory))
        )
        latest = tf.train.latest_checkpoint(directory)
        self.assertEqual(os.path.basename(latest), "ckpt-1")
        model = tf.keras.Sequential(
            [tf.keras.layers.Dense(2, input_shape=(3,))]
        )
        tf.train.Checkpoint(model=model).restore(latest).expect_partial()
        saved = np.load(os.path.join(directory, "saved.npy"))
        np.testing.assert_array_equal(model.get_weights()[0], saved)


class TransientRetryTest(absltest.TestCase):
    """The chief resumes after errors a peer's restart causes, boundedly."""

    def _train(self, errors, checkpoint_dir="/tmp/ckpt"):
        from unittest import mock

        from tf2sync._src.launcher import chief

        spec = tf2sync.testing.cluster_spec_dict(2, 1)
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(spec), rpc_layer="grpc"
        )
        outcomes = list(errors) + [{"accuracy": 1.0}]
        calls = []

        def once(*args):
            calls.append(args)
            outcome = outcomes[len(calls) - 1]
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        config = chief.ChiefConfig(checkpoint_dir=checkpoint_dir)
        with (
            mock.patch.object(chief, "_train_once", once),
            mock.patch.object(chief.time, "sleep"),
            mock.patch.object(chief.local_tasks, "wait_for_port"),
            self.assertLogs(level="WARNING") as logs,
        ):
            return chief.train(resolver, None, config), calls, logs

    def _error(self, kind, task="/job:worker/replica:0/task:1"):
        return kind(None, None, f"From {task}:\nUnable to parse request\nmore")

    def test_transient_errors_are_retried_and_logged_in_one_line(self):
        errors = [
            self._error(tf.errors.InternalError),
            self._error(tf.errors.AbortedError),
        ]
        result, calls, logs = self._train(errors)
        self.assertEqual(result, {"accuracy": 1.0})
        self.assertLen(calls, 3)
        lines = [r.getMessage() for r in logs.records]
        self.assertLen(lines, 2)
        self.assertEqual(
            lines[0],
            "tf2sync: InternalError from /job:worker/replica:0/task:1: From "
            "/job:worker/replica:0/task:1:; retry 1 of 3, then resuming "
            "from the last checkpoint.",
        )
        self.assertNotIn("\n", lines[1])

    def test_retries_are_bounded(self):
        from tf2sync._src.launcher import chief

        errors = [self._error(tf.errors.CancelledError)] * 4
        with self.assertRaisesRegex(
            RuntimeError,
            r"^CancelledError from /job:worker/replica:0/task:1: .*\(after "
            r"3 retries\)\.$",
        ):
            self._train(errors)
        self.assertEqual(chief.MAX_TRANSIENT_RETRIES, 3)

    def test_other_errors_fail_at_once(self):
        with self.assertRaises(tf.errors.InvalidArgumentError):
            self._train([self._error(tf.errors.InvalidArgumentError)])


class OneTraceSaverTest(absltest.TestCase):
    def test_saves_trace_once_and_keep_the_newest(self):
        # TF traces (and registers with every task) a new function per save
        # of variables on several tasks; a frozen worker would block each.
        from tf2sync._src import saver as saver_lib

        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = testutil.dense_model()
        directory = os.path.join(tempfile.mkdtemp(), "new")
        checkpoint = tf.train.Checkpoint(model=model)
        saver = saver_lib.OneTraceSaver(checkpoint, directory, 2)
        for epoch in range(1, 4):
            model.weights[0].assign(
                tf.fill(model.weights[0].shape, float(epoch))
            )
            saver.save(epoch)
        self.assertEqual(saver._write.experimental_get_tracing_count(), 1)
        self.assertEqual(
            os.path.basename(tf.train.latest_checkpoint(directory)), "ckpt-3"
        )
        manager = tf.train.CheckpointManager(checkpoint, directory, 2)
        self.assertEqual(
            [os.path.basename(p) for p in manager.checkpoints],
            ["ckpt-2", "ckpt-3"],
        )
        self.assertFalse(tf.io.gfile.glob(os.path.join(directory, "ckpt-1*")))
        restored = testutil.dense_model()
        tf.train.Checkpoint(model=restored).restore(
            os.path.join(directory, "ckpt-2")
        ).expect_partial()
        np.testing.assert_array_equal(restored.weights[0].numpy(), 2.0)


class EpochCheckpointTraceTest(absltest.TestCase):
    def test_fit_traces_its_save_once_before_the_first_step(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = testutil.dense_model()
            model.compile(
                optimizer=tf2sync.SyncOptimizer(
                    tf.keras.optimizers.SGD(0.1, momentum=0.9)
                ),
                loss="mse",
            )
        saver = tf2sync.SyncCheckpoint(tempfile.mkdtemp())
        x, y = testutil.data("dense", 8)
        data = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(data, epochs=2, steps_per_epoch=4, callbacks=[saver])
        # Traced in on_train_begin with the momentum slots built: the
        # epochs' saves registered no new function.
        write = saver._saver._write
        self.assertEqual(write.experimental_get_tracing_count(), 1)
        reader = tf.train.load_checkpoint(
            tf.train.latest_checkpoint(saver.directory)
        )
        keys = list(reader.get_variable_to_shape_map())
        momenta = [k for k in keys if "inner_optimizer/_variables/" in k]
        self.assertLen(momenta, len(model.trainable_variables), keys)


class FastRecoveryTest(absltest.TestCase):
    """A worker the coordinator saw fail, or that stopped answering."""

    def test_a_failed_worker_releases_its_token_at_once(self):
        from tf2sync._src import watchdog

        # token_timeout=60: only the alarm can release the token in time.
        strategy = testutil.strategy(
            2, replicas_to_aggregate=2, token_timeout=60.0
        )
        with strategy.scope():
            model = testutil.dense_model()
            opt = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
        aggregator = opt._aggregator
        with tf.device(aggregator.device):  # a worker took it and died
            aggregator.token_queue.dequeue()
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        step = _replica_step(strategy, model, opt)
        for _ in range(2):  # the second waits for the lost token
            coordinator.schedule(step)
        began = time.monotonic()
        watchdog.alarm_all("worker 1 failed (injected by the test)")
        # Waits for: the stall (0.5 s without progress) and the release.
        self.assertTrue(_join_within(coordinator, 20), "still stalled")
        self.assertLess(time.monotonic() - began, 10)
        self.assertEqual(int(opt.iterations.numpy()), 1)
        self.assertEqual(strategy._watchdog.released, 1)

    def test_an_epoch_plan_caps_updates_and_other_functions_lift_it(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = testutil.dense_model()
            opt = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        step = _replica_step(strategy, model, opt)
        before = int(opt.iterations.numpy())
        aggregator = opt._aggregator
        run = type("Run", (), {})()  # one training run, as fit's handler
        # Epoch 1: 3 pushes planned (1 update, 1 left for the next epoch).
        coordinator.plan_epoch(step, 3, run)
        for _ in range(3):
            coordinator.schedule(step)
        coordinator.join()
        self.assertEqual(int(opt.iterations.numpy()), before + 1)
        self.assertEqual(int(aggregator.count.numpy()), 1)  # kept, not lost
        # Epoch 2: 3 more (6 in the run: 3 updates); 7 scheduled, as after
        # a re-run: the pushes that would complete a 4th are dropped.
        coordinator.plan_epoch(step, 3, run)
        for _ in range(7):
            coordinator.schedule(step)
        coordinator.join()
        self.assertEqual(int(opt.iterations.numpy()), before + 3)
        self.assertEqual(int(aggregator.count.numpy()), 1)
        self.assertEqual(int(aggregator.over_plan.numpy()), 3)
        weights = [w.numpy() for w in model.weights]
        # A function nobody planned (a user's loop after fit) is not capped.
        other = _replica_step(strategy, model, opt)
        for _ in range(2):
            coordinator.schedule(other)
        coordinator.join()
        self.assertEqual(int(opt.iterations.numpy()), before + 4)
        self.assertGreater(testutil.max_abs_diff(weights, model.weights), 0)

    def test_a_frozen_worker_is_declared_and_its_function_runs_elsewhere(self):
        self._frozen_worker_function_runs_elsewhere(declared_first=False)

    def test_a_function_a_frozen_worker_takes_later_runs_elsewhere(self):
        """Declared while idle, worker 1 then takes a function: the next
        watch moves it (the order a slow worker start gives)."""
        self._frozen_worker_function_runs_elsewhere(declared_first=True)

    def _frozen_worker_function_runs_elsewhere(self, declared_first):
        from tf2sync._src import liveness
        from tf2sync._src.internals import closures

        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        frozen = threading.Event()  # worker 1's pings go unanswered meanwhile

        def pinger(device):
            def ping():
                while "task:1" in device and frozen.is_set():
                    time.sleep(0.05)

            return ping

        monitor = liveness.WorkerMonitor(coordinator, 1.0, pinger=pinger)

        def wait_for(condition):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not condition():
                time.sleep(0.05)

        try:
            with tf.device("/job:ps/task:0"):
                gate = tf.queue.FIFOQueue(-1, tf.int64, shapes=[])
            with strategy.scope():
                runs = tf.Variable(0, dtype=tf.int64)

            @tf.function
            def blocked():  # runs until the test opens the gate
                runs.assign_add(1)
                return gate.dequeue()

            blocked.get_concrete_function()  # traced while all answer
            frozen.set()
            if declared_first:
                # Waits for: worker 1 declared, with no function to move.
                wait_for(lambda: monitor.declared)
                self.assertEqual(monitor.moved, [])
            # One function on each worker, both waiting at the gate.
            results = [coordinator.schedule(blocked) for _ in range(2)]
            # Waits for: both functions started, worker 1 declared and its
            # function moved (at the declaration, or at the next watch if
            # worker 1 took it after being declared).
            wait_for(lambda: monitor.moved and int(runs.numpy()) == 2)
            self.assertEqual([i for i, _ in monitor.declared], [1])
            self.assertGreaterEqual(monitor.declared[0][1], 1.0)
            self.assertEqual(monitor.moved, [1])
            frozen.clear()
            # Worker 0's run, worker 1's (ignored) and the re-run.
            gate.enqueue_many(tf.constant([7, 7, 7], tf.int64))
            self.assertTrue(_join_within(coordinator, 30))
            self.assertEqual(int(runs.numpy()), 3)
            self.assertEqual([int(r.fetch()) for r in results], [7, 7])
            self.assertTrue(coordinator.done())
            self.assertFalse(closures.take_over_closure(coordinator, 1))
        finally:
            monitor.stop()
            frozen.clear()


if __name__ == "__main__":
    absltest.main()
