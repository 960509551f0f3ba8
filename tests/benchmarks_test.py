"""The benchmark harness runs end to end and leaves no process behind.

Smoke runs only (a few seconds of each system): benchmarks are not timed
tests, so nothing here asserts a speed.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import benchutil
import pytest
from absl.testing import absltest
from absl.testing import parameterized

_HARNESS = os.path.join(benchutil.BENCHMARKS, "harness.py")
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
            # The memory smoke (12 fresh clusters) took 266 s on 2 cores
            # that other processes shared.
            timeout=480,
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

    def test_sharding_scenario_runs_w4_on_two_ps_beside_each_ps_state(self):
        """--scenarios=sharding with a 2,000-row w4 (the smoke default)."""
        _, out, records = self._smoke("--scenarios=sharding")
        runs = [
            r
            for r in records
            if r.get("scenario") == "sharding" and "examples_per_sec" in r
        ]
        self.assertCountEqual(
            {(r["workload"], r["config"], r["ps"], r["shards"]) for r in runs},
            [
                ("w4", system, 2, 2)
                for system in (
                    "tf2sync_fit",
                    "tf2sync_loop",
                    "pss_async",
                    "pss_async_unrolled",
                    "tf1_sync",
                )
            ]
            + [
                (workload, system, ps, shards)
                for system in ("tf2sync_loop", "pss_async_unrolled")
                for workload, ps, shards in (
                    ("w3", 2, 2),  # sharded
                    ("w3", 1, 1),
                    ("w3", 2, 1),  # round robin
                    ("w1", 2, 1),
                )
            ],
        )
        for r in runs:
            self.assertGreater(r["examples"], 0, r)
        # Each system on the 2-ps cluster, the small model first: its
        # variables and slots on both ps, each ps's RSS before and after.
        memory = [r for r in records if r.get("event") == "ps_memory"]
        self.assertEqual(
            [(r["config"], r["workload"]) for r in memory],
            [
                ("tf2sync_loop", "w1"),
                ("tf2sync_fit", "w4"),
                ("tf2sync_loop", "w4"),
                ("pss_async", "w4"),
                ("pss_async_unrolled", "w4"),
            ],
        )
        table = 1_000 * 32 * 4  # a shard of the 2,000-row table
        peaks = [r for r in records if r.get("event") == "ps_peak"]
        self.assertEqual(
            [r["config"] for r in peaks], ["tf2sync_fit", "tf2sync_loop"]
        )
        for r in memory:
            self.assertEqual([t["task"] for t in r["ps_tasks"]], [0, 1])
            for t in r["ps_tasks"]:
                self.assertGreater(t["anon_after_kb"], 0, r)
                if r["workload"] == "w4":  # its shard and momentum, or more
                    self.assertGreaterEqual(t["bytes"], 2 * table, r)
        tf1 = next(
            r
            for r in records
            if r.get("event") == "setup" and r.get("config") == "tf1_sync"
        )
        self.assertGreaterEqual(tf1["ps_bytes"]["0"], 2 * table)
        self.assertGreaterEqual(tf1["ps_bytes"]["1"], 2 * table)
        with open(os.path.join(out, "benchmarks.md")) as f:
            markdown = f.read()
        self.assertIn("## Sharding (w4 on 2 ps)", markdown)
        self.assertIn("w4: Embedding 2,000 x 32", markdown)
        self.assertIn("| shards' bytes MB | state MB |", markdown)
        self.assertIn(
            "| w4 (2 shards, 2 ps) tf2sync_loop / tf1_sync |", markdown
        )
        self.assertIn(
            "| w3 2 shards on 2 ps / on 1 ps: tf2sync_loop's ratio / "
            "pss_async_unrolled's |",
            markdown,
        )
        self.assertIn("### Whole variables round robin over 2 ps", markdown)
        self.assertIn(
            "| w1 round robin on 2 ps: tf2sync_loop / pss_async_unrolled |",
            markdown,
        )
        self.assertRegex(
            markdown, r"\| ps memory, w4: tf2sync_fit state on ps 1 \(MB\) \| "
        )
        done = [r for r in records if r.get("event") == "processes"]
        # The memory cluster (2 ps, 2 workers, a chief), then 2 PSS chiefs
        # (in-process clusters) and TF1's process.
        self.assertLen(done[0]["started"], 8)
        self.assertEqual(done[0]["alive"], [])
        _wait_gone(self, done[0]["started"], seconds=1.0)

    def test_baseline_tree_runs_tf2sync_from_both_trees(self):
        """--baseline_tree: a copy of this tree's tf2sync/ and benchmarks/,
        marked so that its log tells which tf2sync each child imported."""
        tree = os.path.join(self._tempdir(), "baseline")
        for folder in ("tf2sync", "benchmarks"):
            shutil.copytree(
                os.path.join(benchutil.ROOT, folder),
                os.path.join(tree, folder),
                ignore=shutil.ignore_patterns("__pycache__"),
            )
        marker = "tf2sync imported from the baseline copy:"
        with open(os.path.join(tree, "tf2sync", "__init__.py"), "a") as f:
            f.write(
                "\nimport sys as _sys\n\n"
                f"print({marker!r}, __file__, file=_sys.stderr, flush=True)\n"
            )
        logs = os.path.join(self._tempdir(), "logs")
        _, out, records = self._smoke(
            "--scenarios=main",
            "--workloads=w1",
            "--systems=local,tf2sync_loop",
            f"--baseline_tree={tree}",
            f"--subprocess_logs={logs}",
        )
        runs = [
            r
            for r in records
            if r.get("scenario") == "main" and "examples_per_sec" in r
        ]
        self.assertCountEqual(
            [r["system"] for r in runs],
            ["local", "tf2sync_loop", "tf2sync_loop@baseline"],
        )
        for r in runs:
            self.assertGreater(r["examples"], 0, r)
        self.assertEqual(
            [r.get("baseline_of") for r in runs if "@" in r["system"]],
            ["tf2sync_loop"],
        )
        started = [r for r in records if r.get("event") == "started"]
        self.assertCountEqual(
            [(r["name"], r.get("tree")) for r in started],
            [("pss_w1", None), ("pss_w1_baseline", tree), ("local_w1", None)],
        )
        # One version per process: only the baseline's imported the copy.
        with open(os.path.join(logs, "pss_w1_baseline.log")) as f:
            self.assertIn(
                f"{marker} {os.path.join(tree, 'tf2sync', '__init__.py')}",
                f.read(),
            )
        for name in ("pss_w1", "local_w1"):
            with open(os.path.join(logs, f"{name}.log")) as f:
                self.assertNotIn(marker, f.read())

        with open(os.path.join(out, "benchmarks.md")) as f:
            markdown = f.read()
        self.assertIn("## Before and after", markdown)
        self.assertIn(f"the baseline tree `{tree}`", markdown)
        self.assertRegex(markdown, r"\| w1 \| `tf2sync_loop` \| [0-9,]+ \| ")

        done = [r for r in records if r.get("event") == "processes"]
        self.assertLen(done, 1)
        self.assertCountEqual(
            [r["name"] for r in done[0]["started"]],
            ["pss_w1", "pss_w1_baseline", "local_w1"],
        )
        self.assertEqual(done[0]["alive"], [])
        _wait_gone(self, done[0]["started"], seconds=1.0)

    def test_clusters_build_the_main_scenario_anew_each_time(self):
        """--clusters=2: every process built twice, the second build's
        repeats numbered on from the first's, the medians over both."""
        _, out, records = self._smoke(
            "--scenarios=main",
            "--workloads=w1",
            "--systems=local,tf2sync_loop",
            "--clusters=2",
        )
        runs = [
            (r["system"], r["cluster"], r["repeat"])
            for r in records
            if r.get("scenario") == "main" and "examples_per_sec" in r
        ]
        self.assertCountEqual(
            runs,
            [
                ("local", 0, 0),
                ("tf2sync_loop", 0, 0),
                ("local", 1, 1),
                ("tf2sync_loop", 1, 1),
            ],
        )
        started = [r for r in records if r.get("event") == "started"]
        self.assertEqual(
            [r["name"] for r in started],
            ["pss_w1", "local_w1", "pss_w1_c1", "local_w1_c1"],
        )
        with open(os.path.join(out, "benchmarks.md")) as f:
            markdown = f.read()
        self.assertIn("built its processes 2 times", markdown)
        # The throughput table's medians count both builds' runs.
        self.assertRegex(
            markdown, r"\| `tf2sync_loop` \| [0-9,]+ \| .* \| 2 \|"
        )
        done = [r for r in records if r.get("event") == "processes"]
        self.assertEqual(done[0]["alive"], [])
        _wait_gone(self, done[0]["started"], seconds=1.0)

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
        ("--workloads=w9", "--workloads: unknown ['w9']"),
        ("--workloads=w4", "--workloads: unknown ['w4']"),
        ("--sharding_rows=0", "--sharding_rows must be positive"),
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


