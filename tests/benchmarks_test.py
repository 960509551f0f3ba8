"""The benchmark harness runs end to end and leaves no process behind.

Smoke runs only (a few seconds of each system): benchmarks are not timed
tests, so nothing here asserts a speed.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from unittest import mock

import pytest
from absl.testing import absltest
from absl.testing import parameterized

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HARNESS = os.path.join(_ROOT, "benchmarks", "harness.py")
_SYSTEMS = (
    "local",
    "tf2sync_fit",
    "tf2sync_fit_keras_loop",
    "tf2sync_loop",
    "tf2sync_loop_while",
    "pss_async",
    "pss_async_unrolled",
    "tf1_sync",
    "mwms",
)


def _load_report():
    """benchmarks/report.py (and its sibling `sections`), by path."""
    folder = os.path.join(_ROOT, "benchmarks")
    spec = importlib.util.spec_from_file_location(
        "report", os.path.join(folder, "report.py")
    )
    module = importlib.util.module_from_spec(spec)
    with mock.patch.object(sys, "path", [folder, *sys.path]):
        spec.loader.exec_module(module)
    return module


def _gone(pid, start_time):
    """True if the process `pid` that started at `start_time` has ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return True
    return fields[0] == "Z" or int(fields[19]) != start_time


def _wait_gone(test, started, seconds=15.0):
    deadline = time.monotonic() + seconds
    left = started
    while left and time.monotonic() < deadline:
        left = [r for r in left if not _gone(r["pid"], r["start_time"])]
        time.sleep(0.2)
    test.assertEqual(left, [], "processes left running")


