"""The ps scenarios `memory` (a subprocess ps's RSS on w3, 1..4 workers)
and `sharding` (w4 over 2 ps): runs, targets, report sections
(docs/benchmarks.md#ps-memory, #sharding)."""

from __future__ import annotations

import itertools
import time

import procs
from driver import Endpoint
from tables import error_row
from tables import errors
from tables import events
from tables import fmt
from tables import median
from tables import rates
from tables import ratio
from tables import runs
from tables import spread
from tables import target

MEMORY_FUNCTIONS = 10  # timed functions per memory cell (peaks show at once)
# So that the ps's RSS follows what it holds and a transient buffer shows in
# its peak: TF's plain CPU allocator (oneDNN's caches freed buffers in a BFC
# pool), and glibc mmaps allocations from 128 kB up and unmaps them when
# freed (by default, freed buffers stay in the heap).
MEMORY_ENV = {
    "TF_ENABLE_ONEDNN_OPTS": "0",
    "MALLOC_MMAP_THRESHOLD_": "131072",
    "MALLOC_TRIM_THRESHOLD_": "131072",
    "MALLOC_ARENA_MAX": "2",
}
# Embedding rows of w3 and of w3_x4, the memory scenario's 4 x control.
EMBEDDING_ROWS = {"w3": 100_000, "w3_x4": 400_000}
EMBEDDING_MB = EMBEDDING_ROWS["w3"] * 32 * 4 / 1e6
# ps state growth per added worker, as a share of the embedding's size: a
# dense per-worker buffer of the table would add 1.0.
MEMORY_PER_WORKER = 0.25
# Stock PSS with the same function form as each tf2sync loop. The ps holds
# each worker's instance of a function, so the form alone moves the growth
# per worker (stock PSS on w3: ~1 MB in the loop, ~5 MB repeated 10 x).
MEMORY_REFERENCE = {
    "tf2sync_loop": "pss_async_unrolled",
    "tf2sync_loop_while": "pss_async",
}
SHARDS = 2  # the sharding scenario's shards and ps tasks
SHARDING_SYSTEMS = (
    "tf2sync_fit",
    "tf2sync_loop",
    "pss_async",
    "pss_async_unrolled",
    "tf1_sync",
)
# Its timed cells: (system, workload, ps tasks, shards per variable).
SHARDING_CELLS = (
    *[(system, "w4", SHARDS, SHARDS) for system in SHARDING_SYSTEMS],
    # w3 sharded on 2 ps and whole on 1: each system's 2-ps / 1-ps ratio;
    # then no partitioner, whole variables round robin over 2 ps.
    *[
        (system, workload, ps, shards)
        for workload, ps, shards in (
            ("w3", SHARDS, SHARDS),
            ("w3", 1, 1),
            ("w3", SHARDS, 1),
            ("w1", SHARDS, 1),
        )
        for system in ("tf2sync_loop", "pss_async_unrolled")
    ],
)
# Its memory cells, set up one after the other on one fresh cluster: first
# a small model, the fixed cost of a system on a ps.
SHARDING_MEMORY_CELLS = (
    ("tf2sync_loop", "w1"),
    ("tf2sync_fit", "w4"),
    ("tf2sync_loop", "w4"),
    ("pss_async", "w4"),
    ("pss_async_unrolled", "w4"),
)
_ROWS = {"w1": 0, "w3": 100_000}  # embedding rows (w4's: the flag)
# Issue 18's bars on w4 (2 shards, 2 ps): (system, baseline, at least).
SHARDING_BARS = (
    ("tf2sync_fit", "tf1_sync", 1.0),
    ("tf2sync_loop", "tf1_sync", 1.0),
    ("tf2sync_fit", "pss_async_unrolled", 0.9),
    ("tf2sync_loop", "pss_async_unrolled", 0.9),
)
SHARD_STATE_FACTOR = 1.25  # a ps's state <= this x its shards' bytes + fixed
# Issue 51: w3's 2-ps / 1-ps ratio at least this x stock PSS's own ratio
# (on shared cores a second ps adds no compute), and whole variables
# round robin over 2 ps at least this x stock PSS unrolled.
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
    ends = sorted({min(s.memory_workers), max(s.memory_workers)})
    cells = [
        ("tf2sync_loop", n, s.optimizer, workload) for n in s.memory_workers
    ]
    cells += [
        (system, n, s.optimizer, workload)
        for system in ("tf2sync_loop_while", "pss_async", "pss_async_unrolled")
        for n in ends
    ]
    cells += [("tf2sync_loop", n, s.optimizer, "w3_x4") for n in ends]
    cells.append(("pss_async", max(s.memory_workers), "keras", workload))
    functions = min(s.functions[workload], MEMORY_FUNCTIONS)
    for repeat, (system, n, kind, cell_workload) in itertools.product(
        range(s.memory_repeats), cells
    ):
        base = {
            "scenario": "memory",
            "workload": cell_workload,
            "workers": n,
            "optimizer": kind,
            "steps_per_function": s.k,
            "functions": functions,
            "repeat": repeat,
        }
        name = f"memory_{system}_{kind}_{cell_workload}_{n}w"
        spec, tasks = bench.start_tasks(name, n, env=MEMORY_ENV)
        chief = bench.start_pss(name, n, cluster_spec=spec, optimizer=kind)
        args = {"system": system, "workload": cell_workload, "k": s.k}
        endpoint = Endpoint(system, "pss", [chief], args, n)
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
    bench.sink.write(
        {
            **base,
            "system": endpoint.name,
            "ps_pid": ps_pid,
            "rss_idle_kb": idle["VmRSS"],
            "anon_idle_kb": idle.get("RssAnon"),
            "rss_state_kb": state["VmRSS"],
            "anon_state_kb": state.get("RssAnon"),
            "hwm_run_kb": after["VmHWM"],
            "rss_after_kb": after["VmRSS"],
            "anon_after_kb": after.get("RssAnon"),
            "peak_reset": reset,
            **result,
        }
    )


