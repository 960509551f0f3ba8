"""Benchmarks: tf2sync against what users would run instead, in one run.

Every system runs on the same machine and cluster shape (2 workers + 1 ps
on 127.0.0.1 unless said otherwise), each in subprocesses that this harness
starts, drives over stdin/stdout and ends by PID. Each system is built and
warmed up once; then the repeats are interleaved, each system after each
other one equally often (A B C, B C A, C A B, C B A, ...), so that machine
noise hits all systems alike, and the report gives ratios of medians. The
harness itself never imports TensorFlow.

Systems (scenario `main`):
  local          one process, no distribution, global batch N x B.
  tf2sync_loop   tf2sync custom loop on a ClusterCoordinator, K steps/fn
                 repeated in the graph as tf2sync.Trainer does by default
                 (up to 10 copies per loop iteration).
  tf2sync_loop_while  the same in a tf.while_loop of single steps.
  tf2sync_fit    tf2sync through model.fit, steps_per_execution=K (the
                 steps repeated in each function, tf2sync's default).
  tf2sync_fit_keras_loop  the same in tf_keras's tf.range loop
                 (tf2sync.unroll_fit_steps(model, False)).
  pss_async      stock (asynchronous) PSS custom loop, K steps/fn in a
                 tf.while_loop.
  pss_async_unrolled     the same, the K steps repeated in the graph.
  pss_async_fit  stock PSS through model.fit (not in the default set).
  tf1_sync       TF1 SyncReplicasOptimizer, graph mode, one
                 MonitoredTrainingSession per worker thread.
  mwms           MultiWorkerMirroredStrategy, one process per worker.

Scenarios: `main` (each workload x system), `straggler` (3 workers, worker
0 sleeps 3x its compute time per step: tf2sync with 0 and 1 backup worker
vs stock PSS), `scaling` (tf2sync step cost with 1..4 workers on w1),
`model_size` (tf2sync and stock PSS on w1 with 64..4096 hidden units),
`memory` (RSS of a subprocess ps on w3 with 1..4 workers, and with a
table 4 x as large), `accuracy`
(time to 95 % held-out accuracy on digits, tf2sync vs stock PSS, each at
every rate of --accuracy_learning_rates), and
`sharding`, not in the default run: w4 (embedding 2,000,000 x 32, 256 MB
and as much again in momentum; --sharding_rows) partitioned over 2 ps
(`FixedShardsPartitioner(2)`; TF1: `fixed_size_partitioner(2)`):
tf2sync_fit, tf2sync_loop, pss_async, pss_async_unrolled and tf1_sync side
by side, each ps's state beside its shards' bytes, and tf2sync on w3 in 2
shards on 2 ps against w3 on 1 ps. It adds about 4 min on 2 cores (248 s
measured, 3 repeats of 20 functions) and ~1.8 GB of RSS per ps (every PSS
system's copy of w4 lives on the same 2 ps):
--scenarios=main,...,sharding, or --scenarios=sharding alone. `startup`,
not in the default run either (benchmarks/startup.py): time from the call
of `model.fit` (tf2sync_fit, pss_async_fit), of `tf2sync.Trainer.train`
(tf2sync_trainer) or a custom loop's first `schedule` (tf2sync_loop,
pss_async; tf2sync_loop_while on request) to the
first applied update, split into tracing, function registration and first
execution, and the first steps; each repeat in a fresh process
(--startup_workloads=w1,digits, --startup_repeats=3: 30 processes, about
6 min on 2 cores).

Before and after (--baseline_tree=PATH, e.g. a git worktree of the
previous commit): every tf2sync system of the main scenario also runs from
PATH, as `<system>@baseline` (PATH/benchmarks/pss_worker.py with
PYTHONPATH=PATH, on a cluster of its own), interleaved in the same rounds
as the current tree's; the report adds "Before and after" (current /
baseline, PASS at >= 0.95 for the median of the rounds' own ratios, which
a slower cluster build does not move). Other systems run once, from this
tree.

Synchronous systems count aggregated examples only (accepted gradients x
B); asynchronous ones count every applied step. Writes JSON lines, a
Markdown report (targets with PASS / MISS) and, when matplotlib imports, a
PNG plot under --output_dir (default docs/).

  python benchmarks/harness.py          # the full run: ~8-13 min, 2 cores
  python benchmarks/harness.py --smoke --output_dir=/tmp/b   # ~15 s
  python benchmarks/harness.py --from_jsonl=docs/benchmarks.jsonl
  python benchmarks/harness.py --scenarios=startup --output_dir=/tmp/bt
  python benchmarks/harness.py --scenarios=sharding --repeats=3
      --functions=w4:20 --output_dir=/tmp/bs    # w4 alone: ~4 min
  python benchmarks/harness.py --scenarios=main --output_dir=/tmp/ba
      --systems=local,tf2sync_fit,tf2sync_loop,tf1_sync
      --baseline_tree=/tmp/base --clusters=3   # before and after (one
      command line; 3 builds of every process: one build cannot decide 5 %)
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import tempfile
import time

import driver
import procs
import report
import scenarios
import startup
from absl import app
from absl import flags
from driver import DEFAULT_SCENARIOS
from driver import DEFAULT_SYSTEMS
from driver import SCENARIOS
from driver import SYSTEMS

_HERE = os.path.dirname(os.path.abspath(__file__))
_DOCS = os.path.join(os.path.dirname(_HERE), "docs")

_WORKLOADS = flags.DEFINE_list(
    "workloads",
    ["w1", "w2", "w3"],
    "Workloads of the main scenario (w4 runs in --scenarios=sharding).",
)
_SYSTEMS = flags.DEFINE_list(
    "systems",
    list(DEFAULT_SYSTEMS),
    f"Systems of the main scenario, of {', '.join(SYSTEMS)}.",
)
_SCENARIOS = flags.DEFINE_list(
    "scenarios",
    list(DEFAULT_SCENARIOS),
    f"Of {', '.join(SCENARIOS)} (`sharding` is not in the default).",
)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Interleaved repeats.")
_CLUSTERS = flags.DEFINE_integer(
    "clusters",
    1,
    "Main scenario: builds its processes (every system's cluster) this many "
    "times, each after the last is ended, and runs --repeats interleaved "
    "repeats on each; medians span them all. A system keeps the speed of "
    "its build for all repeats on it (the same two trees measured 0.84 x in "
    "one run and 1.02 x in the next): use 3 or more for a before/after "
    "within 5 %.",
)
_DEFAULT_FUNCTIONS = {"w1": 60, "w2": 16, "w3": 30, "w4": 30}
_WORKLOADS_ALL = ("w1", "w2", "w3")  # of the main scenario
_FUNCTIONS = flags.DEFINE_list(
    "functions",
    [],
    "Timed functions of K steps per run (the work of one run: functions x "
    "K x B examples, whatever the system), per workload (w2:8) or one int "
    f"for all; default {_DEFAULT_FUNCTIONS} (--smoke: 3).",
)
_K = flags.DEFINE_integer("steps_per_function", 10, "K: steps per function.")
_OPTIMIZER = flags.DEFINE_enum(
    "optimizer",
    "legacy",
    ["legacy", "keras"],
    "tf_keras momentum SGD family: legacy (fused kernels and lazy sparse "
    "momentum, as TF1's MomentumOptimizer) or keras (dense momentum).",
)
_STRAGGLER_WORKLOAD = flags.DEFINE_string(
    "straggler_workload", "w2", "Workload of the straggler scenario."
)
_STRAGGLER_FACTOR = flags.DEFINE_float(
    "straggler_factor", 3.0, "Worker 0 sleeps this x its compute per step."
)
_STRAGGLER_FUNCTIONS = flags.DEFINE_integer(
    "straggler_functions", 12, "Timed functions per straggler run."
)
_MODEL_WIDTHS = flags.DEFINE_list(
    "model_widths",
    ["64", "256", "1024", "4096"],
    "Hidden units of w1 (model_size).",
)
_SCALING_WORKERS = flags.DEFINE_list(
    "scaling_workers", ["1", "2", "3", "4"], "Worker counts (scaling)."
)
_MEMORY_WORKERS = flags.DEFINE_list(
    "memory_workers", ["1", "2", "3", "4"], "Worker counts (memory)."
)
_MEMORY_REPEATS = flags.DEFINE_integer(
    "memory_repeats", 3, "Runs of each memory cell (medians of the state)."
)
_ACCURACY_TARGET = flags.DEFINE_float(
    "accuracy_target", 0.95, "Held-out accuracy to reach on digits."
)
_ACCURACY_EPOCHS = flags.DEFINE_integer(
    "accuracy_epochs", 12, "Epochs per time-to-accuracy run."
)
_ACCURACY_LEARNING_RATES = flags.DEFINE_list(
    "accuracy_learning_rates",
    ["0.05", "0.1"],
    "Momentum SGD rates each system trains digits at (accuracy): the "
    "target compares the systems at the first and each at its best.",
)
_SHARDING_ROWS = flags.DEFINE_integer(
    "sharding_rows",
    2_000_000,
    "Embedding rows of w4 (the sharding scenario; --smoke: 2,000).",
)
_STARTUP_WORKLOADS = flags.DEFINE_list(
    "startup_workloads",
    ["w1", "digits"],
    f"Workloads of the startup scenario, of {', '.join(startup.WORKLOADS)}"
    " (--smoke: w1).",
)
_STARTUP_SYSTEMS = flags.DEFINE_list(
    "startup_systems",
    list(startup.SYSTEMS),
    "Systems of the startup scenario, of "
    f"{', '.join(startup.SYSTEMS + startup.EXTRA_SYSTEMS)}.",
)
_STARTUP_REPEATS = flags.DEFINE_integer(
    "startup_repeats",
    3,
    "Fresh processes per startup cell (--smoke: 1).",
)
_WORKER_GPUS = flags.DEFINE_integer(
    "worker_gpus",
    0,
    "GPUs each training worker task uses (tf2sync and stock PSS workers, "
    "MultiWorkerMirroredStrategy's workers): 0, the default, keeps every "
    "task on CPU. Workers share the machine's GPUs (GPU i mod count), with "
    "memory growth; the ps stay on CPU (benchmarks/gpu_check.sh).",
    lower_bound=0,
)
_STARTUP_ROUNDS = flags.DEFINE_integer(
    "startup_rounds",
    3,
    "Steady-state rounds (one function per worker) timed after the first "
    "functions, in each startup run (--smoke: 1).",
)
_TIMEOUT = flags.DEFINE_float(
    "timeout", 300.0, "Seconds one command to a subprocess may take."
)
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir",
    None,
    "Where benchmarks.md, benchmarks.jsonl and img/benchmarks.png go "
    "(default: docs/; with --smoke: a new temporary directory).",
)
_LOG_DIR = flags.DEFINE_string(
    "subprocess_logs",
    None,
    "Subprocess logs (default: a new temporary directory).",
)
_SMOKE = flags.DEFINE_bool(
    "smoke",
    False,
    "A few seconds of everything requested: w1, 1 repeat, 3 functions of "
    "2 steps, scenario main (unless given explicitly).",
)
_FROM_JSONL = flags.DEFINE_string(
    "from_jsonl", None, "Only rewrite the report from these JSON lines."
)
_BASELINE_TREE = flags.DEFINE_string(
    "baseline_tree",
    None,
    "A checkout of the library to compare with (its tf2sync/ and "
    "benchmarks/): each tf2sync system of the main scenario also runs from "
    "it, as <system>@baseline, interleaved with the current tree's.",
)


for _name in (
    "repeats",
    "clusters",
    "steps_per_function",
    "straggler_functions",
    "memory_repeats",
    "sharding_rows",
    "startup_repeats",
    "startup_rounds",
):
    flags.register_validator(
        _name, lambda v: v > 0, message=f"--{_name} must be positive."
    )


def _positive_ints(values) -> bool:
    return all(v.strip().isdigit() and int(v) > 0 for v in values)


def _positive_numbers(values) -> bool:
    try:
        return bool(values) and all(0 < float(v) < float("inf") for v in values)
    except ValueError:
        return False


flags.register_validator(
    "accuracy_learning_rates",
    _positive_numbers,
    message="--accuracy_learning_rates must be a list of positive numbers.",
)

for _name in ("scaling_workers", "model_widths", "memory_workers"):
    flags.register_validator(
        _name,
        _positive_ints,
        message=f"--{_name} must be a list of positive integers.",
    )


def _baseline_tree_ok(path) -> bool:
    """--baseline_tree: a directory with tf2sync/ and benchmarks/pss_worker.py
    (raises `flags.ValidationError`, which absl prints as one line naming
    the flag and its value)."""
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


flags.register_validator("baseline_tree", _baseline_tree_ok)


@dataclasses.dataclass
class Settings:
    """The run's parameters, from the flags."""

    workloads: list
    systems: list
    scenarios: list
    repeats: int
    functions: dict
    k: int
    optimizer: str
    timeout: float
    straggler_workload: str
    straggler_factor: float
    straggler_functions: int
    scaling_workers: list
    model_widths: list
    memory_workers: list
    memory_repeats: int
    accuracy_target: float
    accuracy_epochs: int
    accuracy_learning_rates: list = dataclasses.field(
        default_factory=lambda: [0.05]
    )
    sharding_rows: int = 2_000_000
    baseline_tree: str | None = None
    startup_workloads: list = dataclasses.field(
        default_factory=lambda: ["w1", "digits"]
    )
    startup_systems: list = dataclasses.field(
        default_factory=lambda: list(startup.SYSTEMS)
    )
    startup_repeats: int = 3
    startup_rounds: int = 3
    worker_gpus: int = 0
    clusters: int = 1

    @property
    def sharding_workload(self) -> str:
        """w4, or w4_r<ROWS> with another table size (workloads.py)."""
        rows = self.sharding_rows
        return "w4" if rows == 2_000_000 else f"w4_r{rows}"


