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

FAULTS = {
    "none": "no fault (baseline)",
    "worker_kill": "worker SIGKILL, restarted {delay:g} s later, no backup "
    "(2 of 2)",
    "worker_kill_backup": "worker SIGKILL, restarted {delay:g} s later, "
    "1 backup (2 of 3)",
    "ps_kill": "ps SIGKILL, restarted {delay:g} s later",
    "chief_kill": "chief SIGKILL, restarted {delay:g} s later",
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
    "steps_per_epoch": (
        3000,
        200,
        "Pushes per epoch (3000: ~7 s on 2 cores, so that a task restarted "
        "5 s after its fault comes back inside the run).",
    ),
    "steps_per_execution": (10, None, "Steps per scheduled function."),
    "num_ps": (1, None, "ps tasks (fault_job's variables round robin)."),
    "freeze_seconds": (240.0, None, "How long worker_freeze stops a worker."),
    "restart_delay": (5.0, None, "Seconds before a killed task restarts."),
    "worker_timeout": (10.0, None, "The chief's --worker_timeout."),
    "checkpoint_every_s": (
        0.0,
        None,
        "The chief's --checkpoint_every_s (0: saves at epoch ends only).",
    ),
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


_running = procutil.running


def _kill_pids(pids):
    """SIGKILLs each PID that still runs tf2sync; waits until gone."""
    mine = []
    for pid in pids:
        with (
            contextlib.suppress(OSError),
            open(f"/proc/{pid}/cmdline", "rb") as f,
        ):
            mine += [pid] * (b"tf2sync" in f.read())
    procutil.kill_pids(mine)
    with contextlib.suppress(AssertionError):
        procutil.wait_gone(pids, 30)


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
            t, *rest = line.split()
            if rest[0] in ("begin", "end"):
                self.lines.append((float(t), rest[0]))
            else:
                self.lines.append((float(t), int(rest[0])))

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


# Averages of identical gradients are exact: a clean run matches its
# reference bit for bit (0.0 measured), while one update more moves a
# weight by 5e-5 even after 4,500 updates, near convergence.
_TOLERANCE = 1e-6


def _off_trajectory(final_npz):
    """`(updates, largest weight difference to their reference)`."""
    with np.load(final_npz) as data:
        step = int(data["step"])
        weights = [data[f"w{i}"] for i in range(len(data.files) - 1)]
    expected = _reference(step)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, expected))
    return step, diff


class Run:
    """One training run on a cluster of its own; `close` ends it by PID."""

    def __init__(self, settings, num_workers, rta, epochs):
        self.settings = settings
        self.dir = tempfile.mkdtemp(prefix="tf2sync-chaos-")
        self.spec = cluster_lib.cluster_spec_dict(
            num_workers, settings["num_ps"]
        )
        self.num_workers = num_workers
        self.rta = rta
        self.epochs = epochs
        self.progress = Progress(os.path.join(self.dir, "progress"))
        self.env = dict(procutil.ENV, TF2SYNC_PROGRESS_FILE=self.progress.path)
        self.chiefs = []
        self.tasks = procutil.Tasks(self.spec)

    def chief_args(self):
        s = self.settings
        args = [
            "--job_name=chief",
            *procutil.host_flags(self.spec),
            "--job_module=fault_job",
            f"--epochs={self.epochs}",
            f"--steps_per_epoch={s['steps_per_epoch']}",
            f"--steps_per_execution={s['steps_per_execution']}",
            f"--learning_rate={fault_job.LEARNING_RATE}",
            f"--momentum={fault_job.MOMENTUM}",
            f"--checkpoint_dir={os.path.join(self.dir, 'ckpt')}",
            "--ps_restart_timeout=120",
        ]
        if self.rta:
            args += [
                f"--replicas_to_aggregate={self.rta}",
                f"--total_num_replicas={self.num_workers}",
            ]
        if s["token_timeout"] is not None:
            args.append(f"--token_timeout={s['token_timeout']:g}")
        if s["worker_timeout"] is not None:
            args.append(f"--worker_timeout={s['worker_timeout']:g}")
        if s.get("checkpoint_every_s"):
            args.append(f"--checkpoint_every_s={s['checkpoint_every_s']:g}")
        return args

    def start_chief(self):
        n = len(self.chiefs)
        with (
            open(os.path.join(self.dir, f"chief{n}.out"), "w") as out,
            open(os.path.join(self.dir, f"chief{n}.err"), "w") as err,
        ):
            self.chiefs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tf2sync", *self.chief_args()],
                    stdout=out,
                    stderr=err,
                    **procutil.child_kwargs(self.env),
                )
            )

    @property
    def chief(self):
        return self.chiefs[-1]

    def output(self, n=-1):
        n = n % len(self.chiefs)
        with open(os.path.join(self.dir, f"chief{n}.out")) as f:
            return f.read()

    def wait_step(self, target, deadline):
        """Waits until the step reaches `target`; False if the chief ended."""
        while time.monotonic() < deadline:
            self.progress.poll()
            if self.progress.step() >= target:
                return True
            if self.chief.poll() is not None:
                return False
            time.sleep(0.02)
        return False

    def close(self, keep_logs):
        """Ends every process by PID; returns the PIDs still running."""
        for chief in self.chiefs:
            procutil.kill(chief)
        pids = self.tasks.stop() + [c.pid for c in self.chiefs]
        time.sleep(0.5)
        left = [p for p in pids if _running(p)]
        if not (self.settings["keep"] or keep_logs or left):
            shutil.rmtree(self.dir, ignore_errors=True)
        return left


