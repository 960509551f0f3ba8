"""The harness's startup scenario (time to the first applied update).

The report section from records (no TensorFlow, milliseconds), and one
smoke run of two systems in fresh processes (slow: about 30 s on 2 cores).
Nothing here asserts a speed.
"""

import json
import os
import subprocess
import sys
import tempfile

import benchutil
import pytest
from absl.testing import absltest

_HARNESS = os.path.join(benchutil.BENCHMARKS, "harness.py")


def _lines(blocks):
    """The Markdown lines of a report section's blocks."""
    return "\n".join(benchutil.load("tables").lines(blocks)).splitlines()


def _record(system, trace, update, workload="w1", **extra):
    return {
        "scenario": "startup",
        "workload": workload,
        "system": system,
        "before_schedule_s": 0.0,
        "trace_s": trace,
        "register_s": 0.5,
        "steady_function_s": 0.1,
        "first_function_s": update + 0.05,
        "first_update_s": update,
        "gc_s": 0.01,
        **extra,
    }


class StartupSectionTest(absltest.TestCase):
    def test_medians_and_ratios_to_stock_pss(self):
        startup = benchutil.load("startup")
        records = [
            _record("tf2sync_loop", trace, trace + 1.0)
            for trace in (4.0, 6.0, 5.0)
        ] + [_record("pss_async", trace, trace + 1.0) for trace in (1.0, 2.0)]
        found = startup.medians(records)
        self.assertEqual(found[("w1", "tf2sync_loop")]["trace_s"], 5.0)
        self.assertEqual(found[("w1", "tf2sync_loop")]["runs"], 3)
        self.assertEqual(found[("w1", "pss_async")]["trace_s"], 1.5)
        lines = _lines(startup.startup_section(records))
        # Each measured workload is described once, the others not.
        self.assertIn(f"* w1: {startup.WORKLOAD_TEXT['w1']}", lines)
        self.assertFalse(any(x.startswith("* digits:") for x in lines))
        ratio_row = next(x for x in lines if "tf2sync_loop / pss_async" in x)
        cells = [c.strip() for c in ratio_row.strip("|").split("|")]
        # (a) trace: 5.0 / 1.5; to the first update: 6.0 / 2.5.
        self.assertEqual(cells[3], f"{5.0 / 1.5:.2f}")
        self.assertEqual(cells[7], f"{6.0 / 2.5:.2f}")
        # The collector's time in the window is shown, not divided.
        self.assertEqual(cells[8], "")
        row = next(x for x in lines if "| `pss_async` |" in x)
        self.assertEqual(row.strip("|").split("|")[8].strip(), "0.010")

    def test_targets_hold_tf2sync_to_one_and_a_half_times_stock(self):
        report = benchutil.load("report")
        records = [
            _record("tf2sync_fit", 1.0, update) for update in (2.0, 2.9, 3.0)
        ] + [_record("pss_async_fit", 1.0, update) for update in (2.0, 2.0)]
        records += [
            _record("tf2sync_loop", 1.0, 4.0),
            _record("pss_async", 1.0, 2.0),
        ]
        rows = {t["target"]: t for t in report.targets(records)}
        fit = rows["w1: first applied update, tf2sync_fit / pss_async_fit"]
        self.assertEqual((fit["measured"], fit["result"]), ("1.45", "PASS"))
        loop = rows["w1: first applied update, tf2sync_loop / pss_async"]
        self.assertEqual((loop["measured"], loop["result"]), ("2.00", "MISS"))
        # No startup records: no startup targets.
        self.assertFalse(
            any("first applied" in t["target"] for t in report.targets([]))
        )

    def test_errors_are_listed_and_no_records_no_section(self):
        startup = benchutil.load("startup")
        self.assertEqual(startup.startup_section([]), [])
        lines = _lines(
            startup.startup_section(
                [
                    {
                        "scenario": "startup",
                        "workload": "w1",
                        "system": "tf2sync_fit",
                        "repeat": 0,
                        "error": "boom",
                    }
                ]
            )
        )
        self.assertTrue(any("boom" in x for x in lines), lines)

    def test_the_report_has_the_section(self):
        report = benchutil.load("report")
        text = report.render([_record("tf2sync_fit", 3.0, 4.0)], "(no plot)")
        self.assertIn("## Time to the first update", text)


@pytest.mark.slow
@absltest.skipUnless(sys.platform.startswith("linux"), "reads /proc")
class StartupSmokeTest(absltest.TestCase):
    def test_smoke_measures_each_system_in_a_fresh_process(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        proc = subprocess.run(
            [
                sys.executable,
                _HARNESS,
                "--smoke",
                "--scenarios=startup",
                "--startup_systems=tf2sync_loop,pss_async",
                f"--output_dir={tmp.name}",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
        with open(os.path.join(tmp.name, "benchmarks.jsonl")) as f:
            records = [json.loads(line) for line in f]
        self.assertEqual([r for r in records if "error" in r], [])
        runs = [r for r in records if r.get("scenario") == "startup"]
        self.assertCountEqual(
            [r["system"] for r in runs], ["tf2sync_loop", "pss_async"]
        )
        for r in runs:
            # Each loop builds its iterators on its clock, as fit and the
            # Trainer do.
            self.assertGreater(r["before_schedule_s"], 0.005, r)
            self.assertGreater(r["trace_s"], 0, r)
            self.assertGreaterEqual(r["first_function_s"], r["trace_s"], r)
            self.assertGreater(r["first_update_s"], r["trace_s"], r)
            self.assertGreaterEqual(r["steps"], 1, r)
            # Each clock starts after a full collection; the collector's
            # own time in the window is reported.
            self.assertBetween(r["gc_s"], 0, r["first_update_s"])
            self.assertIsInstance(r["gc_full"], int)
        started = [r for r in records if r.get("event") == "started"]
        self.assertLen(started, 2)  # one fresh process per measurement
        done = next(r for r in records if r.get("event") == "processes")
        self.assertEqual(done["alive"], [])
        with open(os.path.join(tmp.name, "benchmarks.md")) as f:
            self.assertIn("## Time to the first update", f.read())


if __name__ == "__main__":
    absltest.main()
