"""The report's one table renderer and its arithmetic (no TensorFlow).

A scenario's section is a list of blocks: a string (a paragraph or a
`### heading`) or a `(header, rows)` table; `lines()` writes them all as
Markdown. A target is a row of the report's first table (`target()`).
Every ratio is a ratio of medians of the same run.
"""

from __future__ import annotations

import operator
import statistics

_OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt}


def median(values):
    values = [v for v in values or [] if v is not None]
    return statistics.median(values) if values else None


def ratio(a, b):
    return a / b if a is not None and b else None


def fmt(value, spec=",.0f"):
    return "n/a" if value is None else format(value, spec)


def spread(values):
    """The cells median, min - max and runs of a list of examples/s."""
    low_high = f"{min(values):,.0f} - {max(values):,.0f}"
    return [fmt(median(values)), low_high, len(values)]


def throughput(found, cpu, cells, heads, lead, bases):
    """The (header, rows) of `cells` that ran: `lead(*cell)` (columns
    `heads`), the spread of `found[cell]`, the median's ratio to each of
    `bases` ({column: a cell, None where it is the row's}), CPU us / ex."""
    rows = []
    for cell in (c for c in cells if found.get(c)):
        mid = median(found[cell])
        row = [*lead(*cell), *spread(found[cell])]
        for base in bases.values():
            base = tuple(c if b is None else b for b, c in zip(base, cell))
            row.append(fmt(ratio(mid, median(found.get(base))), ".2f"))
        rows.append(row + [fmt(median(cpu.get(cell)), ".1f")])
    header = [*heads, "median ex/s", "min - max", "runs", *bases]
    return header + ["CPU us / ex"], rows


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def columns(columns, rows):
    """A (header, rows) table of `columns`: (header, key, format or None)."""
    return [name for name, _, _ in columns], [
        [r[k] if spec is None else fmt(r[k], spec) for _, k, spec in columns]
        for r in rows
    ]


def lines(blocks):
    """Markdown lines of a section's blocks (see the module docstring)."""
    out = []
    for block in blocks:
        out += ([block] if isinstance(block, str) else table(*block)) + [""]
    return out


def target(name, value, op, bound, required=None, spec=".2f"):
    """A target's row: PASS when `value op bound`, n/a when not measured."""
    ok = value is not None and bound is not None and _OPS[op](value, bound)
    result = "PASS" if ok else "MISS"
    if value is None:
        result = "n/a (not measured)"
    required = f"{op} {fmt(bound, spec)}" + f" ({required})" * bool(required)
    return {
        "target": name,
        "measured": fmt(value, spec),
        "required": required,
        "result": result,
    }


def runs(records, scenario):
    """The records of `scenario`'s timed runs."""
    return [
        r
        for r in records
        if r.get("scenario") == scenario and "examples_per_sec" in r
    ]


def rates(records, scenario, field="examples_per_sec", key=None):
    """{key(run): [`field` of each run that has it]}; the key is
    (workload, system) by default."""
    key = key or (lambda r: (r["workload"], r["system"]))
    found = {}
    for r in runs(records, scenario):
        if r.get(field) is not None:
            found.setdefault(key(r), []).append(r[field])
    return found


def events(records, scenario, event):
    return [
        r
        for r in records
        if r.get("scenario") == scenario and r.get("event") == event
    ]


def errors(records, scenario):
    return [
        r for r in records if "error" in r and r.get("scenario") == scenario
    ]


def error_row(r):
    return [f"`{r['system']}`", "error", r["error"][:160], 0]
