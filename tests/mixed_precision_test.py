"""Non-finite gradients and mixed precision (tf2sync's own loss scaling)."""

import os
import tempfile

import numpy as np
import tensorflow as tf
import testutil
from absl.testing import absltest
from absl.testing import parameterized

import tf2sync


def _custom_round(strategy, model, opt, batches):
    """Schedules one replica step per batch, in order, then joins."""
    testutil.Loop(strategy, model, opt).round(batches)


class NonFiniteTest(absltest.TestCase):
    def test_nan_push_is_skipped_and_the_step_completes_without_it(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = testutil.dense_model()
            opt = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
        x, y = testutil.data("dense", 24)
        bad = x[8:16].copy()
        bad[0, 0] = np.nan
        # good, NaN, good: the NaN push gives its token back, so the third
        # step fills the update, which is the mean of the two good batches.
        _custom_round(
            strategy,
            model,
            opt,
            [(x[:8], y[:8]), (bad, y[8:16]), (x[16:], y[16:])],
        )
        self.assertEqual(int(opt.nonfinite_dropped.numpy()), 1)
        self.assertEqual(int(opt.iterations.numpy()), 1)
        ref = testutil.dense_model()
        with tf.GradientTape() as tape:
            loss = (
                testutil.mean_loss(y[:8], ref(x[:8]))
                + testutil.mean_loss(y[16:], ref(x[16:]))
            ) / 2
        grads = tape.gradient(loss, ref.trainable_variables)
        tf.keras.optimizers.SGD(0.1).apply_gradients(
            zip(grads, ref.trainable_variables)
        )
        for w in model.get_weights():
            self.assertTrue(np.all(np.isfinite(w)))
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), ref.get_weights()), 1e-6
        )

    def test_raise_policy_fails_the_step_before_any_update(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = testutil.dense_model()
            opt = tf2sync.SyncOptimizer(
                tf.keras.optimizers.SGD(0.1), nonfinite="raise"
            )
        before = model.get_weights()
        x, y = testutil.data("dense", 8)
        x[0, 0] = np.inf
        with self.assertRaisesRegex(
            tf.errors.InvalidArgumentError, "nonfinite='raise'"
        ):
            _custom_round(strategy, model, opt, [(x, y)])
        self.assertEqual(testutil.max_abs_diff(model.get_weights(), before), 0)

    def test_bad_policy(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            with self.assertRaisesRegex(
                ValueError,
                '`nonfinite` must be "skip" or "raise". Received: '
                "nonfinite='ignore'",
            ):
                tf2sync.SyncOptimizer(
                    tf.keras.optimizers.SGD(0.1), nonfinite="ignore"
                )


class MixedPrecisionTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        tf.keras.mixed_precision.set_global_policy("mixed_float16")

    def tearDown(self):
        tf.keras.mixed_precision.set_global_policy("float32")
        super().tearDown()

    def _model(self):
        tf.keras.utils.set_random_seed(0)
        return tf.keras.Sequential(
            [
                tf.keras.layers.Dense(8, activation="relu", input_shape=(4,)),
                tf.keras.layers.Dense(3, name="head"),
                tf.keras.layers.Activation("linear", dtype="float32"),
            ]
        )

    def test_fit_with_multi_optimizer_scales_once_per_sync_step(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = self._model()
            # A LossScaleOptimizer around the multi-optimizer, inside
            # SyncOptimizer: its settings are kept (growth every 2 steps).
            lso = tf.keras.mixed_precision.LossScaleOptimizer(
                tf2sync.MultiOptimizer(
                    groups={"head": tf.keras.optimizers.SGD(0.1)},
                    default=tf.keras.optimizers.SGD(0.01),
                ),
                initial_scale=64.0,
                dynamic_growth_steps=2,
            )
            optimizer = tf2sync.SyncOptimizer(lso)
            model.compile(optimizer=optimizer, loss=testutil.LOSS)
        # compile did not wrap it again: it is the loss-scaled SyncOptimizer.
        self.assertIs(model.optimizer, optimizer)
        self.assertIsInstance(
            optimizer.sync_optimizer.inner_optimizer, tf2sync.MultiOptimizer
        )
        x, y = testutil.data("dense", 16)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(ds, epochs=1, steps_per_epoch=8, verbose=0)
        # 8 pushes, 2 per update: 4 synchronous steps, scale x2 every 2.
        self.assertEqual(int(optimizer.iterations.numpy()), 4)
        self.assertEqual(float(optimizer.loss_scale.numpy()), 256.0)
        for w in model.get_weights():
            self.assertTrue(np.all(np.isfinite(w)))
        self.assertEqual(int(optimizer.nonfinite_dropped.numpy()), 0)

    @parameterized.named_parameters(
        ("one_step_per_function", False),
        # 5 steps repeated in each function: the later pushes call one ps
        # function, whose non-finite path and loss scale must still work.
        ("repeated_steps", True),
    )
    def test_overflow_halves_the_scale_and_never_corrupts_weights(
        self, repeated
    ):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = self._model()
            optimizer = tf2sync.SyncOptimizer(
                tf.keras.mixed_precision.LossScaleOptimizer(
                    tf.keras.optimizers.legacy.SGD(0.1),
                    initial_scale=2.0**40,  # float16 overflows: inf grads
                )
            )
            model.compile(
                optimizer=optimizer,
                loss=testutil.LOSS,
                steps_per_execution=5 if repeated else 1,
            )
        if repeated:
            tf2sync.unroll_fit_steps(model)
        x, y = testutil.data("dense", 16)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(ds, epochs=1, steps_per_epoch=60, verbose=0)
        dropped = int(optimizer.nonfinite_dropped.numpy())
        self.assertGreater(dropped, 0)
        self.assertLess(float(optimizer.loss_scale.numpy()), 2.0**40)
        self.assertGreater(int(optimizer.iterations.numpy()), 0)
        for w in model.get_weights():
            self.assertTrue(np.all(np.isfinite(w)))

    def test_a_legacy_optimizers_checkpoint_keeps_slots_and_scale(self):
        # ModelCheckpoint's TF-format save used to fail at the first epoch
        # end: the loss-scale wrapper, the SyncOptimizer and the legacy
        # inner optimizer each listed the momentum slots.
        def parts():
            strategy = testutil.strategy(2, replicas_to_aggregate=2)
            with strategy.scope():
                model = self._model()
                optimizer = tf2sync.SyncOptimizer(
                    tf.keras.mixed_precision.LossScaleOptimizer(
                        tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
                        initial_scale=64.0,
                        dynamic_growth_steps=2,
                    )
                )
                model.compile(optimizer=optimizer, loss=testutil.LOSS)
                optimizer.build(model.trainable_variables)
            return model, optimizer

        def momenta(model, optimizer):
            return [
                optimizer.get_slot(var, "momentum").numpy()
                for var in model.trainable_variables
            ]

        model, optimizer = parts()
        x, y = testutil.data("dense", 16)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        path = os.path.join(tempfile.mkdtemp(), "ckpt")
        model.fit(
            ds,
            epochs=1,
            steps_per_epoch=8,
            verbose=0,
            callbacks=[
                tf.keras.callbacks.ModelCheckpoint(path, save_weights_only=True)
            ],
        )
        self.assertEqual(optimizer.get_slot_names(), ["momentum"])
        saved = momenta(model, optimizer)
        self.assertGreater(max(float(np.abs(m).max()) for m in saved), 0)
        restored_model, restored = parts()
        restored_model.load_weights(path).assert_existing_objects_matched()
        self.assertEqual(int(restored.iterations.numpy()), 4)
        self.assertEqual(float(optimizer.loss_scale.numpy()), 256.0)
        self.assertEqual(float(restored.loss_scale.numpy()), 256.0)
        self.assertEqual(
            testutil.max_abs_diff(
                restored_model.get_weights(), model.get_weights()
            ),
            0,
        )
        self.assertEqual(
            testutil.max_abs_diff(momenta(restored_model, restored), saved), 0
        )

    @parameterized.parameters(False, True)
    def test_a_saved_model_reloads_under_the_strategy_with_its_scale_settings(
        self, legacy
    ):
        # Loading used to fail for .keras: the SyncOptimizer inside was
        # deserialized into a loss-scale optimizer of its own under the
        # float16 policy, then wrapped again.
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = self._model()
            inner = testutil.momentum_or_adam(legacy)
            model.compile(
                optimizer=tf2sync.SyncOptimizer(
                    tf.keras.mixed_precision.LossScaleOptimizer(
                        inner, initial_scale=64.0, dynamic_growth_steps=2
                    )
                ),
                loss=testutil.LOSS,
            )
        x, y = testutil.data("dense", 16)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(ds, epochs=1, steps_per_epoch=4, verbose=0)
        directory = tempfile.mkdtemp()
        for path in ("model.keras", "model.h5", "savedmodel"):
            path = os.path.join(directory, path)
            model.save(path)
            with testutil.strategy(2, replicas_to_aggregate=2).scope():
                with self.assertLogs(level="WARNING") as logs:
                    loaded = tf.keras.models.load_model(path)
            self.assertTrue(
                any("with a fresh state" in line for line in logs.output),
                logs.output,
            )
            optimizer = loaded.optimizer
            self.assertIsInstance(
                optimizer, tf.keras.mixed_precision.LossScaleOptimizer
            )
            self.assertIsInstance(
                optimizer.sync_optimizer, tf2sync.SyncOptimizer
            )
            self.assertIsInstance(
                optimizer.sync_optimizer.inner_optimizer, type(inner)
            )
            self.assertTrue(optimizer.dynamic)
            self.assertEqual(optimizer.dynamic_growth_steps, 2)
            loaded.fit(ds, epochs=1, steps_per_epoch=8, verbose=0)
            # The file holds no optimizer state: 4 new steps from 64.
            self.assertEqual(int(optimizer.iterations.numpy()), 4)
            self.assertEqual(float(optimizer.loss_scale.numpy()), 256.0)

    def test_policy_alone_turns_loss_scaling_on(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            optimizer = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
        self.assertTrue(optimizer.dynamic)
        self.assertEqual(float(optimizer.loss_scale.numpy()), 2.0**15)

    def test_keras_loss_scale_optimizer_around_sync_is_refused(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        tf.keras.mixed_precision.set_global_policy("float32")
        with strategy.scope():
            model = self._model()
            sync = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
            wrapped = tf.keras.mixed_precision.LossScaleOptimizer(sync)
            model.compile(optimizer=wrapped, loss=testutil.LOSS)
        x, y = testutil.data("dense", 16)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        with self.assertRaisesRegex(
            TypeError, "Put the LossScaleOptimizer inside instead"
        ):
            model.fit(ds, epochs=1, steps_per_epoch=2, verbose=0)


class OutsideScopeTest(absltest.TestCase):
    def test_optimizer_built_outside_the_scope_is_refused(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        outside = tf.keras.optimizers.SGD(0.1)
        with strategy.scope():
            with self.assertRaisesRegex(
                ValueError,
                r"`optimizer` \(SGD\) was created outside `strategy.scope\(\)`",
            ):
                tf2sync.SyncOptimizer(outside)


if __name__ == "__main__":
    absltest.main()