def _sharding_cell(s, system, workload, ps, shards):
    """(endpoint name, setup args, record fields) of a sharding cell."""
    name = f"{system}_{workload}_{ps}ps" + ("_rr" if shards < ps else "")
    args = {"system": system, "workload": s.sharding_workload, "k": s.k}
    if workload != "w4":
        args["workload"] = workload
    if shards > 1:
        args["shards"] = shards
    fields = {
        "config": system,
        "workload": workload,
        "ps": ps,
        "shards": shards,
        "rows": _ROWS.get(workload, s.sharding_rows),
    }
    return name, args, fields


def scenario_sharding(bench, workers=2):
    """Memory on a fresh cluster of subprocess tasks, one system set up at
    a time; then throughput on in-process clusters, interleaved."""
    s = bench.s
    functions = s.functions["w4"]
    base = {
        "scenario": "sharding",
        "workers": workers,
        "steps_per_function": s.k,
        "functions": functions,
    }
    _sharding_memory(bench, base, workers)
    chiefs = {
        SHARDS: bench.start_pss("sharding_2ps", workers, ps=SHARDS),
        1: bench.start_pss("sharding_1ps", workers),
    }
    tf1 = bench.start_tf1(
        s.sharding_workload, workers, SHARDS, SHARDS, "sharding_tf1_sync"
    )
    endpoints, extra = [], {}
    for system, workload, ps, shards in SHARDING_CELLS:
        name, args, extra[name] = _sharding_cell(
            s, system, workload, ps, shards
        )
        if system == "tf1_sync":
            endpoint = Endpoint(name, "tf1", [tf1], {"steps": 2 * s.k}, workers)
        else:
            endpoint = Endpoint(name, "pss", [chiefs[ps]], args, workers)
        endpoints.append(endpoint)
    bench.run_all(endpoints, functions, base, extra, setup_extra=extra)


