"""TensorFlow's mnist_replica.py (TF1, one script per task), ported.

The TF1 program (tools/dist_test/python/mnist_replica.py; its shape is in
tests/testdata/migrate/mnist_replica.py) ran in every ps and worker task:
cluster flags, `tf.train.Server`, `replica_device_setter`, a hidden-layer
MLP trained by `SyncReplicasOptimizer(AdamOptimizer)`, a `Supervisor`, the
chief's token op and queue runner, and a `sess.run` loop on each worker.

Here is what is left of it: the model, the data and the optimizer. The
launcher does the rest (docs/migrating.md, "Porting a whole program"):
it starts the ps and worker servers, builds `SyncParameterServerStrategy`
in the chief (the coordinator), builds the model and this optimizer under
its scope, wraps the optimizer in `tf2sync.compat.v1.SyncReplicasOptimizer`
(`--sync_optimizer=tf1_shim`, this job's default, with
`--replicas_to_aggregate` and `--total_num_replicas`) and trains it with
`model.fit`, whose first step starts the chief's part of the protocol.

From the repository's root, a local cluster of 2 workers and 1 ps:

    tf2sync --job_module=examples.tf1_port.job --epochs=2
"""

from __future__ import annotations

import math

import tensorflow as tf
from absl import flags

# The data: scikit-learn's 8x8 digits (offline), as the launcher's default
# job reads them, in place of MNIST's 28x28 (`input_data` downloaded it).
from tf2sync._src.jobs import digits

IMAGE_PIXELS = 8
_HIDDEN_UNITS = flags.DEFINE_integer(
    "hidden_units", 100, "Units of the hidden layer (mnist_replica's flag)."
)

# mnist_replica's defaults for the launcher's flags (the command line wins).
FLAG_DEFAULTS = {
    "sync_optimizer": "tf1_shim",
    "batch_size": 100,
    "learning_rate": 0.01,
}

LOSS = "sparse_categorical_crossentropy"
METRICS = ["accuracy"]

train_dataset = digits.train_dataset
eval_arrays = digits.eval_arrays
num_train_examples = digits.num_train_examples


def build_model() -> tf.keras.Model:
    """hid = relu(x hid_w + hid_b); y = softmax(hid sm_w + sm_b)."""
    units = _HIDDEN_UNITS.value
    return tf.keras.Sequential(
        [
            tf.keras.layers.Dense(
                units,
                activation="relu",
                input_shape=(IMAGE_PIXELS * IMAGE_PIXELS,),
                kernel_initializer=tf.keras.initializers.TruncatedNormal(
                    stddev=1.0 / IMAGE_PIXELS
                ),
                name="hid",
            ),
            tf.keras.layers.Dense(
                10,
                activation="softmax",
                kernel_initializer=tf.keras.initializers.TruncatedNormal(
                    stddev=1.0 / math.sqrt(units)
                ),
                name="sm",
            ),
        ]
    )


def build_optimizer(learning_rate: float, momentum: float):
    """TF1's Adam, as mnist_replica's `opt` before it wrapped it."""
    del momentum  # Adam has none
    return tf.compat.v1.train.AdamOptimizer(learning_rate)
