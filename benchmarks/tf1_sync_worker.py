"""Benchmark subprocess: TF1's `SyncReplicasOptimizer` in graph mode, one
`MonitoredTrainingSession` per worker thread (docs/benchmarks.md#systems).
Commands (`procs.serve`): `setup(steps)` builds and warms up, `run(steps)`
times `steps` more global steps (N x B examples each)."""

from __future__ import annotations

import os
import threading
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import procs  # noqa: E402
import systems  # noqa: E402
import tensorflow as tf  # noqa: E402
import workloads  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from tf2sync._src import cluster  # noqa: E402

_WORKERS = flags.DEFINE_integer("workers", 2, "Worker tasks.")
_WORKLOAD = flags.DEFINE_string(
    "workload", "w1", f"Model: {', '.join(workloads.WORKLOADS)} or w4_r<ROWS>."
)
_PS = flags.DEFINE_integer("ps", 1, "ps tasks.")
_SHARDS = flags.DEFINE_integer(
    "shards", 1, "Partitions of the embedding (sparse workloads)."
)

v1 = tf.compat.v1


def _start_cluster(num_workers, num_ps=1):
    ports = cluster.pick_free_ports(num_workers + num_ps)
    hosts = [f"{cluster.LOOPBACK}:{p}" for p in ports]
    spec = {"worker": hosts[:num_workers], "ps": hosts[num_workers:]}
    spec = tf.train.ClusterSpec(spec)
    # Fewer inter-op threads than workers + 1 hang on a 2-core machine.
    config = v1.ConfigProto(inter_op_parallelism_threads=num_workers + 2)
    servers = [
        tf.distribute.Server(spec, job_name=job, task_index=i, config=config)
        for job, count in (("worker", num_workers), ("ps", num_ps))
        for i in range(count)
    ]
    return spec, servers[:num_workers], config


class _Replica:
    """One worker's graph, train op and monitored session."""

    def __init__(
        self, spec, index, master, num_workers, workload, config, shards
    ):
        self.graph = tf.Graph()
        with self.graph.as_default():
            setter = v1.train.replica_device_setter(
                worker_device=f"/job:worker/task:{index}", cluster=spec
            )
            with v1.device(setter):
                self.global_step = v1.train.get_or_create_global_step()
                if shards > 1:
                    model = _partitioned_model(workload, shards)
                else:
                    model = workloads.build_model(workload)
                data = workloads.dataset(workload, workloads.batch(workload))
                x, y = v1.data.make_one_shot_iterator(data).get_next()
                loss = workloads.loss_fn(workload)(y, model(x))
                momentum = v1.train.MomentumOptimizer(
                    workloads.LEARNING_RATE, workloads.MOMENTUM
                )
                opt = v1.train.SyncReplicasOptimizer(
                    momentum, num_workers, total_num_replicas=num_workers
                )
                self.train_op = opt.minimize(loss, global_step=self.global_step)
                self.ps_bytes = systems.ps_bytes(v1.global_variables())
                hook = opt.make_session_run_hook(
                    index == 0, num_tokens=num_workers
                )
            self.session = v1.train.MonitoredTrainingSession(
                master=master,
                is_chief=index == 0,
                hooks=[hook],
                config=config,
                stop_grace_period_secs=2,
                save_checkpoint_secs=None,
                save_summaries_steps=None,
                save_summaries_secs=None,
                log_step_count_steps=None,
            )
            self.reader = v1.Session(master, config=config)

    def read_step(self):
        return int(self.reader.run(self.global_step))


def _partitioned_model(workload, shards):
    """The sparse workload with its embedding partitioned in `shards`:
    `(ids) -> predictions`, TF1 style (`get_variable`, a partitioner)."""
    table = v1.get_variable(
        "embedding",
        shape=[workloads.vocab(workload), workloads.EMBED_DIM],
        initializer=v1.random_uniform_initializer(-0.05, 0.05),
        partitioner=v1.fixed_size_partitioner(shards),
    )
    hidden = tf.keras.layers.Dense(64, activation="relu")
    out = tf.keras.layers.Dense(1)

    def model(ids):
        rows = tf.nn.embedding_lookup(table, ids)  # "div", as partitioned
        return out(hidden(tf.reduce_mean(rows, axis=1)))

    return model


class _Server:
    """Worker threads that train while the gate is open: a run opens it
    until the global step rose by `steps` (fixed step counts per worker
    can leave one blocked on a token forever)."""

    def __init__(self, num_workers, workload, num_ps=1, shards=1):
        self.num_ps, self.shards = num_ps, shards
        self.num_workers, self.workload = num_workers, workload
        self.gate, self.done = threading.Event(), threading.Event()
        self.errors, self.target, self.hit = [], None, None

    def setup(self, steps):
        spec, servers, config = _start_cluster(self.num_workers, self.num_ps)
        args = (self.num_workers, self.workload, config, self.shards)
        self.replicas = [  # the chief first: the others wait for its init
            _Replica(spec, i, s.target, *args) for i, s in enumerate(servers)
        ]
        for replica in self.replicas:
            train = threading.Thread(target=self._train, args=(replica,))
            train.daemon = True
            train.start()
        self._until(steps)
        chief = self.replicas[0]
        return {"global_step": chief.read_step(), "ps_bytes": chief.ps_bytes}

    def _train(self, replica):
        try:
            while True:
                self.gate.wait()
                _, step = replica.session.run(
                    [replica.train_op, replica.global_step]
                )
                if step >= self.target and self.gate.is_set():
                    self.gate.clear()
                    self.hit = (time.perf_counter(), int(step))
                    self.done.set()
        except Exception as e:  # noqa: BLE001 - raised by the command
            self.errors.append(e)
            self.done.set()

    def _until(self, steps):
        """Opens the gate until the global step rose by `steps`."""
        before = self.replicas[0].read_step()
        self.target = before + steps
        self.done.clear()
        start = time.perf_counter()
        self.gate.set()
        self.done.wait()
        if self.errors:
            raise self.errors[0]
        end, step = self.hit
        return step - before, end - start

    def run(self, steps):
        applied, seconds = self._until(steps)
        examples = applied * self.num_workers * workloads.batch(self.workload)
        return systems.result(examples, seconds, steps=applied)


def main(argv):
    del argv
    v1.disable_eager_execution()
    tf.get_logger().setLevel("ERROR")
    server = _Server(_WORKERS.value, _WORKLOAD.value, _PS.value, _SHARDS.value)
    procs.serve({"setup": server.setup, "run": server.run})


if __name__ == "__main__":
    app.run(main)
