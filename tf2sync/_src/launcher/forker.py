"""A fork of the launcher that forks the local mode's tasks on request
(`TaskForker`), and the forked tasks' handles."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from tf2sync._src.launcher import console as console_lib
from tf2sync._src.launcher import processes


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
    tasks: each one as `processes.child_kwargs` ties a subprocess, in a
    session of its own, SIGKILL when its parent ends (Linux),
    `processes.PARENT_ENV` set for its `processes.exit_with_parent`, stdout
    and stderr to its log. The forker dies with this process (SIGKILL on
    Linux; on any platform, when this process's end of its pipe closes),
    and its tasks with it.

    `serve(spec, job, index, args)` runs a task in the fork and does not
    return; create the forker from the main thread before any other thread
    starts, and before any TensorFlow op runs or a GPU is found (the
    launcher checks `runtime.runtime_started()` and otherwise starts
    new interpreters).
    """

    def __init__(self, serve):
        preexec = processes.pdeathsig_preexec()
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
        os.environ[processes.PARENT_ENV] = str(parent)
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
