"""Whether a directory can be saved into or read from, in words.

One check for `Trainer`'s `checkpoint_dir` (`trainer_checks`) and the
launcher's directory flags (`launcher/flag_checks.py`). Nothing here
imports TensorFlow.
"""

from __future__ import annotations

import os
import tempfile


def _is_remote(path: str) -> bool:
    return "://" in path  # gs://, s3://, hdfs://: left to TensorFlow


def directory_problem(path: str | None, *, writable: bool) -> str | None:
    """What is wrong with `path` as a directory to save into (`writable`)
    or read from, in words ("is a file, not a directory"), or None.

    A directory that does not exist yet is fine if its nearest existing
    parent is a writable directory (the first save creates it). Remote
    paths (`scheme://...`) are not checked.
    """
    if not path or _is_remote(path):
        return None
    if os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a directory"
    if not writable:
        return None
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            return "the directory is not writable"
        why = _cannot_create_in(path)
        return f"the directory is not writable ({why})" if why else None
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    why = _cannot_create_in(parent)
    if why:
        return f"cannot be created: {parent} is not writable ({why})"
    return None


def _cannot_create_in(directory: str) -> str | None:
    """Why a file cannot be made in `directory` (the OS's words), or None.

    `os.access` answers for the permission bits, and for root nearly always
    yes: a read-only mount, or a directory such as /proc, refuses only when
    something is made there. So a file is made and removed, once, at the
    start, rather than the first save failing after an epoch trained.
    """
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".tf2sync-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None
