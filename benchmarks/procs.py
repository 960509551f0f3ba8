"""Subprocess plumbing of the benchmark harness (no TensorFlow here).

Parent side (the harness): `Child` starts one process in its own session,
talks to it with one JSON command per line on its stdin and one reply per
line on its stdout (marked with `MARK`; other lines go to its log), and ends
it by PID: an `exit` command, then SIGTERM, then SIGKILL, each bounded in
time. `Registry` remembers every process started and ends them all.

Child side: `die_with_parent()` makes the kernel kill the child if the
harness dies first (so nothing is left behind even on SIGKILL); `serve()`
answers commands until `exit` or the end of stdin.

`python benchmarks/procs.py MODULE ARGS...` runs `python -m MODULE ARGS...`
(e.g. a `tf2sync` ps task) under `die_with_parent()`.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import json
import os
import queue
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

MARK = "@@bench "
LOOPBACK = "127.0.0.1"
_PARENT_ENV = "TF2SYNC_BENCH_PARENT"
_PR_SET_PDEATHSIG = 1


class ChildError(RuntimeError):
    """A child answered with an error, ended, or did not answer in time.

    `fatal` is False only for an error answer: the child still serves.
    """

    def __init__(self, message, fatal=True):
        super().__init__(message)
        self.fatal = fatal


# pick_free_ports and wait_for_port repeat tf2sync/_src/{cluster,processes}.py
# on purpose: importing anything from tf2sync imports TensorFlow, which the
# harness's parent process never does.


def pick_free_ports(count: int) -> list[int]:
    """Returns `count` distinct TCP ports free on 127.0.0.1 right now."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


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
                raise ChildError(f"Nothing answered at {address}.") from None
            time.sleep(0.1)


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command, None if `pid` ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields  # a zombie has ended


def start_time(pid: int) -> int | None:
    """The start time of `pid` (clock ticks since boot), None if gone."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def is_alive(pid: int, started: int | None) -> bool:
    """True if the process `pid` that started at `started` still runs."""
    now = start_time(pid)
    return now is not None and now == started


def cpu_seconds(pid: int, started: int | None) -> float:
    """User + system CPU seconds of the process `pid` that started at
    `started` (all its threads); 0 if it has ended."""
    fields = _stat(pid)
    if fields is None or int(fields[19]) != started:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_kb(pid: int) -> dict:
    """VmRSS, VmHWM (peak RSS), RssAnon and RssFile of `pid` in kB (/proc).

    RssAnon is what the process allocated; RssFile is mostly the code of
    its libraries, paged in as new code runs.
    """
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                values[key] = int(rest.split()[0])
    return values


def reset_peak(pid: int) -> bool:
    """Resets VmHWM of `pid` to its current RSS (Linux >= 4.0)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Child:
    """One subprocess, ended only by its own PID (its session's group).

    Args:
      name: A label for logs and errors.
      argv: The command line.
      log_path: Where its stderr (and unmarked stdout) goes.
      env: Extra environment variables.
      protocol: Whether it answers commands (False: a plain server task).
    """

    def __init__(self, name, argv, log_path, env=None, protocol=True):
        self.name = name
        self._protocol = protocol
        self._log = open(log_path, "a")  # noqa: SIM115
        full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        full_env.pop("TF_CONFIG", None)
        full_env[_PARENT_ENV] = str(os.getpid())
        full_env.update(env or {})
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if protocol else subprocess.DEVNULL,
            stdout=subprocess.PIPE if protocol else self._log,
            stderr=self._log,
            env=full_env,
            text=True,
            start_new_session=True,
        )
        self.pid = self.process.pid
        self.started = start_time(self.pid)
        self._replies = queue.Queue()
        if protocol:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            try:
                if line.startswith(MARK):
                    self._replies.put(json.loads(line[len(MARK) :]))
                    continue
            except json.JSONDecodeError:
                pass
            self._log.write(line)
            self._log.flush()
        self._replies.put(None)
        self._log.close()

    def close_log(self) -> None:
        """Closes the log of a plain task (a protocol child's is closed by
        its reader at the end of its stdout)."""
        if not self._protocol:  # else the reader closes it at the end
            self._log.close()

    def send(self, op: str, **args) -> None:
        """Sends one command; `receive` gets its answer."""
        try:
            self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise ChildError(f"{self.name} is gone ({e}).") from None

    def receive(self, timeout: float) -> dict:
        """The next answer; raises `ChildError` on error, end or timeout."""
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            self.signal(signal.SIGUSR1)  # its Python stacks, into its log
            raise ChildError(
                f"{self.name} did not answer within {timeout:g} s; see "
                f"{self._log.name}."
            ) from None
        if reply is None:
            raise ChildError(
                f"{self.name} ended (exit code {self.process.poll()}); "
                f"see {self._log.name}."
            )
        if "error" in reply:
            raise ChildError(f"{self.name}: {reply['error']}", fatal=False)
        return reply

    def call(self, op: str, timeout: float, **args) -> dict:
        """Sends a command and waits for its answer."""
        self.send(op, **args)
        return self.receive(timeout)

    def running(self) -> bool:
        """Whether the process has not ended (reaps it if it has)."""
        return self.process.poll() is None

    def ask_exit(self) -> None:
        """Sends `exit` (a protocol child then ends itself)."""
        if self.running() and self.process.stdin:
            with contextlib.suppress(ChildError):
                self.send("exit")

    def signal(self, sig) -> None:
        """Sends `sig` to the child's own process group (pgid == pid)."""
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def stop(self, grace: float = 5.0) -> None:
        """Ends the process: `exit`, then SIGTERM, then SIGKILL, by PID."""
        stop_all([self], grace)

    def record(self) -> dict:
        """Name, PID and start time (to tell a reused PID apart)."""
        return {"name": self.name, "pid": self.pid, "start_time": self.started}


