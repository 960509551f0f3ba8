"""Benchmarks: tf2sync against what users would run instead, in one run.

Every system runs on the same machine and cluster shape (2 workers + 1 ps
on 127.0.0.1 unless said otherwise), each in subprocesses that this harness
starts, drives over stdin/stdout and ends by PID. Each system is built and
warmed up once; then the repeats are interleaved, each system after each
other one equally often, so that machine noise hits all systems alike, and
the report gives ratios of medians. The harness imports TensorFlow only
to start its subprocesses (tf2sync's helpers), never to measure.

Systems of the scenario `main`: see `scenarios.SYSTEM_TEXT`. Scenarios:
`main`, `straggler` (scenarios.py),
`memory`, `sharding` (memory.py), `startup` (startup.py); `sharding` (w4,
a 2,000,000 x 32 embedding on 2 ps: ~4 min and ~1.8 GB per ps) and
`startup` (30 fresh processes, ~6 min) are not in the default run.

Before and after (--baseline_tree=PATH, e.g. a git worktree of the
previous commit): every tf2sync system of the main scenario also runs from
PATH, as `<system>@baseline` (PATH/benchmarks/pss_worker.py with
PYTHONPATH=PATH, on a cluster of its own), interleaved in the same rounds
as the current tree's; the report adds "Before and after" (current /
baseline, PASS at >= 0.95 for the median of the rounds' own ratios).

Synchronous systems count aggregated examples only (accepted gradients x
B); asynchronous ones count every applied step. Writes JSON lines, a
Markdown report (targets with PASS / MISS) and, when matplotlib imports, a
PNG plot under --output_dir (default docs/).

  python benchmarks/harness.py          # the full run: ~20 min, 2 cores
  python benchmarks/harness.py --smoke --output_dir=/tmp/b   # ~1 min
  python benchmarks/harness.py --from_jsonl=docs/benchmarks.jsonl
  python benchmarks/harness.py --scenarios=main --workloads=w1 --repeats=3
      --systems=local,tf2sync_loop,tf2sync_fit,pss_async,pss_async_fit
      # the quick tf2sync against stock PSS
  python benchmarks/harness.py --scenarios=startup --output_dir=/tmp/bt
  python benchmarks/harness.py --scenarios=sharding --repeats=3
      --functions=w4:20 --output_dir=/tmp/bs    # w4 alone: ~4 min
  python benchmarks/harness.py --scenarios=main --output_dir=/tmp/ba
      --systems=local,tf2sync_fit,tf2sync_loop,tf1_sync
      --baseline_tree=/tmp/base --clusters=3   # before and after (one
      command line; 3 builds of every process: one build cannot decide 5 %)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import types

import driver
import memory
import procs
import report
import scenarios
import startup
from absl import app
from absl import flags

_HERE = os.path.dirname(os.path.abspath(__file__))
_DOCS = os.path.join(os.path.dirname(_HERE), "docs")
_DEFAULT_FUNCTIONS = {"w1": 60, "w2": 16, "w3": 30, "w4": 30}
_STARTUP_SYSTEMS = startup.SYSTEMS + startup.EXTRA_SYSTEMS
# name: (default, its value under --smoke (None: the same), help). A list
# of numbers becomes ints (floats: `_FLOATS`) in the settings.
_FLAGS = {
    "workloads": (
        list(scenarios.WORKLOADS),
        ["w1"],
        "Workloads of the main scenario (w4 runs in --scenarios=sharding).",
    ),
    "systems": (
        list(driver.DEFAULT_SYSTEMS),
        None,
        f"Systems of the main scenario, of {', '.join(driver.SYSTEMS)}.",
    ),
    "scenarios": (
        list(driver.DEFAULT_SCENARIOS),
        ["main"],
        f"Of {', '.join(driver.SCENARIOS)} (not in the default: sharding, "
        "startup).",
    ),
    "repeats": (5, 1, "Interleaved repeats."),
    "clusters": (
        1,
        None,
        "Main scenario: builds its processes (every system's cluster) this "
        "many times, each after the last is ended, and runs --repeats "
        "interleaved repeats on each; medians span them all. A system keeps "
        "the speed of its build for all repeats on it: use 3 or more for a "
        "before/after within 5 %.",
    ),
    "functions": (
        [],
        None,
        "Timed functions of K steps per run (the work of one run: functions "
        "x K x B examples, whatever the system), per workload (w2:8) or one "
        f"int for all; default {_DEFAULT_FUNCTIONS} (--smoke: 3).",
    ),
    "steps_per_function": (10, 2, "K: steps per function."),
    "straggler_workload": ("w2", "w1", "Workload of the straggler scenario."),
    "straggler_factor": (3.0, None, "Worker 0 sleeps this x its compute."),
    "straggler_functions": (12, 3, "Timed functions per straggler run."),
    "memory_workers": (["1", "2", "3", "4"], ["1", "2"], "Workers (memory)."),
    "memory_repeats": (3, 1, "Runs of each memory cell (state: medians)."),
    "sharding_rows": (2_000_000, 2_000, "Embedding rows of w4 (sharding)."),
    "startup_workloads": (
        ["w1", "digits"],
        ["w1"],
        "Workloads of the startup scenario, of "
        f"{', '.join(startup.WORKLOADS)}.",
    ),
    "startup_systems": (
        list(startup.SYSTEMS),
        None,
        f"Systems of the startup scenario, of {', '.join(_STARTUP_SYSTEMS)}.",
    ),
    "startup_repeats": (3, 1, "Fresh processes per startup cell."),
    "startup_rounds": (
        3,
        1,
        "Steady-state rounds (one function per worker) timed after the "
        "first functions, in each startup run.",
    ),
    "worker_gpus": (
        0,
        None,
        "GPUs each training worker task uses (tf2sync and stock PSS workers, "
        "MultiWorkerMirroredStrategy's): 0 keeps every task on CPU. Workers "
        "share the machine's GPUs (GPU i mod count), with memory growth; "
        "the ps stay on CPU (benchmarks/gpu_check.sh).",
    ),
    "timeout": (300.0, 120.0, "Seconds one command to a subprocess may take."),
    "output_dir": (
        None,
        None,
        "Where benchmarks.md, benchmarks.jsonl and img/benchmarks.png go "
        "(default: docs/; with --smoke: a new temporary directory).",
    ),
    "subprocess_logs": (None, None, "Subprocess logs (default: a temp dir)."),
    "smoke": (
        False,
        None,
        "A few seconds of everything requested: w1, 1 repeat, 3 functions "
        "of 2 steps, scenario main (unless given explicitly).",
    ),
    "from_jsonl": (None, None, "Only rewrite the report from these lines."),
    "baseline_tree": (
        None,
        None,
        "A checkout of the library to compare with (its tf2sync/ and "
        "benchmarks/): each tf2sync system of the main scenario also runs "
        "from it, as <system>@baseline, interleaved with the current tree's.",
    ),
}
_DEFINE = {list: flags.DEFINE_list, bool: flags.DEFINE_bool}
_DEFINE |= {int: flags.DEFINE_integer, float: flags.DEFINE_float}
for _name, (_default, _, _help) in _FLAGS.items():
    _DEFINE.get(type(_default), flags.DEFINE_string)(_name, _default, _help)
flags.DEFINE_enum(
    "optimizer",
    "legacy",
    ["legacy", "keras"],
    "tf_keras momentum SGD family: legacy (fused kernels and lazy sparse "
    "momentum, as TF1's MomentumOptimizer) or keras (dense momentum).",
)
for _name, (_default, _, _) in _FLAGS.items():
    if type(_default) is int:
        lowest = 0 if _name == "worker_gpus" else 1
        flags.register_validator(
            _name,
            lambda v, lowest=lowest: v >= lowest,
            message=f"--{_name} must be {'positive' if lowest else '>= 0'}.",
        )


def _numbers(values, kind):
    try:
        return bool(values) and all(0 < kind(v) < float("inf") for v in values)
    except ValueError:
        return False


for _name in ("memory_workers",):
    flags.register_validator(
        _name,
        lambda v: _numbers(v, int),
        message=f"--{_name} must be a list of positive integers.",
    )


@flags.validator("baseline_tree")
def _baseline_tree_ok(path):
    """A directory with tf2sync/ and benchmarks/pss_worker.py (absl prints
    a `ValidationError` as one line naming the flag and its value)."""
    if path is None:
        return True
    if not os.path.isdir(path):
        raise flags.ValidationError("no such directory.")
    for needed in (
        os.path.join("tf2sync", "__init__.py"),
        driver.BASELINE_WORKER,
    ):
        if not os.path.isfile(os.path.join(path, needed)):
            raise flags.ValidationError(
                f"lacks {needed} (want a checkout of this repository)."
            )
    return True


def _settings():
    """The run's parameters (a namespace), from the flags."""
    values = {}
    for name, (_, smoke_value, _) in _FLAGS.items():
        value = flags.FLAGS[name].value
        if flags.FLAGS.smoke and not flags.FLAGS[name].present:
            value = value if smoke_value is None else smoke_value
        if name.endswith("_workers"):
            value = [int(v) for v in value]
        values[name] = value
    functions = {
        w: 3 if flags.FLAGS.smoke else n for w, n in _DEFAULT_FUNCTIONS.items()
    }
    for item in values.pop("functions"):
        name, _, count = item.rpartition(":")
        if name and name not in functions:
            raise app.UsageError(f"--functions: unknown workload {name!r}.")
        for w in [name] if name else list(functions):
            functions[w] = int(count)
    rows, tree = values["sharding_rows"], values["baseline_tree"]
    values.update(
        functions=functions,
        k=values.pop("steps_per_function"),
        optimizer=flags.FLAGS.optimizer,
        baseline_tree=tree and os.path.abspath(tree),
        # w4, or w4_r<ROWS> with another table size (workloads.py)
        sharding_workload="w4" if rows == 2_000_000 else f"w4_r{rows}",
    )
    return types.SimpleNamespace(**values)


