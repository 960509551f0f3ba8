"""Chaos run: faults injected at random times inside epochs, tabulated
(docs/benchmarks.md#faults says what each fault and column is).

  python benchmarks/chaos.py --repeats=3 --output=docs/faults.md
  python benchmarks/chaos.py --faults=worker_freeze --results=/tmp/c.json
  python benchmarks/chaos.py --short     # the CI version, ~1 min
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "tests"))
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import fault_job  # noqa: E402
import numpy as np  # noqa: E402
import procutil  # noqa: E402
import tables  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from tf2sync._src import cluster as cluster_lib  # noqa: E402

median = tables.median
_running = procutil.running

_RESTARTED = "SIGKILL, restarted {delay:g} s later"
FAULTS = {
    "none": "no fault (baseline)",
    "worker_kill": f"worker {_RESTARTED}, no backup (2 of 2)",
    "worker_kill_backup": f"worker {_RESTARTED}, 1 backup (2 of 3)",
    "ps_kill": f"ps {_RESTARTED}",
    "chief_kill": f"chief {_RESTARTED}",
    "worker_freeze": "worker SIGSTOP for {freeze:g} s, then SIGCONT (2 of 2)",
    "combined": "the four above in one run, one per epoch, the SIGSTOP "
    "({freeze:g} s) last",
    "launcher_kill": "launcher (local mode) SIGKILL",
}
_COMBINED = ["worker_kill", "ps_kill", "chief_kill", "worker_freeze"]
_SHORT_FAULTS = ["worker_kill", "launcher_kill"]

# name: (default, its --short value (None: the same), help).
_FLAGS = {
    "repeats": (3, 1, "Runs per fault."),
    "faults": (list(FAULTS), _SHORT_FAULTS, f"Of {', '.join(FAULTS)}."),
    "epochs": (3, 2, "Epochs per run."),
    "steps_per_epoch": (3000, 200, "Pushes per epoch (3000: ~7 s on 2 cores)."),
    "steps_per_execution": (10, None, "Steps per scheduled function."),
    "num_ps": (1, None, "ps tasks (fault_job's variables round robin)."),
    "freeze_seconds": (240.0, None, "How long worker_freeze stops a worker."),
    "restart_delay": (5.0, None, "Seconds before a killed task restarts."),
    "worker_timeout": (10.0, None, "The chief's --worker_timeout."),
    "checkpoint_every_s": (0.0, None, "The chief's (0: saves at epoch ends)."),
    "checkpoint_in_background": (False, None, "The chief's flag of that name."),
    "token_timeout": (-1.0, None, "The chief's --token_timeout (-1: its own)."),
    "run_timeout": (900.0, None, "Seconds before a run is abandoned."),
    "keep": (False, None, "Keep each run's directory."),
}
_DEFINE = {int: flags.DEFINE_integer, float: flags.DEFINE_float}
_DEFINE |= {list: flags.DEFINE_list, bool: flags.DEFINE_bool}
for _name, (_default, _, _help) in _FLAGS.items():
    _DEFINE[type(_default)](_name, _default, _help)
_SEED = flags.DEFINE_integer("seed", None, "RNG seed (default: random).")
_RESULTS = flags.DEFINE_string(
    "results",
    None,
    "JSON file of runs: those in it kept, this invocation's added, the "
    "table made from all (one table from several shorter invocations).",
)
_OUTPUT = flags.DEFINE_string("output", None, "Also write the table here.")
_SHORT = flags.DEFINE_boolean(
    "short", False, "The CI version (the values in `_FLAGS`; given flags win)."
)

_APPLIED = re.compile(r"sync_steps_applied=(\d+)")
_PIDS = re.compile(r"local task pids=\[([\d, ]*)\]")
# Averages of identical gradients are exact: a clean run matches its
# reference bit for bit, while one update more moves a weight by 5e-5.
_TOLERANCE = 1e-6


@dataclasses.dataclass
class Outcome:
    """What one run did (one row of the JSON results)."""

    fault: str
    completed: bool = False
    planned: int = 0
    applied: int | None = None
    off_trajectory: bool | None = None
    weight_diff: float | None = None
    stalls: list = dataclasses.field(default_factory=list)
    redone: int = 0
    redone_s: float = 0.0
    left_behind: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    seed: int = 0
    settings: dict = dataclasses.field(default_factory=dict)
    note: str = ""


class Progress:
    """Reads the chief's progress file (see `fault_job.Progress`)."""

    def __init__(self, path):
        self.path = path
        self.lines = []  # (time, "begin" | "end" | step)
        self._offset = 0

    def poll(self):
        try:
            with open(self.path) as f:
                f.seek(self._offset)
                text = f.read()
        except FileNotFoundError:
            return
        cut = text.rfind("\n") + 1
        self._offset += len(text[:cut].encode())
        for line in text[:cut].splitlines():
            t, value = line.split()[:2]
            known = value in ("begin", "end")
            self.lines.append((float(t), value if known else int(value)))

    def step(self):
        for _, value in reversed(self.lines):
            if isinstance(value, int):
                return value
        return -1

    def updates(self):
        """Times at which the step went up; the updates rolled back; and
        the seconds of training they had taken (from when the step first
        reached the restored value to when it first reached the top)."""
        times, previous, top, redone, seconds = [], None, 0, 0, 0.0
        first = []  # (time, step) when each new top was first seen
        for t, value in self.lines:
            if value == "begin":
                previous = None
            elif isinstance(value, int):
                if previous is None and value < top:
                    redone += top - value
                    since = next(t0 for t0, v in first if v >= value)
                    seconds += first[-1][0] - since
                elif previous is not None and value > previous:
                    times.append(t)
                if value > top or not first:
                    first.append((t, value))
                previous = value
                top = max(top, value)
        return times, redone, round(seconds, 1)


