"""The ps scenarios `memory` (a subprocess ps's RSS on w3, 1..4 workers)
and `sharding` (w4 over 2 ps): runs, targets, report sections
(docs/benchmarks.md#ps-memory, #sharding)."""

from __future__ import annotations

import itertools
import time

import procs
import tables
from tables import fmt
from tables import median
from tables import ratio
from tables import target

MEMORY_FUNCTIONS = 10  # timed functions per memory cell (peaks show at once)
# So that the ps's RSS follows what it holds (docs/benchmarks.md#ps-memory):
# TF's plain CPU allocator, glibc mmapping and unmapping from 128 kB up.
MEMORY_ENV = {
    "TF_ENABLE_ONEDNN_OPTS": "0",
    "MALLOC_MMAP_THRESHOLD_": "131072",
    "MALLOC_TRIM_THRESHOLD_": "131072",
    "MALLOC_ARENA_MAX": "2",
}
# Embedding rows of w3 and of w3_x4, the memory scenario's 4 x control.
EMBEDDING_ROWS = {"w3": 100_000, "w3_x4": 400_000}
EMBEDDING_MB = EMBEDDING_ROWS["w3"] * 32 * 4 / 1e6
# ps state growth per added worker at most, as a share of the embedding.
MEMORY_PER_WORKER = 0.25
# Each tf2sync loop's reference: stock PSS with the same function form.
MEMORY_REFERENCE = {
    "tf2sync_loop": "pss_async_unrolled",
    "tf2sync_loop_while": "pss_async",
}
SHARDS = 2  # the sharding scenario's shards and ps tasks
LOOP_AND_STOCK = ("tf2sync_loop", "pss_async_unrolled")
SHARDING_SYSTEMS = ("tf2sync_fit", "tf2sync_loop", "pss_async")
SHARDING_SYSTEMS += ("pss_async_unrolled", "tf1_sync")
# Its timed cells, (system, workload, ps tasks, shards per variable): w4;
# w3 in 2 shards on 2 ps, whole on 1; whole variables round robin on 2 ps.
SHARDING_CELLS = tuple(
    (system, "w4", SHARDS, SHARDS) for system in SHARDING_SYSTEMS
) + tuple(
    (system, *cell)
    for cell in (("w3", 2, 2), ("w3", 1, 1), ("w3", 2, 1), ("w1", 2, 1))
    for system in LOOP_AND_STOCK
)
# Its memory cells, set up one after the other on one fresh cluster: first
# a small model, the fixed cost of a system on a ps.
SHARDING_MEMORY_CELLS = (("tf2sync_loop", "w1"),) + tuple(
    (system, "w4") for system in SHARDING_SYSTEMS[:-1]
)
_ROWS = {"w1": 0, "w3": 100_000}  # embedding rows (w4's: the flag)
# Issue 18's bars on w4 (2 shards, 2 ps): (system, baseline, at least).
SHARDING_BARS = tuple(
    (system, base, least)
    for base, least in (("tf1_sync", 1.0), ("pss_async_unrolled", 0.9))
    for system in ("tf2sync_fit", "tf2sync_loop")
)
SHARD_STATE_FACTOR = 1.25  # a ps's state <= this x its shards' bytes + fixed
# Issue 51: w3's 2-ps / 1-ps ratio at least this x stock PSS's own ratio,
# and whole variables round robin at least this x stock PSS unrolled.
SHARDED_W3_OF_STOCK = 0.95
ROUND_ROBIN_AT_LEAST = 0.85


def settled(pids, seconds=1.0, slack_kb=64, most=15.0):
    """[memory_kb(pid)] once every RssAnon moved < slack_kb for `seconds`."""
    deadline = time.monotonic() + most
    last = [procs.memory_kb(pid) for pid in pids]
    while time.monotonic() < deadline:
        time.sleep(seconds)
        now = [procs.memory_kb(pid) for pid in pids]
        if all(
            abs(a.get("RssAnon", 0) - b.get("RssAnon", 0)) < slack_kb
            for a, b in zip(now, last)
        ):
            return now
        last = now
    return last


