"""The benchmark workloads: models, synthetic data, losses, optimizers.

* w1: MLP 32 -> 64 relu -> 10, batch 32 per worker.
* w2: CNN on 32x32x3 (conv 32, conv 64 stride 2, conv 64 stride 2, global
  average pool, dense 10), batch 64 per worker.
* w3: sparse: Embedding 100,000 x 32 over 20 ids per example, mean,
  dense 64 relu, dense 1 (mean squared error), batch 128 per worker.
* w4: sparse and large: Embedding 2,000,000 x 32 (256 MB of float32, as
  much again in momentum), otherwise w3, batch 128 per worker; run with its
  variables partitioned over 2 ps (the sharding scenario). `w4_r<ROWS>` is
  w4 with ROWS embedding rows (the smoke run's tiny table).

Embedding tables are initialized by a callable (tf_keras's `uniform`, which
takes `partition_shape`): under a partitioner each shard's initial value is
made on its own ps, not sent from the chief as one 256 MB constant.

Data are synthetic with a fixed seed (8 batches, repeated); the optimizer
is momentum SGD (0.01, momentum 0.9).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

WORKLOADS = ("w1", "w2", "w3", "w4")
VOCAB = 100_000
# Embedding rows: w3's; "w3_x4", w3 with a table 4 x as large (the memory
# scenario's control: what grows with the table); w4's.
VOCABS = {"w3": VOCAB, "w3_x4": 4 * VOCAB, "w4": 2_000_000}
BATCH = {"w1": 32, "w2": 64} | {w: 128 for w in VOCABS}
EMBED_DIM = 32
IDS_PER_EXAMPLE = 20
LEARNING_RATE = 0.01
MOMENTUM = 0.9
SEED = 0


def vocab(workload: str) -> int | None:
    """Embedding rows of a sparse workload (w3, w3_x4, w4, w4_r<ROWS>),
    else None."""
    if workload in VOCABS:
        return VOCABS[workload]
    if workload.startswith("w4_r") and workload[4:].isdigit():
        return int(workload[4:])
    return None


def batch(workload: str) -> int:
    """The per-worker batch of `workload`."""
    return 128 if vocab(workload) else BATCH[workload]


def build_model(workload: str) -> tf.keras.Model:
    """The workload's tf_keras model (create it under the strategy scope)."""
    tf.keras.utils.set_random_seed(SEED)
    layers = tf.keras.layers
    if workload == "w1":
        return tf.keras.Sequential(
            [
                layers.Dense(64, activation="relu", input_shape=(32,)),
                layers.Dense(10),
            ]
        )
    if workload == "w2":
        return tf.keras.Sequential(
            [
                layers.Conv2D(
                    32, 3, activation="relu", input_shape=(32, 32, 3)
                ),
                layers.Conv2D(64, 3, 2, activation="relu"),
                layers.Conv2D(64, 3, 2, activation="relu"),
                layers.GlobalAveragePooling2D(),
                layers.Dense(10),
            ]
        )
    if vocab(workload):
        return tf.keras.Sequential(
            [
                layers.Embedding(
                    vocab(workload), EMBED_DIM, input_length=IDS_PER_EXAMPLE
                ),
                layers.GlobalAveragePooling1D(),
                layers.Dense(64, activation="relu"),
                layers.Dense(1),
            ]
        )
    raise ValueError(f"Unknown workload. Received: workload={workload!r}")


def make_data(workload: str, n: int, seed: int = SEED):
    """`n` synthetic (x, y) examples of the workload, as NumPy arrays."""
    rng = np.random.RandomState(seed)
    if workload.startswith("w1"):
        return rng.randn(n, 32).astype("float32"), rng.randint(0, 10, n)
    if workload == "w2":
        x = rng.randn(n, 32, 32, 3).astype("float32")
        return x, rng.randint(0, 10, n)
    x = rng.randint(0, vocab(workload), size=(n, IDS_PER_EXAMPLE))
    return x, rng.randn(n, 1).astype("float32")


def dataset(workload: str, batch: int, seed: int = SEED) -> tf.data.Dataset:
    """8 batches of `batch` examples, repeated forever."""
    x, y = make_data(workload, batch * 8, seed)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)


def loss_fn(workload: str):
    """`loss(y, logits)`: the mean over the batch (for custom loops)."""
    if vocab(workload):
        return lambda y, p: tf.reduce_mean(tf.square(y - p))
    return lambda y, p: tf.reduce_mean(
        tf.keras.losses.sparse_categorical_crossentropy(y, p, from_logits=True)
    )


def keras_loss(workload: str):
    """The loss for `model.compile`."""
    if vocab(workload):
        return "mse"
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def optimizer(kind: str = "legacy"):
    """Momentum SGD: `legacy` (fused kernels, lazy sparse momentum, as TF1's
    MomentumOptimizer) or `keras` (`tf.keras.optimizers.SGD`, whose momentum
    updates the whole embedding every step)."""
    if kind == "legacy":
        return tf.keras.optimizers.legacy.SGD(LEARNING_RATE, momentum=MOMENTUM)
    if kind == "keras":
        return tf.keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
    raise ValueError(f"Unknown optimizer. Received: optimizer={kind!r}")


def compute_seconds(workload: str, kind: str = "legacy", steps: int = 20):
    """Seconds of one local training step at the per-worker batch.

    The straggler scenario delays one worker by a multiple of this.
    """
    model = build_model(workload)
    opt = optimizer(kind)
    loss = loss_fn(workload)
    it = iter(dataset(workload, batch(workload)))

    @tf.function
    def step():
        x, y = next(it)
        with tf.GradientTape() as tape:
            value = loss(y, model(x))
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps
