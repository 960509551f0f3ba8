"""Benchmarks: tf2sync against what users would run instead; commands and
how to read the report: docs/benchmarks.md#commands."""

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
# Each scenario's run, in the order run; the first three are the default.
SCENARIOS = {
    "main": lambda bench: [
        scenarios.scenario_main(bench, w) for w in bench.s.workloads
    ],
    "straggler": scenarios.scenario_straggler,
    "memory": memory.scenario_memory,
    "sharding": memory.scenario_sharding,
    "ps_scaling": scenarios.scenario_ps_scaling,
    "startup": startup.scenario_startup,
}
_PS_SYSTEMS = ("tf2sync_loop", "tf2sync_fit", "pss_async_unrolled", "tf1_sync")


def _of(choices):
    return f"Of {', '.join(choices)}."


# name: (default, its value under --smoke (None: the same), help).
_FLAGS = {
    "workloads": (list(scenarios.WORKLOADS), ["w1"], "Of the main scenario."),
    "systems": (list(driver.DEFAULT_SYSTEMS), None, _of(driver.SYSTEMS)),
    "scenarios": (list(SCENARIOS)[:3], ["main"], _of(SCENARIOS)),
    "repeats": (5, 1, "Interleaved repeats."),
    "clusters": (1, None, "Main scenario: process builds, --repeats each."),
    "functions": ([], None, f"Per run: w2:8 or N (of {_DEFAULT_FUNCTIONS})."),
    "steps_per_function": (10, 2, "K: steps per function."),
    "straggler_workload": ("w2", "w1", "Workload of the straggler scenario."),
    "straggler_factor": (3.0, None, "Worker 0 sleeps this x its compute."),
    "straggler_functions": (12, 3, "Timed functions per straggler run."),
    "memory_workers": (["1", "2", "3", "4"], ["1", "2"], "Workers (memory)."),
    "memory_repeats": (3, 1, "Runs of each memory cell (state: medians)."),
    "sharding_rows": (2_000_000, 2_000, "Embedding rows of w4 (sharding)."),
    "ps_counts": (["1", "2", "3", "4"], ["2"], "ps counts (ps_scaling)."),
    "ps_workloads": (["w1", "w3"], ["w1"], "Workloads (ps_scaling)."),
    "ps_systems": (list(_PS_SYSTEMS), None, "Systems (ps_scaling)."),
    "ps_functions": (20, 3, "Timed functions per ps_scaling run."),
    "startup_workloads": (["w1", "digits"], ["w1"], _of(startup.WORKLOADS)),
    "startup_systems": (list(startup.SYSTEMS), None, _of(_STARTUP_SYSTEMS)),
    "startup_repeats": (3, 1, "Fresh processes per startup cell."),
    "startup_rounds": (3, 1, "Steady rounds timed per startup run."),
    "worker_gpus": (0, None, "GPUs per training worker (0: CPU only)."),
    "timeout": (300.0, 120.0, "Seconds one command to a subprocess may take."),
    "output_dir": (None, None, "Default: docs/ (--smoke: a temp dir)."),
    "subprocess_logs": (None, None, "Subprocess logs (default: a temp dir)."),
    "smoke": (False, None, "A few seconds of everything requested."),
    "from_jsonl": (None, None, "Only rewrite the report from these lines."),
    "baseline_tree": (None, None, "A checkout to run as <system>@baseline."),
}
_INTS = ("memory_workers", "ps_counts")
_DEFINE = {list: flags.DEFINE_list, bool: flags.DEFINE_bool}
_DEFINE |= {int: flags.DEFINE_integer, float: flags.DEFINE_float}
for _name, (_default, _, _help) in _FLAGS.items():
    _DEFINE.get(type(_default), flags.DEFINE_string)(_name, _default, _help)
    _low = 0 if _name == "worker_gpus" else 1
    if type(_default) is int:
        _what = "positive" if _low else ">= 0"
        _check = lambda v, low=_low: v >= low  # noqa: E731
    elif _name in _INTS:
        _what = "a list of positive integers"
        _check = lambda v: (
            bool(v) and all(x.isdigit() and int(x) > 0 for x in v)
        )
    else:
        continue
    flags.register_validator(_name, _check, f"--{_name} must be {_what}.")
flags.DEFINE_enum("optimizer", "legacy", ["legacy", "keras"], "Momentum SGD.")


@flags.validator("baseline_tree")
def _baseline_tree_ok(path):
    if path is None:
        return True
    if not os.path.isdir(path):
        raise flags.ValidationError("no such directory.")
    for needed in (
        os.path.join("tf2sync", "__init__.py"),
        driver.BASELINE_WORKER,
    ):
        if not os.path.isfile(os.path.join(path, needed)):
            why = f"lacks {needed} (want a checkout of this repository)."
            raise flags.ValidationError(why)
    return True


def _settings():
    values = {}
    for name, (_, smoke_value, _) in _FLAGS.items():
        value = flags.FLAGS[name].value
        if flags.FLAGS.smoke and not flags.FLAGS[name].present:
            value = value if smoke_value is None else smoke_value
        values[name] = [int(v) for v in value] if name in _INTS else value
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
        ("scenarios", SCENARIOS),
        ("ps_workloads", scenarios.WORKLOADS),
        ("ps_systems", _PS_SYSTEMS),
        ("startup_workloads", startup.WORKLOADS),
        ("startup_systems", _STARTUP_SYSTEMS),
    ):
        unknown = sorted(set(getattr(s, name)) - set(allowed))
        if unknown:
            raise app.UsageError(
                f"--{name}: unknown {unknown}; choose from {list(allowed)}."
            )
    tf2sync_systems = any(x.startswith("tf2sync") for x in s.systems)
    if s.baseline_tree and not ("main" in s.scenarios and tf2sync_systems):
        raise app.UsageError(
            f"--baseline_tree={s.baseline_tree}: compares the main "
            "scenario's tf2sync systems; select --scenarios=main and a "
            "tf2sync_* system."
        )


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
        bench = driver.Bench(s, registry, sink)
        for name, run in SCENARIOS.items():
            if name in s.scenarios:
                run(bench)
    finally:
        registry.stop_all()
        started = [c.record() for c in registry.children]
        done = {"event": "processes", "started": started}
        seconds = round(time.monotonic() - start, 1)
        sink.write({**done, "alive": registry.alive(), "seconds": seconds})
        for path in report.write(sink.records, output_dir):
            print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    app.run(main)