class Registry:
    """Every process the harness started, to end them all by PID."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.children = []

    def start(self, name, argv, env=None, protocol=True) -> Child:
        """Starts a `Child`, logging to `<log_dir>/<name>.log`."""
        log_path = os.path.join(self.log_dir, f"{name}.log")
        child = Child(name, argv, log_path, env=env, protocol=protocol)
        self.children.append(child)
        return child

    def stop(self, children) -> None:
        """Ends `children` (all at once, bounded in time)."""
        stop_all(list(children))

    def stop_all(self) -> None:
        """Ends every process started."""
        self.stop(self.children)

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by the started processes still running."""
        return sum(cpu_seconds(c.pid, c.started) for c in self.children)

    def alive(self) -> list[dict]:
        """The records of started processes that still run."""
        return [c.record() for c in self.children if is_alive(c.pid, c.started)]


def _wait_all(children, seconds):
    deadline = time.monotonic() + seconds
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(max(0.0, deadline - time.monotonic()))


def stop_all(children, grace: float = 5.0) -> None:
    """Ends `children` by PID: `exit`, then SIGTERM, then SIGKILL.

    Each phase goes to every child still running at once, then waits at
    most `grace` seconds for them all (plain server tasks get no `exit`
    and only a short wait after SIGTERM: a tf2sync ps or worker task
    blocked in `server.join()` does not run its SIGTERM handler).
    """
    protocol = [c for c in children if c.running() and c.process.stdin]
    for child in protocol:
        child.ask_exit()
    _wait_all(protocol, grace)
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, grace)):
        alive = [c for c in children if c.running()]
        for child in alive:
            child.signal(sig)
        _wait_all(alive, wait)
    for child in children:
        child.close_log()


def die_with_parent() -> None:
    """Child side: the kernel sends SIGKILL here when the harness ends."""
    parent = os.environ.get(_PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):  # the harness ended before prctl
        os._exit(1)


def reply(value: dict) -> None:
    """Child side: writes one marked answer line."""
    sys.stdout.write(MARK + json.dumps(value) + "\n")
    sys.stdout.flush()


def serve(handlers: dict, ready: dict | None = None) -> None:
    """Child side: answers commands from stdin, then exits the process.

    SIGUSR1 writes every thread's Python stack to stderr (the harness sends
    it when an answer is late).

    Each line is `{"op": NAME, ...args}`; `handlers[NAME](**args)` returns
    the answer (a dict). An exception answers `{"error": ...}`. `exit` or
    the end of stdin ends the process with `os._exit(0)` (in-process TF
    servers cannot be stopped otherwise).
    """
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    reply({"op": "ready", "pid": os.getpid(), **(ready or {})})
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "exit":
            break
        if op == "run":
            # What the previous system left for the garbage collector
            # (tf_keras's `fit` leaves a lot) is collected now, outside the
            # timed window. (The idle runs after `fit` needed more: see
            # systems.FitRunner._settle.)
            gc.collect()
        try:
            reply(handlers[op](**command))
        except Exception as e:  # noqa: BLE001 - sent back to the harness
            tail = traceback.format_exc().strip().splitlines()[-3:]
            reply({"error": f"{type(e).__name__}: {e} | {' / '.join(tail)}"})
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    die_with_parent()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
