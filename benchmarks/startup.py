"""The `startup` scenario: time to the first applied update, each repeat
in a fresh `startup_worker.py` process (docs/benchmarks.md#startup)."""

from __future__ import annotations

import procs
import tables
from tables import fmt
from tables import median
from tables import ratio
from tables import target

SYSTEMS = (
    "tf2sync_fit",
    "pss_async_fit",
    "tf2sync_trainer",
    "tf2sync_loop",
    "pss_async",
)
# Also measurable (--startup_systems): tf2sync's loop in a tf.while_loop
# of single steps, which traces one copy of the step, as stock PSS does.
EXTRA_SYSTEMS = ("tf2sync_loop_while",)
# Each tf2sync system and the stock PSS system it is compared with.
PAIRS = (
    ("tf2sync_fit", "pss_async_fit"),
    ("tf2sync_trainer", "pss_async"),
    ("tf2sync_loop", "pss_async"),
    ("tf2sync_loop_while", "pss_async"),
)
WORKLOADS = ("w1", "w2", "digits", "resnet50")
WORKLOAD_TEXT = {
    "w1": "MLP 32-64-10, batch 32/worker",
    "w2": "the harness's CNN on 32x32x3, batch 64/worker",
    "digits": "the launcher's digits conv net, batch 32/worker",
    "resnet50": "ResNet-50 (weights=None) on 64x64x3, batch 4/worker",
}
# The fields of a measurement, in the table's order: (field, header).
FIELDS = (
    ("before_schedule_s", "to 1st schedule s"),
    ("trace_s", "(a) trace s"),
    ("register_s", "(b) register + 1st run s"),
    ("steady_function_s", "(c) 1 function s"),
    ("first_function_s", "to 1st result s"),
    ("first_update_s", "to 1st update s"),
    ("gc_s", "GC in it s"),
)
# Fields with no tf2sync / stock ratio in the table.
NO_RATIO = ("gc_s",)
# Issue 21: tf2sync's time to its first applied update at most this x stock
# PSS's, per workload, fit and custom loop.
FIRST_UPDATE_AT_MOST = 1.5
TARGET_PAIRS = PAIRS[:3]


def scenario_startup(bench, workers=2):
    """Each (workload, system) `startup_repeats` times, a fresh process
    each, interleaved; one record per measurement."""
    s = bench.s
    base = {"scenario": "startup", "workers": workers}
    base.update(steps_per_function=s.k, rounds=s.startup_rounds)
    for workload in s.startup_workloads:
        order = list(s.startup_systems)
        for repeat in range(s.startup_repeats):
            shift = repeat % len(order)
            for system in order[shift:] + order[:shift]:
                _measure(bench, {**base, "workload": workload}, system, repeat)


def _measure(bench, base, system, repeat):
    s = bench.s
    name = f"startup_{base['workload']}_{system}_{repeat}"
    argv = bench.python("startup_worker.py", f"--workers={base['workers']}")
    child = bench.start(name, argv)
    record = {**base, "system": system, "repeat": repeat}
    try:
        ready = child.receive(s.timeout)
        args = {"system": system, "workload": base["workload"], "k": s.k}
        answer = child.call("measure", s.timeout, **args, rounds=base["rounds"])
        answer.pop("op", None)
        bench.sink.write({**record, **answer, "ready_s": ready.get("ready_s")})
    except procs.ChildError as e:
        bench.sink.write({**record, "error": str(e)})
    finally:
        bench.registry.stop([child])


def _ratio(a, b):
    """a / b, None where b is under 1 ms (a loop's `to 1st schedule` in
    runs that started its clock after its iterator)."""
    return ratio(a, b) if b is not None and b >= 0.001 else None


def medians(records) -> dict:
    """{(workload, system): {field: median}} with "runs" the count."""
    found = {}
    for r in records:
        if r.get("scenario") == "startup" and "first_update_s" in r:
            found.setdefault((r["workload"], r["system"]), []).append(r)
    return {
        key: {"runs": len(rs)}
        | {f: median([r.get(f) for r in rs]) for f, _ in FIELDS}
        for key, rs in found.items()
    }


def startup_targets(records):
    """tf2sync / stock PSS, first applied update (none when not run)."""
    found = medians(records)
    rows = []
    for workload in WORKLOADS:
        for ours, theirs in TARGET_PAIRS:
            a, b = found.get((workload, ours)), found.get((workload, theirs))
            if a or b:
                name = f"{workload}: first applied update, {ours} / {theirs}"
                got = (
                    a and b and ratio(a["first_update_s"], b["first_update_s"])
                )
                rows.append(target(name, got, "<=", FIRST_UPDATE_AT_MOST))
    return rows


def startup_section(records):
    """The split per workload and system, and tf2sync / stock PSS."""
    found = medians(records)
    failed = tables.errors(records, "startup")
    if not found and not failed:
        return []
    measured = {workload for workload, _ in found}
    described = [
        f"* {w}: {WORKLOAD_TEXT[w]}" for w in WORKLOADS if w in measured
    ]
    rows = []
    for workload in WORKLOADS:
        shown = set()
        for ours, theirs in PAIRS:
            for system in (ours, theirs):
                m = found.get((workload, system))
                if m and system not in shown:
                    shown.add(system)
                    cells = [fmt(m[f], ".3f") for f, _ in FIELDS]
                    rows.append([workload, f"`{system}`", *cells, m["runs"]])
            a, b = found.get((workload, ours)), found.get((workload, theirs))
            if a and b:
                cells = [
                    "" if f in NO_RATIO else fmt(_ratio(a[f], b[f]), ".2f")
                    for f, _ in FIELDS
                ]
                rows.append([workload, f"{ours} / {theirs}", *cells, ""])
    header = ["workload", "system", *[h for _, h in FIELDS], "runs"]
    errors = [
        f"- {r.get('workload')} `{r.get('system')}` repeat "
        f"{r.get('repeat')}: error {r['error'][:200]}"
        for r in failed
    ]
    return [
        "Seconds from the first call to the first applied update, fresh "
        "processes, medians; ratios tf2sync / stock PSS. Columns: "
        "docs/benchmarks.md#startup.",
        *(["\n".join(described)] if described else []),
        (header, rows),
        *(["\n".join(errors)] if errors else []),
    ]
