"""A TF1 SyncReplicasOptimizer program, ported with tf2sync.compat.v1.

The TF1 original: three variable groups, each trained by its own
`SyncReplicasOptimizer(MomentumOptimizer(lr * k))` with k = 1, 10, 20, one
worker `train_op = tf.group(*train_ops)`, one hook per optimizer. Ported:

* the graph and `MonitoredTrainingSession` become a `tf.function` step
  scheduled on a `ClusterCoordinator`;
* `global_step` goes to group A only; B and C pass `global_step=None` and
  join A's round (TF1 rejected that; see docs/migrating.md): the three
  optimizers form one round, each worker step takes one token after all
  its pushes, and `global_step` rises by 1 per round;
* the hooks go: the coordinator starts the chief's part (seeds the steps,
  enqueues the initial tokens, starts the token watchdog) before the first
  scheduled step runs. TF1's `hook.begin()` / `after_create_session()`
  still work if a codebase keeps them.

Run: python examples/tf1_migration_shim.py [--steps 10] [--json]
"""

import argparse
import json
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf2sync  # noqa: E402
from tf2sync.compat import v1 as compat_v1  # noqa: E402

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
    """Runs `steps` worker steps per worker; returns the final values."""
    resolver = tf2sync.testing.local_cluster(NUM_WORKERS, num_ps=2)
    strategy = tf2sync.SyncParameterServerStrategy(
        resolver, replicas_to_aggregate=NUM_WORKERS
    )
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
        w_a = tf.Variable(tf.zeros([3, 1]), name="w_a")
        w_b = tf.Variable(tf.zeros([1]), name="w_b")
        w_c = tf.Variable(0.0, name="w_c")
        opts = {
            k: compat_v1.SyncReplicasOptimizer(
                tf.compat.v1.train.MomentumOptimizer(LR * s, MOMENTUM),
                replicas_to_aggregate=NUM_WORKERS,
                total_num_replicas=NUM_WORKERS,
                name=f"sync_{k}",
            )
            for k, s in SCALES.items()
        }
    groups = {
        "a": ([w_a], global_step),  # applied first: it owns the round
        "b": ([w_b], None),
        "c": ([w_c], None),
    }

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                pred = x @ w_a + w_b + w_c * x[:, :1]
                loss = tf.reduce_mean(tf.square(pred - y))
            variables = [w_a, w_b, w_c]
            grads = dict(zip("abc", tape.gradient(loss, variables)))
            train_ops = [
                opts[k].apply_gradients(
                    [(grads[k], v) for v in groups[k][0]], groups[k][1]
                )
                for k in "abc"
            ]
            return train_ops  # the new local step (one token), thrice

        return strategy.run(replica, args=(x, y))

    data = shards()
    for _ in range(steps):
        for x, y in data:
            coordinator.schedule(step, args=(x, y))
        coordinator.join()
    return {
        "w_a": w_a.numpy().tolist(),
        "w_b": w_b.numpy().tolist(),
        "w_c": float(w_c.numpy()),
        "global_step": int(global_step.numpy()),
        "rounds": int(opts["a"].rounds.numpy()),
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
