"""Injects each fault on a real local cluster and tabulates what happened.

Every scenario runs `fault_job` (each replica sees one full batch), so a run
that applied U updates must hold the weights of U single-process steps:
"applied twice" counts runs whose final weights are off that trajectory (an
update applied twice, or a stale one applied, would move them). Processes
are started on 127.0.0.1 and ended by PID.

  python tests/fault_table.py --repeats=2 [--output=docs/faults.md]
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import fault_job  # noqa: E402
import numpy as np  # noqa: E402
import procutil  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import tf2sync  # noqa: E402

_REPEATS = flags.DEFINE_integer("repeats", 2, "Runs per fault.")
_OUTPUT = flags.DEFINE_string("output", None, "Also write the table here.")

EPOCHS, STEPS = 5, 20
_APPLIED = re.compile(r"sync_steps_applied=(\d+)")


def _args(spec, directory, rta=None, total=None, extra=()):
    args = [
        "--job_name=chief",
        *procutil.host_flags(spec),
        "--job_module=fault_job",
        f"--epochs={EPOCHS}",
        f"--steps_per_epoch={STEPS}",
        "--steps_per_execution=1",
        f"--learning_rate={fault_job.LEARNING_RATE}",
        f"--momentum={fault_job.MOMENTUM}",
        f"--checkpoint_dir={directory}",
        "--token_timeout=3",
        *extra,
    ]
    if rta:
        args += [
            f"--replicas_to_aggregate={rta}",
            f"--total_num_replicas={total}",
        ]
    return args


def _off_trajectory(output, directory):
    updates = int(_APPLIED.search(output).group(1))
    model = fault_job.build_model()
    latest = tf.train.latest_checkpoint(directory)
    tf.train.Checkpoint(model=model).restore(latest).expect_partial()
    expected = fault_job.reference_weights(updates)
    diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(model.get_weights(), expected)
    )
    return updates, diff > 1e-4


def _worker_killed(num_workers, rta=None, total=None):
    spec = tf2sync.testing.cluster_spec_dict(num_workers, 1)
    tasks = procutil.Tasks(spec)
    directory = tempfile.mkdtemp()
    chief = procutil.start(_args(spec, directory, rta, total))
    try:
        procutil.wait_for_line(chief, f"Epoch 2/{EPOCHS}")
        killed = time.monotonic()
        tasks.kill("worker", num_workers - 1)
        procutil.wait_for_line(chief, f"Epoch 3/{EPOCHS}")
        recovered = time.monotonic() - killed
        output = chief.stdout.read()
        chief.wait(timeout=300)
    finally:
        procutil.kill(chief)
        tasks.stop()
    return output, directory, recovered


def _chief_killed():
    spec = tf2sync.testing.cluster_spec_dict(2, 1)
    tasks = procutil.Tasks(spec)
    directory = tempfile.mkdtemp()
    try:
        first = procutil.start(_args(spec, directory))
        procutil.wait_for_line(first, f"Epoch 3/{EPOCHS}")
        killed = time.monotonic()
        procutil.kill(first)
        second = procutil.launch(_args(spec, directory), timeout=300)
        recovered = time.monotonic() - killed
    finally:
        tasks.stop()
    return second.stdout, directory, recovered


def _ps_killed():
    spec = tf2sync.testing.cluster_spec_dict(2, 1)
    tasks = procutil.Tasks(spec)
    directory = tempfile.mkdtemp()
    chief = procutil.start(
        _args(spec, directory, extra=["--ps_restart_timeout=120"])
    )
    try:
        procutil.wait_for_line(chief, f"Epoch 3/{EPOCHS}")
        killed = time.monotonic()
        tasks.kill("ps", 0)
        time.sleep(1)
        tasks.restart("ps", 0)
        procutil.wait_for_line(chief, "tf2sync: 2 workers")  # rebuilt
        recovered = time.monotonic() - killed
        output = chief.stdout.read()
        chief.wait(timeout=300)
    finally:
        procutil.kill(chief)
        tasks.stop()
    return output, directory, recovered


SCENARIOS = {
    "worker killed, no backup (2 of 2)": lambda: _worker_killed(2),
    "worker killed, 1 backup (2 of 3)": lambda: _worker_killed(3, 2, 3),
    "chief killed, restarted": _chief_killed,
    "ps killed, restarted": _ps_killed,
}


def main(argv):
    del argv
    pushes = EPOCHS * STEPS
    rows = []
    for name, scenario in SCENARIOS.items():
        completed = twice = 0
        recoveries, lost = [], []
        for _ in range(_REPEATS.value):
            output, directory, recovered = scenario()
            if not _APPLIED.search(output):
                continue
            completed += 1
            updates, off = _off_trajectory(output, directory)
            twice += int(off)
            recoveries.append(recovered)
            # Without faults: pushes / replicas_to_aggregate updates.
            rta = 2
            lost.append(pushes // rta - updates)
        rows.append(
            f"| {name} | {_REPEATS.value} | {completed} | "
            f"{statistics.median(lost) if lost else 'n/a'} | {twice} | "
            f"{statistics.median(recoveries) if recoveries else 0:.1f} |"
        )
    table = "\n".join(
        [
            "| fault | runs | completed | updates short of pushes / 2 "
            "(median; stale drops included) "
            "| runs off the exact trajectory (applied twice or stale) "
            "| seconds from fault to next epoch (median) |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as f:
            f.write(
                "# Fault injection\n\n"
                f"`python tests/fault_table.py --repeats={_REPEATS.value}`: "
                f"{EPOCHS} epochs x {STEPS} pushes of `tests/fault_job.py` on "
                "127.0.0.1, each fault injected at an epoch boundary.\n\n"
                + table
                + "\n"
            )


if __name__ == "__main__":
    app.run(main)
    os._exit(0)