def scenario_memory(bench, workload="w3"):
    """RSS of a subprocess ps, each cell `memory_repeats` times on a fresh
    cluster, the cells interleaved (docs/benchmarks.md#ps-memory)."""
    s = bench.s
    most = max(s.memory_workers)
    ends = sorted({min(s.memory_workers), most})
    cells = [("tf2sync_loop", n, workload) for n in s.memory_workers]
    stock = ("tf2sync_loop_while", "pss_async", "pss_async_unrolled")
    cells += [(system, n, workload) for system in stock for n in ends]
    cells += [("tf2sync_loop", n, "w3_x4") for n in ends]
    cells = [(*c, s.optimizer) for c in cells]
    cells.append(("pss_async", most, workload, "keras"))
    functions = min(s.functions[workload], MEMORY_FUNCTIONS)
    for repeat, cell in itertools.product(range(s.memory_repeats), cells):
        system, n, cell_workload, kind = cell
        fields = {"workload": cell_workload, "workers": n, "optimizer": kind}
        base = {**bench.base("memory", functions, **fields), "repeat": repeat}
        name = f"memory_{system}_{kind}_{cell_workload}_{n}w"
        spec, tasks = bench.start_tasks(name, n, env=MEMORY_ENV)
        chief = bench.start_pss(name, n, spec=spec, optimizer=kind)
        endpoint = bench.pss(system, chief, n, system, cell_workload)
        try:
            _measure_memory(bench, endpoint, tasks[0].pid, base)
        except (procs.ChildError, OSError) as e:
            bench.fail([endpoint], endpoint, e, base)
        finally:
            bench.registry.stop([chief, *tasks])


def _measure_memory(bench, endpoint, ps_pid, base):
    bench.wait_ready([endpoint], base)
    if endpoint.failed:
        return
    [idle] = settled([ps_pid])
    bench.setup([endpoint], base)
    if endpoint.failed:
        return
    state = procs.memory_kb(ps_pid)
    reset = procs.reset_peak(ps_pid)
    result = endpoint.run(base["functions"], bench.s.k, bench.s.timeout)
    after = procs.memory_kb(ps_pid)
    record = {**base, "system": endpoint.name, "ps_pid": ps_pid}
    for name, got in (("idle", idle), ("state", state)):
        record[f"rss_{name}_kb"] = got["VmRSS"]
        record[f"anon_{name}_kb"] = got.get("RssAnon")
    record.update(hwm_run_kb=after["VmHWM"], rss_after_kb=after["VmRSS"])
    record.update(anon_after_kb=after.get("RssAnon"), peak_reset=reset)
    bench.sink.write({**record, **result})


def _sharding_cells(bench, workers, cells, chief_of):
    """The endpoints of sharding cells (system, workload, ps, shards), each
    on `chief_of(system, ps)`, and {name: the fields of its records}."""
    endpoints, extra = [], {}
    for system, workload, ps, shards in cells:
        name = f"{system}_{workload}_{ps}ps" + ("_rr" if shards < ps else "")
        rows = _ROWS.get(workload, bench.s.sharding_rows)
        extra[name] = {"config": system, "workload": workload, "ps": ps}
        extra[name].update(shards=shards, rows=rows)
        chief = chief_of(system, ps)
        if workload == "w4":
            workload = bench.s.sharding_workload
        if system == "tf1_sync":
            endpoints.append(bench.tf1(name, chief, workers))
        else:
            pss = bench.pss(name, chief, workers, system, workload, shards)
            endpoints.append(pss)
    return endpoints, extra