def _inject(kind, run, rng, settings):
    """Injects one fault of `kind`; returns once the harness's part is done."""
    delay = settings["restart_delay"]
    index = rng.randrange(run.num_workers)
    if kind == "worker_kill":
        run.tasks.kill("worker", index)
        time.sleep(delay)
        run.tasks.restart("worker", index)
    elif kind == "worker_freeze":
        process = run.tasks.processes[("worker", index)]
        process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(settings["freeze_seconds"])
        finally:
            process.send_signal(signal.SIGCONT)
    elif kind == "ps_kill":
        num_ps = settings["num_ps"]
        ps = rng.randrange(num_ps) if num_ps > 1 else 0
        print(f"  ps {ps} of {num_ps}", flush=True)
        run.tasks.kill("ps", ps)
        time.sleep(delay)
        run.tasks.restart("ps", ps)
    elif kind == "chief_kill":
        procutil.kill(run.chief)
        time.sleep(delay)
        run.start_chief()
    elif kind != "none":
        raise ValueError(kind)


def _target(rng, epoch, per_epoch):
    """A random global step inside `epoch` (1-based)."""
    return (epoch - 1) * per_epoch + max(
        1, round(rng.uniform(0.1, 0.9) * per_epoch)
    )


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
    run = Run(settings, workers, rta, epochs)
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
            print(
                f"  {kind} at step {run.progress.step()} (epoch {epoch})",
                flush=True,
            )
            _inject(kind, run, rng, settings)
        while run.chief.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        run.progress.poll()
        output = run.output()
        final = run.progress.path + ".final.npz"
        outcome.completed = (
            run.chief.poll() == 0
            and bool(_APPLIED.search(output))
            and os.path.exists(final)
        )
        if run.chief.poll() is None:
            outcome.note += "the chief did not end in time; "
        elif not outcome.completed:
            outcome.note += f"the chief exited {run.chief.poll()}; "
        if outcome.completed:
            outcome.applied, outcome.weight_diff = _off_trajectory(final)
            outcome.off_trajectory = outcome.weight_diff > _TOLERANCE
            printed = int(_APPLIED.search(output).group(1))
            if printed != outcome.applied:
                outcome.note += f"printed {printed} applied; "
        times, outcome.redone, outcome.redone_s = run.progress.updates()
        end = next(
            (t for t, v in reversed(run.progress.lines) if v == "end"),
            time.time(),
        )
        for i, t0 in enumerate(injected):
            t1 = injected[i + 1] if i + 1 < len(injected) else end
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
    directory = tempfile.mkdtemp(prefix="tf2sync-chaos-")
    progress = Progress(os.path.join(directory, "progress"))
    env = dict(procutil.ENV, TF2SYNC_PROGRESS_FILE=progress.path)
    out_path = os.path.join(directory, "launcher.out")
    started = time.monotonic()
    deadline = started + settings["run_timeout"]
    args = [
        "--job_module=fault_job",
        "--local_cluster=2,1",
        f"--epochs={epochs}",
        f"--steps_per_epoch={settings['steps_per_epoch']}",
        f"--steps_per_execution={settings['steps_per_execution']}",
        f"--learning_rate={fault_job.LEARNING_RATE}",
        f"--momentum={fault_job.MOMENTUM}",
    ]
    pids = []
    with (
        open(out_path, "w") as out,
        open(os.path.join(directory, "launcher.err"), "w") as err,
    ):
        launcher = subprocess.Popen(
            [sys.executable, "-m", "tf2sync", *args],
            stdout=out,
            stderr=err,
            **procutil.child_kwargs(env),
        )
    try:
        target = _target(rng, rng.randint(1, epochs), per_epoch)
        while time.monotonic() < deadline and launcher.poll() is None:
            progress.poll()
            if progress.step() >= target:
                break
            time.sleep(0.02)
        with open(out_path) as f:
            match = _PIDS.search(f.read())
        pids = [int(p) for p in match.group(1).split(",")] if match else []
        if launcher.poll() is not None or not pids:
            outcome.note += "the launcher ended before the fault; "
        else:
            print(f"  launcher SIGKILL at step {progress.step()}", flush=True)
            procutil.kill(launcher)
            time.sleep(5.0)
            outcome.left_behind = [p for p in pids if _running(p)]
            outcome.completed = True  # the fault was injected
    finally:
        procutil.kill(launcher)
        _kill_pids(pids)
        if [p for p in pids if _running(p)]:
            outcome.note += "task processes survived SIGKILL; "
        if not settings["keep"]:
            shutil.rmtree(directory, ignore_errors=True)
    outcome.seconds = round(time.monotonic() - started, 1)
    return outcome


