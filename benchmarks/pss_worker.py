"""Benchmark subprocess: the chief of a PSS cluster (or `local`, or an
`mwms` worker), serving the harness: `setup(key, system, workload, k,
**options)` builds and warms up a runner and answers its bytes on each ps;
`run(key, functions, window)` times it."""

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
_MWMS = flags.DEFINE_bool(
    "mwms", False, "A MultiWorkerMirroredStrategy worker (its TF_CONFIG set)."
)
_HOLD_TIME = flags.DEFINE_bool(
    "hold_time", False, "Probe how long pushes hold the critical section."
)

# One local step's seconds per workload: every straggler sleeps the same.
_compute_seconds = functools.cache(workloads.compute_seconds)


def _probe(runner):
    """(seconds, holds) of the runner's hold probe by kind, or None."""
    aggregator = getattr(getattr(runner, "opt", None), "_aggregator", None)
    probe = getattr(aggregator, "hold_probe", None)
    if probe is None:
        return None
    return probe.seconds.numpy(), probe.holds.numpy()


class _Server:
    """The runners of this process, by key."""

    def __init__(self, resolver, workers, kind, mwms=None):
        self.resolver = resolver
        self.mwms = mwms
        self.workers = workers
        self.kind = kind
        self.runners = {}

    def setup(self, key, system, workload, k, **options):
        sync = system.startswith("tf2sync")
        answer = {"key": key}
        common = (workload, k, self.kind)
        if system in ("local", "mwms"):
            self.runners[key] = systems.LocalRunner(
                workload, self.workers, k, self.kind, strategy=self.mwms
            )
            return answer
        parts = [options.get(x) for x in ("rta", "total", "shards")]
        strategy = systems.strategy(self.resolver, sync, self.workers, *parts)
        if "_fit" in system:
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
            group = systems.loop_group(system, strategy, k)
            runner = systems.LoopRunner(
                strategy, *common, sync=sync, delay_s=delay_s, group=group
            )
            answer["delay_s"] = delay_s
        self.runners[key] = runner
        state = list(runner.model.variables) + list(runner.opt.variables())
        answer["ps_bytes"] = systems.ps_bytes(state)
        return answer

    def run(self, key, functions, window=False):
        runner = self.runners[key]
        before = _probe(runner)
        out = runner.run(functions, window=window)
        if before is not None:
            after = _probe(runner)
            for i, kind in enumerate(("push", "finalize")):
                out[f"{kind}_holds"] = int(after[1][i] - before[1][i])
                out[f"{kind}_hold_s"] = float(after[0][i] - before[0][i])
        return out


def main(argv):
    del argv
    tf.get_logger().setLevel("ERROR")
    if _HOLD_TIME.value:
        from tf2sync._src.sync import hold_time

        hold_time.enable()
    workers, mwms = _WORKERS.value, None
    if _MWMS.value:
        workers, resolver = 1, None
        mwms = tf.distribute.MultiWorkerMirroredStrategy()
    elif _CLUSTER_SPEC.value:
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
    elif workers:  # an in-process cluster
        resolver = tf2sync.testing.local_cluster(workers, _PS.value)
    else:  # `local` only: a cluster would move its variables off localhost
        workers, resolver = _LOCAL_WORKERS.value, None
    server = _Server(resolver, workers, _OPTIMIZER.value, mwms)
    handlers = {"setup": server.setup, "run": server.run}
    procs.serve(handlers, ready={"workers": workers})


if __name__ == "__main__":
    app.run(main)
