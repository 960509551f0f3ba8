"""Shared test helpers: one in-process cluster per shape per process.

In-process servers cannot be stopped, so a test process starts each
cluster shape once and every test builds a fresh strategy on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

import tf2sync
from tf2sync._src import cluster as cluster_lib

_CURRENT = {}


def cluster(num_workers: int = 2, num_ps: int = 1):
    """The process's cluster of this shape, started on first use.

    Only the latest cluster is reused: reconnecting to an earlier one would
    restart the chief's server on a port its unstoppable predecessor holds.
    """
    shape = (num_workers, num_ps)
    latest = cluster_lib.latest_local_cluster_spec()
    cached = _CURRENT.get(shape)
    if cached is None or cached.cluster_spec().as_dict() != latest:
        _CURRENT.clear()
        _CURRENT[shape] = tf2sync.testing.local_cluster(num_workers, num_ps)
    return _CURRENT[shape]


def strategy(num_workers=2, num_ps=1, **kwargs):
    return tf2sync.SyncParameterServerStrategy(
        cluster(num_workers, num_ps), **kwargs
    )


def dense_model(seed=0):
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential(
        [
            tf.keras.layers.Dense(8, activation="relu", input_shape=(4,)),
            tf.keras.layers.Dense(3),
        ]
    )


def sparse_model(seed=0, vocab=50):
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential(
        [
            tf.keras.layers.Embedding(vocab, 4, input_length=5),
            tf.keras.layers.GlobalAveragePooling1D(),
            tf.keras.layers.Dense(3),
        ]
    )


def two_tables_model(seed=0, vocab_a=50, vocab_b=31):
    """Two embedding tables (two sparse gradients) and a dense head."""
    tf.keras.utils.set_random_seed(seed)
    ids = tf.keras.Input((5,), dtype="int64")
    a = tf.keras.layers.Embedding(vocab_a, 4, name="table_a")(ids)
    b = tf.keras.layers.Embedding(vocab_b, 3, name="table_b")(ids % vocab_b)
    pooled = tf.keras.layers.Concatenate()(
        [
            tf.keras.layers.GlobalAveragePooling1D()(a),
            tf.keras.layers.GlobalAveragePooling1D()(b),
        ]
    )
    hidden = tf.keras.layers.Dense(6, activation="relu")(pooled)
    return tf.keras.Model(ids, tf.keras.layers.Dense(3)(hidden))


def one_process(model_fn, opt_fn, batches, initial=None):
    """The weights of one process after one step per batch (from `initial`
    weights if given)."""
    model = model_fn()
    if initial is not None:
        model.set_weights(initial)
    opt = opt_fn()
    for x, y in batches:
        with tf.GradientTape() as tape:
            loss = mean_loss(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return model.get_weights()


def momentum_or_adam(legacy):
    """Legacy momentum SGD (slots by `get_slot`) or new-family Adam."""
    if legacy:
        return tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9)
    return tf.keras.optimizers.Adam(0.01)


def data(kind, n, seed=0, vocab=50):
    rng = np.random.RandomState(seed)
    if kind == "dense":
        x = rng.randn(n, 4).astype("float32")
    else:
        x = rng.randint(0, vocab, size=(n, 5)).astype("int64")
    y = rng.randint(0, 3, size=(n,)).astype("int64")
    return x, y


LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def tf1_momentum_per_group(model, x, y, rates, momentum, steps):
    """`steps` full-batch steps of `model` (in place) under TF1's
    `MomentumOptimizer`, one per variable group: `rates` maps a substring
    of the variables' names to its group's rate. Returns the optimizers,
    by the same keys (for their slots)."""
    optimizers = {
        key: tf.compat.v1.train.MomentumOptimizer(rate, momentum)
        for key, rate in rates.items()
    }
    variables = model.trainable_variables
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = mean_loss(y, model(x))
        grads = tape.gradient(loss, variables)
        for key, optimizer in optimizers.items():
            optimizer.apply_gradients(
                [(g, v) for g, v in zip(grads, variables) if key in v.name]
            )
    return optimizers


def mean_loss(y, logits):
    """Mean cross-entropy over the batch (usable inside strategy.run)."""
    return tf.reduce_mean(
        tf.keras.losses.sparse_categorical_crossentropy(
            y, logits, from_logits=True
        )
    )


def max_abs_diff(a_weights, b_weights):
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(a_weights, b_weights)
    )


def assert_fit_refused(test, model, error, regex):
    """`model.fit` raises `error` before any step: weights are unchanged."""
    before = model.get_weights()
    x, y = data("dense", 16)
    ds = tf.data.Dataset.from_tensors((x, y)).repeat()
    with test.assertRaisesRegex(error, regex):
        model.fit(ds, epochs=1, steps_per_epoch=2, verbose=0)
    test.assertEqual(max_abs_diff(model.get_weights(), before), 0.0)


class Loop:
    """A custom loop: one replica step per scheduled function.

    `round(batches)` schedules a step per batch, in order, and joins; with
    `delay=True` each step first sleeps its own `delays[i]` seconds after
    reading its tag (in-process clusters only: it runs Python).
    """

    def __init__(self, strategy, model, optimizer, delay=False):
        self.strategy = strategy
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(
            strategy
        )
        variables = model.trainable_variables

        def replica_step(x, y, seconds):
            if delay:
                slept = tf.py_function(
                    lambda s: time.sleep(float(s)) or 0.0,
                    [seconds],
                    tf.float32,
                )
                x = x + tf.cast(slept, x.dtype) * 0
            with tf.GradientTape() as tape:
                loss = mean_loss(y, model(x))
            grads = tape.gradient(loss, variables)
            return optimizer.apply_gradients(zip(grads, variables))

        @tf.function
        def step(x, y, seconds):
            return strategy.run(replica_step, args=(x, y, seconds))

        self.step = step

    def round(self, batches, delays=None):
        delays = delays or [0.0] * len(batches)
        for (x, y), d in zip(batches, delays):
            self.coordinator.schedule(
                self.step, args=(x, y, tf.constant(d, tf.float32))
            )
        self.coordinator.join()


# The README's one-liner, in TF 2.21's default setting (`tf.keras` is
# Keras 3, which cannot load tf_keras's files): nothing of tf2sync loaded.
_PREDICT = """
import os, sys
os.environ.pop("TF_USE_LEGACY_KERAS", None)
import numpy as np
import tf_keras
model = tf_keras.models.load_model(sys.argv[1], compile=False)
x = np.load(sys.argv[2])
np.save(sys.argv[3], model.predict(x, verbose=0))
assert not [m for m in sys.modules if m.startswith("tf2sync")], "tf2sync"
"""


_LOAD_AND_TRAIN = """
import json, os, sys
os.environ["TF_USE_LEGACY_KERAS"] = "1"
import numpy as np
import tensorflow as tf
assert "tf2sync" not in sys.modules
x, y = np.load(sys.argv[2] + "/x.npy"), np.load(sys.argv[2] + "/y.npy")
out = {}
paths = sys.argv[1].split(",")
assert paths[0].endswith(".keras"), paths
for path in paths:
    model = tf.keras.models.load_model(path)  # compiled, with its optimizer
    # A .keras file names tf2sync's module, which Keras imports.
    assert "tf2sync" in sys.modules
    before = model.predict(x, verbose=0)
    model.fit(x, y, batch_size=len(x), epochs=2, verbose=0)
    out[path] = {
        "optimizer": type(model.optimizer).__name__,
        "predict": before.astype("float64").tolist(),
        "iterations": int(model.optimizer.iterations.numpy()),
        "moved": float(np.abs(model.predict(x, verbose=0) - before).max()),
    }
