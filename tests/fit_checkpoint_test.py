"""`tf2sync.SyncCheckpoint`: saves inside epochs, and `fit` resumes there."""

import os
import tempfile
import threading
from unittest import mock

import numpy as np
import tensorflow as tf
import testutil
from absl.testing import absltest
from absl.testing import parameterized
from tensorflow.python.data.experimental.ops import testing as data_testing

import tf2sync
from tf2sync._src import checkpointing
from tf2sync._src import saver as saver_lib
from tf2sync._src.internals import checkpoints as checkpoints_internals

_STEPS = 8  # per epoch
_UPDATES = _STEPS  # in 2 epochs of 2 workers' pushes, 2 a step


def _saves(directory):
    state = tf.train.get_checkpoint_state(directory)
    return [os.path.basename(p) for p in state.all_model_checkpoint_paths]


class _Steps(tf.keras.callbacks.Callback):
    """Records `(epoch, last step of the call)` of every scheduled call,
    and the cap of updates (`plan_updates`) it ran under."""

    def __init__(self):
        super().__init__()
        self._supports_tf_logs = True
        self.calls = []
        self.limits = []
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append((self.epoch, batch))
        limit = self.model.optimizer._aggregator.step_limit
        self.limits.append(int(limit.numpy()))


class ArgumentsTest(parameterized.TestCase):
    @parameterized.parameters(
        ("every_steps", 0),
        ("every_steps", -3),
        ("every_steps", 2.5),
        ("every_steps", True),
        ("every_seconds", 0),
        ("every_seconds", float("nan")),
        ("every_seconds", float("inf")),
        ("every_seconds", "30"),
        ("max_to_keep", 0),
        ("background", "yes"),
    )
    def test_bad_arguments_are_refused_in_one_line(self, name, value):
        with self.assertRaisesRegex(
            ValueError, f"^`{name}` must be .* Received: {name}="
        ):
            tf2sync.SyncCheckpoint("/tmp/unused", **{name: value})

    def test_position_of_a_save(self):
        self.assertEqual(checkpointing.position_of("/d/ckpt-3"), (3, 0))
        self.assertEqual(checkpointing.position_of("/d/ckpt-3_120"), (3, 120))
        self.assertEqual(checkpointing.latest_epoch("/nonexistent"), (None, 0))


class EvaluatorTest(absltest.TestCase):
    def test_a_newer_save_inside_an_epoch_hides_not_the_newest_end(self):
        directory = tempfile.mkdtemp()
        model = testutil.dense_model()
        checkpoint = tf.train.Checkpoint(model=model)
        saver = saver_lib.OneTraceSaver(checkpoint, directory, 5)
        for name in ("1", "2", "2_5"):  # the newest is inside epoch 3
            saver.save(name)
        x, y = testutil.data("dense", 8)
        results = checkpointing.evaluate_checkpoints(
            testutil.dense_model,
            (x, tf.one_hot(y, 3)),
            "mse",
            [],
            directory,
            max_evaluations=2,
            timeout=1,
        )
        # The newest save is inside epoch 3: the newest epoch's end is
        # evaluated; the older one is skipped, as an evaluator that fell
        # behind skips to the newest.
        self.assertEqual([epoch for epoch, _ in results], [2])