def _stall(update_times, start, end):
    """Longest pause without an update from `start` to `end`."""
    points = [start, *[t for t in update_times if start < t <= end], end]
    return max(b - a for a, b in zip(points, points[1:]))


@functools.cache
def _reference(updates):
    return fault_job.reference_weights(updates, compiled=True)


def _off_trajectory(final_npz):
    """`(updates, largest weight difference to their reference)`."""
    with np.load(final_npz) as data:
        step = int(data["step"])
        weights = [data[f"w{i}"] for i in range(len(data.files) - 1)]
    expected = _reference(step)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, expected))
    return step, diff


class Run:
    """One training run: its directory, the progress its chief writes, the
    `python -m tf2sync` processes it started (`close` ends them by PID)."""

    def __init__(self, settings, epochs):
        self.settings = settings
        self.epochs = epochs
        self.dir = tempfile.mkdtemp(prefix="tf2sync-chaos-")
        self.progress = Progress(os.path.join(self.dir, "progress"))
        self.env = dict(procutil.ENV, TF2SYNC_PROGRESS_FILE=self.progress.path)
        self.started = []
        self.tasks = None  # a cluster of task processes, if any

    def start(self, name, *args):
        """Starts fault_job's chief or launcher; its output in `name`.out."""
        s = self.settings
        args = [
            *args,
            "--job_module=fault_job",
            f"--epochs={self.epochs}",
            f"--steps_per_epoch={s['steps_per_epoch']}",
            f"--steps_per_execution={s['steps_per_execution']}",
            f"--learning_rate={fault_job.LEARNING_RATE}",
            f"--momentum={fault_job.MOMENTUM}",
        ]
        path = os.path.join(self.dir, name)
        with open(path + ".out", "w") as out, open(path + ".err", "w") as err:
            self.started.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tf2sync", *args],
                    stdout=out,
                    stderr=err,
                    **procutil.child_kwargs(self.env),
                )
            )
        return self.started[-1]

    def output(self, name):
        with open(os.path.join(self.dir, f"{name}.out")) as f:
            return f.read()

    def wait_step(self, target, deadline):
        """Waits until the step reaches `target`; False if the process
        started last ended (or the deadline passed) first."""
        while time.monotonic() < deadline:
            self.progress.poll()
            if self.progress.step() >= target:
                return True
            if self.started[-1].poll() is not None:
                return False
            time.sleep(0.02)
        return False

    def close(self, keep_logs, pids=()):
        """Ends every process (and `pids`) by PID; returns those still
        running."""
        for process in self.started:
            procutil.kill(process)
        procutil.kill_pids(_tf2sync_pids(pids))
        with contextlib.suppress(AssertionError):
            procutil.wait_gone(pids, 30)
        pids = [*pids, *[p.pid for p in self.started]]
        if self.tasks:
            pids = self.tasks.stop() + pids
            time.sleep(0.5)
        left = [p for p in pids if _running(p)]
        if not (self.settings["keep"] or keep_logs or left):
            shutil.rmtree(self.dir, ignore_errors=True)
        return left