def scenario_sharding(bench, workers=2):
    """Memory on a fresh cluster of subprocess tasks, one system set up at
    a time; then throughput on in-process clusters, interleaved."""
    s = bench.s
    functions = s.functions["w4"]
    base = bench.base("sharding", functions, workers=workers)
    _sharding_memory(bench, base, workers)
    chiefs = {
        SHARDS: bench.start_pss("sharding_2ps", workers, ps=SHARDS),
        1: bench.start_pss("sharding_1ps", workers),
    }
    chiefs["tf1"] = bench.start_tf1(
        s.sharding_workload, workers, SHARDS, SHARDS, "sharding_tf1_sync"
    )
    endpoints, extra = _sharding_cells(
        bench,
        workers,
        SHARDING_CELLS,
        lambda system, ps: chiefs["tf1" if system == "tf1_sync" else ps],
    )
    bench.run_all(endpoints, functions, base, extra, setup_extra=extra)


def _sharding_memory(bench, base, workers):
    s = bench.s
    spec, tasks = bench.start_tasks(
        "sharding_memory", workers, env=MEMORY_ENV, ps=SHARDS
    )
    chief = bench.start_pss("sharding_memory", workers, spec=spec)
    pids = [t.pid for t in tasks[:SHARDS]]
    cells = [(*cell, SHARDS, SHARDS) for cell in SHARDING_MEMORY_CELLS]
    endpoints, extra = _sharding_cells(bench, workers, cells, lambda *_: chief)
    memory = {**base, "memory_cluster": True}
    try:
        bench.wait_ready(endpoints, memory)
        empty = settled(pids)
        for endpoint in endpoints:
            if endpoint.failed:
                continue
            before = settled(pids)
            got = bench.setup([endpoint], memory, extra).get(endpoint.name)
            if got is None:
                continue
            after = settled(pids)
            by_ps = got.get("ps_bytes", {})
            tasks_memory = [
                {
                    "task": i,
                    "pid": pid,
                    "bytes": by_ps.get(str(i), 0),
                    "rss_empty_kb": empty[i]["VmRSS"],
                    "anon_empty_kb": empty[i].get("RssAnon"),
                    "anon_before_kb": before[i].get("RssAnon"),
                    "anon_after_kb": after[i].get("RssAnon"),
                    "rss_after_kb": after[i]["VmRSS"],
                }
                for i, pid in enumerate(pids)
            ]
            record = {**memory, **extra[endpoint.name]}
            record.update(system=endpoint.name, event="ps_memory")
            bench.sink.write({**record, "ps_tasks": tasks_memory})
        for endpoint in endpoints:  # each tf2sync system's per-step peak
            fields = extra[endpoint.name]
            if endpoint.failed or not endpoint.name.startswith("tf2sync"):
                continue
            if fields["workload"] != "w4":
                continue
            rss = [procs.memory_kb(pid)["VmRSS"] for pid in pids]
            reset = [procs.reset_peak(pid) for pid in pids]
            functions = min(base["functions"], MEMORY_FUNCTIONS)
            endpoint.run(functions, s.k, s.timeout)
            hwm = [procs.memory_kb(pid)["VmHWM"] for pid in pids]
            record = {**memory, **fields, "system": endpoint.name}
            peak = [h - r for h, r in zip(hwm, rss)]
            record.update(event="ps_peak", peak_kb=peak, peak_reset=all(reset))
            bench.sink.write(record)
    except (procs.ChildError, OSError) as e:
        error = {"system": "sharding_memory", "error": str(e)}
        bench.sink.write({**memory, **error})
    finally:
        bench.registry.stop([chief, *tasks])


# -- memory: targets and section --------------------------------------------


def _state_mb(r):
    if r.get("anon_state_kb") is not None:  # allocations only, no code
        return (r["anon_state_kb"] - r["anon_idle_kb"]) / 1e3
    return (r["rss_state_kb"] - r["rss_idle_kb"]) / 1e3