def _sharding_memory(bench, base, workers):
    s = bench.s
    spec, tasks = bench.start_tasks(
        "sharding_memory", workers, env=MEMORY_ENV, ps=SHARDS
    )
    chief = bench.start_pss("sharding_memory", workers, cluster_spec=spec)
    pids = [t.pid for t in tasks[:SHARDS]]
    endpoints, extra = [], {}
    for system, workload in SHARDING_MEMORY_CELLS:
        cell = _sharding_cell(s, system, workload, SHARDS, SHARDS)
        name, args, extra[name] = cell
        endpoints.append(Endpoint(name, "pss", [chief], args, workers))
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
            bench.sink.write(
                {
                    **memory,
                    **extra[endpoint.name],
                    "system": endpoint.name,
                    "event": "ps_memory",
                    "ps_tasks": tasks_memory,
                }
            )
        for endpoint in endpoints:  # each tf2sync system's per-step peak
            if endpoint.failed or not endpoint.name.startswith("tf2sync"):
                continue
            if extra[endpoint.name]["workload"] != "w4":
                continue
            rss = [procs.memory_kb(pid)["VmRSS"] for pid in pids]
            reset = [procs.reset_peak(pid) for pid in pids]
            functions = min(base["functions"], MEMORY_FUNCTIONS)
            endpoint.run(functions, s.k, s.timeout)
            hwm = [procs.memory_kb(pid)["VmHWM"] for pid in pids]
            bench.sink.write(
                {
                    **memory,
                    **extra[endpoint.name],
                    "system": endpoint.name,
                    "event": "ps_peak",
                    "peak_kb": [h - r for h, r in zip(hwm, rss)],
                    "peak_reset": all(reset),
                }
            )
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
    cells = {}
    for r in records:
        if r.get("scenario") == "memory" and "rss_state_kb" in r:
            key = (r["system"], r["workers"], r["optimizer"], r["workload"])
            cells.setdefault(key, []).append(r)
    names = ("system", "workers", "optimizer", "workload")
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
        found = sorted(
            (
                c
                for c in cells
                if (c["system"], c["workload"]) == (system, workload)
                and kind in (None, c["optimizer"])
            ),
            key=lambda c: c["workers"],
        )
        added = found[-1]["workers"] - found[0]["workers"] if found else 0
        if added:
            return (found[-1]["state_mb"] - found[0]["state_mb"]) / added
        return None

    most, share = MEMORY_PER_WORKER * EMBEDDING_MB, f"{MEMORY_PER_WORKER:.0%}"
    rows = []
    for system, stock in MEMORY_REFERENCE.items():
        kind = next((c["optimizer"] for c in cells if c["system"] == system), 0)
        rows.append(
            target(
                f"ps memory: {system} state growth per added worker, beyond "
                f"{stock}'s (MB)",
                _minus(growth(system), growth(stock, kind=kind)),
                "<=",
                most,
                f"{share} of the embedding",
                ".1f",
            )
        )
    peak = [
        c["peak_mb"]
        for c in cells
        if (c["system"], c["workload"]) == ("tf2sync_loop", "w3")
    ]
    return [
        *rows,
        target(
            "ps memory: tf2sync_loop state growth per added worker with 4 x "
            "the embedding, minus with w3's (MB)",
            _minus(growth("tf2sync_loop", "w3_x4"), growth("tf2sync_loop")),
            "<=",
            most,
            f"{share} of w3's embedding",
            ".1f",
        ),
        target(
            "ps memory: tf2sync largest per-step peak (MB)",
            max(peak, default=None),
            "<",
            EMBEDDING_MB,
            "the embedding's size",
            ".1f",
        ),
    ]


def _table(columns, rows):
    """(header, rows) of `columns`: (header, key, format spec or None)."""
    return [name for name, _, _ in columns], [
        [
            row[k] if spec is None else fmt(row[k], spec)
            for _, k, spec in columns
        ]
        for row in rows
    ]


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
    return [
        f"w3, embedding {EMBEDDING_MB:.1f} MB; the ps a process of its own; "
        "idle and state medians of the runs, the peak the largest. Columns "
        "and references: docs/benchmarks.md#ps-memory.",
        _table(
            MEMORY_COLUMNS,
            [
                {
                    **c,
                    "rows": EMBEDDING_ROWS[c["workload"]],
                    "peak": fmt(c["peak_mb"], ".1f")
                    + " (*)" * (not c["peak_reset"]),
                }
                for c in found
            ],
        ),
    ]


# -- sharding: targets and section ------------------------------------------


def sharding_rates(records, field="examples_per_sec"):
    """{(workload, config, ps tasks, shards): [`field` of each timed run]}
    (shards 1 on several ps: whole variables placed round robin)."""

    def key(r):
        return r["workload"], r["config"], r["ps"], r.get("shards", r["ps"])

    return rates(records, "sharding", field, key)


