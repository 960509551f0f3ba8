"""The launcher's processes end with it; its errors end on one line.

Every process is started on 127.0.0.1 and ended by its PID in a `finally`.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap

import procutil
import pytest
from absl.testing import absltest

import tf2sync
from tf2sync._src.launcher import local_tasks
from tf2sync._src.launcher import processes

# Every test here starts real processes.
pytestmark = pytest.mark.slow

# Starts a ps task as the launcher would, but with the parent watch only
# (no PR_SET_PDEATHSIG), prints its PID, then waits to be killed.
_MIDDLE = textwrap.dedent(
    """
    import os, subprocess, sys, time
    ps_hosts, worker_hosts, stderr_path = sys.argv[1:]
    env = dict(os.environ, {parent_env}=str(os.getpid()))
    task = subprocess.Popen(
        [sys.executable, "-m", "tf2sync", "--job_name=ps",
         "--ps_hosts=" + ps_hosts, "--worker_hosts=" + worker_hosts],
        env=env, stdout=subprocess.DEVNULL, stderr=open(stderr_path, "w"),
        start_new_session=True,
    )
    print(task.pid, flush=True)
    time.sleep(3600)
    """
).format(parent_env=processes.PARENT_ENV)


class LauncherDeathTest(absltest.TestCase):
    def test_sigkilled_launcher_takes_its_local_tasks_along(self):
        launcher = procutil.start(["--epochs=1000"])
        pids = []
        forker = None
        try:
            for line in launcher.stdout:
                match = re.search(r"tf2sync: local task pids=(\[.*\])", line)
                if match:
                    pids = json.loads(match.group(1))
                if "Epoch" in line:  # training, every task serving
                    break
            self.assertLen(pids, 3)
            self.assertTrue(all(procutil.running(p) for p in pids))
            # The tasks are forks (no interpreter started with task flags)
            # of one forker, the launcher's child (forker.TaskForker).
            forkers = {procutil.parent(p) for p in pids}
            self.assertLen(forkers, 1)
            forker = forkers.pop()
            self.assertEqual(procutil.parent(forker), launcher.pid)
            for pid in pids:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    self.assertNotIn(b"--job_name", f.read())
            launcher.send_signal(signal.SIGKILL)  # no handler runs
            launcher.wait(timeout=30)
            # Every task exits by itself, the forker too: PR_SET_PDEATHSIG
            # (Linux), or each task's parent watch (0.5 s polls) within a
            # few seconds.
            seconds = procutil.wait_gone([*pids, forker], 10.0)
        finally:
            procutil.kill(launcher)
            procutil.kill_pids(pids + ([forker] if forker else []))
        print(f"local tasks gone {seconds:.2f} s after the launcher's SIGKILL")

    def test_a_task_whose_parent_dies_exits_by_the_parent_watch(self):
        spec = tf2sync.testing.cluster_spec_dict(1, 1)
        stderr_path = os.path.join(tempfile.mkdtemp(), "ps.err")
        middle = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _MIDDLE,
                ",".join(spec["ps"]),
                ",".join(spec["worker"]),
                stderr_path,
            ],
            stdout=subprocess.PIPE,
            text=True,
            **procutil.child_kwargs(procutil.ENV),
        )
        task = []
        try:
            task = [int(middle.stdout.readline())]
            local_tasks.wait_for_port(spec["ps"][0], 120)  # it serves
            middle.send_signal(signal.SIGKILL)
            middle.wait(timeout=30)
            seconds = procutil.wait_gone(task, 10.0)
        finally:
            procutil.kill(middle)
            procutil.kill_pids(task)
        with open(stderr_path) as f:
            lines = f.read().splitlines()
        self.assertEqual(
            lines[-1],
            f"tf2sync: the process that started this one (pid {middle.pid})"
            " is gone.",
        )
        print(f"ps gone {seconds:.2f} s after its parent's SIGKILL")


class ChiefErrorTest(absltest.TestCase):
    def _chief(self, *args):
        spec = tf2sync.testing.cluster_spec_dict(2, 1)  # nothing serves
        out = procutil.launch(
            [
                "--job_name=chief",
                *procutil.host_flags(spec),
                "--connect_timeout=1",
                *args,
            ],
            timeout=120,
        )
        return spec, out

    def test_an_error_ends_on_its_one_line(self):
        spec, out = self._chief()
        self.assertEqual(out.returncode, 1, out.stderr[-3000:])
        self.assertNotIn("Traceback", out.stderr)
        self.assertEqual(
            out.stderr.splitlines()[-1],
            f"tf2sync: TimeoutError: No task answered at {spec['ps'][0]} "
            "within 1 s (`--connect_timeout`). Check that the task is "
            "started and that the address is right. (--verbosity=1 prints "
            "the traceback)",
        )

    def test_verbosity_1_prints_the_traceback_too(self):
        spec, out = self._chief("--verbosity=1")
        self.assertEqual(out.returncode, 1, out.stderr[-3000:])
        self.assertIn("Traceback (most recent call last)", out.stderr)
        self.assertRegex(
            out.stderr.splitlines()[-1],
            rf"^tf2sync: TimeoutError: No task answered at {spec['ps'][0]}",
        )


if __name__ == "__main__":
    absltest.main()