def memory_cells(records):
    """One row per memory cell (system, workers, optimizer, workload), in
    the order measured: the median state over its repeats (one RSS reading
    moves by MBs between runs), the largest per-step peak, its runs."""
    names = ("system", "workers", "optimizer", "workload")
    cells = {}
    for r in records:
        if r.get("scenario") == "memory" and "rss_state_kb" in r:
            cells.setdefault(tuple(r[n] for n in names), []).append(r)
    return [
        {
            **dict(zip(names, key)),
            "idle_mb": median([r["rss_idle_kb"] / 1e3 for r in rs]),
            "state_mb": median([_state_mb(r) for r in rs]),
            "peak_mb": max(
                (r["hwm_run_kb"] - r["rss_state_kb"]) / 1e3 for r in rs
            ),
            "peak_reset": all(r["peak_reset"] for r in rs),
            "runs": len(rs),
        }
        for key, rs in cells.items()
    ]


def _minus(a, b):
    return None if None in (a, b) else a - b


def memory_targets(records):
    """Each tf2sync loop's state growth per added worker beyond that of
    stock PSS in the same form; with 4 x the table minus with w3's; the
    largest per-step peak (all in MB)."""
    cells = memory_cells(records)

    def growth(system, workload="w3", kind=None):
        """State MB per added worker, from the fewest to the most."""
        key = (system, workload)
        found = [c for c in cells if kind in (None, c["optimizer"])]
        found = [c for c in found if (c["system"], c["workload"]) == key]
        found.sort(key=lambda c: c["workers"])
        added = found[-1]["workers"] - found[0]["workers"] if found else 0
        if added:
            return (found[-1]["state_mb"] - found[0]["state_mb"]) / added
        return None

    most, share = MEMORY_PER_WORKER * EMBEDDING_MB, f"{MEMORY_PER_WORKER:.0%}"
    rows = []
    for system, stock in MEMORY_REFERENCE.items():
        kind = next((c["optimizer"] for c in cells if c["system"] == system), 0)
        beyond = _minus(growth(system), growth(stock, kind=kind))
        name = f"ps memory: {system} state growth per added worker, beyond "
        name += f"{stock}'s (MB)"
        rows.append(
            target(name, beyond, "<=", most, f"{share} of the embedding", ".1f")
        )
    x4 = _minus(growth("tf2sync_loop", "w3_x4"), growth("tf2sync_loop"))
    name = "ps memory: tf2sync_loop state growth per added worker with 4 x "
    name += "the embedding, minus with w3's (MB)"
    rows.append(
        target(name, x4, "<=", most, f"{share} of w3's embedding", ".1f")
    )
    loop = ("tf2sync_loop", "w3")
    peak = [c["peak_mb"] for c in cells if (c["system"], c["workload"]) == loop]
    name = "ps memory: tf2sync largest per-step peak (MB)"
    peak = max(peak, default=None)
    rows.append(
        target(name, peak, "<", EMBEDDING_MB, "the embedding's size", ".1f")
    )
    return rows


MEMORY_COLUMNS = (
    ("system", "system", None),
    ("workers", "workers", None),
    ("optimizer", "optimizer", None),
    ("embedding rows", "rows", ","),
    ("ps RSS idle MB", "idle_mb", ".1f"),
    ("state MB", "state_mb", ".1f"),
    ("per-step peak MB", "peak", None),
    ("runs", "runs", None),
)


def memory_section(records):
    found = memory_cells(records)
    if not found:
        return []
    for c in found:
        c["rows"] = EMBEDDING_ROWS[c["workload"]]
        c["peak"] = fmt(c["peak_mb"], ".1f") + " (*)" * (not c["peak_reset"])
    return [
        f"w3, embedding {EMBEDDING_MB:.1f} MB; the ps a process of its own; "
        "idle and state medians of the runs, the peak the largest. Columns "
        "and references: docs/benchmarks.md#ps-memory.",
        tables.columns(MEMORY_COLUMNS, found),
    ]


