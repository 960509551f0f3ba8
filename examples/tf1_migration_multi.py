"""The TF1 three-optimizer program, rewritten with tf2sync's own API.

The same model, data and numbers as examples/tf1_migration_shim.py (three
variable groups trained by Momentum at lr, 10*lr and 20*lr, averaged over
the workers every step), but without the compat shim:

* `tf2sync.SyncParameterServerStrategy` replaces the servers and
  `replica_device_setter`;
* one `tf2sync.SyncOptimizer(tf2sync.MultiOptimizer(groups=...))` replaces
  the three `SyncReplicasOptimizer`s, their hooks and `tf.group`: the
  gradients are averaged once per synchronous step, each group applies its
  share, and `optimizer.iterations` (the global step) rises by 1 per step;
* a custom loop on a `ClusterCoordinator` replaces `MonitoredTrainingSession`.
  There is no wasted step after start.

Run: python examples/tf1_migration_multi.py [--steps 10] [--json]
"""

import argparse
import json
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf2sync  # noqa: E402

NUM_WORKERS = 2
LR = 0.005
MOMENTUM = 0.9
SCALES = {"a": 1.0, "b": 10.0, "c": 20.0}


def shards(seed=0, n=8):
    """Each worker's fixed batch `(x [n, 3], y [n, 1])`, float32."""
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(NUM_WORKERS):
        x = rng.randn(n, 3).astype("float32")
        y = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3).astype("float32")
        out.append((x, y))
    return out


def train(steps):
    """Runs `steps` synchronous steps; returns the final values."""
    resolver = tf2sync.testing.local_cluster(NUM_WORKERS, num_ps=2)
    strategy = tf2sync.SyncParameterServerStrategy(
        resolver, replicas_to_aggregate=NUM_WORKERS
    )
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        w_a = tf.Variable(tf.zeros([3, 1]), name="w_a")
        w_b = tf.Variable(tf.zeros([1]), name="w_b")
        w_c = tf.Variable(0.0, name="w_c")
        variables = [w_a, w_b, w_c]
        optimizer = tf2sync.SyncOptimizer(
            tf2sync.MultiOptimizer(
                groups={
                    f"^w_{k}": tf.keras.optimizers.SGD(
                        LR * s, momentum=MOMENTUM
                    )
                    for k, s in SCALES.items()
                }
            )
        )
        optimizer.build(variables)

    def replica(x, y):
        with tf.GradientTape() as tape:
            pred = x @ w_a + w_b + w_c * x[:, :1]
            loss = tf.reduce_mean(tf.square(pred - y))
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))

    @tf.function
    def step(x, y):
        strategy.run(replica, args=(x, y))

    data = shards()
    for _ in range(steps):
        for x, y in data:  # one replica step per worker: one sync step
            coordinator.schedule(step, args=(x, y))
        coordinator.join()
    return {
        "w_a": w_a.numpy().tolist(),
        "w_b": w_b.numpy().tolist(),
        "w_c": float(w_c.numpy()),
        "global_step": int(optimizer.iterations.numpy()),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = train(args.steps)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    # In-process servers cannot be stopped: leave without waiting for them.
    os._exit(0)


if __name__ == "__main__":
    main()