class ClusterRun(Run):
    """A chief started by the harness, on ps and worker tasks it started."""

    def __init__(self, settings, num_workers, rta, epochs):
        super().__init__(settings, epochs)
        self.num_workers = num_workers
        self.rta = rta
        num_ps = settings["num_ps"]
        self.spec = cluster_lib.cluster_spec_dict(num_workers, num_ps)
        self.tasks = procutil.Tasks(self.spec)

    def start_chief(self):
        s = self.settings
        args = ["--job_name=chief", *procutil.host_flags(self.spec)]
        args += [f"--checkpoint_dir={os.path.join(self.dir, 'ckpt')}"]
        args += ["--ps_restart_timeout=120"]
        if self.rta:
            args += [f"--replicas_to_aggregate={self.rta}"]
            args += [f"--total_num_replicas={self.num_workers}"]
        for name in ("token_timeout", "worker_timeout"):
            if s[name] is not None:
                args.append(f"--{name}={s[name]:g}")
        if s.get("checkpoint_every_s"):
            args.append(f"--checkpoint_every_s={s['checkpoint_every_s']:g}")
        if s.get("checkpoint_in_background"):
            args.append("--checkpoint_in_background")
        self.start(f"chief{len(self.started)}", *args)

    @property
    def chief(self):
        return self.started[-1]


def _inject(kind, run, rng, settings):
    """Injects one fault of `kind`; returns once the harness's part is done."""
    delay = settings["restart_delay"]
    index = rng.randrange(run.num_workers)
    if kind == "ps_kill":
        num_ps = settings["num_ps"]
        index = rng.randrange(num_ps) if num_ps > 1 else 0
        print(f"  ps {index} of {num_ps}", flush=True)
    if kind in ("worker_kill", "ps_kill"):
        job = kind.removesuffix("_kill")
        run.tasks.kill(job, index)
        time.sleep(delay)
        run.tasks.restart(job, index)
    elif kind == "worker_freeze":
        process = run.tasks.processes[("worker", index)]
        process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(settings["freeze_seconds"])
        finally:
            process.send_signal(signal.SIGCONT)
    elif kind == "chief_kill":
        procutil.kill(run.chief)
        time.sleep(delay)
        run.start_chief()
    elif kind != "none":
        raise ValueError(kind)


def _target(rng, epoch, per_epoch):
    """A random global step inside `epoch` (1-based)."""
    inside = max(1, round(rng.uniform(0.1, 0.9) * per_epoch))
    return (epoch - 1) * per_epoch + inside