# -- sharding: targets and section ------------------------------------------


def sharding_rates(records, field="examples_per_sec"):
    """{(workload, config, ps tasks, shards): [`field` of each timed run]}
    (shards 1 on several ps: whole variables placed round robin)."""

    def key(r):
        return r["workload"], r["config"], r["ps"], r.get("shards", r["ps"])

    return tables.rates(records, "sharding", field, key)


def sharding_memory(records):
    """One dict per (system, ps task) set up on the 2-ps cluster: bytes,
    state, `fixed` and the bound (MB; docs/benchmarks.md#sharding)."""
    peaks = {
        (r["config"], r["workload"], i): kb / 1e3
        for r in tables.events(records, "sharding", "ps_peak")
        for i, kb in enumerate(r["peak_kb"])
    }
    rows = [
        {
            "system": r["config"],
            "workload": r["workload"],
            "task": t["task"],
            "bytes_mb": t["bytes"] / 1e6,
            "state_mb": (t["anon_after_kb"] - t["anon_before_kb"]) / 1e3,
            "empty_rss_mb": t["rss_empty_kb"] / 1e3,
            "rss_after_mb": t["rss_after_kb"] / 1e3,
            "peak_mb": peaks.get((r["config"], r["workload"], t["task"])),
        }
        for r in tables.events(records, "sharding", "ps_memory")
        for t in r["ps_tasks"]
    ]
    fixed = {m["task"]: m["state_mb"] for m in rows if m["workload"] == "w1"}
    for m in rows:
        small = m["workload"] == "w1"
        m["fixed_mb"] = fixed.get(m["task"])
        m["label"] = m["workload"] + " (fixed)" * small
        m["per_byte"] = None if small else ratio(m["state_mb"], m["bytes_mb"])
        m["bound_mb"] = None
        if m["fixed_mb"] is not None and not small:
            m["bound_mb"] = SHARD_STATE_FACTOR * m["bytes_mb"] + m["fixed_mb"]
    return rows


def sharding_targets(records):
    """None when the scenario did not run."""
    if not any(r.get("scenario") == "sharding" for r in records):
        return []
    found = sharding_rates(records)

    def over(cell, base):
        return ratio(median(found.get(cell)), median(found.get(base)))

    rows = [
        target(
            f"w4 (2 shards, 2 ps) {system} / {base}",
            over(("w4", system, 2, 2), ("w4", base, 2, 2)),
            ">=",
            least,
        )
        for system, base, least in SHARDING_BARS
    ]
    factor = SHARD_STATE_FACTOR
    memory = [
        m
        for m in sharding_memory(records)
        if m["workload"] == "w4" and m["system"].startswith("tf2sync")
    ]
    for m in memory:
        name = f"ps memory, w4: {m['system']} state on ps {m['task']} (MB)"
        bound = f"{factor} x its shards' {m['bytes_mb']:.1f} MB + the fixed "
        bound += f"{fmt(m['fixed_mb'], '.1f')} MB"
        rows.append(
            target(name, m["state_mb"], "<=", m["bound_mb"], bound, ".1f")
        )
    if not memory:
        row = target("ps memory, w4: tf2sync state per ps", None, "<=", None)
        row["required"] = f"<= {factor} x its shards' bytes + the fixed cost"
        rows.append(row)
    own = [over(("w3", c, 2, 2), ("w3", c, 1, 1)) for c in LOOP_AND_STOCK]
    name = "w3 2 shards on 2 ps / on 1 ps: tf2sync_loop's ratio / "
    name += "pss_async_unrolled's"
    own = None if None in own else ratio(*own)
    rows.append(target(name, own, ">=", SHARDED_W3_OF_STOCK))
    for w in ("w1", "w3"):
        name = f"{w} round robin on 2 ps: tf2sync_loop / pss_async_unrolled"
        cells = [(w, c, 2, 1) for c in LOOP_AND_STOCK]
        rows.append(target(name, over(*cells), ">=", ROUND_ROBIN_AT_LEAST))
    return rows


