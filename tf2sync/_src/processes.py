"""A local cluster of real processes on 127.0.0.1, stopped by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import tensorflow as tf

from tf2sync._src import cluster as cluster_lib


def wait_for_port(address: str, timeout: float) -> None:
    """Blocks until `address` ("host:port") accepts TCP, or raises."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"No task answered at {address} within {timeout:g} s "
                    "(`--connect_timeout`). Check that the task is started "
                    "and that the address is right."
                ) from None
            time.sleep(0.1)


class LocalProcessCluster:
    """ps and worker tasks as subprocesses on 127.0.0.1, with free ports.

    Each task is `python -m tf2sync --job_name=... --task_index=...` in its
    own process group. `stop()` (also run on exit from the `with` block,
    and on Ctrl-C in the launcher) sends SIGTERM, then SIGKILL, to each PID.
    """

    def __init__(
        self, num_workers: int, num_ps: int, *, log_dir=None, num_gpus=None
    ):
        self.spec = cluster_lib.cluster_spec_dict(num_workers, num_ps)
        self.processes = []
        self._log_dir = log_dir
        self._num_gpus = num_gpus

    def start(self, timeout: float = 60.0):
        """Starts every task; returns the chief's cluster resolver."""
        common = [
            "--ps_hosts=" + ",".join(self.spec["ps"]),
            "--worker_hosts=" + ",".join(self.spec["worker"]),
            "--chief_host=" + self.spec["chief"][0],
        ]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        env.pop("TF_CONFIG", None)
        for job in ("ps", "worker"):
            for index in range(len(self.spec[job])):
                task_env = dict(env)
                task_args = []
                if job == "ps":
                    task_env["CUDA_VISIBLE_DEVICES"] = ""
                elif self._num_gpus is not None:
                    # Disjoint GPUs per worker on this one machine.
                    first = index * self._num_gpus
                    task_env["CUDA_VISIBLE_DEVICES"] = ",".join(
                        str(first + i) for i in range(self._num_gpus)
                    )
                    task_args.append(f"--num_gpus={self._num_gpus}")
                out = subprocess.DEVNULL
                if self._log_dir:
                    os.makedirs(self._log_dir, exist_ok=True)
                    out = open(  # noqa: SIM115
                        os.path.join(self._log_dir, f"{job}{index}.log"), "w"
                    )
                self.processes.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "tf2sync",
                            f"--job_name={job}",
                            f"--task_index={index}",
                            *common,
                            *task_args,
                        ],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=task_env,
                        start_new_session=True,
                    )
                )
        try:
            for address in self.spec["ps"] + self.spec["worker"]:
                wait_for_port(address, timeout)
        except BaseException:
            self.stop()
            raise
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.spec),
            task_type="chief",
            task_id=0,
            rpc_layer="grpc",
        )

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def stop(self, grace: float = 5.0) -> None:
        """Ends every task by PID: SIGTERM, then SIGKILL after `grace` s."""
        for p in self.processes:
            if p.poll() is None:
                _signal(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.processes:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(p.pid, signal.SIGKILL)
                p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _signal(pid, sig):
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(pid, sig)