@pytest.mark.slow
@absltest.skipUnless(sys.platform.startswith("linux"), "reads /proc")
class HarnessSmokeTest(absltest.TestCase):
    def _tempdir(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        return tmp.name

    def _smoke(self, *flags):
        """Runs a smoke harness; returns (process, output dir, records)."""
        out = self._tempdir()
        proc = subprocess.run(
            [
                sys.executable,
                _HARNESS,
                "--smoke",
                f"--output_dir={out}",
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=240,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
        with open(os.path.join(out, "benchmarks.jsonl")) as f:
            records = [json.loads(line) for line in f]
        self.assertEqual([r for r in records if "error" in r], [])
        return proc, out, records

    def test_smoke_run_reports_every_system_and_ends_every_process(self):
        logs = os.path.join(self._tempdir(), "logs")
        proc, out, records = self._smoke(f"--subprocess_logs={logs}")
        runs = [
            r
            for r in records
            if r.get("scenario") == "main" and "examples_per_sec" in r
        ]
        self.assertCountEqual({r["system"] for r in runs}, _SYSTEMS)
        for r in runs:
            self.assertGreater(r["examples"], 0, r)
            self.assertGreater(r["seconds"], 0, r)
            # CPU of the harness's processes during the run (/proc ticks:
            # a short run may read 0).
            self.assertGreaterEqual(r["cpu_us_per_example"], 0, r)
        self.assertGreater(sum(r["cpu_s"] for r in runs), 0)
        printed = [
            json.loads(line)
            for line in proc.stdout.splitlines()
            if line.startswith("{")
        ]
        self.assertEqual(printed, records)

        with open(os.path.join(out, "benchmarks.md")) as f:
            markdown = f.read()
        self.assertIn("## Targets", markdown)
        self.assertIn("Smoke run: not a measurement.", markdown)
        self.assertIn("| CPU us / ex |", markdown)
        for system in _SYSTEMS:
            self.assertIn(f"| `{system}` | ", markdown)

        done = [r for r in records if r.get("event") == "processes"]
        self.assertLen(done, 1)
        started = done[0]["started"]
        self.assertCountEqual(
            [r["name"] for r in started],
            ["pss_w1", "local_w1", "tf1_sync_w1", "mwms_w1_0", "mwms_w1_1"],
        )
        self.assertEqual(done[0]["alive"], [])
        _wait_gone(self, started, seconds=1.0)

    def test_memory_scenario_measures_each_cell_repeatedly(self):
        _, out, records = self._smoke(
            "--scenarios=memory", "--memory_workers=1", "--memory_repeats=2"
        )
        runs = [
            r
            for r in records
            if r.get("scenario") == "memory" and "rss_state_kb" in r
        ]
        # tf2sync's two loop forms, stock PSS in both, the 4 x table, and
        # stock with tf.keras' SGD: 6 cells, each once before any again.
        cells = [(r["system"], r["optimizer"], r["workload"]) for r in runs]
        self.assertLen(set(cells), 6)
        self.assertEqual(cells[:6], cells[6:])
        self.assertEqual([r["repeat"] for r in runs], [0] * 6 + [1] * 6)
        for r in runs:
            self.assertGreater(r["anon_state_kb"], r["anon_idle_kb"], r)
        with open(os.path.join(out, "benchmarks.md")) as f:
            markdown = f.read()
        self.assertIn("| state MB | per-step peak MB | runs |", markdown)
        rows = [
            line
            for line in markdown.splitlines()
            if line.startswith(("| tf2sync_loop", "| pss_async"))
        ]
        self.assertLen(rows, 6)
        for line in rows:
            self.assertEndsWith(line, "| 2 |")

    def test_model_size_scenario_reports_each_width(self):
        _, out, records = self._smoke(
            "--scenarios=model_size", "--model_widths=64,256"
        )
        runs = [r for r in records if r.get("scenario") == "model_size"]
        self.assertCountEqual(
            {(r["config"], r["width"]) for r in runs if "seconds" in r},
            {
                (system, width)
                for system in ("tf2sync_loop", "pss_async")
                for width in (64, 256)
            },
        )
        with open(os.path.join(out, "benchmarks.md")) as f:
            markdown = f.read()
        self.assertIn("## Model size", markdown)
        self.assertIn("| 256 | 11,018 | ", markdown)  # 32*256 + 256 + 2570

    def test_killed_harness_leaves_no_process(self):
        """SIGKILL to the harness: the kernel ends its subprocesses."""
        out = self._tempdir()
        proc = subprocess.Popen(
            [
                sys.executable,
                _HARNESS,
                "--smoke",
                "--systems=tf2sync_loop,tf1_sync,mwms",
                f"--output_dir={out}",
                f"--subprocess_logs={os.path.join(out, 'logs')}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        started = []
        try:
            for line in proc.stdout:  # until every system is set up
                record = json.loads(line) if line.startswith("{") else {}
                if record.get("event") == "started":
                    started.append(record)
                if record.get("event") == "setup" and (
                    record["system"] == "mwms"
                ):
                    break
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        self.assertLen(started, 4)
        _wait_gone(self, started)


class FlagTest(parameterized.TestCase):
    @parameterized.parameters(
        ("--memory_workers=0", "--memory_workers=['0']"),
        ("--memory_repeats=0", "--memory_repeats must be positive"),
        ("--scaling_workers=1,x", "--scaling_workers=['1', 'x']"),
        ("--workloads=w9", "--workloads: unknown ['w9']"),
    )
    def test_bad_flags_are_refused_naming_the_flag(self, flag, named):
        proc = subprocess.run(
            [sys.executable, _HARNESS, "--smoke", flag],
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn(named, proc.stderr)


class ReportTest(absltest.TestCase):
    def test_targets_are_ratios_of_medians(self):
        report = _load_report()

        def run(workload, system, rate):
            return {
                "scenario": "main",
                "workload": workload,
                "system": system,
                "examples_per_sec": rate,
            }

        records = [
            run("w1", "tf1_sync", 10.0),
            run("w1", "tf1_sync", 12.0),
            run("w1", "tf1_sync", 1000.0),  # an outlier: medians ignore it
            run("w1", "tf2sync_loop", 20.0),
            run("w1", "tf2sync_loop", 18.0),
            run("w1", "tf2sync_fit", 11.0),
        ]
        rows = {t["target"]: t for t in report.targets(records)}
        loop = rows["w1 tf2sync_loop / tf1_sync"]
        self.assertEqual((loop["measured"], loop["result"]), ("1.58", "PASS"))
        fit = rows["w1 tf2sync_fit / tf1_sync"]
        self.assertEqual((fit["measured"], fit["result"]), ("0.92", "MISS"))
        self.assertStartsWith(rows["w2 tf2sync_loop / local"]["result"], "n/a")

    def test_memory_targets_compare_growth_per_worker(self):
        report = _load_report()

        def cell(
            system, workers, state_mb, workload="w3", kind="legacy", peak=2.0
        ):
            return {
                "scenario": "memory",
                "workload": workload,
                "system": system,
                "workers": workers,
                "optimizer": kind,
                "rss_idle_kb": 600_000,
                "anon_idle_kb": 200_000,
                "rss_state_kb": 600_000 + state_mb * 1000,
                "anon_state_kb": 200_000 + state_mb * 1000,
                "hwm_run_kb": 600_000 + state_mb * 1000 + peak * 1000,
                "peak_reset": True,
            }

        def rows(x4_state_mb, extra=()):
            records = [
                cell("pss_async", 1, 30),
                cell("pss_async", 4, 33),  # stock: 1 MB per worker
                # Stock with the step repeated: 2 MB per worker.
                cell("pss_async_unrolled", 1, 31),
                cell("pss_async_unrolled", 4, 37),
                cell("tf2sync_loop", 1, 35),
                cell("tf2sync_loop", 4, 47),  # 4 MB per worker: 2 beyond
                cell("tf2sync_loop_while", 1, 32),
                cell("tf2sync_loop_while", 4, 44),  # 4: 3 beyond
                cell("tf2sync_loop", 1, 110, "w3_x4"),
                cell("tf2sync_loop", 4, x4_state_mb, "w3_x4"),
                *extra,
            ]
            found = {t["target"]: t for t in report.targets(records)}
            return {k: v for k, v in found.items() if "memory" in k}

        found = rows(x4_state_mb=122.0)  # the same 4 MB per worker
        # Each tf2sync form against stock PSS in the same form.
        for system, stock, measured in (
            ("tf2sync_loop", "pss_async_unrolled", "2.0"),
            ("tf2sync_loop_while", "pss_async", "3.0"),
        ):
            beyond = found[
                f"ps memory: {system} state growth per added worker, "
                f"beyond {stock}'s (MB)"
            ]
            self.assertEqual(
                (beyond["measured"], beyond["result"]), (measured, "PASS")
            )
        table = (
            "ps memory: tf2sync_loop state growth per added worker with 4 x "
            "the embedding, minus with w3's (MB)"
        )
        self.assertEqual(
            (found[table]["measured"], found[table]["result"]), ("0.0", "PASS")
        )
        # A buffer of the table's size per worker: 51.2 MB more each.
        found = rows(x4_state_mb=122.0 + 3 * 51.2)
        self.assertEqual(
            (found[table]["measured"], found[table]["result"]), ("51.2", "MISS")
        )

        # Repeated cells: the state is their median, the peak their largest.
        # Stock's 4-worker cell read low once (2 MB per worker less), as
        # single readings did in real runs: the median keeps the reference.
        found = rows(
            x4_state_mb=122.0,
            extra=[
                cell("pss_async_unrolled", 4, 37),
                cell("pss_async_unrolled", 4, 31),
                cell("tf2sync_loop", 4, 47, peak=9.0),
                cell("tf2sync_loop", 4, 48),
            ],
        )
        beyond = found[
            "ps memory: tf2sync_loop state growth per added worker, "
            "beyond pss_async_unrolled's (MB)"
        ]
        self.assertEqual(
            (beyond["measured"], beyond["result"]), ("2.0", "PASS")
        )
        peak = found["ps memory: tf2sync largest per-step peak (MB)"]
        self.assertEqual(peak["measured"], "9.0")
        section = "\n".join(
            report.sections.memory_section(
                [cell("tf2sync_loop", 4, 47), cell("tf2sync_loop", 4, 60)]
                + [cell("tf2sync_loop", 4, 48)]
            )
        )
        self.assertIn(
            "| tf2sync_loop | 4 | legacy | 100,000 | 600.0 | 48.0 | 2.0 | 3 |",
            section,
        )


if __name__ == "__main__":
    absltest.main()
