"""Stock tf_keras callbacks and sync metrics under model.fit."""

import contextlib
import csv
import glob
import io
import math
import tempfile
import time

import numpy as np
import tensorflow as tf
import testutil
from absl.testing import absltest

import tf2sync
from tf2sync._src import callbacks as callbacks_lib
from tf2sync._src import strategy as strategy_lib

_X, _Y = testutil.data("dense", 32)


def _dataset():
    return tf.data.Dataset.from_tensors((_X, _Y)).repeat()


def _compiled(num_workers=2, rta=2, total=None, model_fn=None):
    strategy = testutil.strategy(
        num_workers, replicas_to_aggregate=rta, total_num_replicas=total
    )
    with strategy.scope():
        model = (model_fn or testutil.dense_model)()
        model.compile(
            optimizer=tf2sync.SyncOptimizer(
                tf.keras.optimizers.SGD(0.05, momentum=0.9)
            ),
            loss=testutil.LOSS,
            metrics=["accuracy"],
        )
    return model


class _Interrupt(tf.keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted on purpose")


class CallbacksTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        self.dir = tempfile.mkdtemp()

    def test_model_checkpoint_weights_and_full_model(self):
        model = _compiled()
        model.fit(
            _dataset(),
            epochs=2,
            steps_per_epoch=4,
            verbose=0,
            callbacks=[
                tf.keras.callbacks.ModelCheckpoint(
                    self.dir + "/w_{epoch}.h5", save_weights_only=True
                ),
                tf.keras.callbacks.ModelCheckpoint(
                    self.dir + "/m_{epoch}.keras"
                ),
            ],
        )
        local = testutil.dense_model(seed=1)
        local.load_weights(self.dir + "/w_2.h5")
        self.assertEqual(
            testutil.max_abs_diff(local.get_weights(), model.get_weights()), 0
        )
        loaded = tf.keras.models.load_model(
            self.dir + "/m_2.keras", compile=False
        )
        self.assertEqual(
            testutil.max_abs_diff(loaded.get_weights(), model.get_weights()), 0
        )

    def test_backup_and_restore_resumes_exactly(self):
        # Uninterrupted: 3 epochs of 4 pushes = 6 synchronous steps.
        reference = _compiled()
        reference.fit(_dataset(), epochs=3, steps_per_epoch=4, verbose=0)
        backup = tf.keras.callbacks.BackupAndRestore(self.dir + "/backup")
        first = _compiled()
        with self.assertRaisesRegex(RuntimeError, "interrupted on purpose"):
            first.fit(
                _dataset(),
                epochs=3,
                steps_per_epoch=4,
                verbose=0,
                callbacks=[backup, _Interrupt(epoch=1)],
            )
        # A fresh strategy, model and optimizer, as after a chief restart.
        second = _compiled()
        history = second.fit(
            _dataset(),
            epochs=3,
            steps_per_epoch=4,
            verbose=0,
            callbacks=[
                tf.keras.callbacks.BackupAndRestore(self.dir + "/backup")
            ],
        )
        self.assertLen(history.history["loss"], 1)  # only epoch 3 ran
        self.assertEqual(int(second.optimizer.iterations.numpy()), 6)
        self.assertLess(
            testutil.max_abs_diff(
                second.get_weights(), reference.get_weights()
            ),
            1e-6,
        )

    def test_tensorboard_and_csv_get_the_sync_metrics(self):
        model = _compiled()
        model.fit(
            _dataset(),
            epochs=2,
            steps_per_epoch=4,
            verbose=0,
            callbacks=[
                tf2sync.SyncMetrics(batch_size=32),
                tf.keras.callbacks.TensorBoard(self.dir + "/tb"),
                tf.keras.callbacks.CSVLogger(self.dir + "/log.csv"),
            ],
        )
        tags = set()
        for path in glob.glob(self.dir + "/tb/train/events*"):
            for record in tf.data.TFRecordDataset(path):
                event = tf.compat.v1.Event.FromString(record.numpy())
                tags.update(v.tag for v in event.summary.value)
        self.assertContainsSubset(
            {"epoch_sync_steps", "epoch_stale_dropped", "epoch_barrier_wait_s"},
            tags,
        )
        with open(self.dir + "/log.csv") as f:
            rows = list(csv.DictReader(f))
        # SyncMetrics made the totals exact after each epoch's join.
        self.assertEqual([float(r["sync_steps"]) for r in rows], [2.0, 4.0])
        self.assertEqual(
            [float(r["stale_dropped_epoch"]) for r in rows], [0, 0]
        )
        for row in rows:
            self.assertGreater(float(row["examples_per_s"]), 0)
            self.assertGreater(float(row["sync_steps_per_s"]), 0)

    def _epoch_lines(self, *callbacks, model=None):
        model = model or _compiled()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            history = model.fit(
                _dataset(),
                epochs=2,
                steps_per_epoch=4,
                verbose=2,
                callbacks=list(callbacks),
            )
        lines = [
            line for line in out.getvalue().splitlines() if "/4 - " in line
        ]
        self.assertLen(lines, 2, out.getvalue())
        # Every figure stays in the logs, whatever the line shows.
        self.assertContainsSubset(
            {"accepted_w0", "stale_w1", "barrier_wait_s_epoch", "loss"},
            set(history.history),
        )
        return lines

    def test_epoch_line_shows_what_a_person_reads(self):
        for line in self._epoch_lines(tf2sync.SyncMetrics(batch_size=32)):
            for shown in (
                "loss:",
                "accuracy:",
                "sync_steps:",
                "examples_per_s:",
            ):
                self.assertIn(shown, line)
            self.assertIn("stale_dropped:", line)
            for hidden in ("accepted_w0", "stale_w1", "barrier_wait", "_epoch"):
                self.assertNotIn(hidden, line)
            self.assertLess(len(line), 200, line)
            # tf_keras's verbose-2 line, with counts as integers (its own
            # printed `sync_steps: 4.0000 - stale_dropped: 0.0000e+00`).
            self.assertRegex(line, r"^4/4 - \d+s - loss: \d+\.\d{4}(e-\d+)? - ")
            self.assertRegex(line, r" - sync_steps: [1-9]\d* - ")
            self.assertRegex(line, r" - stale_dropped: \d+ - ")
            self.assertRegex(
                line, r" - \d+(s|ms|us)/epoch - \d+(s|ms|us)/step$"
            )

    def test_epoch_values_as_a_person_reads_them(self):
        from tf2sync._src import callbacks as callbacks_lib

        text = callbacks_lib.epoch_value_text
        self.assertEqual(text(np.int64(176)), "176")
        self.assertEqual(text(0), "0")
        self.assertEqual(text(np.float32(0.5)), "0.5000")
        self.assertEqual(text(0.0), "0.0000e+00")
        self.assertEqual(text(2730.27724), "2730.2772")

    def test_sync_metrics_verbose_shows_every_figure(self):
        lines = self._epoch_lines(
            tf2sync.SyncMetrics(batch_size=32, verbose=True)
        )
        for line in lines:
            for shown in ("accepted_w0", "stale_w1", "barrier_wait_s_epoch"):
                self.assertIn(shown, line)
            self.assertRegex(line, r" - accepted_w0: \d+ - ")

    def test_another_progress_bar_prints_instead_not_as_well(self):
        # Listed after SyncMetrics, the user's bar prints its logs: every
        # figure, one line per epoch.
        model = _compiled()
        sync_metrics = tf2sync.SyncMetrics(batch_size=32)
        lines = self._epoch_lines(
            sync_metrics,
            tf.keras.callbacks.ProgbarLogger(count_mode="steps"),
            model=model,
        )
        for line in lines:
            for shown in ("sync_steps:", "accepted_w0", "examples_per_s"):
                self.assertIn(shown, line)
        # Alone in the next fit, SyncMetrics prints its own line again.
        for line in self._epoch_lines(sync_metrics, model=model):
            self.assertIn("examples_per_s:", line)
            self.assertNotIn("accepted_w0", line)

    def test_sync_metrics_refuses_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "batch_size=0"):
            tf2sync.SyncMetrics(batch_size=0)
        with self.assertRaisesRegex(ValueError, "verbose='yes'"):
            tf2sync.SyncMetrics(verbose="yes")

    def test_early_stopping_and_reduce_lr_on_plateau(self):
        model = _compiled()
        history = model.fit(
            _dataset(),
            epochs=10,
            steps_per_epoch=2,
            verbose=0,
            callbacks=[
                # min_delta is huge: no epoch counts as an improvement.
                tf.keras.callbacks.ReduceLROnPlateau(
                    monitor="loss", patience=0, factor=0.5, min_delta=100
                ),
                tf.keras.callbacks.EarlyStopping(
                    monitor="loss", patience=2, min_delta=100
                ),
            ],
        )
        self.assertLen(history.history["loss"], 3)
        self.assertEqual(int(model.optimizer.iterations.numpy()), 3)
        # ReduceLROnPlateau logs the rate of the epoch, then halves it.
        self.assertEqual(
            [round(float(v), 4) for v in history.history["lr"]],
            [0.05, 0.05, 0.025],
        )
        self.assertAlmostEqual(
            float(model.optimizer.inner_optimizer.learning_rate.numpy()),
            0.0125,
        )

    def test_terminate_on_nan_runs_and_stops_fit_on_a_nan_loss(self):
        # It reads fit's logs unconverted (`logs.get("loss")`), which stock
        # PSS's RemoteValue refuses (a TypeError from fit).
        history = _fit_terminating_on_nan(_compiled(), _dataset(), 3)
        self.assertLen(history.history["loss"], 3)
        # NaN features through a linear model: the loss is NaN (a ReLU's
        # NaN may come out 0 or NaN, as the CPU's max instruction has it).
        # The step's push is dropped, and TerminateOnNaN stops fit at the
        # first call, whose loss it waits for: one step ran.
        model = _compiled(model_fn=_linear_model)
        before = model.get_weights()
        history = _fit_terminating_on_nan(model, _nan_features(), 2)
        self.assertEqual(history.history["nonfinite_dropped"], [1])
        self.assertTrue(math.isnan(history.history["loss"][0]))
        self.assertEqual(testutil.max_abs_diff(model.get_weights(), before), 0)

    def test_a_nan_gradient_of_a_finite_loss_is_dropped_and_fit_goes_on(self):
        # Each step's loss is finite and its gradients NaN: each push is
        # dropped and counted, the weights stay, and nothing stops fit.
        model = _compiled(model_fn=_nan_gradient_model)
        before = model.get_weights()
        history = _fit_terminating_on_nan(model, _dataset(), 2)
        self.assertEqual(history.history["nonfinite_dropped"], [4, 8])
        self.assertTrue(all(math.isfinite(v) for v in history.history["loss"]))
        self.assertEqual(testutil.max_abs_diff(model.get_weights(), before), 0)


