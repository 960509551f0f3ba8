"""A local cluster of real processes on 127.0.0.1, stopped by PID.

Its tasks are forks of a `TaskForker` (no second TensorFlow import), or
new interpreters where GPUs are planned.

Also the launcher's process plumbing, the one place that touches the OS's
process machinery:

* `child_kwargs`: `Popen` arguments that tie a child to this process. On
  Linux the kernel sends the child SIGKILL when the thread that started it
  ends (`prctl(PR_SET_PDEATHSIG)`), and `$TF2SYNC_PARENT_PID` has a tf2sync
  child watch for its parent itself (`exit_with_parent`), on any platform.
* `exit_with_parent`: child side: once the process that started this one is
  gone, stop this one's local tasks and exit.
* `exit_on_signals`: the launcher, chief or evaluator: SIGINT and SIGTERM,
  whatever their inherited disposition, stop every local task by PID, print
  one line and exit 130 / 143 at once.
* `serve_forever`: a ps or worker task: SIGINT and SIGTERM exit 0 at once.
* `end_process`: exit without the interpreter's teardown.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tf2sync._src import cluster as cluster_lib
from tf2sync._src.launcher import console as console_lib

# Set in a child's environment by `child_kwargs`: the PID that started it.
PARENT_ENV = "TF2SYNC_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_INTERVAL = 0.5  # seconds between two looks at the parent
_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
_REASONS = {
    signal.SIGINT: "interrupted (Ctrl-C)",
    signal.SIGTERM: "terminated (SIGTERM)",
}
# Taken, never released, by whoever ends the process: the main thread's
# `end_process` then waits for a signal's exit under way, and vice versa.
_EXIT_LOCK = threading.Lock()
# LocalProcessClusters started in this process and not yet stopped.
_CLUSTERS = []


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
    --task_index=...` started with `child_kwargs`. `stop()` (also run on
    exit from the `with` block, and on SIGINT / SIGTERM in the launcher,
    see `exit_on_signals`) sends SIGTERM, then SIGKILL, to each PID.
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

        _CLUSTERS.append(self)  # a signal from now on stops what started
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
                        **child_kwargs(task_env),
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
            _CLUSTERS.remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class TaskForker:
    """A fork of this process that forks local tasks on request.

    A task that is a fork inherits the modules this process imported: it
    starts in well under a second instead of importing TensorFlow again
    (seconds of CPU per task; on 2 cores, most of the local mode's start).
    Tasks are not forked from the launcher itself: by the time the
    cluster starts the launcher may have run TensorFlow code (reading a
    checkpoint directory), and forks of such a process share its
    runtime's state, random generator included (two workers then gave
    their functions' ps parts the same name). This process is forked
    first, before TensorFlow runs anything, and stays idle but for forking
    tasks: each one as `child_kwargs` ties a subprocess, in a session of its
    own, SIGKILL when its parent ends (Linux), `PARENT_ENV` set for its
    `exit_with_parent`, stdout and stderr to its log. The forker dies with
    this process (SIGKILL on Linux; on any platform, when this process's
    end of its pipe closes), and its tasks with it.

    `serve(spec, job, index, args)` runs a task in the fork and does not
    return; create the forker from the main thread before any other thread
    starts, and before any TensorFlow op runs or a GPU is found (the
    launcher checks `runtime.runtime_started()` and otherwise starts
    new interpreters).
    """

    def __init__(self, serve):
        preexec = _pdeathsig_preexec()
        requests, self._requests = os.pipe()
        self._replies, replies = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        self.pid = os.fork()
        if self.pid:
            os.close(requests)
            os.close(replies)
            return
        code = 1
        try:
            os.close(self._requests)
            os.close(self._replies)
            if preexec is not None:
                preexec()
            # It prints nothing: hold none of the launcher's output (a
            # caller reading it to its end must not wait for the forker).
            quiet = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(quiet, fd)
            os.close(quiet)
            console_lib.close_console_fd()
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # reap tasks
            # A Ctrl-C reaches the launcher's process group: the forker
            # stays to reap the tasks the launcher then stops (a task
            # re-parented to a launcher that is PID 1 would stay a zombie).
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _serve_requests(serve, requests, replies, preexec)
            code = 0
        finally:
            os._exit(code)

    def fork(self, request, env, log):
        """Forks one task running `serve(*request)`; returns its handle."""
        import pickle

        data = pickle.dumps((request, dict(env), log))
        os.write(self._requests, len(data).to_bytes(8, "big") + data)
        pid = int.from_bytes(_read_exactly(self._replies, 8), "big")
        return _Forked(pid, self.pid)


def _alive(pid, reaper) -> bool:
    """Whether `pid` runs. A zombie whose parent is `reaper` (the forker)
    is still ending: the forker reaps it. One re-parented elsewhere (to a
    launcher that is PID 1 and reaps nothing) has ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0] != "Z" or int(fields[1]) == reaper
    except FileNotFoundError:
        return False
    except (OSError, IndexError, ValueError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _read_exactly(fd, size):
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError("the task forker is gone")
        data += chunk
    return data


def _serve_requests(serve, requests, replies, preexec):
    """The forker's loop: a task per request, until the pipe closes."""
    import pickle

    while True:
        try:
            size = int.from_bytes(_read_exactly(requests, 8), "big")
            request, env, log = pickle.loads(_read_exactly(requests, size))
        except EOFError:
            return  # the launcher is gone, or done
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(requests)
            os.close(replies)
            _run_task(serve, request, env, log, preexec, parent)
        os.write(replies, pid.to_bytes(8, "big"))


def _run_task(serve, request, env, log, preexec, parent):
    """A forked task: its session, log, environment, then `serve`.

    `parent`: the forker's PID, read before the fork."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        if preexec is not None:
            preexec()
        out = os.open(
            log or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
        )
        for fd in (1, 2):
            os.dup2(out, fd)
        os.close(out)
        # The launcher's Python streams (and absl's handler) may write to
        # its console's descriptor (see `console`): the task's go to its log.
        old = sys.stderr
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        console_lib.repoint_handlers(old, sys.stderr)
        if os.getppid() != parent:  # the forker died before PDEATHSIG was set
            return
        os.environ.clear()
        os.environ.update(env)
        os.environ[PARENT_ENV] = str(parent)
        serve(*request)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - the task's log says why
        import traceback

        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


class _Forked:
    """A forked task, with the part of `subprocess.Popen` that `stop` uses.

    Not this process's child (the forker's, which reaps it): it is running
    while its PID exists.
    """

    def __init__(self, pid, reaper):
        self.pid = pid
        self._reaper = reaper  # the forker
        self.returncode = None

    def poll(self):
        if self.returncode is None and not _alive(self.pid, self._reaper):
            self.returncode = 0  # its code went to the forker
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


def _signal(pid, sig):
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(pid, sig)


def _pdeathsig_preexec():
    """A `preexec_fn` setting PR_SET_PDEATHSIG=SIGKILL; None off Linux.

    libc's `prctl` is looked up here, in the parent: the forked child only
    calls it, then execs.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int
    option = ctypes.c_int(_PR_SET_PDEATHSIG)
    sig = ctypes.c_ulong(int(signal.SIGKILL))

    def set_pdeathsig():
        prctl(option, sig)

    return set_pdeathsig


