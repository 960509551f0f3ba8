"""Benchmark subprocess: the chief of a PSS cluster, serving the harness.

Runs the systems of the ParameterServerStrategy family (`local`,
`tf2sync_loop`, `tf2sync_fit`, `pss_async`, `pss_async_fit`) on one
cluster: an in-process one on 127.0.0.1 (default), or the ps and worker
tasks the harness started as subprocesses (`--cluster_spec`, so that it can
read the ps's memory). `local` runs in a process of its own, with no
cluster (`--workers=0`): connecting to one moves the default device.
Commands (see `procs.serve`):

* `setup(key, system, workload, k, **options)` builds and warms up a
  runner (options: `rta`, `total` and `delay_factor` for loops; `shards`
  for loops and `fit`: variables partitioned with
  `FixedShardsPartitioner(shards)`; `epochs` and `target` for workload
  `digits`, see accuracy.py); it answers the bytes of the runner's
  variables and slots on each ps (`ps_bytes`);
* `run(key, functions, window=False)` times it;
* `compute(workload)` times one local step at the per-worker batch.

Started by benchmarks/harness.py, not by hand.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import procs  # noqa: E402

procs.die_with_parent()

import accuracy  # noqa: E402
import systems  # noqa: E402
import tensorflow as tf  # noqa: E402
import workloads  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import tf2sync  # noqa: E402

_WORKERS = flags.DEFINE_integer(
    "workers", 2, "Worker tasks (0: no cluster, for the `local` system)."
)
_LOCAL_WORKERS = flags.DEFINE_integer(
    "local_workers", 2, "With --workers=0: `local` trains on this many x B."
)
_PS = flags.DEFINE_integer("ps", 1, "ps tasks of the in-process cluster.")
_CLUSTER_SPEC = flags.DEFINE_string(
    "cluster_spec",
    None,
    "JSON cluster dict (chief, worker, ps) of tasks already started; "
    "default: start an in-process cluster.",
)
_OPTIMIZER = flags.DEFINE_enum(
    "optimizer", "legacy", ["legacy", "keras"], "Momentum SGD family."
)


class _Server:
    """The runners of this process, by key."""

    def __init__(self, resolver, workers, kind):
        self.resolver = resolver
        self.workers = workers
        self.kind = kind
        self.runners = {}
        self.compute_s = {}

    def compute(self, workload):
        if workload not in self.compute_s:
            self.compute_s[workload] = workloads.compute_seconds(
                workload, self.kind
            )
        return {"seconds": self.compute_s[workload]}

    def _strategy(self, sync, rta=None, total=None, shards=None):
        partitioner = None
        if shards:
            partitioner = tf.distribute.experimental.partitioners
            partitioner = partitioner.FixedShardsPartitioner(shards)
        if not sync:
            return tf.distribute.experimental.ParameterServerStrategy(
                self.resolver, variable_partitioner=partitioner
            )
        extra = {"variable_partitioner": partitioner} if shards else {}
        return tf2sync.SyncParameterServerStrategy(
            self.resolver,
            replicas_to_aggregate=rta or self.workers,
            total_num_replicas=total or self.workers,
            **extra,
        )

    def setup(self, key, system, workload, k, **options):
        """Builds the runner `key` of `system`; see the module docstring."""
        sync = system.startswith("tf2sync")
        answer = {"key": key}
        if system == "local":
            runner = systems.LocalRunner(workload, self.workers, k, self.kind)
        elif workload == "digits":
            runner = accuracy.AccuracyRunner(
                lambda: self._strategy(sync),
                sync=sync,
                k=k,
                epochs=options["epochs"],
                target=options["target"],
                learning_rate=options["learning_rate"],
            )
        elif "_fit" in system:
            strategy = self._strategy(sync, shards=options.get("shards"))
            runner = systems.FitRunner(
                strategy,
                workload,
                k,
                self.kind,
                sync=sync,
                keras_loop=system.endswith("_keras_loop"),
            )
        else:
            delay_s = 0.0
            if options.get("delay_factor"):
                compute = self.compute(workload)["seconds"]
                delay_s = options["delay_factor"] * compute
                answer["compute_s"] = compute
            strategy = self._strategy(
                sync,
                options.get("rta"),
                options.get("total"),
                options.get("shards"),
            )
            runner = systems.LoopRunner(
                strategy,
                workload,
                k,
                self.kind,
                sync=sync,
                delay_s=delay_s,
                group=_loop_group(system, k, strategy),
            )
            answer["delay_s"] = delay_s
        self.runners[key] = runner
        model = getattr(runner, "model", None)
        if model is not None and system != "local":
            answer["ps_bytes"] = systems.state_bytes(model, runner.opt)
        return answer

    def run(self, key, functions, window=False):
        return self.runners[key].run(functions, window=window)


def main(argv):
    del argv
    tf.get_logger().setLevel("ERROR")
    if _CLUSTER_SPEC.value:
        spec = json.loads(_CLUSTER_SPEC.value)
        for address in spec["ps"] + spec["worker"]:
            procs.wait_for_port(address, 120.0)
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(spec),
            task_type="chief",
            task_id=0,
            rpc_layer="grpc",
        )
        workers = len(spec["worker"])
    elif _WORKERS.value:
        workers = _WORKERS.value
        resolver = tf2sync.testing.local_cluster(workers, _PS.value)
    else:  # `local` only: a cluster would move its variables off localhost
        workers, resolver = _LOCAL_WORKERS.value, None
    server = _Server(resolver, workers, _OPTIMIZER.value)
    procs.serve(
        {"setup": server.setup, "run": server.run, "compute": server.compute},
        ready={"workers": workers},
    )


def _loop_group(system, k, strategy):
    """`LoopRunner`'s `group` for a loop system (see `sections.SYSTEM_TEXT`)."""
    if system == "tf2sync_loop":  # tf2sync.Trainer's default
        return strategy.options.max_unrolled_steps
    if system.endswith("_unrolled"):
        return k
    return None  # a tf.while_loop of single steps


if __name__ == "__main__":
    app.run(main)
