"""Synchronous training in your own loop on ClusterCoordinator.

The custom-training-loop API is the stock TF2 one, with two changes: the
strategy is `tf2sync.SyncParameterServerStrategy` and the optimizer is wrapped
in `tf2sync.SyncOptimizer`. Each `strategy.run` is one synchronous replica
step (token, tag, gradients, push); put several in one scheduled function to
cut dispatch cost.

Run: python examples/custom_loop.py
"""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf2sync  # noqa: E402

STEPS_PER_FUNCTION = 10


def main(num_functions=20):
    resolver = tf2sync.testing.local_cluster(num_workers=2, num_ps=1)
    strategy = tf2sync.SyncParameterServerStrategy(
        resolver, replicas_to_aggregate=2, total_num_replicas=2
    )
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    rng = np.random.RandomState(0)
    x = rng.randn(512, 8).astype("float32")
    y = (x @ rng.randn(8, 1)).astype("float32")

    tf.keras.utils.set_random_seed(0)
    with strategy.scope():
        model = tf.keras.Sequential(
            [tf.keras.layers.Dense(1, input_shape=(8,))]
        )
        optimizer = tf2sync.SyncOptimizer(
            tf.keras.optimizers.SGD(0.05, momentum=0.9)
        )
        # Create every slot now, eagerly, under the scope.
        optimizer.build(model.trainable_variables)

    initial_loss = float(np.mean((model(x).numpy() - y) ** 2))

    def dataset_fn():
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)

    per_worker_iterator = iter(
        coordinator.create_per_worker_dataset(dataset_fn)
    )

    def replica_step(batch):
        features, labels = batch
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(features) - labels))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_function(iterator):
        loss = tf.constant(0.0)
        for _ in tf.range(STEPS_PER_FUNCTION):
            loss = strategy.run(replica_step, args=(next(iterator),))
        return loss

    for _ in range(num_functions):
        last = coordinator.schedule(train_function, args=(per_worker_iterator,))
    coordinator.join()
    final_loss = float(np.mean((model(x).numpy() - y) ** 2))
    print(
        f"loss={last.fetch():.5f} full_data_loss: {initial_loss:.4f} -> "
        f"{final_loss:.5f} "
        f"sync_steps_applied={int(optimizer.iterations.numpy())} "
        f"stale_gradients_dropped={int(optimizer.stale_dropped.numpy())}"
    )
    return optimizer, initial_loss, final_loss


if __name__ == "__main__":
    main()
    os._exit(0)
