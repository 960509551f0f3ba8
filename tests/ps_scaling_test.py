"""The harness's ps_scaling scenario runs end to end: rows, hold counts,
the table.

A smoke run (2 ps, w1, two functions of 10 steps per run, one run) of
every system: each gives a run, tf2sync's hold probe counts one commit per
push and one finalize per update over the timed runs, the report's ratios
are those of the runs, and no process of the run is left. Nothing here
asserts a speed.
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

_HARNESS = os.path.join(benchutil.BENCHMARKS, "harness.py")
_SYSTEMS = ("tf2sync_loop", "tf2sync_fit", "pss_async_unrolled", "tf1_sync")
_FUNCTIONS, _K, _WORKERS = 2, 10, 2


@absltest.skipUnless(sys.platform.startswith("linux"), "reads /proc")
class PsScalingSmokeTest(absltest.TestCase):
    def test_every_system_reports_a_row_and_tf2sync_its_holds(self):
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run(
                [
                    sys.executable,
                    _HARNESS,
                    "--smoke",
                    "--scenarios=ps_scaling",
                    "--ps_counts=2",
                    "--ps_workloads=w1",
                    f"--ps_systems={','.join(_SYSTEMS)}",
                    f"--ps_functions={_FUNCTIONS}",
                    f"--steps_per_function={_K}",
                    "--repeats=1",
                    f"--output_dir={tmp}",
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
            with open(os.path.join(tmp, "benchmarks.jsonl")) as f:
                records = [json.loads(line) for line in f]
            with open(os.path.join(tmp, "benchmarks.md")) as f:
                markdown = f.read()
        self.assertEqual([r for r in records if "error" in r], [])
        # The PSS chief and TF1's process, ended by PID.
        done = next(r for r in records if r.get("event") == "processes")
        self.assertEqual(done["alive"], [])
        runs = [
            r
            for r in records
            if r.get("scenario") == "ps_scaling" and "examples_per_sec" in r
        ]
        by = {r["config"]: r for r in runs}
        self.assertCountEqual(by, _SYSTEMS)
        for row in runs:
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
            self.assertGreater(row["push_hold_s"], 0)
        self.assertNotIn("push_holds", by["pss_async_unrolled"])
        # The table: tf2sync's loop over stock and over TF1, as the runs.
        loop = by["tf2sync_loop"]["examples_per_sec"]
        line = next(
            x
            for x in markdown.splitlines()
            if x.startswith("| w1 | rr | tf2sync_loop | 2 |")
        )
        cells = [c.strip() for c in line.strip("|").split("|")]
        stock = by["pss_async_unrolled"]["examples_per_sec"]
        tf1 = by["tf1_sync"]["examples_per_sec"]
        self.assertEqual(cells[5], f"{loop / stock:.2f}")
        self.assertEqual(cells[6], f"{loop / tf1:.2f}")


if __name__ == "__main__":
    absltest.main()
