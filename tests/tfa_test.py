"""tfa.optimizers.MultiOptimizer inside tf2sync.SyncOptimizer.

Needs an environment where tensorflow-addons imports (TF <= 2.15), e.g.
Python 3.11 + tensorflow 2.15.1 + tf-keras 2.15.1 + tensorflow-addons 0.23.0:

    PYTHONPATH=. .venv-tfa/bin/python -m pytest tests/tfa_test.py

(`.ci/run` builds that environment). Skipped where tensorflow_addons does
not import, as on TF 2.21.
"""

import os

# Before tensorflow: tf.keras must be tf_keras, or tfa's classes subclass the
# standalone `keras` package's optimizer and tf2sync refuses them.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tempfile  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import testutil  # noqa: E402
from absl.testing import absltest  # noqa: E402
from absl.testing import parameterized  # noqa: E402

import tf2sync  # noqa: E402

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import tensorflow_addons as tfa
except Exception as e:  # ImportError, or tfa refusing this TF version.
    tfa = None
    _WHY = f"tensorflow_addons does not import here: {e!r}"
else:
    _WHY = ""


def _model(seed=0):
    tf.keras.utils.set_random_seed(seed)
    layer1 = tf.keras.layers.Dense(8, activation="tanh", name="layer1")
    layer2 = tf.keras.layers.Dense(3, name="layer2")
    model = tf.keras.Sequential([tf.keras.Input((4,)), layer1, layer2])
    return model, layer1, layer2


def _data():
    rng = np.random.RandomState(0)
    x = rng.randn(16, 4).astype("float32")
    y = rng.randn(16, 3).astype("float32")
    return x, y


def _sgd(legacy, rate):
    if legacy:
        return tf.keras.optimizers.legacy.SGD(rate)
    return tf.keras.optimizers.SGD(rate)


def _reference(steps, legacy):
    """Single process: plain tfa MultiOptimizer, full batch, `steps` steps."""
    model, layer1, layer2 = _model()
    multi = tfa.optimizers.MultiOptimizer(
        [(_sgd(legacy, 0.1), layer1), (_sgd(legacy, 0.0), layer2)]
    )
    x, y = _data()
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        multi.apply_gradients(zip(grads, model.trainable_variables))
    return model, multi


@absltest.skipIf(tfa is None, _WHY)
class TfaMultiOptimizerTest(parameterized.TestCase):
    @parameterized.named_parameters(("new_sgd", False), ("legacy_sgd", True))
    def test_fit_freezes_layer2_moves_layer1_one_step_per_two_pushes(
        self, legacy
    ):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model, layer1, layer2 = _model()
            multi = tfa.optimizers.MultiOptimizer(
                [(_sgd(legacy, 0.1), layer1), (_sgd(legacy, 0.0), layer2)]
            )
            sync = tf2sync.SyncOptimizer(multi)
            model.compile(optimizer=sync, loss="mse")
        before1 = [w.copy() for w in layer1.get_weights()]
        before2 = [w.copy() for w in layer2.get_weights()]

        x, y = _data()  # Same full batch on every worker.
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        pushes = 6
        model.fit(ds, epochs=1, steps_per_epoch=pushes, verbose=0)

        for a, b in zip(layer2.get_weights(), before2):
            np.testing.assert_array_equal(a, b)  # Frozen (rate 0.0).
        moved = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(layer1.get_weights(), before1)
        )
        self.assertGreater(moved, 1e-4)

        accepted = int(sync.gradients_accepted.numpy())
        stale = int(sync.stale_dropped.numpy())
        self.assertEqual(accepted + stale, pushes)
        self.assertEqual(stale, 0)
        self.assertEqual(int(multi.iterations.numpy()), pushes // 2)
        self.assertEqual(int(sync.iterations.numpy()), pushes // 2)
        # Each group's own optimizer applied once per synchronous step, as
        # tfa's apply_gradients does.
        for spec in multi.optimizer_specs:
            self.assertEqual(
                int(spec["optimizer"].iterations.numpy()), pushes // 2
            )

        # Same weights as plain tfa, single process, pushes // 2 full-batch
        # steps: the mean of identical gradients is that gradient.
        ref, _ = _reference(pushes // 2, legacy)
        for a, b in zip(model.get_weights(), ref.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    def test_checkpoint_holds_each_group_slots_and_step(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model, layer1, layer2 = _model()
            adam = tf.keras.optimizers.Adam(0.01)
            multi = tfa.optimizers.MultiOptimizer(
                [(adam, layer1), (_sgd(False, 0.0), layer2)]
            )
            sync = tf2sync.SyncOptimizer(multi)
            model.compile(optimizer=sync, loss="mse")
        x, y = _data()
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(ds, epochs=1, steps_per_epoch=4, verbose=0)
        self.assertEqual(int(multi.iterations.numpy()), 2)
        self.assertEqual(int(adam.iterations.numpy()), 2)

        path = tf.train.Checkpoint(model=model, optimizer=sync).save(
            os.path.join(tempfile.mkdtemp(), "ckpt")  # Not create_tempdir:
            # absl flags are unparsed under pytest.
        )
        names = [n for n, _ in tf.train.list_variables(path)]
        self.assertTrue(any("tfa_spec_0" in n for n in names), names)
        slots = [n for n in names if "tfa_spec_0/_variables/" in n]
        self.assertLen(slots, 4, names)  # Adam m, v of layer1 kernel, bias.

        slot = adam.variables()[1]  # A first-moment slot of layer1.
        value = slot.numpy().copy()
        slot.assign(tf.zeros_like(slot))
        adam.iterations.assign(0)
        tf.train.Checkpoint(model=model, optimizer=sync).restore(
            path
        ).assert_existing_objects_matched()
        np.testing.assert_array_equal(slot.numpy(), value)
        self.assertEqual(int(adam.iterations.numpy()), 2)


if __name__ == "__main__":
    absltest.main()
