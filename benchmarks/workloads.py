"""The benchmark workloads (models, synthetic data, losses, optimizers);
docs/benchmarks.md#workloads describes each."""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

WORKLOADS = ("w1", "w2", "w3", "w4")
VOCAB = 100_000
# Embedding rows: w3's; "w3_x4" (the memory scenario's control); w4's.
VOCABS = {"w3": VOCAB, "w3_x4": 4 * VOCAB, "w4": 2_000_000}
BATCH = {"w1": 32, "w2": 64, "digits": 32, "resnet50": 4}
EMBED_DIM = 32
IDS_PER_EXAMPLE = 20
LEARNING_RATE = 0.01
MOMENTUM = 0.9
SEED = 0
RESNET_SHAPE = (64, 64, 3)
SOFTMAX = ("digits", "resnet50")  # models that end in a softmax


def _digits():
    from tf2sync._src.jobs import digits  # needs scikit-learn

    return digits


def vocab(workload: str) -> int | None:
    """Embedding rows of a sparse workload (w3, w3_x4, w4, w4_r<ROWS>)."""
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
            [layers.Dense(64, "relu", input_shape=(32,)), layers.Dense(10)]
        )
    if workload == "w2":
        first = layers.Conv2D(32, 3, activation="relu", input_shape=(32, 32, 3))
        convs = [layers.Conv2D(64, 3, 2, activation="relu") for _ in range(2)]
        pool = layers.GlobalAveragePooling2D()
        return tf.keras.Sequential([first, *convs, pool, layers.Dense(10)])
    if vocab(workload):
        rows = layers.Embedding(
            vocab(workload), EMBED_DIM, input_length=IDS_PER_EXAMPLE
        )
        mean = layers.GlobalAveragePooling1D()
        dense = [layers.Dense(64, activation="relu"), layers.Dense(1)]
        return tf.keras.Sequential([rows, mean, *dense])
    if workload == "digits":
        return _digits().build_model()
    if workload == "resnet50":
        return tf.keras.applications.ResNet50(
            weights=None, input_shape=RESNET_SHAPE, classes=10
        )
    raise ValueError(f"Unknown workload. Received: workload={workload!r}")


def make_data(workload: str, n: int, seed: int = SEED):
    """`n` synthetic (x, y) examples of the workload, as NumPy arrays."""
    rng = np.random.RandomState(seed)
    shape = {"w1": (32,), "w2": (32, 32, 3), "resnet50": RESNET_SHAPE}
    if workload in shape:
        x = rng.randn(n, *shape[workload]).astype("float32")
        return x, rng.randint(0, 10, n)
    x = rng.randint(0, vocab(workload), size=(n, IDS_PER_EXAMPLE))
    return x, rng.randn(n, 1).astype("float32")


def dataset(workload: str, batch: int, seed: int = SEED) -> tf.data.Dataset:
    """8 batches of `batch` examples, repeated forever (digits: its own)."""
    if workload == "digits":
        return _digits().train_dataset(tf.distribute.InputContext(), batch)
    x, y = make_data(workload, batch * 8, seed)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)


def keras_loss(workload: str):
    """The loss for `model.compile`."""
    if vocab(workload):
        return "mse"
    logits = workload not in SOFTMAX
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=logits)


def loss_fn(workload: str):
    """`loss(y, output)`: the mean over the batch (for custom loops)."""
    if vocab(workload):
        return lambda y, p: tf.reduce_mean(tf.square(y - p))
    logits = workload not in SOFTMAX
    return lambda y, p: tf.reduce_mean(
        tf.keras.losses.sparse_categorical_crossentropy(y, p, logits)
    )


def optimizer(kind: str = "legacy"):
    """Momentum SGD: `legacy` (fused kernels, lazy sparse momentum, as TF1's
    MomentumOptimizer) or `keras` (dense momentum)."""
    if kind == "legacy":
        return tf.keras.optimizers.legacy.SGD(LEARNING_RATE, momentum=MOMENTUM)
    if kind == "keras":
        return tf.keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
    raise ValueError(f"Unknown optimizer. Received: optimizer={kind!r}")


def compute_seconds(workload: str, kind: str = "legacy", steps: int = 20):
    """Seconds of one local training step at the per-worker batch (the
    straggler scenario delays one worker by a multiple of this)."""
    model, opt, loss = build_model(workload), optimizer(kind), loss_fn(workload)
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
