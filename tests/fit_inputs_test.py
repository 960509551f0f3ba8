"""`fit`, `evaluate` and `predict` take what tf_keras takes on one machine.

A click model with three named inputs (two embedding tables and dense
features, as a recommender's), trained from a dict of NumPy arrays and
from a `tf.data` dataset of dicts; `val_*` and `evaluate` must be the
metrics of the whole set, as a one-process `evaluate` of the same weights
gives them, for 1 to 3 workers and set sizes that do and do not divide
into batches. Before, each worker read its own copy of the validation
arrays from its start: the first batches counted once per worker, the
rest never (issue 55: 0.5378 reported, 0.5372 on the whole set).
"""

import math

import numpy as np
import tensorflow as tf
import testutil
from absl.testing import absltest
from absl.testing import parameterized

import tf2sync
from tf2sync._src import sharding

BATCH = 64
VOCAB_A, VOCAB_B = 1000, 100


def _data(n, seed):
    rng = np.random.RandomState(seed)
    x = {
        "cat_a": rng.randint(0, VOCAB_A, size=(n, 1)),
        "cat_b": rng.randint(0, VOCAB_B, size=(n, 1)),
        "dense_features": rng.randn(n, 8).astype("float32"),
    }
    y = (
        (x["dense_features"][:, 0] + (x["cat_a"][:, 0] % 7 == 0)) > 0.5
    ).astype("float32")
    return x, y


def _click_model():
    tf.keras.utils.set_random_seed(1)
    cat_a = tf.keras.Input((1,), name="cat_a", dtype="int64")
    cat_b = tf.keras.Input((1,), name="cat_b", dtype="int64")
    dense = tf.keras.Input((8,), name="dense_features")
    a = tf.keras.layers.Embedding(VOCAB_A, 8)(cat_a)
    b = tf.keras.layers.Embedding(VOCAB_B, 4)(cat_b)
    h = tf.keras.layers.Concatenate()(
        [tf.keras.layers.Flatten()(a), tf.keras.layers.Flatten()(b), dense]
    )
    h = tf.keras.layers.Dense(16, activation="relu")(h)
    out = tf.keras.layers.Dense(1, activation="sigmoid")(h)
    return tf.keras.Model(
        {"cat_a": cat_a, "cat_b": cat_b, "dense_features": dense}, out
    )


def _compile(model, optimizer=None):
    model.compile(
        optimizer=optimizer,
        loss="binary_crossentropy",
        metrics=["AUC", "accuracy"],
        steps_per_execution=4,
    )
    return model


def _trained(num_workers):
    strategy = testutil.strategy(
        num_workers,
        1,
        replicas_to_aggregate=num_workers,
        total_num_replicas=num_workers,
    )
    with strategy.scope():
        model = _click_model()
        _compile(
            model,
            tf2sync.SyncOptimizer(tf.keras.optimizers.legacy.Adagrad(0.1)),
        )
    return model


def _one_process(model, x, y):
    local = _compile(_click_model(), "sgd")
    local.set_weights(sharding.whole_weights(model.weights))
    return local, local.evaluate(
        x, y, batch_size=BATCH, verbose=0, return_dict=True
    )