def child_kwargs(env=None) -> dict:
    """`Popen` keyword arguments for a child that must die with this process.

    `env` (default: this process's environment) gets `PARENT_ENV`, this
    PID, which a tf2sync child watches (`exit_with_parent`); on Linux the
    child also gets PR_SET_PDEATHSIG=SIGKILL, which the kernel sends when
    the thread of this process that started the child ends (start children
    from the main thread).
    """
    kwargs = {"env": dict(os.environ if env is None else env)}
    kwargs["env"][PARENT_ENV] = str(os.getpid())
    preexec = _pdeathsig_preexec()
    if preexec is not None:
        kwargs["preexec_fn"] = preexec
    return kwargs


def exit_with_parent() -> None:
    """Child side: this process ends once the one that started it is gone.

    Only for a child started with `child_kwargs`: `PARENT_ENV` is read, and
    removed from the environment (this process's own children get this
    PID). A daemon thread compares `os.getppid()` with it every
    `WATCH_INTERVAL` s; once this process is re-parented it stops its local
    tasks, prints one line and exits 1. This covers what PR_SET_PDEATHSIG
    does not: other platforms, and a parent gone before the child set up.
    """
    parent = os.environ.pop(PARENT_ENV, "")
    if not parent.isdigit():
        return
    parent = int(parent)

    def watch():
        while os.getppid() == parent:
            time.sleep(WATCH_INTERVAL)
        _end(1, f"the process that started this one (pid {parent}) is gone")

    threading.Thread(
        target=watch, name="tf2sync-parent-watch", daemon=True
    ).start()


