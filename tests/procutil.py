"""Helpers for tests that start real processes (all on 127.0.0.1).

Every process started here is ended by its PID, with SIGKILL if need be.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
ENV.pop("TF_CONFIG", None)
# Job modules of the tests (fault_job) import from tests/.
ENV["PYTHONPATH"] = os.pathsep.join(
    p for p in (TESTS_DIR, os.environ.get("PYTHONPATH", "")) if p
)


def launch(args, env=None, timeout=240):
    """Runs `python -m tf2sync ARGS` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "tf2sync", *args],
        capture_output=True,
        text=True,
        env=env or ENV,
        timeout=timeout,
    )


def start(args, env=None):
    """Starts `python -m tf2sync ARGS` with stdout piped, stderr to a file."""
    return subprocess.Popen(
        [sys.executable, "-m", "tf2sync", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env or ENV,
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

    def __init__(self, spec, env=None):
        self.processes = {}
        for job in ("ps", "worker"):
            for i in range(len(spec[job])):
                args = [f"--job_name={job}", f"--task_index={i}"]
                args += host_flags(spec)
                task_env = dict(env or ENV)
                if env and "TF_CONFIG" in env:
                    config = json.loads(env["TF_CONFIG"])
                    config["task"] = {"type": job, "index": i}
                    task_env["TF_CONFIG"] = json.dumps(config)
                    args = []
                self.processes[(job, i)] = subprocess.Popen(
                    [sys.executable, "-m", "tf2sync", *args],
                    env=task_env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )

    def kill(self, job, index):
        kill(self.processes[(job, index)])

    def stop(self):
        for process in self.processes.values():
            kill(process)
        return [p.pid for p in self.processes.values()]