class FindSyncOptimizerTest(absltest.TestCase):
    def test_itself_or_under_loss_scaling_by_its_marker_else_refused(self):
        # By `SyncOptimizer`'s class marker, not its class: optimizer.py
        # imports what imports callbacks.py (lint_test's no-cycle test).
        self.assertTrue(tf2sync.SyncOptimizer._tf2sync_synchronous)

        class Sync:
            _tf2sync_synchronous = True

        class Scaled:
            sync_optimizer = Sync()

        sync, scaled = Sync(), Scaled()
        self.assertIs(callbacks_lib.find_sync_optimizer(sync), sync)
        self.assertIs(
            callbacks_lib.find_sync_optimizer(scaled), scaled.sync_optimizer
        )
        with self.assertRaisesRegex(
            ValueError, "SyncMetrics needs a model compiled with tf2sync"
        ):
            callbacks_lib.find_sync_optimizer(tf.keras.optimizers.SGD(0.1))


def _fit_terminating_on_nan(model, data, epochs):
    return model.fit(
        data,
        epochs=epochs,
        steps_per_epoch=4,
        verbose=0,
        callbacks=[tf.keras.callbacks.TerminateOnNaN()],
    )


def _nan_features():
    return tf.data.Dataset.from_tensors((_X * float("nan"), _Y)).repeat()


