"""Benchmark subprocess: one worker of MultiWorkerMirroredStrategy.

What a TF2 user runs instead of parameter servers: synchronous all-reduce
(CPU ring collectives over gRPC), one process per worker, `TF_CONFIG` set
by the harness. The custom loop runs K steps per `tf.function`, global
batch N x B. Every worker gets the same commands at the same time (see
`procs.serve`): `setup(k)` builds the model and warms up, `run(functions)`
times `functions` functions. Started by benchmarks/harness.py.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import procs  # noqa: E402
import systems  # noqa: E402
import tensorflow as tf  # noqa: E402
import workloads  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

_WORKLOAD = flags.DEFINE_enum(
    "workload", "w1", list(workloads.WORKLOADS), "Model."
)
_OPTIMIZER = flags.DEFINE_enum(
    "optimizer", "legacy", ["legacy", "keras"], "Momentum SGD family."
)


class _Server:
    def __init__(self, strategy, workload, kind):
        self.strategy = strategy
        self.workload = workload
        self.kind = kind
        self.batch = workloads.BATCH[workload]
        self.k = None

    def setup(self, k):
        strategy, workload = self.strategy, self.workload
        self.k = k
        replicas = strategy.num_replicas_in_sync
        loss = workloads.loss_fn(workload)
        with strategy.scope():
            model = workloads.build_model(workload)
            opt = systems.make_optimizer(model, self.kind, sync=False)
        batch = self.batch
        data = strategy.distribute_datasets_from_function(
            lambda ctx: workloads.dataset(workload, batch)
        )
        self.iterator = iter(data)

        def replica(batch):
            x, y = batch
            with tf.GradientTape() as tape:
                # The optimizer sums the replicas' gradients: average them.
                value = loss(y, model(x)) / replicas
            grads = tape.gradient(value, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        @tf.function
        def train(iterator):
            for _ in tf.range(k):
                strategy.run(replica, args=(next(iterator),))

        self.train = train
        for _ in range(systems.WARMUP_FUNCTIONS):
            train(self.iterator)
        return {"replicas": replicas}

    def run(self, functions):
        start = time.perf_counter()
        for _ in range(functions):
            self.train(self.iterator)
        seconds = time.perf_counter() - start
        steps = functions * self.k
        examples = steps * self.batch * self.strategy.num_replicas_in_sync
        return systems.result(examples, seconds, steps=steps)


def main(argv):
    del argv
    tf.get_logger().setLevel("ERROR")
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    server = _Server(strategy, _WORKLOAD.value, _OPTIMIZER.value)
    procs.serve({"setup": server.setup, "run": server.run})


if __name__ == "__main__":
    app.run(main)