def sharding_memory(records):
    """One dict per (system, ps task) set up on the 2-ps cluster: bytes,
    state, `fixed` and the bound (MB; docs/benchmarks.md#sharding)."""
    peaks = {
        (r["config"], r["workload"], i): kb / 1e3
        for r in events(records, "sharding", "ps_peak")
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
        for r in events(records, "sharding", "ps_memory")
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
        rows.append(
            target(
                f"ps memory, w4: {m['system']} state on ps {m['task']} (MB)",
                m["state_mb"],
                "<=",
                m["bound_mb"],
                f"{factor} x its shards' {m['bytes_mb']:.1f} MB + the fixed "
                f"{fmt(m['fixed_mb'], '.1f')} MB",
                ".1f",
            )
        )
    if not memory:
        row = target("ps memory, w4: tf2sync state per ps", None, "<=", None)
        row["required"] = f"<= {factor} x its shards' bytes + the fixed cost"
        rows.append(row)
    own = [over(("w3", c, 2, 2), ("w3", c, 1, 1)) for c in LOOP_AND_STOCK]
    rows.append(
        target(
            "w3 2 shards on 2 ps / on 1 ps: tf2sync_loop's ratio / "
            "pss_async_unrolled's",
            None if None in own else ratio(*own),
            ">=",
            SHARDED_W3_OF_STOCK,
        )
    )
    return rows + [
        target(
            f"{w} round robin on 2 ps: tf2sync_loop / pss_async_unrolled",
            over((w, "tf2sync_loop", 2, 1), (w, "pss_async_unrolled", 2, 1)),
            ">=",
            ROUND_ROBIN_AT_LEAST,
        )
        for w in ("w1", "w3")
    ]


LOOP_AND_STOCK = ("tf2sync_loop", "pss_async_unrolled")
_ = None  # in a base cell: the row's own
# The sharding section's throughput tables: (heading and text, the cells
# (workload, system, ps, shards), the columns before the runs' (a format
# of the cell, or a function of it), {column: the cell each is divided by}).
SHARDING_TABLES = (
    (
        ["### w4 throughput (2 workers + 2 ps)"],
        [("w4", c, 2, 2) for c in SHARDING_SYSTEMS],
        {"system": "`{1}`"},
        {
            f"vs {b}": (_, b, _, _)
            for b in ("tf1_sync", *LOOP_AND_STOCK[1:], "pss_async")
        },
    ),
    (
        [
            "### w3 on 2 ps against 1 ps",
            "w3 in 2 shards on the 2-ps cluster against whole on 1 ps, "
            "in the same rounds.",
        ],
        [("w3", c, ps, ps) for c in LOOP_AND_STOCK for ps in (1, 2)],
        {
            "system": "`{1}`",
            "ps": "{2}",
            "partitioned": lambda w, c, ps, n: (
                f"{n} shards" * (n > 1) or "none"
            ),
        },
        {"vs 1 ps": (_, _, 1, 1)},
    ),
    (
        [
            "### Whole variables round robin over 2 ps",
            "No partitioner: each variable whole on one of the 2 ps.",
        ],
        [(w, c, 2, 1) for w in ("w1", "w3") for c in LOOP_AND_STOCK],
        {"workload": "{0}", "system": "`{1}`"},
        {"vs pss_async_unrolled": (_, "pss_async_unrolled", _, _)},
    ),
)
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
    failed = errors(records, "sharding")
    if not found and not failed:
        return []
    cpu = sharding_rates(records, "cpu_us_per_example")
    rows_w4 = next(
        (
            r.get("rows")
            for r in runs(records, "sharding")
            if r["workload"] == "w4"
        ),
        None,
    )
    blocks = [
        f"w4: Embedding {fmt(rows_w4, ',')} x 32, 2 workers and 2 ps, "
        "every variable of rank >= 1 in 2 shards, one per ps; see "
        "docs/benchmarks.md#sharding.",
    ]
    for i, (text, cells, lead, bases) in enumerate(SHARDING_TABLES):
        rows = []
        for cell in (c for c in cells if found.get(c)):
            mid, row = median(found[cell]), []
            for column in lead.values():
                row.append(
                    column.format(*cell)
                    if isinstance(column, str)
                    else column(*cell)
                )
            for base in bases.values():
                base = tuple(c if b is None else b for b, c in zip(base, cell))
                row.append(fmt(ratio(mid, median(found.get(base))), ".2f"))
            cpu_us = fmt(median(cpu.get(cell)), ".1f")
            rows.append(
                [
                    *row[: len(lead)],
                    *spread(found[cell]),
                    *row[len(lead) :],
                    cpu_us,
                ]
            )
        if i == 0:  # the w4 table, with the failures
            rows += [error_row(r) for r in failed]
        elif not rows:
            continue
        header = [*lead, "median ex/s", "min - max", "runs", *bases]
        blocks += [*text, (header + ["CPU us / ex"], rows)]
    memory = sharding_memory(records)
    if memory:
        blocks += [
            "### ps memory under sharding",
            "Each system set up one at a time on a fresh cluster of "
            "subprocess tasks (2 ps, 2 workers); MB per ps.",
            _table(SHARDING_MEMORY_COLUMNS, memory),
        ]
    tf1 = [
        r
        for r in events(records, "sharding", "setup")
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