def _linear_model():
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(4,))])


def _nan_gradient_model():
    """Finite outputs, NaN gradients: sqrt(|t - t|) adds 0 forward;
    backward, sqrt's gradient at 0 (infinite) times abs's (0) is NaN."""
    model = testutil.dense_model()
    model.add(
        tf.keras.layers.Lambda(
            lambda t: t + tf.sqrt(tf.abs(t - tf.stop_gradient(t)))
        )
    )
    return model


class _SlowReplica(tf.keras.Sequential):
    """Worker 0 sleeps 0.1 s per step after reading its tag: a straggler."""

    def train_step(self, data):
        x, y = data
        worker = strategy_lib.current_step().worker
        seconds = tf.where(tf.equal(worker, 0), 0.1, 0.0)
        slept = tf.py_function(
            lambda s: time.sleep(float(s)) or 0.0, [seconds], tf.float32
        )
        slept.set_shape([])
        x = x + tf.cast(slept, x.dtype) * 0
        return super().train_step((x, y))


class SyncMetricsTest(absltest.TestCase):
    def test_slow_backup_worker_is_counted_stale_in_history(self):
        def model_fn():
            tf.keras.utils.set_random_seed(0)
            return _SlowReplica(
                [
                    tf.keras.layers.Dense(8, input_shape=(4,)),
                    tf.keras.layers.Dense(3),
                ]
            )

        model = _compiled(num_workers=3, rta=2, total=3, model_fn=model_fn)

        history = model.fit(
            _dataset(),
            epochs=1,
            steps_per_epoch=300,
            verbose=0,
            callbacks=[tf2sync.SyncMetrics()],
        )
        stale = history.history["stale_dropped"]
        self.assertGreater(stale[-1], 0)
        self.assertEqual(
            history.history["sync_steps"][-1],
            float(model.optimizer.iterations.numpy()),
        )
        self.assertGreater(history.history["barrier_wait_s"][-1], 0)
        accepted = int(model.optimizer.gradients_accepted.numpy())
        # Every push is accounted for: accepted or dropped as stale.
        self.assertEqual(accepted + int(stale[-1]), 300)
        logs = {k: v[-1] for k, v in history.history.items()}
        # Per worker: the straggler's pushes are the ones mostly dropped.
        # (Fast workers lose some too: a surplus token lets one of them push
        # twice for a step while the other's push is in flight, as in TF1.)
        pushed = [
            logs[f"accepted_w{i}"] + logs[f"stale_w{i}"] for i in range(3)
        ]
        self.assertEqual(sum(pushed), 300)
        self.assertEqual(sum(logs[f"stale_w{i}"] for i in range(3)), stale[-1])
        straggler_rate = logs["stale_w0"] / pushed[0]
        fast_rate = (logs["stale_w1"] + logs["stale_w2"]) / (
            pushed[1] + pushed[2]
        )
        self.assertGreater(straggler_rate, 0.5, logs)
        self.assertLess(fast_rate, 0.25, logs)
        self.assertLess(pushed[0], (pushed[1] + pushed[2]) / 4, logs)
        # The totals cross from the ps as one vector: each in its place.
        aggregator = model.optimizer._aggregator
        accepted_w = aggregator.accepted_per_worker.numpy()
        stale_w = aggregator.stale_per_worker.numpy()
        expected = {
            "sync_steps": int(model.optimizer.iterations.numpy()),
            "stale_dropped": int(aggregator.stale_dropped.numpy()),
            "nonfinite_dropped": int(aggregator.nonfinite_dropped.numpy()),
            "barrier_wait_s": float(aggregator.wait_seconds.numpy()),
            "accepted": accepted,
            "over_plan_dropped": int(aggregator.over_plan.numpy()),
        }
        for i in range(3):
            expected[f"accepted_w{i}"] = int(accepted_w[i])
            expected[f"stale_w{i}"] = int(stale_w[i])
        self.assertEqual(aggregator.totals(), expected)
        self.assertNotEqual(list(accepted_w), list(stale_w))


if __name__ == "__main__":
    absltest.main()
