"""A launcher job for fault tests: every replica sees the same full batch.

Any `replicas_to_aggregate` fresh gradients then average to the full-batch
gradient, so a run that applied U synchronous updates must hold exactly the
weights of U single-process full-batch steps, whatever failed on the way:
an update applied twice, or a stale gradient applied, would move them off.

With `TF2SYNC_PROGRESS_FILE` set, `callbacks()` (the chief adds a job's
callbacks to `fit`'s) records the global step as it moves, for
`benchmarks/chaos.py`.
"""

import os
import threading
import time

import numpy as np
import tensorflow as tf

LOSS = "sparse_categorical_crossentropy"
METRICS = ["accuracy"]
LEARNING_RATE = 0.1
MOMENTUM = 0.9


def arrays():
    rng = np.random.RandomState(0)
    x = rng.randn(64, 8).astype("float32")
    y = (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0).astype("int64")
    return x, y


def build_model():
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential(
        [
            tf.keras.layers.Dense(16, activation="relu", input_shape=(8,)),
            tf.keras.layers.Dense(3, activation="softmax"),
        ]
    )


def train_dataset(input_context, batch_size):
    del input_context, batch_size
    x, y = arrays()
    return tf.data.Dataset.from_tensors((x, y)).repeat()


def eval_arrays():
    return arrays()


def num_train_examples():
    return 64


def reference_weights(updates, compiled=False):
    """Weights after `updates` single-process full-batch steps.

    `compiled`: each step in a `tf.function` (several times faster, for
    thousands of steps).
    """
    model = build_model()
    opt = tf.keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
    x, y = arrays()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy()

    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    if compiled:
        step = tf.function(step)
    for _ in range(updates):
        step()
    return model.get_weights()


PROGRESS_ENV = "TF2SYNC_PROGRESS_FILE"


def callbacks():
    """A `Progress` callback if `TF2SYNC_PROGRESS_FILE` names a file."""
    path = os.environ.get(PROGRESS_ENV)
    return [Progress(path)] if path else []


class Progress(tf.keras.callbacks.Callback):
    """Appends "time step" to a file each time the global step moves.

    A thread reads `model.optimizer.iterations` every `interval` seconds
    from `on_train_begin` to `on_train_end`; times are `time.time()`, for
    another process to compare with its own. Lines: `T begin` when a fit
    starts (a new chief, or one rebuilt after a ps restart), `T STEP` on
    each change, `T end STEP` when it ends. At the end it also saves the
    step and the model's weights to `PATH.final.npz`, read after the last
    epoch's join: nothing is in flight then.
    """

    _latest = None  # the thread of the last fit in this process

    def __init__(self, path, interval=0.05):
        super().__init__()
        self._path = path
        self._interval = interval
        self._stop = threading.Event()
        self._thread = None

    def _write(self, text):
        with open(self._path, "a") as f:
            f.write(f"{time.time():.3f} {text}\n")

    def on_train_begin(self, logs=None):
        # A fit that raised (a ps died) never reached on_train_end.
        if Progress._latest is not None:
            Progress._latest.set()
        Progress._latest = self._stop
        self._write("begin")
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self):
        iterations = self.model.optimizer.iterations
        last = None
        while not self._stop.is_set():
            try:
                step = int(iterations.numpy())
            except Exception:  # noqa: BLE001 - a ps away; the chief handles it
                self._stop.wait(0.5)
                continue
            if step != last and not self._stop.is_set():
                self._write(str(step))
                last = step
            self._stop.wait(self._interval)

    def on_train_end(self, logs=None):
        self._stop.set()
        self._thread.join(timeout=10)
        step = int(self.model.optimizer.iterations.numpy())
        weights = self.model.get_weights()
        np.savez(
            self._path + ".final.npz",
            step=step,
            **{f"w{i}": w for i, w in enumerate(weights)},
        )
        self._write(f"end {step}")
