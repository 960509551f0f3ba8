"""Throughput and the commit's hold time over 1 to 4 parameter servers.

For each ps count (`--ps`), one child process runs an in-process cluster
of 2 workers and that many ps on 127.0.0.1 and sets up, for each workload
and placement, tf2sync's custom loop (`Trainer`'s repeated step), tf2sync's
`fit` and stock PSS's unrolled loop; then it times them interleaved
(`--repeats` rounds of `--functions` functions of 10 steps each; medians).
Placements: `rr`, the variables whole, round robin over the ps (PSS's
default); `sharded`, w3's embedding in one shard per ps
(`FixedShardsPartitioner`). tf2sync's aggregators carry the hold-time
probe (`tf2sync._src.sync.hold_time`): the mean seconds a push (one ps:
accumulate and, once per step, apply; several ps: the commit) and a
finalize hold the global step's critical section, inside it, over the
timed runs.

`tf1_sync` (in `--systems` by default) is TF1's `SyncReplicasOptimizer`
in graph mode (`tf1_sync_worker.py`: `replica_device_setter` places its
variables round robin, `fixed_size_partitioner` shards w3's embedding),
on a cluster of its own started after the child's runs at that ps count:
measured the same way (`--repeats` runs of `--functions` x 10 / 2 global
steps), but not interleaved with the others.

On 2 shared cores more ps add no compute: the table shows what the
protocol costs per ps, as ratios (tf2sync / stock and / TF1 at each ps
count, and each system's N-ps / 1-ps rate). Writes JSON lines
(`--output`), a Markdown table on stdout and a plot (`--plot`,
matplotlib).

  python benchmarks/ps_scaling.py --ps=1,2,3,4 --plot=/tmp/ps_scaling.png
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tables  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from tf2sync._src.launcher import processes  # noqa: E402

_PS = flags.DEFINE_list("ps", ["1", "2", "3", "4"], "Ps counts.")
_WORKLOADS = flags.DEFINE_list("workloads", ["w1", "w3"], "Workloads.")
_SYSTEMS = flags.DEFINE_list(
    "systems",
    ["tf2sync_loop", "tf2sync_fit", "pss_async_unrolled", "tf1_sync"],
    "Systems.",
)
_FUNCTIONS = flags.DEFINE_integer("functions", 20, "Functions per run.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Interleaved runs.")
_OUTPUT = flags.DEFINE_string("output", None, "JSON lines written here.")
_PLOT = flags.DEFINE_string("plot", None, "A PNG plot written here.")
_CHILD = flags.DEFINE_integer("child", None, "Internal: run one ps count.")

K = 10  # steps per function
WORKERS = 2


def cells(workloads, ps):
    """(workload, placement) pairs measured at `ps` parameter servers."""
    out = []
    for workload in workloads:
        out.append((workload, "rr"))
        if workload == "w3" and ps > 1:
            out.append((workload, "sharded"))
    return out


def child(ps):
    """Measures every cell at `ps` ps; prints one JSON line per result."""
    import systems
    import tensorflow as tf

    import tf2sync
    from tf2sync._src.sync import hold_time

    hold_time.enable()
    resolver = tf2sync.testing.local_cluster(WORKERS, ps)
    runners = {}
    for workload, placement in cells(_WORKLOADS.value, ps):
        part = None
        if placement == "sharded":
            part = (
                tf.distribute.experimental.partitioners.FixedShardsPartitioner(
                    ps
                )
            )
        for system in _SYSTEMS.value:
            if system == "tf1_sync":  # a process of its own (`tf1_rows`)
                continue
            sync = system.startswith("tf2sync")
            if sync:
                strategy = tf2sync.SyncParameterServerStrategy(
                    resolver,
                    replicas_to_aggregate=WORKERS,
                    total_num_replicas=WORKERS,
                    variable_partitioner=part,
                )
            else:
                strategy = tf.distribute.experimental.ParameterServerStrategy(
                    resolver, variable_partitioner=part
                )
            start = time.perf_counter()
            if system.endswith("fit"):
                runner = systems.FitRunner(
                    strategy, workload, K, "legacy", sync=sync
                )
            else:
                group = strategy.options.max_unrolled_steps if sync else K
                runner = systems.LoopRunner(
                    strategy, workload, K, "legacy", sync=sync, group=group
                )
            setup = time.perf_counter() - start
            runners[(workload, placement, system)] = (runner, setup)
    rates = {key: [] for key in runners}
    holds = {}
    for key, (runner, _) in runners.items():
        holds[key] = [_probe(runner)]
    for rep in range(_REPEATS.value):
        keys = list(runners) if rep % 2 == 0 else list(reversed(runners))
        for key in keys:
            out = runners[key][0].run(_FUNCTIONS.value)
            rates[key].append(out["examples_per_sec"])
    for key, (runner, setup) in runners.items():
        workload, placement, system = key
        row = {
            "ps": ps,
            "workload": workload,
            "placement": placement,
            "system": system,
            "setup_s": round(setup, 2),
            "examples_per_sec": statistics.median(rates[key]),
            "runs": rates[key],
        }
        before, after = holds[key][0], _probe(runner)
        if before is not None:
            for i, kind in enumerate(("push", "finalize")):
                n = int(after[1][i] - before[1][i])
                seconds = float(after[0][i] - before[0][i])
                row[f"{kind}_holds"] = n
                row[f"{kind}_hold_us"] = round(1e6 * seconds / max(n, 1), 1)
        print(json.dumps(row), flush=True)


def tf1_rows(ps):
    """TF1 sync's row for each cell at `ps` ps (graph mode: a process of
    its own per cell, ended by PID)."""
    import procs

    rows = []
    log = os.path.join(tempfile.gettempdir(), "ps_scaling_tf1.log")
    steps = max(1, _FUNCTIONS.value * K // WORKERS)
    for workload, placement in cells(_WORKLOADS.value, ps):
        shards = ps if placement == "sharded" else 1
        argv = [
            sys.executable,
            os.path.join(
                os.path.dirname(os.path.abspath(__file__)), "tf1_sync_worker.py"
            ),
            f"--workers={WORKERS}",
            f"--workload={workload}",
            f"--ps={ps}",
            f"--shards={shards}",
        ]
        child = procs.Child(f"tf1_sync_{workload}_{ps}", argv, log)
        try:
            child.receive(120)  # "ready"
            start = time.perf_counter()
            child.call("setup", 600, steps=steps)
            setup = time.perf_counter() - start
            rates = [
                child.call("run", 600, steps=steps)["examples_per_sec"]
                for _ in range(_REPEATS.value)
            ]
        finally:
            child.stop()
        rows.append(
            {
                "ps": ps,
                "workload": workload,
                "placement": placement,
                "system": "tf1_sync",
                "setup_s": round(setup, 2),
                "examples_per_sec": statistics.median(rates),
                "runs": rates,
            }
        )
    return rows


def _probe(runner):
    """(seconds, holds) arrays of the runner's hold probe, or None."""
    aggregator = getattr(runner.opt, "_aggregator", None)
    probe = getattr(aggregator, "hold_probe", None)
    if probe is None:
        return None
    return probe.seconds.numpy(), probe.holds.numpy()