def run_fault(fault, settings, rng):
    if fault == "launcher_kill":
        return _launcher_run(settings, rng)
    return _cluster_run(fault, settings, rng)


def _fmt(values, spec):
    if not values:
        return "n/a"
    return f"{format(median(values), spec)} / {format(max(values), spec)}"


def table(outcomes):
    """The Markdown table of `outcomes`, one row per fault and setting."""

    def name(o):
        s = o.settings
        text = FAULTS[o.fault].format(
            delay=s["restart_delay"], freeze=s["freeze_seconds"]
        )
        num_ps = s.get("num_ps", 1)  # runs recorded before the flag: 1
        text = text if num_ps == 1 else f"{text}, {num_ps} ps"
        every = s.get("checkpoint_every_s")
        return f"{text}, a save every {every:g} s" if every else text

    groups = {}
    for o in sorted(outcomes, key=lambda o: list(FAULTS).index(o.fault)):
        groups.setdefault((o.fault, name(o)), []).append(o)
    rows = []
    for (fault, name), mine in groups.items():
        left = sum(len(o.left_behind) for o in mine)
        seconds = f"{median(o.seconds for o in mine):.0f}"
        if fault == "launcher_kill":
            rows.append([name, len(mine), *["n/a"] * 7, left, seconds])
            continue
        done = [o for o in mine if o.completed]
        applied = [o for o in done if o.applied is not None]
        rows.append(
            [
                name,
                len(mine),
                len(done),
                sum(bool(o.off_trajectory) for o in applied)
                if applied
                else "n/a",
                _fmt([max(0, o.applied - o.planned) for o in applied], "g"),
                _fmt([max(0, o.planned - o.applied) for o in applied], "g"),
                _fmt([o.redone for o in mine], "g"),
                _fmt([o.redone_s for o in mine], ".1f"),
                _fmt([x for o in mine for x in o.stalls], ".1f"),
                left,
                seconds,
            ]
        )
    header = ["fault", "runs", "completed", "applied twice"]
    header += ["updates over the plan (median / max)"]
    header += ["work lost, updates (median / max)"]
    header += [
        "updates redone (median / max)",
        "training redone, seconds (median / max)",
        "seconds stalled (median / max)",
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
    previous = []
    if _RESULTS.value and os.path.exists(_RESULTS.value):
        with open(_RESULTS.value) as f:
            previous = [Outcome(**o) for o in json.load(f)]
    outcomes = []
    public = {k: v for k, v in settings.items() if k not in ("keep",)}
    for fault in settings["faults"]:
        for repeat in range(settings["repeats"]):
            print(f"chaos: {fault} run {repeat + 1}", flush=True)
            outcome = run_fault(fault, settings, rng)
            outcome.seed, outcome.settings = seed, public
            print(f"  {json.dumps(dataclasses.asdict(outcome))}", flush=True)
            outcomes.append(outcome)
            if _RESULTS.value:
                with open(_RESULTS.value, "w") as f:
                    json.dump(
                        [dataclasses.asdict(o) for o in previous + outcomes],
                        f,
                        indent=1,
                    )
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
    commands = "\n".join(
        f"    python benchmarks/chaos.py --faults={','.join(v['faults'])} "
        f"--repeats={v['repeats']} --seed={seed}"
        + (
            f" --freeze_seconds={v['freeze_seconds']:g}"
            if v["freeze_seconds"] != _FLAGS["freeze_seconds"][0]
            else ""
        )
        + " --results=/tmp/chaos.json"
        for seed, v in invocations.items()
    )
    seconds = [o.seconds for o in outcomes]
    with open(path, "w") as f:
        f.write(
            "# Fault injection\n\nMerged through --results from:\n\n"
            f"{commands}\n\n{s['epochs']} epochs x {s['steps_per_epoch']} "
            f"pushes, steps_per_execution={s['steps_per_execution']}, 2 "
            f"workers (3 with the backup), the chief with --checkpoint_dir"
            f"{_timeouts(s)}; runs of {min(seconds):.0f}-{max(seconds):.0f} "
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


def _timeouts(s):
    parts = []
    if s["worker_timeout"] is not None:
        parts.append(f" --worker_timeout={s['worker_timeout']:g}")
    if s["token_timeout"] is not None:
        parts.append(f" --token_timeout={s['token_timeout']:g}")
    return "".join(parts)


if __name__ == "__main__":
    app.run(main)
