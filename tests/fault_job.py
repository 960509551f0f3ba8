"""A launcher job for fault tests: every replica sees the same full batch.

Any `replicas_to_aggregate` fresh gradients then average to the full-batch
gradient, so a run that applied U synchronous updates must hold exactly the
weights of U single-process full-batch steps, whatever failed on the way:
an update applied twice, or a stale gradient applied, would move them off.
"""

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


def reference_weights(updates):
    """Weights after `updates` single-process full-batch steps."""
    model = build_model()
    opt = tf.keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
    x, y = arrays()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy()
    for _ in range(updates):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return model.get_weights()