class BackgroundSaveTest(absltest.TestCase):
    """`OneTraceSaver(background=True)` on variables on a ps and the chief."""

    def _saver(self, directory):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = testutil.dense_model()
        checkpoint = tf.train.Checkpoint(model=model)
        saver = saver_lib.OneTraceSaver(
            checkpoint, directory, 3, background=True
        )
        saver.prepare()
        return model, saver

    def _weights(self, path):
        restored = testutil.dense_model()
        tf.train.Checkpoint(model=restored).restore(path).expect_partial()
        return restored.get_weights()

    def test_a_save_holds_the_state_at_its_copy_not_at_its_write(self):
        directory = tempfile.mkdtemp()
        model, saver = self._saver(directory)
        real = checkpoints_internals.call_with_captures
        copied = threading.Event()

        def late(*args):  # the write runs after the training moved on
            copied.wait(30)
            return real(*args)

        kernel = model.weights[0]
        kernel.assign(tf.fill(kernel.shape, 1.0))
        with mock.patch.object(
            checkpoints_internals, "call_with_captures", late
        ):
            path = saver.save("0_4")
            kernel.assign(tf.fill(kernel.shape, 2.0))  # training goes on
            self.assertIsNone(tf.train.latest_checkpoint(directory))
            copied.set()
            saver.wait()
        self.assertEqual(tf.train.latest_checkpoint(directory), path)
        np.testing.assert_array_equal(self._weights(path)[0], 1.0)
        kernel.assign(tf.fill(kernel.shape, 3.0))
        np.testing.assert_array_equal(self._weights(saver.save(1))[0], 3.0)
        saver.wait()
        # One trace each, whatever the saves: no new function to register.
        self.assertEqual(saver._write.experimental_get_tracing_count(), 1)
        self.assertEqual(saver._copy.experimental_get_tracing_count(), 1)
        # Each copy beside its variable: a ps copies what it holds.
        for captured, snapshot in zip(
            saver._concrete.captured_inputs, saver._captures
        ):
            self.assertEqual(captured.device, snapshot.device)
        self.assertTrue(
            any("/job:ps/" in c.device for c in saver._captures),
            [c.device for c in saver._captures],
        )

    def test_a_failed_write_is_raised_and_leaves_the_save_before(self):
        directory = tempfile.mkdtemp()
        _, saver = self._saver(directory)
        first = saver.save(1)
        saver.wait()

        def fail(*args):
            raise OSError("disk full")

        with mock.patch.object(
            checkpoints_internals, "call_with_captures", fail
        ):
            saver.save(2)
            with self.assertRaisesRegex(OSError, "disk full"):
                saver.wait()
            saver.wait()  # raised once
            # Before a new run: logged, not raised (its restore takes the
            # save before).
            saver.save(3)
            with self.assertLogs(level="WARNING") as logs:
                saver.settle()
        self.assertIn("disk full", "\n".join(logs.output))
        self.assertEqual(tf.train.latest_checkpoint(directory), first)