def exit_on_signals() -> None:
    """Main thread: SIGINT and SIGTERM end this process, whatever happens.

    Both are handled whatever disposition this process inherited (a
    non-interactive shell's `cmd &` starts it with SIGINT ignored). The
    Python-level handler does nothing: an exception raised into TensorFlow's
    code could surface as a `SystemError`, and the main thread may sit in
    C++ code for long. Instead the signal's number reaches a thread through
    `signal.set_wakeup_fd`, which stops every local task by PID (SIGTERM,
    then SIGKILL), prints one line, e.g. `tf2sync: interrupted (Ctrl-C);
    stopped 3 local tasks.`, and exits 130 (SIGINT) or 143 (SIGTERM) at
    once. Meanwhile what TensorFlow or the main thread print as the tasks go
    is dropped.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def wait():
        while True:
            for number in os.read(read_fd, 64):
                if number in _EXIT_CODES:
                    _end(_EXIT_CODES[number], _REASONS[number])

    threading.Thread(target=wait, name="tf2sync-signals", daemon=True).start()
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for sig in _EXIT_CODES:
        signal.signal(sig, _no_op)


def serve_forever(server) -> None:
    """A ps or worker task: blocks until SIGINT or SIGTERM, then exits 0.

    In-process servers cannot be stopped: the process exits at once
    (`os._exit`), whatever disposition it inherited. Python runs signal
    handlers only between bytecodes, never while the main thread waits in
    `server.join()`, so it waits in Python instead. `server` stays
    referenced meanwhile.
    """
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)  # no `exit_on_signals` thread from here on
    for sig in _EXIT_CODES:
        signal.signal(sig, lambda *_: os._exit(0))
    while server is not None:
        time.sleep(3600)


def end_process(code: int) -> None:
    """Flushes stdout and stderr and exits `code`, skipping the teardown.

    Remote resources cannot be deleted once the tasks are gone; the
    interpreter's teardown would try (and log every failure). If a signal
    (or a gone parent) is already ending the process, waits for that.
    """
    _EXIT_LOCK.acquire()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _no_op(signum, frame):
    del signum, frame


def _end(code, reason):
    """Stops every local task by PID, prints `tf2sync: REASON.`, exits."""
    _EXIT_LOCK.acquire()  # never released
    # The main thread may hold a stream's lock, blocked on a full pipe:
    # flush from a helper, for at most a second.
    flusher = threading.Thread(target=_flush, daemon=True)
    flusher.start()
    flusher.join(1.0)
    saved = None
    with contextlib.suppress(OSError):
        # The console's stderr: descriptor 2, unless the launcher moved
        # TensorFlow's log off it (see `console`).
        console = console_lib.console_fd()
        saved = os.dup(console)
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in {1, 2, console}:
            os.dup2(devnull, fd)
    clusters = list(_CLUSTERS)
    for cluster in clusters:
        with contextlib.suppress(Exception):
            cluster.stop()
    line = f"tf2sync: {reason}"
    if clusters:
        count = sum(len(c.processes) for c in clusters)
        line += f"; stopped {count} local task{'' if count == 1 else 's'}"
    if saved is not None:
        with contextlib.suppress(OSError):
            os.write(saved, (line + ".\n").encode())
    os._exit(code)


def _flush():
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