SHARDING_MEMORY_COLUMNS = (
    ("system", "system", None),
    ("workload", "label", None),
    ("ps", "task", None),
    ("empty ps RSS MB", "empty_rss_mb", ".1f"),
    ("shards' bytes MB", "bytes_mb", ".1f"),
    ("state MB", "state_mb", ".1f"),
    ("state / bytes", "per_byte", ".2f"),
    (f"bound MB ({SHARD_STATE_FACTOR} x bytes + fixed)", "bound_mb", ".1f"),
    ("per-step peak MB", "peak_mb", ".1f"),
    ("ps RSS after setup MB", "rss_after_mb", ".1f"),
)


def sharding_section(records):
    found = sharding_rates(records)
    failed = tables.errors(records, "sharding")
    if not found and not failed:
        return []
    cpu = sharding_rates(records, "cpu_us_per_example")
    w4 = [r for r in tables.runs(records, "sharding") if r["workload"] == "w4"]
    rows = fmt(w4[0].get("rows") if w4 else None, ",")
    blocks = [
        f"w4: Embedding {rows} x 32, 2 workers and 2 ps, every variable of "
        "rank >= 1 in 2 shards, one per ps; see docs/benchmarks.md#sharding.",
        "### w4 throughput (2 workers + 2 ps)",
    ]
    _ = None  # in a base cell: the row's own
    vs = ("tf1_sync", "pss_async_unrolled", "pss_async")
    header, rows = tables.throughput(
        found,
        cpu,
        [("w4", c, 2, 2) for c in SHARDING_SYSTEMS],
        ["system"],
        lambda w, c, ps, n: [f"`{c}`"],
        {f"vs {b}": (_, b, _, _) for b in vs},
    )
    blocks.append((header, rows + [tables.error_row(r) for r in failed]))
    w3 = tables.throughput(
        found,
        cpu,
        [("w3", c, ps, ps) for c in LOOP_AND_STOCK for ps in (1, 2)],
        ["system", "ps", "partitioned"],
        lambda w, c, ps, n: [
            f"`{c}`",
            str(ps),
            f"{n} shards" * (n > 1) or "none",
        ],
        {"vs 1 ps": (_, _, 1, 1)},
    )
    if w3[1]:
        blocks += [
            "### w3 on 2 ps against 1 ps",
            "w3 in 2 shards on the 2-ps cluster against whole on 1 ps, "
            "in the same rounds.",
            w3,
        ]
    rr = tables.throughput(
        found,
        cpu,
        [(w, c, 2, 1) for w in ("w1", "w3") for c in LOOP_AND_STOCK],
        ["workload", "system"],
        lambda w, c, ps, n: [w, f"`{c}`"],
        {"vs pss_async_unrolled": (_, "pss_async_unrolled", _, _)},
    )
    if rr[1]:
        blocks += [
            "### Whole variables round robin over 2 ps",
            "No partitioner: each variable whole on one of the 2 ps.",
            rr,
        ]
    memory = sharding_memory(records)
    if memory:
        blocks += [
            "### ps memory under sharding",
            "Each system set up one at a time on a fresh cluster of "
            "subprocess tasks (2 ps, 2 workers); MB per ps.",
            tables.columns(SHARDING_MEMORY_COLUMNS, memory),
        ]
    tf1 = [
        r
        for r in tables.events(records, "sharding", "setup")
        if r.get("config") == "tf1_sync" and r.get("ps_bytes")
    ]
    if tf1:
        placed = sorted(tf1[0]["ps_bytes"].items())
        blocks.append(
            "TF1's variables (with slots and the SyncReplicasOptimizer's "
            "step variables) by ps: "
            + ", ".join(f"ps {k}: {v / 1e6:,.1f} MB" for k, v in placed)
            + "."
        )
    return blocks
