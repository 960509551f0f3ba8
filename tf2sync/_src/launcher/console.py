"""What the launcher's console shows: tf2sync's and Keras's lines only.

TensorFlow's C++ runtime writes its log (oneDNN, CUDA, CPU feature guard,
gRPC server start, ...) straight to file descriptor 2, before and outside
Python's logging. The launcher's local mode (the whole cluster on this
machine, what a person runs first) moves descriptor 2 to a log file and
gives Python a new `sys.stderr` on the original stream, so Python's lines
(absl and Keras logging, warnings, tracebacks, tf2sync's one-line errors)
still reach the console and TensorFlow's C++ lines go to the file.

`TF_CPP_MIN_LOG_LEVEL` defaults to 1 in every role (a value already in the
environment is kept): INFO lines of the C++ runtime are not written at all,
warnings and errors go to the log file.

Both must happen before TensorFlow loads, and importing `tf2sync` loads it:
`tf2sync/__init__.py` calls `setup_launcher` first thing when the process
is the launcher: the `tf2sync` command (`sys.argv[0]`) or `python -m
tf2sync` (`sys.orig_argv`). This module imports no TensorFlow.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import sys
import tempfile
import time

from absl import flags

_state = {"log_dir": None, "done": False, "console_fd": 2}

# Must be set before TensorFlow's C++ runtime loads (before `import
# tensorflow`): the runtime reads it once.
DEFAULT_TF_CPP_MIN_LOG_LEVEL = "1"


def quiet_tensorflow_info() -> None:
    """Sets `TF_CPP_MIN_LOG_LEVEL` to 1 unless the environment sets it."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", DEFAULT_TF_CPP_MIN_LOG_LEVEL)


# The local mode makes a temporary log directory per run (printed once).
# Making one removes this user's older ones beyond the newest
# `KEPT_LOG_DIRS`, once nothing in them was written for `STALE_LOG_DIR_S`
# (a cluster still running writes to its own), as pytest keeps its last
# few base temporary directories.
LOG_DIR_PREFIX = "tf2sync-logs-"
KEPT_LOG_DIRS = 5
STALE_LOG_DIR_S = 24 * 3600


def task_log_dir(requested: str | None) -> str:
    """`requested` (created if need be), or a new temporary directory
    (older ones pruned: `prune_log_dirs`)."""
    if requested:
        os.makedirs(requested, exist_ok=True)
        return requested
    path = tempfile.mkdtemp(prefix=LOG_DIR_PREFIX)
    prune_log_dirs(os.path.dirname(path), keep=KEPT_LOG_DIRS)
    return path


def prune_log_dirs(parent: str, keep: int, stale_s: float = STALE_LOG_DIR_S):
    """Removes old temporary log directories of the local mode in `parent`.

    A directory goes when its name has `LOG_DIR_PREFIX`, this user owns
    it, it holds nothing but `.log` files, at least `keep` such
    directories were written more recently, and none of its files was
    written in the last `stale_s` seconds. Nothing else is touched, and
    what cannot be read or removed is left as it is.

    Returns:
      The paths removed.
    """
    found = []
    try:
        with os.scandir(parent) as listing:
            entries = list(listing)
    except OSError:
        return []
    for entry in entries:
        if not entry.name.startswith(LOG_DIR_PREFIX):
            continue
        written = _last_write_of_logs(entry)
        if written is not None:
            found.append((written, entry.path))
    found.sort(reverse=True)
    now = time.time()
    removed = []
    for written, path in found[keep:]:
        if now - written >= stale_s:
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                removed.append(path)
    return removed


def _last_write_of_logs(entry) -> float | None:
    """The latest write time of the directory `entry` and its files, or
    None unless it is this user's directory of `.log` files only."""
    try:
        info = entry.stat(follow_symlinks=False)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return None
        latest = info.st_mtime
        with os.scandir(entry.path) as items:
            for item in items:
                item_info = item.stat(follow_symlinks=False)
                if not stat.S_ISREG(item_info.st_mode):
                    return None
                if not item.name.endswith(".log"):
                    return None
                latest = max(latest, item_info.st_mtime)
        return latest
    except OSError:
        return None


def native_logs_to(path: str) -> None:
    """Sends file descriptor 2 to `path`; Python's stderr stays on the console.

    After this call, whatever writes to descriptor 2 directly (TensorFlow's
    C++ logging, child processes that inherit it) appends to `path`, and
    `sys.stderr` (with absl's log handler, which holds its own reference) is
    a new stream on the original descriptor 2. Call it before `import
    tensorflow` so that TensorFlow's Python logger picks the new stream too.

    Args:
      path: The log file; created or appended to.
    """
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    old = sys.stderr
    console = os.dup(2)
    os.set_inheritable(console, False)
    _state["console_fd"] = console
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    os.close(log)
    sys.stderr = os.fdopen(
        console,
        "w",
        buffering=1,
        encoding=getattr(old, "encoding", None) or "utf-8",
        errors="backslashreplace",
    )
    repoint_handlers(old, sys.stderr)


