"""keras_calls: the tf_keras call and the data handler the coordinator serves.

They are recorded by two patches (`keras_calls`, `data_handler_context`)
rather than read from the call stack: nothing is recorded outside a call
(a user's loop, `Trainer`) nor seen from another thread; `fit`'s training
data handler is told from its validation one (the role "validation"),
and an `evaluate` inside `fit` (its validation) is that `evaluate`, with
the `fit` around it.
"""

import threading

import numpy as np
import tensorflow as tf
import testutil
from absl.testing import absltest

import tf2sync
from tf2sync._src import coordinator as coordinator_lib
from tf2sync._src import keras_calls


def _outside():
    """What the records say now: all empty outside a call."""
    return (
        keras_calls.current(),
        keras_calls.input_role(),
        keras_calls.handler_being_built(),
        keras_calls.building_exact_evaluation(),
    )


class _Probe(tf.keras.callbacks.Callback):
    """Records, at each call's start, what `keras_calls` says of it."""

    def __init__(self):
        super().__init__()
        self.seen = []
        self.other_thread = []

    def _see(self, hook):
        model = self.model
        self.seen.append(
            (
                hook,
                keras_calls.entry_point(model),
                keras_calls.input_role(model),
                keras_calls.fit_data_handler(model) is not None,
                self in keras_calls.fit_callbacks(model),
            )
        )
        thread = threading.Thread(
            target=lambda: self.other_thread.append(keras_calls.current())
        )
        thread.start()
        thread.join()

    def on_train_begin(self, logs=None):
        self._see("train")

    def on_test_begin(self, logs=None):
        self._see("test")

    def on_predict_begin(self, logs=None):
        self._see("predict")


class OneMachineTest(absltest.TestCase):
    def test_each_call_is_recorded_while_it_runs(self):
        keras_calls.install()
        model = testutil.dense_model()
        model.compile(optimizer="sgd", loss="mse")
        x = np.zeros((8, 4), "float32")
        y = np.zeros((8, 3), "float32")
        self.assertEqual(_outside(), (None, None, None, False))
        probe = _Probe()
        model.fit(x, y, validation_data=(x, y), callbacks=[probe], verbose=0)
        model.evaluate(x, y, callbacks=[probe], verbose=0)
        model.predict(x, callbacks=[probe], verbose=0)
        # No coordinator: fit's data handler is not one it records.
        self.assertEqual(
            probe.seen,
            [
                ("train", "fit", "fit", False, True),
                ("test", "evaluate", "evaluate", False, True),  # validation
                ("test", "evaluate", "evaluate", False, False),
                ("predict", "predict", "predict", False, False),
            ],
        )
        self.assertEqual(probe.other_thread, [None] * 4)
        self.assertEqual(_outside(), (None, None, None, False))


def _dataset():
    x = np.random.RandomState(0).randn(16, 4).astype("float32")
    y = np.zeros((16, 3), "float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()


class CoordinatorTest(absltest.TestCase):
    def test_the_input_hook_is_told_each_handler_and_its_role(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = testutil.dense_model()
            model.compile(
                optimizer=tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1)),
                loss="mse",
            )
        hooked = []

        def hook(coordinator, dataset_fn):
            handler = keras_calls.handler_being_built()
            hooked.append(
                (
                    keras_calls.entry_point(model),
                    keras_calls.input_role(),
                    type(handler).__name__,
                    keras_calls.fit_data_handler(model) is not None,
                )
            )

        coordinator_lib.add_input_hook(hook)
        self.addCleanup(coordinator_lib._INPUT_HOOKS.remove, hook)
        probe = _Probe()
        model.fit(
            _dataset(),
            epochs=1,
            steps_per_epoch=2,
            validation_data=_dataset(),
            validation_steps=1,
            callbacks=[probe],
            verbose=0,
        )
        model.evaluate(_dataset(), steps=1, verbose=0)
        handler = "_ClusterCoordinatorDataHandler"
        self.assertEqual(
            hooked,
            [
                ("fit", "fit", handler, False),
                ("fit", "validation", handler, True),
                ("evaluate", "evaluate", handler, False),
            ],
        )
        # The validation's evaluate runs inside fit, on the handler fit made.
        self.assertEqual(
            probe.seen,
            [
                ("train", "fit", "validation", True, True),
                ("test", "evaluate", "evaluate", True, True),
            ],
        )
        self.assertEqual(_outside(), (None, None, None, False))
        # A user's loop after fit: its dataset is built with no call.
        hooked.clear()
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        coordinator.create_per_worker_dataset(
            lambda: strategy.distribute_datasets_from_function(
                lambda context: _dataset()
            )
        )
        self.assertEqual(hooked, [(None, None, "NoneType", False)])


if __name__ == "__main__":
    absltest.main()