def _cluster_run(fault, settings, rng):
    if fault == "combined":
        # The freeze last: once the frozen worker is declared failed, the
        # others may finish the run before it thaws.
        kinds = rng.sample(_COMBINED[:-1], len(_COMBINED) - 1)
        kinds.append("worker_freeze")
    else:
        kinds = [fault.removesuffix("_backup")]
    workers, rta = (3, 2) if fault == "worker_kill_backup" else (2, None)
    epochs = settings["epochs"]
    if fault == "combined":
        epochs = max(epochs, len(kinds) + 1)
        at = list(range(2, len(kinds) + 2))
    else:
        at = [rng.randint(1, epochs)]
    pushes = settings["steps_per_epoch"]
    outcome = Outcome(fault, planned=epochs * pushes // (rta or workers))
    # Updates an epoch makes: with a backup, one push in 3 is surplus.
    per_epoch = pushes // workers
    started = time.monotonic()
    deadline = started + settings["run_timeout"]
    run = ClusterRun(settings, workers, rta, epochs)
    injected = []
    try:
        run.start_chief()
        for kind, epoch in zip(kinds, at):
            target = _target(rng, epoch, per_epoch)
            if not run.wait_step(target, deadline):
                outcome.note += f"{kind} not injected (step {target}); "
                break
            if run.progress.step() >= epochs * per_epoch:
                outcome.note += f"{kind} not injected (training done); "
                break
            injected.append(time.time())
            step = run.progress.step()
            print(f"  {kind} at step {step} (epoch {epoch})", flush=True)
            _inject(kind, run, rng, settings)
        while run.chief.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        run.progress.poll()
        applied = _APPLIED.search(run.output(f"chief{len(run.started) - 1}"))
        final = run.progress.path + ".final.npz"
        code = run.chief.poll()
        outcome.completed = (
            code == 0 and bool(applied) and os.path.exists(final)
        )
        if code is None:
            outcome.note += "the chief did not end in time; "
        elif not outcome.completed:
            outcome.note += f"the chief exited {code}; "
        if outcome.completed:
            outcome.applied, outcome.weight_diff = _off_trajectory(final)
            outcome.off_trajectory = outcome.weight_diff > _TOLERANCE
            printed = int(applied.group(1))
            if printed != outcome.applied:
                outcome.note += f"printed {printed} applied; "
        times, outcome.redone, outcome.redone_s = run.progress.updates()
        ends = [t for t, v in run.progress.lines if v == "end"]
        bounds = [*injected[1:], ends[-1] if ends else time.time()]
        for t0, t1 in zip(injected, bounds):
            outcome.stalls.append(round(_stall(times, t0, t1), 2))
    finally:
        outcome.left_behind = run.close(keep_logs=not outcome.completed)
        if outcome.left_behind or not outcome.completed:
            outcome.note += f"logs in {run.dir}; "
    outcome.seconds = round(time.monotonic() - started, 1)
    return outcome


def _launcher_run(settings, rng):
    """SIGKILLs a local-mode launcher mid-epoch; counts its orphans."""
    epochs = settings["epochs"]
    per_epoch = settings["steps_per_epoch"] // 2
    outcome = Outcome("launcher_kill", planned=epochs * per_epoch)
    started = time.monotonic()
    run = Run(settings, epochs)
    pids = []
    try:
        launcher = run.start("launcher", "--local_cluster=2,1")
        target = _target(rng, rng.randint(1, epochs), per_epoch)
        run.wait_step(target, started + settings["run_timeout"])
        match = _PIDS.search(run.output("launcher"))
        pids = [int(p) for p in match.group(1).split(",")] if match else []
        if launcher.poll() is not None or not pids:
            outcome.note += "the launcher ended before the fault; "
        else:
            step = run.progress.step()
            print(f"  launcher SIGKILL at step {step}", flush=True)
            procutil.kill(launcher)
            time.sleep(5.0)
            outcome.left_behind = [p for p in pids if _running(p)]
            outcome.completed = True  # the fault was injected
    finally:
        if run.close(keep_logs=False, pids=pids):
            outcome.note += "task processes survived SIGKILL; "
    outcome.seconds = round(time.monotonic() - started, 1)
    return outcome


def _tf2sync_pids(pids):
    """The PIDs of `pids` that still run tf2sync (not reused by another)."""
    mine = []
    for pid in pids:
        with (
            contextlib.suppress(OSError),
            open(f"/proc/{pid}/cmdline", "rb") as f,
        ):
            mine += [pid] * (b"tf2sync" in f.read())
    return mine


def run_fault(fault, settings, rng):
    if fault == "launcher_kill":
        return _launcher_run(settings, rng)
    return _cluster_run(fault, settings, rng)


def _fmt(values, spec):
    if not values:
        return "n/a"
    return f"{format(median(values), spec)} / {format(max(values), spec)}"


def _name(o):
    """A row's fault, with its settings."""
    s = o.settings
    text = FAULTS[o.fault].format(
        delay=s["restart_delay"], freeze=s["freeze_seconds"]
    )
    num_ps = s.get("num_ps", 1)  # runs recorded before the flag: 1
    text = text if num_ps == 1 else f"{text}, {num_ps} ps"
    every = s.get("checkpoint_every_s")
    text = f"{text}, a save every {every:g} s" if every else text
    return text + ", in the background" * bool(
        s.get("checkpoint_in_background")
    )


def table(outcomes):
    """The Markdown table of `outcomes`, one row per fault and setting."""
    groups = {}
    for o in sorted(outcomes, key=lambda o: list(FAULTS).index(o.fault)):
        groups.setdefault((o.fault, _name(o)), []).append(o)
    rows = []
    for (fault, name), mine in groups.items():
        left = sum(len(o.left_behind) for o in mine)
        seconds = f"{median(o.seconds for o in mine):.0f}"
        if fault == "launcher_kill":
            rows.append([name, len(mine), *["n/a"] * 7, left, seconds])
            continue
        done = [o for o in mine if o.completed]
        applied = [o for o in done if o.applied is not None]
        twice = sum(bool(o.off_trajectory) for o in applied)
        rows.append(
            [
                name,
                len(mine),
                len(done),
                twice if applied else "n/a",
                _fmt([max(0, o.applied - o.planned) for o in applied], "g"),
                _fmt([max(0, o.planned - o.applied) for o in applied], "g"),
                _fmt([o.redone for o in mine], "g"),
                _fmt([o.redone_s for o in mine], ".1f"),
                _fmt([x for o in mine for x in o.stalls], ".1f"),
                left,
                seconds,
            ]
        )
    median_max = " (median / max)"
    header = ["fault", "runs", "completed", "applied twice"]
    header += [
        f"{column}{median_max}"
        for column in (
            "updates over the plan",
            "work lost, updates",
            "updates redone",
            "training redone, seconds",
            "seconds stalled",
        )
    ]
    header += ["processes left behind", "seconds per run (median)"]
    return "\n".join(tables.table(header, rows))


def _settings():
    settings = {}
    for name, (_, short, _) in _FLAGS.items():
        value = flags.FLAGS[name].value
        if _SHORT.value and short is not None and not flags.FLAGS[name].present:
            value = list(short) if isinstance(short, list) else short
        settings[name] = value
    if settings["token_timeout"] < 0:
        settings["token_timeout"] = None
    return settings


def main(argv):
    del argv
    run_all(_settings())
    # Skip the interpreter's teardown (TensorFlow's can be slow or noisy).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_all(settings):
    """Runs every fault `settings` asks for; prints and writes the table."""
    unknown = [f for f in settings["faults"] if f not in FAULTS]
    if unknown:
        raise app.UsageError(f"Unknown --faults {unknown}; of {list(FAULTS)}")
    seed = _SEED.value if _SEED.value is not None else random.randrange(2**31)
    print(f"chaos: seed={seed} {json.dumps(settings)}", flush=True)
    rng = random.Random(seed)
    previous, outcomes = [], []
    if _RESULTS.value and os.path.exists(_RESULTS.value):
        with open(_RESULTS.value) as f:
            previous = [Outcome(**o) for o in json.load(f)]
    public = {k: v for k, v in settings.items() if k != "keep"}
    for fault in settings["faults"]:
        for repeat in range(settings["repeats"]):
            print(f"chaos: {fault} run {repeat + 1}", flush=True)
            outcome = run_fault(fault, settings, rng)
            outcome.seed, outcome.settings = seed, public
            print(f"  {json.dumps(dataclasses.asdict(outcome))}", flush=True)
            outcomes.append(outcome)
            if _RESULTS.value:
                with open(_RESULTS.value, "w") as f:
                    rows = [dataclasses.asdict(o) for o in previous + outcomes]
                    json.dump(rows, f, indent=1)
    text = table(previous + outcomes)
    print(text)
    if _OUTPUT.value:
        write_doc(_OUTPUT.value, text, previous + outcomes)
    return outcomes


def write_doc(path, text, outcomes):
    """Writes docs/faults.md: how to reproduce, the setting, the table."""
    s = outcomes[0].settings
    invocations = {}
    for o in outcomes:
        invocations.setdefault(o.seed, o.settings)
    commands = []
    for seed, v in invocations.items():
        command = (
            f"    python benchmarks/chaos.py --faults={','.join(v['faults'])} "
        )
        command += f"--repeats={v['repeats']} --seed={seed}"
        if v["freeze_seconds"] != _FLAGS["freeze_seconds"][0]:
            command += f" --freeze_seconds={v['freeze_seconds']:g}"
        commands.append(command + " --results=/tmp/chaos.json")
    timeouts = "".join(
        f" --{name}={s[name]:g}"
        for name in ("worker_timeout", "token_timeout")
        if s[name] is not None
    )
    seconds = [o.seconds for o in outcomes]
    with open(path, "w") as f:
        f.write(
            "# Fault injection\n\nMerged through --results from:\n\n"
            + "\n".join(commands)
            + f"\n\n{s['epochs']} epochs x {s['steps_per_epoch']} "
            f"pushes, steps_per_execution={s['steps_per_execution']}, 2 "
            f"workers (3 with the backup), the chief with --checkpoint_dir"
            f"{timeouts}; runs of {min(seconds):.0f}-{max(seconds):.0f} "
            "s. What the faults and columns are: [benchmarks.md]"
            "(benchmarks.md#faults).\n\n" + text + "\n" + _failures(outcomes)
        )


def _failures(outcomes):
    """A paragraph on the runs that did not complete, if any."""
    failed = [o for o in outcomes if not o.completed]
    if not failed:
        return ""
    lines = [
        f"- {o.fault}, seed {o.seed}: "
        + re.sub(r"logs in \S+; ", "", o.note).strip().rstrip(";")
        for o in failed
    ]
    return "\nRuns that did not complete:\n\n" + "\n".join(lines) + "\n"


if __name__ == "__main__":
    app.run(main)