def _settings() -> Settings:
    smoke = _SMOKE.value

    def given(holder, smoke_value):
        if smoke and not flags.FLAGS[holder.name].present:
            return smoke_value
        return holder.value

    functions = {
        w: 3 if smoke else count for w, count in _DEFAULT_FUNCTIONS.items()
    }
    for item in _FUNCTIONS.value:
        name, _, count = item.rpartition(":")
        if name and name not in functions:
            raise app.UsageError(f"--functions: unknown workload {name!r}.")
        for w in [name] if name else list(functions):
            functions[w] = int(count)
    return Settings(
        workloads=given(_WORKLOADS, ["w1"]),
        systems=_SYSTEMS.value,
        scenarios=given(_SCENARIOS, ["main"]),
        repeats=given(_REPEATS, 1),
        functions=functions,
        k=given(_K, 2),
        optimizer=_OPTIMIZER.value,
        timeout=given(_TIMEOUT, 120.0),
        straggler_workload=given(_STRAGGLER_WORKLOAD, "w1"),
        straggler_factor=_STRAGGLER_FACTOR.value,
        straggler_functions=given(_STRAGGLER_FUNCTIONS, 3),
        scaling_workers=[int(n) for n in given(_SCALING_WORKERS, ["1", "2"])],
        model_widths=[int(n) for n in given(_MODEL_WIDTHS, ["64", "256"])],
        memory_workers=[int(n) for n in given(_MEMORY_WORKERS, ["1", "2"])],
        memory_repeats=given(_MEMORY_REPEATS, 1),
        accuracy_target=_ACCURACY_TARGET.value,
        accuracy_epochs=given(_ACCURACY_EPOCHS, 2),
        accuracy_learning_rates=[
            float(v) for v in _ACCURACY_LEARNING_RATES.value
        ],
        sharding_rows=given(_SHARDING_ROWS, 2_000),
        baseline_tree=_BASELINE_TREE.value
        and os.path.abspath(_BASELINE_TREE.value),
        startup_workloads=given(_STARTUP_WORKLOADS, ["w1"]),
        startup_systems=_STARTUP_SYSTEMS.value,
        startup_repeats=given(_STARTUP_REPEATS, 1),
        startup_rounds=given(_STARTUP_ROUNDS, 1),
        worker_gpus=_WORKER_GPUS.value,
        clusters=_CLUSTERS.value,
    )