def repoint_handlers(old, new) -> None:
    """Logging handlers already made on `old` (absl's) now write to `new`."""
    import logging

    from absl import logging as absl_logging

    handlers = [absl_logging.get_absl_handler().python_handler]
    loggers = [logging.getLogger()] + [
        logger
        for logger in logging.root.manager.loggerDict.values()
        if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        handlers.extend(logger.handlers)
    for handler in handlers:
        if getattr(handler, "stream", None) in (old, sys.__stderr__):
            handler.stream = new


def flag_value(argv, name):
    """The last `--NAME=V` / `--NAME V` in `argv` (as absl reads), or None.

    A `--flagfile` counts as its lines in its place, as absl reads it. If
    one cannot be read, no flagfile is read here (absl reports it when it
    parses the flags).
    """
    args = _with_flagfiles(argv[1:])
    value = None
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{name}" and i + 1 < len(args):
            value = args[i + 1]
    return value


def _with_flagfiles(args):
    """`args` with each `--flagfile` expanded (absl's own reading)."""
    if not any(a.lstrip("-").startswith("flagfile") for a in args):
        return args
    from absl import flags  # no TensorFlow

    try:
        return flags.FLAGS.read_flags_from_files(args, force_gnu=True)
    except flags.Error:
        return args


def auto_cluster_source(job_name, environ=os.environ) -> str:
    """`--cluster_from=auto`'s source: flags, tf_config, jobset or local.

    Role flags first, then TF_CONFIG, then a JobSet pod, else the local
    mode (the launcher's module docstring).
    """
    from tf2sync._src.launcher import jobset  # no TensorFlow

    if job_name is not None:
        return "flags"
    if environ.get("TF_CONFIG"):
        return "tf_config"
    return "jobset" if jobset.is_jobset(environ) else "local"


def runs_local_cluster(argv, environ=os.environ) -> bool:
    """Whether `argv` and the environment make the launcher's local mode."""
    source = flag_value(argv, "cluster_from") or "auto"
    if source == "auto":
        source = auto_cluster_source(flag_value(argv, "job_name"), environ)
    return source == "local"


def is_launcher(argv=None, orig_argv=None) -> bool:
    """Whether this process is the launcher: `tf2sync` or `python -m tf2sync`.

    Args:
      argv: `sys.argv` (default). While `python -m` imports the package,
        before its `__main__` runs, `argv[0]` is "-m".
      orig_argv: the interpreter's own command line (default
        `sys.orig_argv`), which names the module after `-m`.
    """
    argv = sys.argv if argv is None else argv
    if not argv:
        return False
    if os.path.basename(argv[0]) == "tf2sync":
        return True
    if argv[0] != "-m":
        return False
    orig_argv = (
        getattr(sys, "orig_argv", ()) if orig_argv is None else orig_argv
    )
    for i, arg in enumerate(orig_argv[1:], start=1):
        # `-m`, or flags grouped before it (`-um`), the name after it or
        # in the same word (`-mtf2sync`, `-umtf2sync`).
        match = _DASH_M.match(arg)
        if match:
            module = match.group(1) or "".join(orig_argv[i + 1 : i + 2])
            return module == "tf2sync"
    return False


# Python's flags that take no value, grouped before `m` (`python -Im x`).
_DASH_M = re.compile(r"^-[bBdEiIOPqRsSuvx]*m(.*)$")


def setup_launcher(argv) -> str | None:
    """The local mode's console: TF's C++ log to `<task log dir>/chief.log`.

    Only in the local mode, where the launcher prints the directory (with
    the tasks' logs) once. The roles of a cluster (ps, worker, chief,
    evaluator) keep TensorFlow's log on their stderr, where their
    platform's logs (`kubectl logs`, Slurm's output) show it. Runs once per
    process; a directory that cannot be made is left to the launcher to
    report (it then makes it again).

    Returns:
      The task log directory (`--task_log_dir`, or a new temporary one), or
      None outside the local mode or when the directory cannot be made.
    """
    quiet_tensorflow_info()
    if _state["done"]:
        return _state["log_dir"]
    _state["done"] = True
    if not runs_local_cluster(argv):
        return None
    try:
        log_dir = task_log_dir(flag_value(argv, "task_log_dir"))
        native_logs_to(os.path.join(log_dir, "chief.log"))
    except OSError:
        return None
    _state["log_dir"] = log_dir
    return log_dir


def close_console_fd() -> None:
    """Closes the console's copy (a forked task's, which has its own log);
    `console_fd()` is 2 again."""
    fd = _state["console_fd"]
    if fd > 2:
        with contextlib.suppress(OSError):
            os.close(fd)
    _state["console_fd"] = 2


def console_fd() -> int:
    """The descriptor of the console's stderr: 2, or its copy once moved."""
    return _state["console_fd"]


def launcher_log_dir() -> str | None:
    """The directory `setup_launcher` chose, if it ran and sent logs there."""
    return _state["log_dir"]


# absl's short help: `--help`, `-?`, `--helpshort` (one or two dashes).
_HELP_FLAGS = ("help", "?", "helpshort")


def flags_in_help(*modules) -> None:
    """Makes `--help` list the flags of `modules` (those imported).

    absl's `--help` shows the key flags of the module named by
    `sys.argv[0]`, here the console script (or `tf2sync/__main__.py`),
    which defines none; its usage line is `__main__`'s docstring, which
    the console script lacks. Only when help is asked for: absl prints the
    same text above every usage error, which stays one line.
    """
    main = sys.argv[0]
    args = sys.argv[1:]
    if "--" in args:
        args = args[: args.index("--")]
    if not any(
        arg.startswith("-") and arg.lstrip("-").split("=")[0] in _HELP_FLAGS
        for arg in args
    ):
        return
    for module in modules:
        if module in sys.modules:
            for flag in flags.FLAGS.get_key_flags_for_module(module):
                flags.FLAGS.register_key_flag_for_module(main, flag)
    script = sys.modules.get("__main__")
    if script is not None and not getattr(script, "__doc__", None):
        script.__doc__ = (
            "tf2sync: synchronous parameter-server training. Without role "
            "flags or TF_CONFIG it starts a local cluster (2 workers, 1 ps) "
            f"and trains --job_module on it.\n\nUSAGE: {main} [flags]"
        )
