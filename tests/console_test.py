"""The launcher's console: TensorFlow's C++ log to a file, Python's kept."""

import json
import os
import subprocess
import sys
import tempfile
import time
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized

from tf2sync._src.launcher import console

# A child that moves its descriptor 2 away, then writes as TF's C++ runtime
# does (straight to descriptor 2) and as Python code does.
_CHILD = r"""
import logging, os, sys, warnings
from absl import logging as absl_logging
from tf2sync._src.launcher import console
console.native_logs_to(sys.argv[1])
os.write(2, b"I0000 00:00:1.0 1 cpu_feature_guard.cc:227] native line\n")
print("python stderr line", file=sys.stderr)
absl_logging.warning("absl warning line")
logging.getLogger("tensorflow").warning("tf python logger line")
warnings.warn("a python warning line")
raise SystemExit(3)
"""


class NativeLogsTest(absltest.TestCase):
    def test_native_lines_go_to_the_file_python_lines_to_stderr(self):
        path = os.path.join(tempfile.mkdtemp(), "chief.log")
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, path],
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.assertEqual(out.returncode, 3, out.stderr)
        for line in (
            "python stderr line",
            "absl warning line",
            "tf python logger line",
            "a python warning line",
        ):
            self.assertIn(line, out.stderr)
        self.assertNotIn("native line", out.stderr)
        with open(path) as f:
            self.assertIn("cpu_feature_guard.cc:227] native line", f.read())


class LocalModeTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("no_flags", [], {}, True),
        ("ps_flag", ["--job_name=ps"], {}, False),
        ("chief_flag", ["--job_name", "chief"], {}, False),
        ("tf_config", [], {"TF_CONFIG": json.dumps({"task": {}})}, False),
        ("jobset", [], {"TF2SYNC_JOBSET_REPLICATED_JOB": "chief"}, False),
        ("explicit_local", ["--cluster_from=local"], {"TF_CONFIG": "{}"}, True),
        ("explicit_jobset", ["--cluster_from=jobset"], {}, False),
        ("after_double_dash", ["--", "--job_name=ps"], {}, True),
    )
    def test_runs_local_cluster(self, args, environ, expected):
        self.assertEqual(
            console.runs_local_cluster(["tf2sync", *args], environ), expected
        )

    def test_flag_value_stops_at_double_dash(self):
        argv = ["tf2sync", "--task_log_dir=/a", "--", "--task_log_dir=/b"]
        self.assertEqual(console.flag_value(argv, "task_log_dir"), "/a")
        self.assertIsNone(console.flag_value(["tf2sync"], "task_log_dir"))

    def test_flag_value_reads_flagfiles_as_absl_does(self):
        path = os.path.join(tempfile.mkdtemp(), "job.cfg")
        with open(path, "w") as f:
            f.write("--job_name=worker\n--task_log_dir=/in_file\n")
        argv = ["tf2sync", f"--flagfile={path}"]
        self.assertEqual(console.flag_value(argv, "job_name"), "worker")
        # The last one wins, as in absl: after the file, or before it.
        self.assertEqual(
            console.flag_value([*argv, "--task_log_dir=/a"], "task_log_dir"),
            "/a",
        )
        self.assertEqual(
            console.flag_value(
                ["tf2sync", "--task_log_dir=/a", "--flagfile", path],
                "task_log_dir",
            ),
            "/in_file",
        )
        # A role in a flagfile is not the local mode.
        self.assertFalse(console.runs_local_cluster(argv, {}))
        # A flagfile that cannot be read: absl reports it when it parses.
        missing = ["tf2sync", "--flagfile=/no/such.cfg", "--job_name=ps"]
        self.assertEqual(console.flag_value(missing, "job_name"), "ps")

    def test_is_launcher(self):
        self.assertTrue(console.is_launcher(["/venv/bin/tf2sync", "--x"]))
        self.assertFalse(console.is_launcher(["-m"]))
        self.assertFalse(console.is_launcher(["/usr/bin/python3"]))
        # `python -m tf2sync` while Python imports the package.
        for orig in (
            ["python3", "-m", "tf2sync", "--epochs=2"],
            ["python3", "-u", "-mtf2sync"],
            ["python3", "-um", "tf2sync"],
            ["python3", "-Imtf2sync", "--epochs=2"],
            ["python3", "-Rm", "tf2sync"],
        ):
            self.assertTrue(console.is_launcher(["-m"], orig), orig)
        for orig in (
            ["python3", "-m", "pytest", "tf2sync"],
            ["python3", "-m", "tf2sync.something"],
            ["python3", "-c", "import tf2sync"],
            ["python3", "-um", "pytest"],
        ):
            self.assertFalse(console.is_launcher(["-m"], orig), orig)


class LogDirPruningTest(absltest.TestCase):
    def _parent(self):
        parent = tempfile.TemporaryDirectory()
        self.addCleanup(parent.cleanup)
        return parent.name

    def _log_dir(self, parent, name, age_s, files=("chief.log",)):
        path = os.path.join(parent, console.LOG_DIR_PREFIX + name)
        os.mkdir(path)
        when = time.time() - age_s
        for file in files:
            with open(os.path.join(path, file), "w") as f:
                f.write("x\n")
            os.utime(os.path.join(path, file), (when, when))
        os.utime(path, (when, when))
        return path

    def test_keeps_the_newest_and_the_recently_written(self):
        parent = self._parent()
        day = console.STALE_LOG_DIR_S
        old = [self._log_dir(parent, f"old{i}", 2 * day + i) for i in range(4)]
        new = [self._log_dir(parent, f"new{i}", 60 + i) for i in range(3)]
        # Old by its directory, written an hour ago by a running cluster.
        running = self._log_dir(parent, "running", 3 * day)
        os.utime(os.path.join(running, "chief.log"))
        mine_not = self._log_dir(
            parent, "other", 3 * day, files=("chief.log", "notes.txt")
        )
        unrelated = os.path.join(parent, "tf2sync_bench_logs_x")
        os.mkdir(unrelated)

        removed = console.prune_log_dirs(parent, keep=2)

        # Newest first: running, new0 (the 2 kept), new1, new2 (written
        # within the day), then the old ones; `other` holds a file the
        # launcher does not write.
        self.assertCountEqual(removed, old)
        for path in [*new, running, mine_not, unrelated]:
            self.assertTrue(os.path.isdir(path), path)
        for path in old:
            self.assertFalse(os.path.exists(path), path)

    def test_a_new_temporary_dir_prunes_its_parent(self):
        parent = self._parent()
        old = [
            self._log_dir(parent, f"old{i}", 2 * console.STALE_LOG_DIR_S)
            for i in range(console.KEPT_LOG_DIRS + 2)
        ]
        with mock.patch.object(tempfile, "tempdir", parent):
            made = console.task_log_dir(None)
        self.assertEqual(os.path.dirname(made), parent)
        left = [p for p in old if os.path.exists(p)]
        # The new one and the newest KEPT_LOG_DIRS - 1 old ones stay.
        self.assertLen(left, console.KEPT_LOG_DIRS - 1)
        self.assertTrue(os.path.isdir(made))

    def test_a_requested_dir_prunes_nothing(self):
        parent = self._parent()
        old = [
            self._log_dir(parent, f"old{i}", 2 * console.STALE_LOG_DIR_S)
            for i in range(console.KEPT_LOG_DIRS + 2)
        ]
        console.task_log_dir(os.path.join(parent, "mine"))
        self.assertTrue(all(os.path.isdir(p) for p in old))


if __name__ == "__main__":
    absltest.main()
