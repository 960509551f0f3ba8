"""Helpers for tests that start real processes (all on 127.0.0.1).

Every process started here is ended by its PID, with SIGKILL if need be,
and dies with the test's process (`processes.child_kwargs`: SIGKILL from the
kernel on Linux, and a tf2sync process watches its parent itself).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

from tf2sync._src.launcher import processes

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
ENV.pop("TF_CONFIG", None)
# Job modules of the tests (fault_job) import from tests/.
ENV["PYTHONPATH"] = os.pathsep.join(
    p for p in (TESTS_DIR, os.environ.get("PYTHONPATH", "")) if p
)

# Popen arguments for a process that dies with the test's (see the top).
child_kwargs = processes.child_kwargs


def launch(args, env=None, timeout=240):
    """Runs `python -m tf2sync ARGS` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "tf2sync", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **processes.child_kwargs(env or ENV),
    )


def assert_refused(test, out, message, returncode=2):
    """Checks that the launcher run `out` refused before any task started:
    exit `returncode` (None: any non-zero), `message` in its stderr, no
    traceback, no local task started."""
    if returncode is None:
        test.assertNotEqual(out.returncode, 0, out.stderr[-3000:])
    else:
        test.assertEqual(out.returncode, returncode, out.stderr[-3000:])
    test.assertIn(message, out.stderr)
    test.assertNotIn("Traceback", out.stderr)
    test.assertNotIn("local task pids", out.stdout)  # nothing started


def run_python(code, env=None, timeout=120):
    """Runs `python -c CODE` to completion (a fresh interpreter)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        **processes.child_kwargs(env or ENV),
    )


def start(args, env=None, stderr_path=None):
    """Starts `python -m tf2sync ARGS`; stdout piped, stderr to a file."""
    stderr = open(stderr_path, "w") if stderr_path else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "tf2sync", *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        **processes.child_kwargs(env or ENV),
    )


def wait_for_line(process, needle):
    """Reads `process`'s stdout until a line contains `needle`."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} never printed: {''.join(lines)}")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def running(pid):
    """Alive and not a zombie (an unreaped orphan has ended too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return alive(pid)


def parent(pid):
    """The parent PID of `pid` (Linux: /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def wait_gone(pids, seconds):
    """Waits until no PID in `pids` runs; returns the seconds it took.

    Raises AssertionError naming those still running after `seconds`.
    """
    start = time.monotonic()
    while any(running(p) for p in pids):
        if time.monotonic() - start > seconds:
            left = [p for p in pids if running(p)]
            raise AssertionError(f"still running after {seconds} s: {left}")
        time.sleep(0.05)
    return time.monotonic() - start


def kill_pids(pids):
    """SIGKILL to each PID still running (processes not started here)."""
    for pid in pids:
        if running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def kill(process):
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def host_flags(spec):
    flags = [
        "--ps_hosts=" + ",".join(spec["ps"]),
        "--worker_hosts=" + ",".join(spec["worker"]),
    ]
    if "chief" in spec:
        flags.append("--chief_host=" + spec["chief"][0])
    return flags


class Tasks:
    """ps/worker tasks started by a test, ended by PID in `stop`."""

    def __init__(self, spec, env=None, args=()):
        """`args`: extra flags for every task."""
        self._spec = spec
        self._env = env
        self._args = list(args)
        self.processes = {}
        self.ended = []
        for job in ("ps", "worker"):
            for i in range(len(spec[job])):
                self.restart(job, i)

    def restart(self, job, index):
        """(Re)starts task `job:index` at its address."""
        args = [f"--job_name={job}", f"--task_index={index}"]
        args += host_flags(self._spec)
        task_env = dict(self._env or ENV)
        if self._env and "TF_CONFIG" in self._env:
            config = json.loads(self._env["TF_CONFIG"])
            config["task"] = {"type": job, "index": index}
            task_env["TF_CONFIG"] = json.dumps(config)
            args = []
        self.processes[(job, index)] = subprocess.Popen(
            [sys.executable, "-m", "tf2sync", *args, *self._args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            **processes.child_kwargs(task_env),
        )

    def kill(self, job, index):
        process = self.processes[(job, index)]
        kill(process)
        self.ended.append(process.pid)

    def stop(self):
        for process in self.processes.values():
            kill(process)
        return self.ended + [p.pid for p in self.processes.values()]