json.dump(out, open(sys.argv[2] + "/out.json", "w"))
"""


def load_and_train_in_plain_process(test, paths, x, y):
    """`load_model(path)` (compiled), `predict(x)`, then 2 steps of `fit` on
    `(x, y)`, in a new process that does not import tf2sync itself.

    `paths[0]` must be a `.keras` file: loading it imports tf2sync (checked),
    which an h5 file or a SavedModel after it needs (as `import tf2sync`
    would: their configs name tf2sync's classes but not its module).

    Returns `{path: {"optimizer": class name, "predict": ..., "iterations":
    after the fit, "moved": max change of the predictions}}`; fails `test`
    with the process's stderr if it exits non-0.
    """
    directory = tempfile.mkdtemp()
    np.save(directory + "/x.npy", x)
    np.save(directory + "/y.npy", y)
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_TRAIN, ",".join(paths), directory],
        capture_output=True,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        timeout=180,
    )
    test.assertEqual(out.returncode, 0, out.stderr[-3000:])
    with open(directory + "/out.json") as f:
        return json.load(f)


_SERVE = """
import sys
import numpy as np
import tensorflow as tf
assert "tf2sync" not in sys.modules
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
(out,) = serve(tf.constant(np.load(sys.argv[2]))).values()
np.save(sys.argv[3], out.numpy())
assert not [m for m in sys.modules if m.startswith("tf2sync")], "tf2sync"
"""


def _on_x_in_new_process(test, script, path, x):
    """Runs `script PATH X.npy OUT.npy` in a new process; returns OUT."""
    directory = tempfile.mkdtemp()
    np.save(directory + "/x.npy", x)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            path,
            directory + "/x.npy",
            directory + "/out.npy",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        timeout=120,
    )
    test.assertEqual(out.returncode, 0, out.stderr[-2000:])
    return np.load(directory + "/out.npy")


def serve_in_plain_process(test, path, x):
    """A SavedModel's `serving_default` signature on `x`, called in a new
    process that imports neither tf2sync nor Keras itself."""
    return _on_x_in_new_process(test, _SERVE, path, x)


def predict_in_plain_process(test, path, x):
    """`load_model(path, compile=False).predict(x)` in a new process that
    never imports tf2sync; fails `test` with its stderr if it exits non-0."""
    return _on_x_in_new_process(test, _PREDICT, path, x)


class FetchRecorded:
    """A scheduled function's `RemoteValue` that notes each fetch
    in `events` (as "fetched")."""

    def __init__(self, value, events):
        self._value = value
        self._events = events

    def fetch(self):
        self._events.append("fetched")
        return self._value.fetch()


def only_save(source_dir, name):
    """A new directory whose one checkpoint is `source_dir`'s `name` (a
    restart after that save)."""
    directory = tempfile.mkdtemp()
    for path in tf.io.gfile.glob(os.path.join(source_dir, name + "*")):
        tf.io.gfile.copy(path, os.path.join(directory, os.path.basename(path)))
    tf.compat.v1.train.update_checkpoint_state(
        directory, os.path.join(directory, name)
    )
    return directory