def _check(settings):
    for name, values, allowed in (
        ("workloads", settings.workloads, _WORKLOADS_ALL),
        ("systems", settings.systems, SYSTEMS),
        ("scenarios", settings.scenarios, SCENARIOS),
        ("startup_workloads", settings.startup_workloads, startup.WORKLOADS),
        (
            "startup_systems",
            settings.startup_systems,
            startup.SYSTEMS + startup.EXTRA_SYSTEMS,
        ),
    ):
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise app.UsageError(
                f"--{name}: unknown {unknown}; choose from {list(allowed)}."
            )
    if settings.baseline_tree and not (
        "main" in settings.scenarios
        and any(x.startswith("tf2sync") for x in settings.systems)
    ):
        raise app.UsageError(
            f"--baseline_tree={settings.baseline_tree}: compares the main "
            "scenario's tf2sync systems; select --scenarios=main and a "
            "tf2sync_* system."
        )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    settings = _settings()
    _check(settings)
    if _SMOKE.value and not _OUTPUT_DIR.value:
        output_dir = tempfile.mkdtemp(prefix="tf2sync_bench_")
    else:
        output_dir = _OUTPUT_DIR.value or _DOCS
    os.makedirs(output_dir, exist_ok=True)
    if _FROM_JSONL.value:
        with open(_FROM_JSONL.value) as f:
            records = [json.loads(line) for line in f if line.strip()]
        print("\n".join(report.write(records, output_dir)))
        return
    log_dir = _LOG_DIR.value or tempfile.mkdtemp(prefix="tf2sync_bench_logs_")
    os.makedirs(log_dir, exist_ok=True)
    sink = driver.Sink(os.path.join(output_dir, "benchmarks.jsonl"))
    registry = procs.Registry(log_dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sink.write(
        {
            "event": "config",
            "command": " ".join(
                ["python", "benchmarks/harness.py", *sys.argv[1:]]
            ),
            "smoke": _SMOKE.value,
            "log_dir": log_dir,
            "machine": report.machine(),
            **dataclasses.asdict(settings),
        }
    )
    start = time.monotonic()
    bench = driver.Bench(settings, registry, sink)
    try:
        if "main" in settings.scenarios:
            for workload in settings.workloads:
                scenarios.scenario_main(bench, workload)
        if "straggler" in settings.scenarios:
            scenarios.scenario_straggler(bench)
        if "scaling" in settings.scenarios:
            scenarios.scenario_scaling(bench)
        if "model_size" in settings.scenarios:
            scenarios.scenario_model_size(bench)
        if "memory" in settings.scenarios:
            scenarios.scenario_memory(bench)
        if "accuracy" in settings.scenarios:
            scenarios.scenario_accuracy(bench)
        if "sharding" in settings.scenarios:
            scenarios.scenario_sharding(bench)
        if "startup" in settings.scenarios:
            startup.scenario_startup(bench)
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
