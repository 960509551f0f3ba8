"""The launcher's process plumbing, the one place that touches the OS's
process machinery (the local mode's tasks: `local_tasks`, `forker`):

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
import sys
import threading
import time

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
# `local_tasks.LocalProcessCluster`s started in this process and not yet
# stopped (a signal or a gone parent stops them).
LOCAL_CLUSTERS = []


def pdeathsig_preexec():
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
    preexec = pdeathsig_preexec()
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
    clusters = list(LOCAL_CLUSTERS)
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
