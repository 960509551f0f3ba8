"""The command: `python -m tf2sync.migrate PROGRAM.py [PROGRAM2.py ...]`.

Prints one line per construct and line,
`PROGRAM.py:LINE: construct -> TF2/tf2sync form (docs/migrating.md#anchor)`,
then a summary line counting each kind, and exits 0. A missing or
unreadable file, or one that is not valid Python, is refused with one
line naming it (and the syntax error's line) and exit code 2, before any
finding is printed.
"""

from __future__ import annotations

import collections
import os
import sys

from tf2sync._src.migrate import finder
from tf2sync._src.migrate import table

PROG = "python -m tf2sync.migrate"
_SHORT_USAGE = f"usage: {PROG} PROGRAM.py [PROGRAM2.py ...]"
USAGE = (
    f"usage: {PROG} PROGRAM.py [PROGRAM2.py ...]: prints the distributed-"
    f"TF1 constructs of each program (read, never run) and their "
    f"tf2sync forms ({table.DOC})"
)


class UsageError(Exception):
    """A bad argument: its message is the one line the command prints."""


def _read(path: str) -> list[finder.Finding]:
    if not os.path.exists(path):
        raise UsageError(f"PROGRAM {path!r}: no such file")
    if os.path.isdir(path):
        raise UsageError(f"PROGRAM {path!r} is a directory, not a program")
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as e:
        raise UsageError(
            f"PROGRAM {path!r} cannot be read: {e.strerror}"
        ) from None
    try:
        return finder.find(source, path)
    except SyntaxError as e:
        where = f"line {e.lineno}: " if e.lineno else ""
        raise UsageError(
            f"PROGRAM {path!r} is not valid Python: {where}{e.msg}"
        ) from None


def format_finding(path: str, f: finder.Finding) -> str:
    """`PATH:LINE: construct -> form (docs/migrating.md#anchor)`."""
    return f"{path}:{f.line}: {f.text} -> {f.form} ({f.construct.link})"


def summary(findings: list[finder.Finding], files: int) -> str:
    """One line: how many constructs of each kind, in the table's order."""
    where = f"{files} file" + ("s" if files != 1 else "")
    if not findings:
        return f"{PROG}: no distributed-TF1 constructs in {where}"
    counts = collections.Counter(f.name for f in findings)
    parts = ", ".join(
        f"{c.name} {counts[c.name]}" for c in table.CONSTRUCTS if counts[c.name]
    )
    plural = "s" if len(findings) != 1 else ""
    return f"{PROG}: {len(findings)} construct{plural} in {where}: {parts}"


def main(argv: list[str] | None = None, out=None, err=None) -> int:
    """Runs the command.

    Args:
      argv: the arguments after the command (default `sys.argv[1:]`).
      out: where findings and the summary go (default `sys.stdout`).
      err: where the one-line refusal goes (default `sys.stderr`).

    Returns:
      0 when every program was read, 2 on a bad argument.
    """
    argv = sys.argv[1:] if argv is None else argv
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if argv in (["-h"], ["--help"]):
        print(USAGE, file=out)
        return 0
    try:
        if not argv:
            raise UsageError(f"no PROGRAM given ({_SHORT_USAGE})")
        for arg in argv:
            if arg.startswith("-"):
                raise UsageError(
                    f"unknown option {arg!r} (the only one is --help; "
                    f"{_SHORT_USAGE}; a program named so: ./{arg})"
                )
        results = [(path, _read(path)) for path in argv]
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=err)
        return 2
    everything = []
    for path, findings in results:
        for f in findings:
            print(format_finding(path, f), file=out)
        everything += findings
    print(summary(everything, len(results)), file=out)
    return 0