def table(rows) -> str:
    """The Markdown table: rates, ratios and hold times per cell."""
    by = {
        (r["workload"], r["placement"], r["system"], r["ps"]): r for r in rows
    }

    def versus(rate, other):
        return tables.fmt(
            tables.ratio(rate, (other or {}).get("examples_per_sec")), ".2f"
        ).replace("n/a", "")

    lines = []
    for r in sorted(
        rows,
        key=lambda r: (r["workload"], r["placement"], r["system"], r["ps"]),
    ):
        w, p, s, n = r["workload"], r["placement"], r["system"], r["ps"]
        rate = r["examples_per_sec"]
        lines.append(
            [
                w,
                p,
                s,
                n,
                f"{rate:.0f}",
                versus(rate, by.get((w, p, "pss_async_unrolled", n))),
                versus(rate, by.get((w, p, "tf1_sync", n))),
                versus(rate, by.get((w, "rr", s, 1))),
                r.get("push_hold_us", ""),
                r.get("finalize_hold_us", ""),
                r["setup_s"],
            ]
        )
    header = ["workload", "placement", "system", "ps", "ex/s", "/ stock"]
    header += ["/ TF1", "/ own 1 ps", "push hold us", "finalize hold us"]
    return "\n".join(tables.table(header + ["set-up s"], lines))


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["workload"], r["placement"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    axes = axes if len(keys) > 1 else [axes]
    for ax, (w, p) in zip(axes, keys):
        for system in sorted({r["system"] for r in rows}):
            points = sorted(
                (r["ps"], r["examples_per_sec"])
                for r in rows
                if (r["workload"], r["placement"], r["system"])
                == (w, p, system)
                or (
                    p == "sharded"
                    and r["ps"] == 1
                    and r["system"] == system
                    and r["workload"] == w
                )
            )
            if points:
                ax.plot(*zip(*points), marker="o", label=system)
        ax.set_xticks(sorted({r["ps"] for r in rows}))
        ax.set_title(f"{w} {p}")
        ax.set_xlabel("parameter servers")
        ax.set_ylabel("examples/s")
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv):
    del argv
    if _CHILD.value is not None:
        processes.exit_with_parent()
        child(_CHILD.value)
        return
    rows = []
    passed = [
        f"--workloads={','.join(_WORKLOADS.value)}",
        f"--systems={','.join(_SYSTEMS.value)}",
        f"--functions={_FUNCTIONS.value}",
        f"--repeats={_REPEATS.value}",
    ]
    for ps in [int(p) for p in _PS.value]:
        argv = [sys.executable, os.path.abspath(__file__), f"--child={ps}"]
        proc = subprocess.Popen(
            argv + passed,
            stdout=subprocess.PIPE,
            text=True,
            **processes.child_kwargs(),  # dies with this process
        )
        try:
            for line in proc.stdout:
                if line.startswith("{"):
                    rows.append(json.loads(line))
                    print(line, end="", flush=True)
        finally:
            proc.kill()  # by PID, if it is still running
            proc.wait()
        if "tf1_sync" in _SYSTEMS.value:
            for row in tf1_rows(ps):
                rows.append(row)
                print(json.dumps(row), flush=True)
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(table(rows))
    if _PLOT.value:
        plot(rows, _PLOT.value)


if __name__ == "__main__":
    app.run(main)