class ExactValidationTest(parameterized.TestCase):
    def _assert_metrics(self, got, expected):
        self.assertEqual(set(got), set(expected))
        for name, value in expected.items():
            self.assertAlmostEqual(float(got[name]), value, places=5, msg=name)

    @parameterized.named_parameters(
        ("one_worker_divides", 1, 640),
        ("two_workers_does_not_divide", 2, 600),
        ("three_workers_divides", 3, 640),
        ("three_workers_does_not_divide", 3, 601),
    )
    def test_dict_arrays_train_and_validate_on_the_whole_set(
        self, num_workers, num_validation
    ):
        model = _trained(num_workers)
        x, y = _data(2048, seed=0)
        xv, yv = _data(num_validation, seed=1)
        history = model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=2,
            validation_data=(xv, yv),
            verbose=0,
        )
        # steps_per_epoch derived: one pass at BATCH, shared by the workers.
        steps = math.ceil(2048 / BATCH)
        self.assertEqual(
            history.history["sync_steps"][-1], 2 * steps // num_workers
        )
        local, expected = _one_process(model, xv, yv)
        got = {
            k[len("val_") :]: v[-1]
            for k, v in history.history.items()
            if k.startswith("val_")
        }
        self._assert_metrics(got, expected)
        self._assert_metrics(
            model.evaluate(
                xv, yv, batch_size=BATCH, verbose=0, return_dict=True
            ),
            expected,
        )
        # A finite dataset of dicts, evaluated once, exactly.
        dataset = tf.data.Dataset.from_tensor_slices((xv, yv)).batch(50)
        self._assert_metrics(
            model.evaluate(dataset, verbose=0, return_dict=True), expected
        )
        np.testing.assert_allclose(
            model.predict(xv, batch_size=BATCH, verbose=0),
            local.predict(xv, batch_size=BATCH, verbose=0),
            rtol=1e-5,
            atol=1e-6,
        )

    def test_sharded_tables_on_two_ps(self):
        # The recommender's case: its tables split over 2 ps.
        strategy = testutil.strategy(
            2,
            2,
            replicas_to_aggregate=2,
            total_num_replicas=2,
            variable_partitioner=(
                tf.distribute.experimental.partitioners.FixedShardsPartitioner(
                    2
                )
            ),
        )
        with strategy.scope():
            model = _compile(
                _click_model(),
                tf2sync.SyncOptimizer(tf.keras.optimizers.legacy.Adagrad(0.1)),
            )
        self.assertNotEmpty(sharding.sharded_groups(model.variables))
        x, y = _data(1024, seed=0)
        xv, yv = _data(301, seed=1)
        history = model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            validation_data=(xv, yv),
            verbose=0,
        )
        _, expected = _one_process(model, xv, yv)
        got = {
            k[len("val_") :]: v[-1]
            for k, v in history.history.items()
            if k.startswith("val_")
        }
        self._assert_metrics(got, expected)

    def test_a_dataset_of_dicts_trains_and_validates(self):
        model = _trained(2)
        x, y = _data(512, seed=0)
        xv, yv = _data(300, seed=1)
        train = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)
        validation = tf.data.Dataset.from_tensor_slices((xv, yv)).batch(32)
        history = model.fit(
            train,
            epochs=1,
            steps_per_epoch=8,
            validation_data=validation,
            verbose=0,
        )
        self.assertEqual(history.history["sync_steps"], [4])
        _, expected = _one_process(model, xv, yv)
        self.assertAlmostEqual(
            history.history["val_loss"][0], expected["loss"], places=5
        )

    def test_evaluate_before_training(self):
        # Exact evaluation clones the compiled metrics, which a model's
        # first step builds: evaluate builds them from one batch.
        model = _trained(2)
        xv, yv = _data(200, seed=1)
        _, expected = _one_process(model, xv, yv)
        self._assert_metrics(
            model.evaluate(
                xv, yv, batch_size=BATCH, verbose=0, return_dict=True
            ),
            expected,
        )

    def test_sample_weights_of_dict_arrays_are_applied(self):
        # tf_keras's own conversion passed `sample_weight` where its
        # adapters take `sample_weights`: the weights were dropped. All
        # zero, no step may move a weight.
        model = _trained(2)
        before = sharding.whole_weights(model.weights)
        x, y = _data(256, seed=0)
        model.fit(
            x,
            y,
            sample_weight=np.zeros(256, "float32"),
            batch_size=BATCH,
            epochs=1,
            verbose=0,
        )
        self.assertGreater(int(model.optimizer.iterations.numpy()), 0)
        self.assertEqual(
            testutil.max_abs_diff(
                sharding.whole_weights(model.weights), before
            ),
            0,
        )
        with self.assertRaisesRegex(
            ValueError, r"^`class_weight` is not applied .* class_weight=\{0: 1"
        ):
            model.fit(x, y, class_weight={0: 1, 1: 2}, verbose=0)

    def test_a_list_of_input_arrays_is_evaluated_exactly(self):
        strategy = testutil.strategy(
            2, 1, replicas_to_aggregate=2, total_num_replicas=2
        )

        def build():
            tf.keras.utils.set_random_seed(2)
            a, b = tf.keras.Input((3,)), tf.keras.Input((5,))
            h = tf.keras.layers.Concatenate()([a, b])
            out = tf.keras.layers.Dense(1, activation="sigmoid")(h)
            model = tf.keras.Model([a, b], out)
            model.compile(
                optimizer=tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
                if tf.distribute.has_strategy()
                else "sgd",
                loss="binary_crossentropy",
                metrics=["accuracy"],
            )
            return model

        with strategy.scope():
            model = build()
        rng = np.random.RandomState(3)
        xs = [rng.randn(203, 3).astype("f"), rng.randn(203, 5).astype("f")]
        y = (xs[0][:, 0] > 0).astype("float32")
        local = build()
        local.set_weights(model.get_weights())
        self._assert_metrics(
            model.evaluate(
                xs, y, batch_size=BATCH, verbose=0, return_dict=True
            ),
            local.evaluate(
                xs, y, batch_size=BATCH, verbose=0, return_dict=True
            ),
        )

    def test_own_test_step_keeps_needing_validation_steps(self):
        # tf_keras's exact evaluation skips a model's own test_step: such
        # a model keeps the per-worker reading, bounded by the steps.
        class OwnTestStep(tf.keras.Model):
            def test_step(self, data):
                return super().test_step(data)

        strategy = testutil.strategy(
            2, 1, replicas_to_aggregate=2, total_num_replicas=2
        )
        with strategy.scope():
            inner = _click_model()
            model = OwnTestStep(inner.inputs, inner.outputs)
            _compile(
                model,
                tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1)),
            )
        x, y = _data(256, seed=0)
        with self.assertRaisesRegex(ValueError, "needs `validation_steps`"):
            model.fit(
                x,
                y,
                batch_size=BATCH,
                epochs=1,
                validation_data=(x, y),
                verbose=0,
            )


if __name__ == "__main__":
    absltest.main()