class ResumeInsideAnEpochTest(parameterized.TestCase):
    """One cluster per process: both runs share it (see testutil)."""

    def _fit(self, strategy, initial, directory, **kwargs):
        with strategy.scope():
            model = testutil.dense_model()
            model.set_weights(initial)
            model.compile(
                optimizer=tf2sync.SyncOptimizer(
                    tf.keras.optimizers.SGD(0.05, momentum=0.9)
                ),
                loss="mse",
                steps_per_execution=2,
            )
        x, y = testutil.data("dense", 16)
        data = tf.data.Dataset.from_tensors((x, y)).repeat()
        steps = _Steps()
        saver = tf2sync.SyncCheckpoint(directory, max_to_keep=10, **kwargs)
        model.fit(
            data,
            epochs=2,
            steps_per_epoch=_STEPS,
            # SyncMetrics' epoch line took the batch hooks' logs for dicts.
            callbacks=[saver, steps, tf2sync.SyncMetrics()],
            verbose=2,
        )
        return model, steps

    @parameterized.named_parameters(("", False), ("background", True))
    def test_a_run_resumed_inside_an_epoch_ends_as_the_whole_run(
        self, background
    ):
        # One batch repeated: each update is the mean of two equal
        # gradients, whichever workers push them; every 2 steps (pushes)
        # one update.
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            initial = testutil.dense_model().get_weights()
        whole_dir = tempfile.mkdtemp()
        whole, steps = self._fit(
            strategy, initial, whole_dir, every_steps=4, background=background
        )
        self.assertEqual(
            _saves(whole_dir),
            ["ckpt-0_4", "ckpt-1", "ckpt-1_4", "ckpt-2"],
        )
        self.assertEqual(
            steps.calls,
            [(0, 1), (0, 3), (0, 5), (0, 7), (1, 1), (1, 3), (1, 5), (1, 7)],
        )
        self.assertEqual(steps.limits, [_UPDATES // 2] * 4 + [_UPDATES] * 4)
        step = whole.optimizer.iterations.numpy()
        self.assertEqual(step, _UPDATES)
        # The save inside epoch 1 holds 12 steps: 6 updates.
        reader = tf.train.load_checkpoint(os.path.join(whole_dir, "ckpt-1_4"))
        saved_steps = [
            reader.get_tensor(k)
            for k in reader.get_variable_to_shape_map()
            if k.startswith("optimizer/inner_optimizer/_iterations/")
        ]
        self.assertEqual(saved_steps, [(_STEPS + 4) // 2])

        # A restart after ckpt-1_4: only it is in the directory.
        resumed_dir = testutil.only_save(whole_dir, "ckpt-1_4")
        resumed, steps = self._fit(
            strategy,
            initial,
            resumed_dir,
            every_steps=4,
            background=background,
        )
        self.assertEqual(steps.calls, [(1, 5), (1, 7)])  # epoch 1's last 4
        # Planned: the 4 steps left (not lifted, nor a whole epoch more).
        self.assertEqual(steps.limits, [_UPDATES] * 2)
        self.assertEqual(resumed.optimizer.iterations.numpy(), _UPDATES)
        # Steps count from where the epoch resumed: no save at its step 6.
        self.assertEqual(_saves(resumed_dir), ["ckpt-1_4", "ckpt-2"])
        self.assertLess(
            testutil.max_abs_diff(whole.get_weights(), resumed.get_weights()),
            1e-6,
        )
        self.assertEqual(
            resumed.optimizer._aggregator.totals()["over_plan_dropped"], 0
        )

    def test_saves_by_time_after_a_scheduled_function(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            initial = testutil.dense_model().get_weights()
        directory = tempfile.mkdtemp()
        self._fit(strategy, initial, directory, every_seconds=1e-6)
        # After each call but an epoch's last (its end saves).
        self.assertEqual(
            _saves(directory),
            ["ckpt-0_2", "ckpt-0_4", "ckpt-0_6", "ckpt-1"]
            + ["ckpt-1_2", "ckpt-1_4", "ckpt-1_6", "ckpt-2"],
        )

    def test_seconds_are_the_trainings_not_the_schedulings(self):
        # fit schedules an epoch's 10 calls at once; the steps then take
        # 20 ms each (2 workers: ~0.4 s an epoch). A clock read as calls
        # are scheduled saw < 0.15 s and never saved inside the epoch.
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = testutil.dense_model()
            model.compile(
                optimizer=tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.05)),
                loss="mse",
                steps_per_execution=4,
            )
        x, y = testutil.data("dense", 16)

        # tf.data's own sleep (C++, no Python): a Python function in the
        # input of an in-process worker stalled the whole suite on CI.
        data = (
            tf.data.Dataset.from_tensors((x, y))
            .repeat()
            .apply(data_testing.sleep(20_000))
        )
        # Set up first (tracing, the first steps): the measured epoch's
        # calls are then all scheduled within milliseconds.
        model.fit(data, epochs=1, steps_per_epoch=40, verbose=0)
        directory = tempfile.mkdtemp()
        saver = tf2sync.SyncCheckpoint(
            directory, every_seconds=0.15, max_to_keep=20
        )
        model.fit(
            data, epochs=1, steps_per_epoch=40, callbacks=[saver], verbose=0
        )
        inside = [s for s in _saves(directory) if "_" in s]
        self.assertNotEmpty(inside, _saves(directory))


if __name__ == "__main__":
    absltest.main()