def _check(s):
    for name, allowed in (
        ("workloads", scenarios.WORKLOADS),
        ("systems", driver.SYSTEMS),
        ("scenarios", driver.SCENARIOS),
        ("startup_workloads", startup.WORKLOADS),
        ("startup_systems", _STARTUP_SYSTEMS),
    ):
        unknown = sorted(set(getattr(s, name)) - set(allowed))
        if unknown:
            raise app.UsageError(
                f"--{name}: unknown {unknown}; choose from {list(allowed)}."
            )
    if s.baseline_tree and not (
        "main" in s.scenarios
        and any(x.startswith("tf2sync") for x in s.systems)
    ):
        raise app.UsageError(
            f"--baseline_tree={s.baseline_tree}: compares the main "
            "scenario's tf2sync systems; select --scenarios=main and a "
            "tf2sync_* system."
        )


def _run(bench, s):
    for workload in s.workloads if "main" in s.scenarios else []:
        scenarios.scenario_main(bench, workload)
    for name, run in (
        ("straggler", scenarios.scenario_straggler),
        ("memory", memory.scenario_memory),
        ("sharding", memory.scenario_sharding),
        ("startup", startup.scenario_startup),
    ):
        if name in s.scenarios:
            run(bench)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    s = _settings()
    _check(s)
    output_dir = s.output_dir or _DOCS
    if s.smoke and not s.output_dir:
        output_dir = tempfile.mkdtemp(prefix="tf2sync_bench_")
    os.makedirs(output_dir, exist_ok=True)
    if s.from_jsonl:
        with open(s.from_jsonl) as f:
            records = [json.loads(line) for line in f if line.strip()]
        print("\n".join(report.write(records, output_dir)))
        return
    log_dir = s.subprocess_logs or tempfile.mkdtemp(prefix="tf2sync_logs_")
    os.makedirs(log_dir, exist_ok=True)
    sink = driver.Sink(os.path.join(output_dir, "benchmarks.jsonl"))
    registry = procs.Registry(log_dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    command = " ".join(["python", "benchmarks/harness.py", *sys.argv[1:]])
    config = {"event": "config", "command": command, "log_dir": log_dir}
    sink.write({**config, "machine": report.machine(), **vars(s)})
    start = time.monotonic()
    try:
        _run(driver.Bench(s, registry, sink), s)
    finally:
        registry.stop_all()
        sink.write(
            {
                "event": "processes",
                "started": [c.record() for c in registry.children],
                "alive": registry.alive(),
                "seconds": round(time.monotonic() - start, 1),
            }
        )
        for path in report.write(sink.records, output_dir):
            print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    app.run(main)
