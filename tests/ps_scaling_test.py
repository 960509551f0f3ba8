"""benchmarks/ps_scaling.py runs end to end: rows, hold counts, the table.

A smoke run (2 ps, w1, two functions per run, one run) of every system:
each gives a row, tf2sync's hold probe counts one commit per push and one
finalize per update over the timed runs, the Markdown table's ratios are
those of the rows, and no process of the run is left. Nothing here asserts
a speed.
"""

import json
import os
import subprocess
import sys
import tempfile

import benchutil
import pytest
from absl.testing import absltest

pytestmark = pytest.mark.slow

_SCRIPT = os.path.join(benchutil.BENCHMARKS, "ps_scaling.py")
_SYSTEMS = ("tf2sync_loop", "tf2sync_fit", "pss_async_unrolled", "tf1_sync")
_FUNCTIONS, _K, _WORKERS = 2, 10, 2


def _running(marker):
    """PIDs of processes whose command line holds `marker`."""
    pids = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(pid))
    return pids


@absltest.skipUnless(sys.platform.startswith("linux"), "reads /proc")
class PsScalingSmokeTest(absltest.TestCase):
    def test_every_system_reports_a_row_and_tf2sync_its_holds(self):
        with tempfile.TemporaryDirectory() as tmp:
            output = os.path.join(tmp, "rows.jsonl")
            proc = subprocess.run(
                [
                    sys.executable,
                    _SCRIPT,
                    "--ps=2",
                    "--workloads=w1",
                    f"--systems={','.join(_SYSTEMS)}",
                    f"--functions={_FUNCTIONS}",
                    "--repeats=1",
                    f"--output={output}",
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
            with open(output) as f:
                rows = [json.loads(line) for line in f]
        # The child per ps count and TF1's process, ended by PID.
        self.assertEqual(_running(f"{_SCRIPT}\0--child"), [])
        self.assertEqual(_running("tf1_sync_worker.py"), [])
        by = {r["system"]: r for r in rows}
        self.assertCountEqual(by, _SYSTEMS)
        for row in rows:
            self.assertEqual((row["ps"], row["workload"]), (2, "w1"))
            self.assertGreater(row["examples_per_sec"], 0)
        # One run: the loop's functions; `fit` runs 2 epochs of them and
        # times the second (`systems.FitRunner.run`).
        for system, pushes in (
            ("tf2sync_loop", _FUNCTIONS * _K),
            ("tf2sync_fit", 2 * _FUNCTIONS * _K),
        ):
            row = by[system]
            self.assertEqual(row["push_holds"], pushes, row)
            self.assertEqual(row["finalize_holds"], pushes // _WORKERS, row)
            self.assertGreater(row["push_hold_us"], 0)
        self.assertNotIn("push_holds", by["pss_async_unrolled"])
        # The table: tf2sync's loop over stock and over TF1, as the rows.
        loop = by["tf2sync_loop"]["examples_per_sec"]
        line = next(
            x
            for x in proc.stdout.splitlines()
            if x.startswith("| w1 | rr | tf2sync_loop | 2 |")
        )
        cells = [c.strip() for c in line.strip("|").split("|")]
        stock = by["pss_async_unrolled"]["examples_per_sec"]
        tf1 = by["tf1_sync"]["examples_per_sec"]
        self.assertEqual(cells[5], f"{loop / stock:.2f}")
        self.assertEqual(cells[6], f"{loop / tf1:.2f}")


if __name__ == "__main__":
    absltest.main()