class BaselineTreeFlagTest(absltest.TestCase):
    def _refused(self, *flags):
        """The harness's one-line error for `flags` (it must fail)."""
        proc = subprocess.run(
            [sys.executable, _HARNESS, "--smoke", *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.assertNotEqual(proc.returncode, 0)
        path = next(f for f in flags if f.startswith("--baseline_tree="))
        lines = [line for line in proc.stderr.splitlines() if path in line]
        self.assertLen(lines, 1, proc.stderr[-2000:])
        return lines[0]

    def _tree(self, *files):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        for name in files:
            path = os.path.join(tmp.name, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "w").close()
        return tmp.name

    def test_a_missing_directory_is_refused_naming_flag_and_value(self):
        path = os.path.join(self._tree(), "nothing_here")
        line = self._refused(f"--baseline_tree={path}")
        self.assertIn(f"--baseline_tree={path}: no such directory", line)

    def test_a_tree_without_the_library_is_refused(self):
        path = self._tree("benchmarks/pss_worker.py")
        line = self._refused(f"--baseline_tree={path}")
        self.assertIn(f"--baseline_tree={path}: lacks tf2sync/", line)

    def test_a_tree_without_the_worker_is_refused(self):
        path = self._tree("tf2sync/__init__.py")
        line = self._refused(f"--baseline_tree={path}")
        self.assertIn(
            f"--baseline_tree={path}: lacks benchmarks/pss_worker.py", line
        )

    def test_it_needs_a_tf2sync_system_of_the_main_scenario(self):
        path = self._tree("tf2sync/__init__.py", "benchmarks/pss_worker.py")
        for flags in (
            ["--systems=local,tf1_sync"],
            ["--scenarios=straggler"],
        ):
            line = self._refused(f"--baseline_tree={path}", *flags)
            self.assertIn("select --scenarios=main and a tf2sync_*", line)


class BalancedOrderTest(parameterized.TestCase):
    """The rounds' order: no system always runs right after the same one
    (whatever a run leaves behind is charged to the next)."""

    @parameterized.parameters(1, 2, 3, 4, 5, 6)
    def test_each_system_follows_each_other_equally_often(self, count):
        driver = benchutil.load("driver")
        rounds = count if count % 2 == 0 else 2 * count
        follows = {}
        for index in range(rounds):
            order = driver.balanced_order(count, index)
            self.assertCountEqual(order, range(count))
            for before, after in zip(order, order[1:]):
                follows[before, after] = follows.get((before, after), 0) + 1
        pairs = [(a, b) for a in range(count) for b in range(count) if a != b]
        self.assertCountEqual(follows, pairs)
        self.assertLen(set(follows.values()), min(1, len(pairs)))
        # Later rounds (a cluster built again) go on with the same cycle.
        self.assertEqual(
            driver.balanced_order(count, rounds + 1),
            driver.balanced_order(count, 1),
        )

    def test_four_systems_of_a_before_and_after_run(self):
        """fit, fit@baseline, loop, loop@baseline: the current fit no
        longer runs after the baseline's loop in every round."""
        driver = benchutil.load("driver")
        before_fit = {
            order[order.index(0) - 1]
            for order in (driver.balanced_order(4, i) for i in range(4))
            if order.index(0) > 0
        }
        self.assertEqual(before_fit, {1, 2, 3})


class ReportTest(absltest.TestCase):
    def test_targets_are_ratios_of_medians(self):
        report = benchutil.load("report")

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

    def test_before_and_after_pairs_each_round_of_both_trees(self):
        """A slow cluster build slows both trees: the rounds' own ratios
        decide, not the pooled medians (which it would tip to MISS)."""
        report = benchutil.load("report")

        def run(system, cluster, repeat, rate):
            return {
                "scenario": "main",
                "workload": "w1",
                "system": system,
                "cluster": cluster,
                "repeat": repeat,
                "examples_per_sec": rate,
            }

        loop, then = "tf2sync_loop", "tf2sync_loop@baseline"
        records = [
            {"event": "config", "baseline_tree": "/tmp/base", "repeats": 3},
            # Build 0 at 60 % of build 1's speed, for both trees; the
            # current tree 0.96-0.99 x the baseline within every round.
            run(loop, 0, 0, 58.0),
            run(then, 0, 0, 60.0),
            run(loop, 0, 1, 59.0),
            run(then, 0, 1, 60.0),
            run(loop, 1, 2, 97.0),
            run(then, 1, 2, 100.0),
            run(loop, 1, 3, 98.0),
            run(then, 1, 3, 100.0),
            run(loop, 1, 4, 99.0),
            run(then, 1, 4, 100.0),
            # A round the baseline did not finish pairs nothing.
            run(loop, 0, 5, 10.0),
            run("tf2sync_fit", 0, 0, 90.0),
            run("tf2sync_fit@baseline", 0, 0, 100.0),
        ]
        rows = {
            r["system"]: r for r in report.scenarios.before_after_rows(records)
        }
        row = rows[loop]
        # Pooled medians: 78 against 100, a MISS that is not one.
        self.assertAlmostEqual(row["ratio"], 0.78)
        self.assertEqual(row["rounds"], 5)
        self.assertAlmostEqual(row["paired"], 0.98)
        self.assertEqual(row["result"], "PASS")
        fit = rows["tf2sync_fit"]
        self.assertEqual((fit["rounds"], fit["result"]), (1, "MISS"))
        section = report.render(records, "").split("## Before and after")[1]
        self.assertIn("| 0.780 | 0.980 (5) |", section)
        self.assertIn("| 0.900 | 0.900 (1) |", section)

    def test_before_and_after_compares_medians_with_the_baseline(self):
        report = benchutil.load("report")

        def run(system, rate, cpu=10.0):
            return {
                "scenario": "main",
                "workload": "w1",
                "system": system,
                "examples_per_sec": rate,
                "cpu_us_per_example": cpu,
            }

        records = [
            {"event": "config", "baseline_tree": "/tmp/base", "repeats": 3},
            run("local", 200.0),
            run("tf1_sync", 50.0),
            # The loop keeps exactly 0.95 x the baseline: PASS.
            run("tf2sync_loop", 95.0),
            run("tf2sync_loop", 94.0),
            run("tf2sync_loop", 500.0),  # an outlier: medians ignore it
            run("tf2sync_loop@baseline", 100.0),
            run("tf2sync_loop@baseline", 101.0),
            run("tf2sync_loop@baseline", 99.0),
            # fit fell to 0.90 x: MISS.
            run("tf2sync_fit", 90.0, cpu=12.0),
            run("tf2sync_fit@baseline", 100.0),
            {
                "scenario": "main",
                "workload": "w1",
                "system": "tf2sync_loop_while@baseline",
                "error": "pss_w1_baseline ended",
            },
        ]
        rows = {
            r["system"]: r for r in report.scenarios.before_after_rows(records)
        }
        self.assertEqual(
            (rows["tf2sync_loop"]["ratio"], rows["tf2sync_loop"]["result"]),
            (0.95, "PASS"),
        )
        self.assertEqual(rows["tf2sync_fit"]["result"], "MISS")
        self.assertEqual(
            rows["tf2sync_loop_while"]["result"], "n/a (not measured)"
        )
        markdown = report.render(records, "")
        self.assertIn("## Before and after", markdown)
        self.assertIn("the baseline tree `/tmp/base`", markdown)
        section = markdown.split("## Before and after")[1]
        # current, baseline, runs, current / baseline, vs local and
        # vs tf1_sync (current / baseline), CPU us / ex, the result.
        self.assertIn(
            "| w1 | `tf2sync_loop` | 95 | 100 | 3 / 3 | 0.950 | n/a (0) "
            "| 0.47 / 0.50 | 1.90 / 2.00 | 10.0 / 10.0 | PASS |",
            section,
        )
        self.assertIn(
            "| w1 | `tf2sync_fit` | 90 | 100 | 1 / 1 | 0.900 | n/a (0) "
            "| 0.45 / 0.50 | 1.80 / 2.00 | 12.0 / 10.0 | MISS |",
            section,
        )
        self.assertIn("| w1 | `tf2sync_loop_while` | n/a | n/a |", section)
        self.assertIn(
            "Not PASS (MISS or not measured): w1 `tf2sync_fit`, w1 "
            "`tf2sync_loop_while`.",
            section,
        )
        # The targets and the main table ignore the baseline's runs.
        loop = {t["target"]: t for t in report.targets(records)}[
            "w1 tf2sync_loop / tf1_sync"
        ]
        self.assertEqual(loop["measured"], "1.90")

        # Without a baseline: no such section, the rest unchanged (but
        # for the main table's row of the baseline's error).
        plain = [r for r in records if "@" not in r.get("system", "")]
        self.assertEqual(report.scenarios.before_after_rows(plain), [])
        self.assertNotIn("Before and after", report.render(plain, ""))
        ran = [r for r in records if "error" not in r]
        self.assertEqual(
            report.render(ran, "").split("## Before and after")[0],
            report.render(plain, "").split("## Reproduce")[0],
        )

    def test_sharding_targets_come_only_with_the_sharding_scenario(self):
        report = benchutil.load("report")

        def run(workload, config, rate, ps=2, shards=None):
            return {
                "scenario": "sharding",
                "workload": workload,
                "config": config,
                "system": f"{config}_{workload}_{ps}ps",
                "ps": ps,
                "shards": shards or ps,
                "examples_per_sec": rate,
            }

        def memory(workload, config, states_mb, bytes_mb):
            return {
                "scenario": "sharding",
                "event": "ps_memory",
                "workload": workload,
                "config": config,
                "ps_tasks": [
                    {
                        "task": i,
                        "bytes": bytes_mb * 1e6,
                        "rss_empty_kb": 600_000,
                        "anon_before_kb": 100_000,
                        "anon_after_kb": 100_000 + state * 1000,
                        "rss_after_kb": 700_000,
                    }
                    for i, state in enumerate(states_mb)
                ],
            }

        records = [
            run("w4", "tf1_sync", 100.0),
            run("w4", "tf2sync_loop", 105.0),
            run("w4", "tf2sync_fit", 95.0),
            run("w4", "pss_async_unrolled", 110.0),
            run("w3", "tf2sync_loop", 90.0, ps=2),
            run("w3", "tf2sync_loop", 100.0, ps=1),
            # stock's own 2-ps / 1-ps: 0.8; tf2sync's 0.9 / 0.8 = 1.125.
            run("w3", "pss_async_unrolled", 80.0, ps=2),
            run("w3", "pss_async_unrolled", 100.0, ps=1),
            # round robin: w1 0.84 (MISS), w3 0.85 (PASS, the bar itself).
            run("w1", "tf2sync_loop", 84.0, shards=1),
            run("w1", "pss_async_unrolled", 100.0, shards=1),
            run("w3", "tf2sync_loop", 85.0, shards=1),
            run("w3", "pss_async_unrolled", 100.0, shards=1),
            memory("w1", "tf2sync_loop", [10.0, 12.0], 0.01),
            # ps 0: 1.25 x 256 + 10 = 330 exactly: PASS; ps 1: 343 > 332.
            memory("w4", "tf2sync_loop", [330.0, 343.0], 256.0),
        ]
        rows = {t["target"]: t for t in report.targets(records)}

        def got(name):
            return rows[name]["measured"], rows[name]["result"]

        self.assertEqual(
            got("w4 (2 shards, 2 ps) tf2sync_loop / tf1_sync"), ("1.05", "PASS")
        )
        self.assertEqual(
            got("w4 (2 shards, 2 ps) tf2sync_fit / tf1_sync"), ("0.95", "MISS")
        )
        self.assertEqual(
            got("w4 (2 shards, 2 ps) tf2sync_fit / pss_async_unrolled"),
            ("0.86", "MISS"),
        )
        self.assertEqual(
            got("w4 (2 shards, 2 ps) tf2sync_loop / pss_async_unrolled"),
            ("0.95", "PASS"),
        )
        ps0 = "ps memory, w4: tf2sync_loop state on ps 0 (MB)"
        self.assertEqual(got(ps0), ("330.0", "PASS"))
        self.assertStartsWith(rows[ps0]["required"], "<= 330.0 (1.25 x")
        ps1 = "ps memory, w4: tf2sync_loop state on ps 1 (MB)"
        self.assertEqual(got(ps1), ("343.0", "MISS"))
        self.assertEqual(
            got(
                "w3 2 shards on 2 ps / on 1 ps: tf2sync_loop's ratio / "
                "pss_async_unrolled's"
            ),
            ("1.12", "PASS"),
        )
        self.assertEqual(
            got("w1 round robin on 2 ps: tf2sync_loop / pss_async_unrolled"),
            ("0.84", "MISS"),
        )
        self.assertEqual(
            got("w3 round robin on 2 ps: tf2sync_loop / pss_async_unrolled"),
            ("0.85", "PASS"),
        )
        section = "\n".join(
            report.tables.lines(report.memory.sharding_section(records))
        )
        self.assertIn(
            "| tf2sync_loop | w4 | 1 | 600.0 | 256.0 | 343.0 | 1.34 | 332.0 "
            "| n/a | 700.0 |",
            section,
        )
        self.assertIn(
            "| `tf2sync_loop` | 105 | 105 - 105 | 1 | 1.05 |", section
        )
        # Without the scenario: none of its targets, no section.
        plain = [run("w1", "tf1_sync", 1.0) | {"scenario": "main"}]
        self.assertFalse(
            any("w4" in t["target"] for t in report.targets(plain))
        )
        self.assertEqual(report.memory.sharding_section(plain), [])

    def test_memory_targets_compare_growth_per_worker(self):
        report = benchutil.load("report")

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
            report.tables.lines(
                report.memory.memory_section(
                    [cell("tf2sync_loop", 4, 47), cell("tf2sync_loop", 4, 60)]
                    + [cell("tf2sync_loop", 4, 48)]
                )
            )
        )
        self.assertIn(
            "| tf2sync_loop | 4 | legacy | 100,000 | 600.0 | 48.0 | 2.0 | 3 |",
            section,
        )


if __name__ == "__main__":
    absltest.main()
