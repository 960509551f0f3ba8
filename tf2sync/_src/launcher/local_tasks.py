"""A local cluster of real processes on 127.0.0.1, stopped by PID.

Its tasks are forks of a `forker.TaskForker` (no second TensorFlow import),
or new interpreters where GPUs are planned; `processes` ties each to the
launcher. Also `wait_for_port`, for a task to answer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

from tf2sync._src import cluster as cluster_lib
from tf2sync._src.launcher import processes as processes_lib


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


def gpu_plan(num_workers: int, per_worker: int, available: int):
    """`(CUDA_VISIBLE_DEVICES per worker, shared)` for local workers.

    Disjoint GPUs (`per_worker` each) when the machine has enough;
    otherwise worker i takes GPUs `i * per_worker ...` modulo `available`,
    so workers share them (`shared`: each process must then grow its
    memory rather than take it all). With `per_worker` 0 or no GPU, every
    worker sees none ("").
    """
    if per_worker <= 0 or available <= 0:
        return [""] * num_workers, False
    shared = num_workers * per_worker > available
    per_worker = min(per_worker, available)
    visible = [
        ",".join(
            str((index * per_worker + i) % available) for i in range(per_worker)
        )
        for index in range(num_workers)
    ]
    return visible, shared


def machine_gpus() -> int:
    """GPUs this machine shows TensorFlow (no device is initialised)."""
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


class LocalProcessCluster:
    """ps and worker tasks as processes on 127.0.0.1, with free ports.

    Each task runs in its own process group and dies with this process,
    even on SIGKILL: a fork of `forker` (a `TaskForker`) where one is given
    and no GPUs are planned, otherwise `python -m tf2sync --job_name=...
    --task_index=...` started with `processes.child_kwargs`. `stop()`
    (also run on exit from the `with` block, and on SIGINT / SIGTERM in the
    launcher, see `processes.exit_on_signals`) sends SIGTERM, then SIGKILL,
    to each PID.
    """

    def __init__(
        self,
        num_workers: int,
        num_ps: int,
        *,
        log_dir=None,
        num_gpus=None,
        worker_args=None,
        forker=None,
    ):
        """`worker_args`: None, or one list of extra flags per worker.

        `forker`: None, or a `TaskForker`: each task is then a fork of it
        rather than a new interpreter (without GPUs planned: they take a
        new interpreter's GPU runtime).
        """
        self.spec = cluster_lib.cluster_spec_dict(num_workers, num_ps)
        self.processes = []
        self._forker = forker if num_gpus is None else None
        self._log_dir = log_dir
        self._num_gpus = num_gpus
        self._worker_args = worker_args

    def start(self, timeout: float = 60.0):
        """Starts every task; returns the chief's cluster resolver."""
        import tensorflow as tf

        # A signal from now on stops what started.
        processes_lib.LOCAL_CLUSTERS.append(self)
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
                if job == "worker" and self._worker_args:
                    task_args.extend(self._worker_args[index])
                if job == "ps":
                    task_env["CUDA_VISIBLE_DEVICES"] = ""
                elif self._num_gpus is not None:
                    visible, shared = gpu_plan(
                        len(self.spec["worker"]),
                        self._num_gpus,
                        machine_gpus(),
                    )
                    task_env["CUDA_VISIBLE_DEVICES"] = visible[index]
                    if shared:  # several processes on one GPU: grow
                        task_env["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"
                    task_args.append(f"--num_gpus={self._num_gpus}")
                log = None
                if self._log_dir:
                    os.makedirs(self._log_dir, exist_ok=True)
                    log = os.path.join(self._log_dir, f"{job}{index}.log")
                if self._forker is not None:
                    self.processes.append(
                        self._forker.fork(
                            (self.spec, job, index, task_args), task_env, log
                        )
                    )
                    continue
                out = subprocess.DEVNULL
                if log:
                    out = open(log, "w")  # noqa: SIM115
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
                        start_new_session=True,
                        **processes_lib.child_kwargs(task_env),
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
        processes = list(self.processes)
        for p in processes:
            if p.poll() is None:
                _signal(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in processes:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(p.pid, signal.SIGKILL)
                p.wait()
        with contextlib.suppress(ValueError):
            processes_lib.LOCAL_CLUSTERS.remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _signal(pid, sig):
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(pid, sig)
