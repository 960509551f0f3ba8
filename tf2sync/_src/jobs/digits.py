"""The default job: a small conv net on scikit-learn's digits (offline).

1,797 8x8 images, 1,500 for training. A job module gives the launcher these
names; write your own and pass `--job_module=your.module`:

* `build_model() -> tf.keras.Model`, called under the strategy scope;
* `train_dataset(input_context, batch_size) -> tf.data.Dataset`, repeated,
  worker `input_context.input_pipeline_id`'s shard;
* `eval_arrays() -> (x, y)`, held-out NumPy arrays;
* `num_train_examples() -> int`;
* `LOSS` and `METRICS`, passed to `model.compile`;
* optionally `optimizer_groups(learning_rate)`: a list of
  `(description, predicate, learning_rate)` giving each variable group its
  own rate (a `tf2sync.MultiOptimizer` of momentum SGDs), or
  `build_optimizer(learning_rate, momentum)`: the tf_keras optimizer itself
  (see `clicks.py`).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os

import numpy as np
import tensorflow as tf

# The data is scikit-learn's copy (an extra: `tf2sync[examples]`). Refused
# at import, so the launcher names what is missing before any task starts
# rather than the chief failing in its first trace.
if importlib.util.find_spec("sklearn") is None:
    raise ModuleNotFoundError(
        "No module named 'sklearn': the digits job reads scikit-learn's "
        "copy of its data (pip install 'tf2sync[examples]')",
        name="sklearn",
    )

LOSS = "sparse_categorical_crossentropy"
METRICS = ["accuracy"]
_NUM_TRAIN = 1500


@functools.cache
def _arrays():
    """The shuffled images (scaled to [0, 1]) and labels, read-only.

    Read from the file scikit-learn ships (`datasets/data/digits.csv.gz`,
    what `load_digits` reads: 64 pixels and the label per row) without
    importing scikit-learn, whose import (scipy.stats with it) is a large
    part of the chief's start; `load_digits` where the file is not
    there. Cached: each worker's `train_dataset` and `eval_arrays` use it.
    """
    table = _digits_table()
    x = (table[:, :-1] / 16.0).astype("float32")
    y = table[:, -1].astype("int64")
    order = np.random.RandomState(0).permutation(len(x))
    x, y = x[order], y[order]
    x.flags.writeable = y.flags.writeable = False
    return x, y


def _digits_table():
    """scikit-learn's digits as one float64 array of 65 columns."""
    spec = importlib.util.find_spec("sklearn")  # finds, does not import
    for folder in (spec and spec.submodule_search_locations) or ():
        path = os.path.join(folder, "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            with gzip.open(path, "rt") as f:
                return np.loadtxt(f, delimiter=",")
    from sklearn.datasets import load_digits

    digits = load_digits()
    return np.column_stack([digits.data, digits.target])


def build_model() -> tf.keras.Model:
    return tf.keras.Sequential(
        [
            tf.keras.layers.Reshape((8, 8, 1), input_shape=(64,)),
            tf.keras.layers.Conv2D(16, 3, activation="relu", name="conv"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(10, activation="softmax", name="dense"),
        ]
    )


def optimizer_groups(learning_rate: float):
    """The TF1 pattern: conv at lr, dense kernels at 10*lr, biases at 20*lr."""
    return [
        (
            "conv kernels",
            lambda v: "conv" in v.name and "kernel" in v.name,
            learning_rate,
        ),
        (
            "dense kernels",
            lambda v: "dense" in v.name and "kernel" in v.name,
            10 * learning_rate,
        ),
        ("biases", lambda v: "bias" in v.name, 20 * learning_rate),
    ]


def train_dataset(input_context, batch_size: int) -> tf.data.Dataset:
    """Worker `input_pipeline_id`'s shard, reshuffled and read once per pass.

    Under tf2sync the input context names each worker's pipeline (stock
    PSS gives every worker 0 of 1). With the launcher's default epoch (one
    pass, read through `tf2sync.OnePassPerEpoch`), an epoch in which each
    worker pushes its shard's batches has each example in one applied
    gradient (see docs/data.md).
    """
    x, y = _arrays()
    ds = tf.data.Dataset.from_tensor_slices((x[:_NUM_TRAIN], y[:_NUM_TRAIN]))
    ds = ds.shard(
        input_context.num_input_pipelines, input_context.input_pipeline_id
    )
    shard = -(-_NUM_TRAIN // input_context.num_input_pipelines)
    return ds.shuffle(shard).batch(batch_size).repeat()


def train_pass(batch_size: int) -> tf.data.Dataset:
    """One pass over the training examples, shuffled, for tf.data service
    (`--input_sharding=service`: the tf.data workers run it)."""
    x, y = _arrays()
    ds = tf.data.Dataset.from_tensor_slices((x[:_NUM_TRAIN], y[:_NUM_TRAIN]))
    return ds.shuffle(_NUM_TRAIN).batch(batch_size)


def eval_arrays():
    x, y = _arrays()
    return x[_NUM_TRAIN:], y[_NUM_TRAIN:]


def num_train_examples() -> int:
    return _NUM_TRAIN
