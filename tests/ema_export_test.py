"""EMA of the weights (once per sync step) and export to a plain process."""

import tempfile

import numpy as np
import tensorflow as tf
import testutil
from absl.testing import absltest
from absl.testing import parameterized

import tf2sync

_DECAY = 0.5


def _round_trip_batches(n_rounds, batch=8):
    x, y = testutil.data("dense", 2 * batch * n_rounds)
    rounds = []
    for r in range(n_rounds):
        lo = 2 * r * batch
        rounds.append(
            [
                (x[lo : lo + batch], y[lo : lo + batch]),
                (
                    x[lo + batch : lo + 2 * batch],
                    y[lo + batch : lo + 2 * batch],
                ),
            ]
        )
    return rounds


class EmaTest(absltest.TestCase):
    def test_ema_follows_post_update_values_once_per_sync_step(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = testutil.dense_model()
            opt = tf2sync.SyncOptimizer(
                tf.keras.optimizers.SGD(0.1, momentum=0.9), ema_decay=_DECAY
            )
            opt.build(model.trainable_variables)
        loop = testutil.Loop(strategy, model, opt)
        rounds = _round_trip_batches(3)
        for parts in rounds:
            loop.round(parts)
        # NumPy reference: single-process trajectory at batch 2B; the EMA
        # starts at the initial weights and takes each post-update value.
        ref = testutil.dense_model()
        ref_opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)
        shadows = [w.copy() for w in ref.get_weights()]
        for parts in rounds:
            x = np.concatenate([p[0] for p in parts])
            y = np.concatenate([p[1] for p in parts])
            with tf.GradientTape() as tape:
                loss = testutil.mean_loss(y, ref(x))
            grads = tape.gradient(loss, ref.trainable_variables)
            ref_opt.apply_gradients(zip(grads, ref.trainable_variables))
            shadows = [
                _DECAY * s + (1 - _DECAY) * w
                for s, w in zip(shadows, ref.get_weights())
            ]
        self.assertEqual(int(opt.iterations.numpy()), 3)
        got = [v.numpy() for v in opt.ema_variables]
        self.assertLess(testutil.max_abs_diff(got, shadows), 1e-5)
        trained = model.get_weights()
        with opt.ema_weights():
            self.assertLess(
                testutil.max_abs_diff(model.get_weights(), shadows), 1e-5
            )
        self.assertEqual(testutil.max_abs_diff(model.get_weights(), trained), 0)

    def test_ema_is_saved_in_checkpoints(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = testutil.dense_model()
            opt = tf2sync.SyncOptimizer(
                tf.keras.optimizers.SGD(0.1), ema_decay=0.9
            )
            model.compile(optimizer=opt, loss=testutil.LOSS)
        x, y = testutil.data("dense", 16)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(ds, epochs=1, steps_per_epoch=4, verbose=0)
        saved = [v.numpy() for v in opt.ema_variables]
        checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)
        path = checkpoint.save(tempfile.mkdtemp() + "/ckpt")
        for v in opt.ema_variables:
            v.assign(tf.zeros_like(v))
        checkpoint.restore(path).assert_existing_objects_matched()
        self.assertEqual(
            testutil.max_abs_diff(
                [v.numpy() for v in opt.ema_variables], saved
            ),
            0,
        )

    def test_bad_decay(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            with self.assertRaisesRegex(
                ValueError,
                r"`ema_decay` must be a float in \[0, 1\). Received: "
                r"ema_decay=1.5",
            ):
                tf2sync.SyncOptimizer(
                    tf.keras.optimizers.SGD(0.1), ema_decay=1.5
                )


class ExportTest(parameterized.TestCase):
    def test_ema_model_loads_in_a_plain_process(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = testutil.dense_model()
            opt = tf2sync.SyncOptimizer(
                tf.keras.optimizers.SGD(0.1), ema_decay=0.5
            )
            model.compile(optimizer=opt, loss=testutil.LOSS)
        x, y = testutil.data("dense", 16)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(ds, epochs=1, steps_per_epoch=6, verbose=0)
        directory = tempfile.mkdtemp()
        paths = {
            "keras": directory + "/model.keras",
            "h5": directory + "/model.h5",
            "savedmodel": directory + "/savedmodel",
        }
        with opt.ema_weights():
            ema_weights = model.get_weights()
            # The native format always stores the optimizer; its config
            # names tf2sync classes, so a plain process loads it with
            # compile=False (the weights are all that is exported).
            model.save(paths["keras"])
            model.save(paths["h5"], include_optimizer=False)
            model.save(paths["savedmodel"], include_optimizer=False)
        local = testutil.dense_model(seed=3)
        local.set_weights(ema_weights)
        expected = local.predict(x, verbose=0)
        for path in paths.values():
            got = testutil.predict_in_plain_process(self, path, x)
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)

    @parameterized.named_parameters(
        ("adam", "float32", False, "Adam"),
        ("legacy_momentum", "float32", True, "SGD"),
        ("mixed_adam", "mixed_float16", False, "LossScaleOptimizerV3"),
        ("mixed_legacy_momentum", "mixed_float16", True, "LossScaleOptimizer"),
    )
    def test_a_model_saved_with_its_optimizer_trains_in_a_plain_process(
        self, policy, legacy, expected_optimizer
    ):
        # The default save keeps the optimizer; a process that evaluates,
        # predicts or fine-tunes loads it without a cluster and gets the
        # inner optimizer (its loss-scale wrapper under mixed_float16).
        tf.keras.mixed_precision.set_global_policy(policy)
        self.addCleanup(tf.keras.mixed_precision.set_global_policy, "float32")
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = testutil.dense_model()
            inner = testutil.momentum_or_adam(legacy)
            model.compile(
                optimizer=tf2sync.SyncOptimizer(inner, ema_decay=0.5),
                loss=testutil.LOSS,
            )
        x, y = testutil.data("dense", 16)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(ds, epochs=1, steps_per_epoch=4, verbose=0)
        expected = model.predict(x, verbose=0)
        directory = tempfile.mkdtemp()
        paths = [
            directory + "/model.keras",
            directory + "/model.h5",
            directory + "/savedmodel",
        ]
        for path in paths:
            model.save(path)
        got = testutil.load_and_train_in_plain_process(self, paths, x, y)
        for path in paths:
            self.assertEqual(got[path]["optimizer"], expected_optimizer, path)
            np.testing.assert_allclose(
                got[path]["predict"], expected, rtol=1e-2, atol=1e-3
            )
            self.assertGreater(got[path]["moved"], 0, path)
            self.assertGreaterEqual(got[path]["iterations"], 2, path)


if __name__ == "__main__":
    absltest.main()
