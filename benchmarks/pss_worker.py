"""Benchmark subprocess: the chief of a PSS cluster, serving the harness.

Runs the systems of the ParameterServerStrategy family (systems.py) on one
cluster: an in-process one on 127.0.0.1 (default), or the ps and worker
tasks the harness started as subprocesses (`--cluster_spec`, so that it can
read the ps's memory). `local` runs in a process of its own, with no
cluster (`--workers=0`): connecting to one moves the default device.
Commands (see `procs.serve`):

* `setup(key, system, workload, k, **options)` builds and warms up a
  runner (options: `rta`, `total` and `delay_factor` for loops; `shards`:
  variables partitioned with `FixedShardsPartitioner(shards)`); it answers the
  bytes of the runner's variables and slots on each ps (`ps_bytes`);
* `run(key, functions, window=False)` times it.

Started by benchmarks/harness.py, not by hand.
"""

from __future__ import annotations

import functools
import json
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import procs  # noqa: E402
import systems  # noqa: E402
import tensorflow as tf  # noqa: E402
import workloads  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import tf2sync  # noqa: E402
from tf2sync._src.launcher import local_tasks  # noqa: E402

_WORKERS = flags.DEFINE_integer(
    "workers", 2, "Worker tasks (0: no cluster, for the `local` system)."
)
_LOCAL_WORKERS = flags.DEFINE_integer(
    "local_workers", 2, "With --workers=0: `local` trains on this many x B."
)
_PS = flags.DEFINE_integer("ps", 1, "ps tasks of the in-process cluster.")
_CLUSTER_SPEC = flags.DEFINE_string(
    "cluster_spec", None, "JSON cluster dict of tasks already started."
)
_OPTIMIZER = flags.DEFINE_enum(
    "optimizer", "legacy", ["legacy", "keras"], "Momentum SGD family."
)


# One local step's seconds, measured once per workload: every straggler
# configuration sleeps the same.
_compute_seconds = functools.cache(workloads.compute_seconds)


class _Server:
    """The runners of this process, by key."""

    def __init__(self, resolver, workers, kind):
        self.resolver = resolver
        self.workers = workers
        self.kind = kind
        self.runners = {}

    def _strategy(self, sync, rta=None, total=None, shards=None):
        partitioner = None
        if shards:
            partitioner = tf.distribute.experimental.partitioners
            partitioner = partitioner.FixedShardsPartitioner(shards)
        if not sync:
            return tf.distribute.experimental.ParameterServerStrategy(
                self.resolver, variable_partitioner=partitioner
            )
        return tf2sync.SyncParameterServerStrategy(
            self.resolver,
            replicas_to_aggregate=rta or self.workers,
            total_num_replicas=total or self.workers,
            **({"variable_partitioner": partitioner} if shards else {}),
        )

    def setup(self, key, system, workload, k, **options):
        """Builds the runner `key` of `system`; see the module docstring."""
        sync = system.startswith("tf2sync")
        answer = {"key": key}
        common = (workload, k, self.kind)
        if system == "local":
            runner = systems.LocalRunner(workload, self.workers, k, self.kind)
        elif "_fit" in system:
            strategy = self._strategy(sync, shards=options.get("shards"))
            keras_loop = system.endswith("_keras_loop")
            runner = systems.FitRunner(
                strategy, *common, sync=sync, keras_loop=keras_loop
            )
        else:
            delay_s = 0.0
            if options.get("delay_factor"):
                compute = _compute_seconds(workload, self.kind)
                delay_s = options["delay_factor"] * compute
                answer["compute_s"] = compute
            strategy = self._strategy(
                sync,
                options.get("rta"),
                options.get("total"),
                options.get("shards"),
            )
            group = None  # a tf.while_loop of single steps
            if system == "tf2sync_loop":  # tf2sync.Trainer's default
                group = strategy.options.max_unrolled_steps
            elif system.endswith("_unrolled"):
                group = k
            runner = systems.LoopRunner(
                strategy, *common, sync=sync, delay_s=delay_s, group=group
            )
            answer["delay_s"] = delay_s
        self.runners[key] = runner
        if getattr(runner, "model", None) is not None and system != "local":
            answer["ps_bytes"] = systems.state_bytes(runner.model, runner.opt)
        return answer

    def run(self, key, functions, window=False):
        return self.runners[key].run(functions, window=window)


def main(argv):
    del argv
    tf.get_logger().setLevel("ERROR")
    workers = _WORKERS.value
    if _CLUSTER_SPEC.value:
        spec = json.loads(_CLUSTER_SPEC.value)
        for address in spec["ps"] + spec["worker"]:
            local_tasks.wait_for_port(address, 120.0)
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(spec),
            task_type="chief",
            task_id=0,
            rpc_layer="grpc",
        )
        workers = len(spec["worker"])
    elif workers:
        resolver = tf2sync.testing.local_cluster(workers, _PS.value)
    else:  # `local` only: a cluster would move its variables off localhost
        workers, resolver = _LOCAL_WORKERS.value, None
    server = _Server(resolver, workers, _OPTIMIZER.value)
    handlers = {"setup": server.setup, "run": server.run}
    procs.serve(handlers, ready={"workers": workers})


if __name__ == "__main__":
    app.run(main)
