"""The harness's subprocesses (no TensorFlow at import): `Child`, `Registry`
and, child side, `serve` (docs/benchmarks.md#how-the-harness-measures)."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback

MARK = "@@bench "
LOOPBACK = "127.0.0.1"


class ChildError(RuntimeError):
    """A child's error (`fatal` False: it still serves), end or timeout."""

    def __init__(self, message, fatal=True):
        super().__init__(message)
        self.fatal = fatal


def library(name):
    """tf2sync's `_src.<name>`, imported late (it imports TensorFlow)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return __import__(f"tf2sync._src.{name}", fromlist=["_"])


def _stat(pid):
    """/proc/PID/stat's fields after the command; None once `pid` ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields  # a zombie has ended


def start_time(pid):
    """The start time of `pid` (clock ticks since boot), None if gone."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def cpu_seconds(pid, started):
    """CPU seconds of `pid` started at `started`; 0 once it ended."""
    fields = _stat(pid)
    if fields is None or int(fields[19]) != started:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_kb(pid):
    """VmRSS, VmHWM, RssAnon and RssFile of `pid`, in kB."""
    with open(f"/proc/{pid}/status") as f:
        pairs = [line.partition(":")[::2] for line in f]
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    return {k: int(v.split()[0]) for k, v in pairs if k in keys}


def reset_peak(pid):
    """Resets VmHWM of `pid` to its current RSS (Linux >= 4.0)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Child:
    """One subprocess, in its own session, ended by its PID (`protocol`
    False: a server task, which answers no command)."""

    def __init__(self, name, argv, log_path, env=None, protocol=True):
        self.name = name
        self._protocol = protocol
        self._log = open(log_path, "a")  # noqa: SIM115
        full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        full_env.pop("TF_CONFIG", None)
        full_env.update(env or {})
        pipe = subprocess.PIPE
        self.process = subprocess.Popen(
            argv,
            stdin=pipe if protocol else subprocess.DEVNULL,
            stdout=pipe if protocol else self._log,
            stderr=self._log,
            text=True,
            start_new_session=True,
            **library("launcher.processes").child_kwargs(full_env),
        )
        self.pid = self.process.pid
        self.started = start_time(self.pid)
        self._replies = queue.Queue()
        if protocol:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            if line.startswith(MARK):
                with contextlib.suppress(json.JSONDecodeError):
                    self._replies.put(json.loads(line[len(MARK) :]))
                    continue
            self._log.write(line)
            self._log.flush()
        self._replies.put(None)
        self._log.close()

    def send(self, op, **args):
        try:
            self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise ChildError(f"{self.name} is gone ({e}).") from None

    def receive(self, timeout):
        log = self._log.name
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            self.signal(signal.SIGUSR1)  # its Python stacks, into its log
            message = f"did not answer within {timeout:g} s; see {log}."
            raise ChildError(f"{self.name} {message}") from None
        if reply is None:
            message = f"ended (exit code {self.process.poll()}); see {log}."
            raise ChildError(f"{self.name} {message}")
        if "error" in reply:
            raise ChildError(f"{self.name}: {reply['error']}", fatal=False)
        return reply

    def call(self, op, timeout, **args):
        self.send(op, **args)
        return self.receive(timeout)

    def running(self):
        return self.process.poll() is None

    def signal(self, sig):
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def record(self):
        return {"name": self.name, "pid": self.pid, "start_time": self.started}


class Registry:
    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.children = []

    def start(self, name, argv, env=None, protocol=True):
        log_path = os.path.join(self.log_dir, f"{name}.log")
        child = Child(name, argv, log_path, env=env, protocol=protocol)
        self.children.append(child)
        return child

    def stop(self, children):
        stop_all(list(children))

    def stop_all(self):
        stop_all(self.children)

    def cpu_seconds(self):
        return sum(cpu_seconds(c.pid, c.started) for c in self.children)

    def alive(self):
        return [
            c.record() for c in self.children if start_time(c.pid) == c.started
        ]


def _wait_all(children, seconds):
    deadline = time.monotonic() + seconds
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(max(0.0, deadline - time.monotonic()))


def stop_all(children, grace=5.0):
    """`exit`, then SIGTERM (2 s: a server task blocked in `join` ignores
    it), then SIGKILL, each to all still running, `grace` s for them."""
    protocol = [c for c in children if c.running() and c.process.stdin]
    for child in protocol:
        with contextlib.suppress(ChildError):
            child.send("exit")
    _wait_all(protocol, grace)
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, grace)):
        alive = [c for c in children if c.running()]
        for child in alive:
            child.signal(sig)
        _wait_all(alive, wait)
    for child in children:
        if not child._protocol:  # a protocol child's reader closes its log
            child._log.close()


def reply(value):
    sys.stdout.write(MARK + json.dumps(value) + "\n")
    sys.stdout.flush()


def serve(handlers, ready=None):
    """Answers `{"op": NAME, ...}` lines with `handlers[NAME](**args)` until
    `exit` or the end of stdin. SIGUSR1 dumps the stacks."""
    library("launcher.processes").exit_with_parent()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    reply({"op": "ready", "pid": os.getpid(), **(ready or {})})
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "exit":
            break
        if op == "run":
            # What the previous system left for the collector (tf_keras's
            # `fit` leaves a lot) is collected now, outside the timed run.
            gc.collect()
        try:
            reply(handlers[op](**command))
        except Exception as e:  # noqa: BLE001 - sent back to the harness
            tail = traceback.format_exc().strip().splitlines()[-3:]
            reply({"error": f"{type(e).__name__}: {e} | {' / '.join(tail)}"})
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
