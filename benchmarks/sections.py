"""Sections of the benchmark report, from the harness's JSON records.

Each `*_section(records)` returns Markdown lines (none when its scenario did
not run). Every ratio is a ratio of medians of the same run. No TensorFlow.
"""

from __future__ import annotations

import statistics

WORKLOADS = ("w1", "w2", "w3")
WORKLOAD_TEXT = {
    "w1": "MLP 32-64-10, batch 32/worker",
    "w2": "CNN on 32x32x3, batch 64/worker",
    "w3": "Embedding 100,000 x 32 (20 ids), batch 128/worker",
}
SYSTEM_TEXT = {
    "local": "one process, no distribution, global batch N x B",
    "tf2sync_fit": "tf2sync, `model.fit`, steps_per_execution=K; each "
    "function repeats the step in its graph (tf2sync's default: up to 10 "
    "copies per loop iteration)",
    "tf2sync_fit_keras_loop": "the same after "
    "`tf2sync.unroll_fit_steps(model, False)`: tf_keras's `tf.range` loop",
    "tf2sync_loop": "tf2sync, custom loop, K steps per scheduled function, "
    "as `tf2sync.Trainer` runs them by default: the step repeated in the "
    "graph, up to 10 copies per loop iteration",
    "tf2sync_loop_while": "the same in a `tf.while_loop` of single steps "
    "(`tf2sync.Trainer(use_tf_while_loop=True)`, Orbit's loop)",
    "pss_async": "stock ParameterServerStrategy (async), custom loop in a "
    "`tf.while_loop` (`tf.range`)",
    "pss_async_unrolled": "stock ParameterServerStrategy (async), the "
    "K steps repeated in the graph",
    "pss_async_fit": "stock ParameterServerStrategy (async), `model.fit`",
    "tf1_sync": "TF1 `SyncReplicasOptimizer`, graph mode, one "
    "MonitoredTrainingSession per worker thread",
    "mwms": "MultiWorkerMirroredStrategy, one process per worker",
}
# The suffix of a system run from --baseline_tree (`tf2sync_loop@baseline`),
# and the share of the baseline's examples/s that the current tree keeps
# at least (the "Before and after" section's PASS).
BASELINE = "@baseline"
BASELINE_KEEP = 0.95
# Embedding rows of w3 and of w3_x4, the memory scenario's 4 x control
# (benchmarks/workloads.py; this module does not import TensorFlow).
EMBEDDING_ROWS = {"w3": 100_000, "w3_x4": 400_000}
EMBEDDING_MB = EMBEDDING_ROWS["w3"] * 32 * 4 / 1e6


def runs(records, scenario):
    """The records of `scenario`'s timed runs."""
    return [
        r
        for r in records
        if r.get("scenario") == scenario and "examples_per_sec" in r
    ]


def rates(records, scenario, field="examples_per_sec"):
    """{(workload, system): [`field` of each run that has it]}."""
    found = {}
    for r in runs(records, scenario):
        if r.get(field) is not None:
            found.setdefault((r["workload"], r["system"]), []).append(r[field])
    return found


def median(values):
    values = [v for v in values or [] if v is not None]
    return statistics.median(values) if values else None


def ratio(a, b):
    return a / b if a is not None and b else None


def fmt(value, spec=",.0f"):
    return "n/a" if value is None else format(value, spec)


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def systems_section(records) -> list[str]:
    ran = {r.get("system") for r in records if r.get("scenario") == "main"}
    rows = [[f"`{k}`", v] for k, v in SYSTEM_TEXT.items() if k in ran]
    return table(["system", "what"], rows) + [""] if rows else []


def main_section(records) -> list[str]:
    found = rates(records, "main")
    cpu = rates(records, "main", "cpu_us_per_example")
    lines = []
    for workload in WORKLOADS:
        failed = [
            r
            for r in records
            if "error" in r
            and r.get("scenario") == "main"
            and r.get("workload") == workload
        ]
        systems = [s for s in SYSTEM_TEXT if (workload, s) in found]
        if not systems and not failed:
            continue
        tf1 = median(found.get((workload, "tf1_sync")))
        pss = median(found.get((workload, "pss_async")))
        rows = []
        for system in systems:
            values = found[(workload, system)]
            mid = median(values)
            rows.append(
                [
                    f"`{system}`",
                    fmt(mid),
                    f"{min(values):,.0f} - {max(values):,.0f}",
                    len(values),
                    fmt(ratio(mid, tf1), ".2f"),
                    fmt(ratio(mid, pss), ".2f"),
                    fmt(median(cpu.get((workload, system))), ".1f"),
                ]
            )
        for r in failed:
            rows.append([f"`{r['system']}`", "error", r["error"][:160], 0])
        header = ["system", "median ex/s", "min - max", "runs"]
        header += ["vs tf1_sync", "vs pss_async", "CPU us / ex"]
        lines += [f"### {workload}: {WORKLOAD_TEXT[workload]}", ""]
        lines += table(header, rows) + [""]
    return lines


def paired_ratios(records, workload, system) -> list[float]:
    """current / baseline of `system` in each round both trees ran.

    A round (`cluster`, `repeat`) runs every system once, one after the
    other; a cluster build, or the machine for a while, can be slower for
    both trees alike (docs/benchmarks.md: one build at two thirds of the
    next's speed), which pooled medians mix and a ratio within the round
    cancels.
    """
    by_round = {}
    for r in runs(records, "main"):
        if r.get("workload") == workload and "repeat" in r:
            key = (r.get("cluster", 0), r["repeat"])
            by_round.setdefault(key, {})[r["system"]] = r["examples_per_sec"]
    then = system + BASELINE
    return [
        rate[system] / rate[then]
        for _, rate in sorted(by_round.items())
        if rate.get(system) is not None and rate.get(then)
    ]


def before_after_rows(records) -> list[dict]:
    """Per workload and tf2sync system run from --baseline_tree: the medians
    of examples/s of the current tree and the baseline and their ratio, the
    median of the rounds' own ratios (`paired_ratios`), each tree's ratios
    to local and tf1_sync, and PASS / MISS / n/a for current / baseline >=
    BASELINE_KEEP: the rounds' median where rounds paired, else the
    medians' ratio. None where not measured."""
    found = rates(records, "main")
    cpu = rates(records, "main", "cpu_us_per_example")
    failed = {
        (r.get("workload"), r.get("system"))
        for r in records
        if "error" in r and r.get("scenario") == "main"
    }
    ran = set(found) | failed
    if not any(system.endswith(BASELINE) for _, system in ran):
        return []
    rows = []
    for workload in WORKLOADS:
        local = median(found.get((workload, "local")))
        tf1 = median(found.get((workload, "tf1_sync")))
        for system in SYSTEM_TEXT:
            then = system + BASELINE
            if not system.startswith("tf2sync") or (workload, then) not in ran:
                continue
            now_rate = median(found.get((workload, system)))
            then_rate = median(found.get((workload, then)))
            pooled = ratio(now_rate, then_rate)
            paired = paired_ratios(records, workload, system)
            kept = median(paired) if paired else pooled
            rows.append(
                {
                    "workload": workload,
                    "system": system,
                    "current": now_rate,
                    "baseline": then_rate,
                    "runs": (
                        len(found.get((workload, system), [])),
                        len(found.get((workload, then), [])),
                    ),
                    "ratio": pooled,
                    "paired": median(paired),
                    "rounds": len(paired),
                    "kept": kept,
                    "vs_local": (
                        ratio(now_rate, local),
                        ratio(then_rate, local),
                    ),
                    "vs_tf1_sync": (
                        ratio(now_rate, tf1),
                        ratio(then_rate, tf1),
                    ),
                    "cpu_us": (
                        median(cpu.get((workload, system))),
                        median(cpu.get((workload, then))),
                    ),
                    "result": (
                        "n/a (not measured)"
                        if kept is None
                        else "PASS"
                        if kept >= BASELINE_KEEP
                        else "MISS"
                    ),
                }
            )
    return rows


def before_after_section(records) -> list[str]:
    """The current tree against --baseline_tree (none without it)."""
    found = before_after_rows(records)
    if not found:
        return []
    config = next((r for r in records if r.get("event") == "config"), {})
    tree = config.get("baseline_tree") or "?"

    def pair(values, spec):
        return " / ".join(fmt(v, spec) for v in values)

    rows = [
        [
            r["workload"],
            f"`{r['system']}`",
            fmt(r["current"]),
            fmt(r["baseline"]),
            pair(r["runs"], "d"),
            fmt(r["ratio"], ".3f"),
            f"{fmt(r['paired'], '.3f')} ({r['rounds']})",
            pair(r["vs_local"], ".2f"),
            pair(r["vs_tf1_sync"], ".2f"),
            pair(r["cpu_us"], ".1f"),
            r["result"],
        ]
        for r in found
    ]
    missed = [f"{r['workload']} `{r['system']}`" for r in found]
    missed = [m for m, r in zip(missed, found) if r["result"] != "PASS"]
    verdict = (
        f"Every cell keeps >= {BASELINE_KEEP:.2f} x the baseline."
        if not missed
        else f"Not PASS (MISS or not measured): {', '.join(missed)}."
    )
    header = ["workload", "system", "current ex/s", "baseline ex/s"]
    header += ["runs (current / baseline)", "current / baseline"]
    header += ["paired rounds: median (rounds)"]
    header += ["vs local (current / baseline)"]
    header += ["vs tf1_sync (current / baseline)"]
    header += ["CPU us / ex (current / baseline)"]
    header.append(f"current / baseline >= {BASELINE_KEEP:.2f}")
    return [
        "Each tf2sync system of the main scenario, from this tree and from "
        f"the baseline tree `{tree}` (`<system>{BASELINE}`: that tree's "
        "own `benchmarks/pss_worker.py` and `tf2sync`, on a cluster of its "
        "own), interleaved in the same rounds. Examples/s are medians of "
        "the repeats; *current / baseline* is their ratio; *paired rounds* "
        "is the median of each round's own current / baseline (both trees "
        "one after the other), which a faster or slower cluster build "
        "does not move, and decides the result where rounds paired; the "
        "ratios to `local` and `tf1_sync` are each version's median over "
        f"the same run's (run once, from this tree). {verdict}",
        "",
        *table(header, rows),
        "",
    ]


def _by_straggler(records):
    by = {}
    for r in runs(records, "straggler"):
        key = (r["config"], r["straggler"])
        by.setdefault(key, []).append(r["examples_per_sec"])
    return by


def straggler_kept(records):
    """{config: median with the straggler / median without}."""
    by = _by_straggler(records)
    return {
        c: ratio(median(by.get((c, True))), median(by.get((c, False))))
        for c, _ in by
    }


def straggler_section(records) -> list[str]:
    by = _by_straggler(records)
    if not by:
        return []
    setups = [
        r
        for r in records
        if r.get("scenario") == "straggler" and r.get("event") == "setup"
    ]
    delay = max((r.get("delay_s", 0) for r in setups), default=0)
    compute = max((r.get("compute_s", 0) for r in setups), default=0)
    kept = straggler_kept(records)
    async_slow = median(by.get(("pss_async", True)))
    dropped = {}
    for r in runs(records, "straggler"):
        if r.get("pushes"):
            key = (r["config"], r["straggler"])
            share = r.get("stale_dropped", 0) / r["pushes"]
            dropped.setdefault(key, []).append(share)
    rows = [
        [
            config,
            fmt(median(by.get((config, False)))),
            fmt(median(by.get((config, True)))),
            fmt(kept.get(config), ".2f"),
            fmt(ratio(median(by.get((config, True))), async_slow), ".2f"),
            " / ".join(
                fmt(median(dropped.get((config, s))), ".0%")
                for s in (False, True)
            ),
        ]
        for config in ("tf2sync_b0", "tf2sync_b1", "pss_async")
    ]
    first = runs(records, "straggler")[0]
    header = ["configuration", "no straggler ex/s", "straggler ex/s"]
    header += ["kept", "vs pss_async (straggler)"]
    header.append("stale pushes dropped (without / with)")
    return [
        f"{first['workers']} workers, {first['workload']}; worker 0 sleeps "
        f"{delay * 1e3:.1f} ms per step ({ratio(delay, compute) or 0:.1f} x "
        f"its compute alone, {compute * 1e3:.1f} ms). `tf2sync_b0`: "
        "replicas_to_aggregate = total = 3; `tf2sync_b1`: 2 of 3 (one backup "
        "worker); *kept*: with / without the straggler. Rates are taken "
        "between 20 % and 80 % of each run's gradients (no start, no tail). "
        "All workers share this machine's cores: a sleeping worker frees "
        "CPU for the others, which favours every configuration that does "
        "not wait for it more than it would on separate machines.",
        "",
        *table(header, rows),
        "",
    ]


def scaling_section(records) -> list[str]:
    per = {}
    for r in runs(records, "scaling"):
        ms = 1e3 * r["seconds"] / max(1, r["steps"])
        per.setdefault(r["workers"], []).append((ms, r["examples_per_sec"]))
    if not per:
        return []
    base = median([ms for ms, _ in per[min(per)]])
    rows = []
    for n in sorted(per):
        ms = median([m for m, _ in per[n]])
        rows.append(
            [
                n,
                fmt(ms, ".2f"),
                fmt(median([e for _, e in per[n]])),
                fmt(ratio(ms, base), ".2f"),
            ]
        )
    header = ["workers", "median ms / sync step", "median ex/s"]
    header.append(f"step cost vs {min(per)} worker(s)")
    return [
        "tf2sync custom loop on w1, replicas_to_aggregate = total = workers;"
        " a step is one synchronous update (N gradients), all workers on "
        "this machine.",
        "",
        *table(header, rows),
        "",
    ]


def model_size_section(records) -> list[str]:
    per = {}
    for r in runs(records, "model_size"):
        key = (r["width"], r["parameters"])
        ms = 1e3 * r["seconds"] / max(1, r["steps"])
        cell = per.setdefault(key, {}).setdefault(r["config"], [])
        cell.append((ms, r["examples_per_sec"]))
    if not per:
        return []
    first = min(per)
    base = median([ms for ms, _ in per[first].get("tf2sync_loop", [])] or [0])
    rows = []
    for key in sorted(per):
        width, parameters = key
        sync = per[key].get("tf2sync_loop", [])
        stock = per[key].get("pss_async", [])
        ms = median([m for m, _ in sync]) if sync else None
        sync_rate = median([e for _, e in sync]) if sync else None
        stock_rate = median([e for _, e in stock]) if stock else None
        rows.append(
            [
                width,
                f"{parameters:,}",
                fmt(ms, ".2f"),
                fmt(ratio(ms, base) if ms and base else None, ".2f"),
                fmt(sync_rate),
                fmt(stock_rate),
                fmt(ratio(sync_rate, stock_rate), ".2f"),
            ]
        )
    header = [
        "hidden units",
        "parameters",
        "tf2sync ms / sync step",
        f"vs {first[0]} units",
        "tf2sync ex/s",
        "pss_async ex/s",
        "tf2sync / pss_async",
    ]
    return [
        "w1 (32 -> H relu -> 10, batch 32 per worker), 2 workers + 1 ps; "
        "tf2sync's custom loop (a step is one synchronous update of 2 "
        "gradients) and stock asynchronous PSS, interleaved.",
        "",
        *table(header, rows),
        "",
    ]


def _memory_rows(records):
    return [
        r
        for r in records
        if r.get("scenario") == "memory" and "rss_state_kb" in r
    ]


def _state_mb(r):
    if r.get("anon_state_kb") is not None:  # allocations only, no code
        return (r["anon_state_kb"] - r["anon_idle_kb"]) / 1e3
    return (r["rss_state_kb"] - r["rss_idle_kb"]) / 1e3


def _peak_mb(r):
    return (r["hwm_run_kb"] - r["rss_state_kb"]) / 1e3


def _memory_cells(records):
    """One row per memory cell (system, workers, optimizer, workload), in
    the order measured: the median state over its repeats (one RSS reading
    moves by MBs between runs), the largest per-step peak, its runs."""
    cells = {}
    for r in _memory_rows(records):
        key = (r["system"], r["workers"], r["optimizer"], r["workload"])
        cells.setdefault(key, []).append(r)
    return [
        {
            "system": system,
            "workers": workers,
            "optimizer": optimizer,
            "workload": workload,
            "idle_mb": median([r["rss_idle_kb"] / 1e3 for r in rs]),
            "state_mb": median([_state_mb(r) for r in rs]),
            "peak_mb": max(_peak_mb(r) for r in rs),
            "peak_reset": all(r["peak_reset"] for r in rs),
            "runs": len(rs),
        }
        for (system, workers, optimizer, workload), rs in cells.items()
    ]


def _growth_per_worker(cells):
    cells = sorted(cells, key=lambda c: c["workers"])
    added = cells[-1]["workers"] - cells[0]["workers"] if cells else 0
    if not added:
        return None
    return (cells[-1]["state_mb"] - cells[0]["state_mb"]) / added


# Stock PSS with the same function form as each tf2sync loop: the step
# repeated in the graph, or a `tf.while_loop` of single steps. The ps holds
# each worker's instance of a function, so the form alone moves the growth
# per worker (stock PSS on w3: ~1 MB in the loop, ~5 MB repeated 10 x).
MEMORY_REFERENCE = {
    "tf2sync_loop": "pss_async_unrolled",
    "tf2sync_loop_while": "pss_async",
}


def memory_summary(records, system="tf2sync_loop"):
    """`system`'s (state growth per added worker beyond that of stock PSS
    in the same function form, largest per-step peak), in MB, on w3."""
    found = [c for c in _memory_cells(records) if c["workload"] == "w3"]
    ours = [c for c in found if c["system"] == system]
    kind = ours[0]["optimizer"] if ours else None
    stock = [
        c
        for c in found
        if c["system"] == MEMORY_REFERENCE.get(system, "pss_async")
        and c["optimizer"] == kind
    ]
    growth = _growth_per_worker(ours)
    reference = _growth_per_worker(stock)
    if growth is not None and reference is not None:
        growth -= reference
    else:
        growth = None
    return growth, max((c["peak_mb"] for c in ours), default=None)


def memory_growth_with_table(records, system="tf2sync_loop"):
    """MB: `system`'s state growth per added worker with w3_x4's embedding
    minus the same with w3's (0 when nothing per worker grows with the
    table), or None."""
    cells = [c for c in _memory_cells(records) if c["system"] == system]
    growth = {
        workload: _growth_per_worker(
            [c for c in cells if c["workload"] == workload]
        )
        for workload in ("w3", "w3_x4")
    }
    if None in growth.values():
        return None
    return growth["w3_x4"] - growth["w3"]


def memory_section(records) -> list[str]:
    found = _memory_cells(records)
    if not found:
        return []
    rows = [
        [
            c["system"],
            c["workers"],
            c["optimizer"],
            f"{EMBEDDING_ROWS[c['workload']]:,}",
            fmt(c["idle_mb"], ".1f"),
            fmt(c["state_mb"], ".1f"),
            fmt(c["peak_mb"], ".1f") + ("" if c["peak_reset"] else " (*)"),
            c["runs"],
        ]
        for c in found
    ]
    header = ["system", "workers", "optimizer", "embedding rows"]
    header += ["ps RSS idle MB"]
    header += ["state MB", "per-step peak MB", "runs"]
    return [
        f"w3; the ps is a process of its own (`python -m tf2sync "
        f"--job_name=ps`, run with TF_ENABLE_ONEDNN_OPTS=0 and glibc "
        f"mmapping every buffer from 128 kB up, so that its RSS follows what "
        f"it holds). The embedding is {EMBEDDING_MB:.1f} MB, its momentum "
        "slot as much again. *state*: anonymous RSS (allocations, not "
        "code pages) after setup and warm-up minus the same before the "
        "chief connected (variables, slots, accumulators, functions). "
        "*per-step peak*: peak RSS during the timed run minus "
        "RSS before it (peak reset through /proc/PID/clear_refs; (*) where "
        "that failed). Each cell is a fresh cluster, measured *runs* times "
        "(the cells interleaved): idle and state are medians, the peak "
        "the largest. Stock PSS with the same optimizer and the same "
        "function form is the reference (the target compares tf2sync's "
        "state growth per added worker with its: `pss_async_unrolled` for "
        "`tf2sync_loop`, `pss_async` for `tf2sync_loop_while`; the ps holds "
        "each worker's instance of the function, so a step repeated in the "
        "graph costs stock PSS more per worker too); "
        "with `keras` (`tf.keras.optimizers.SGD`, whose momentum rewrites "
        "the whole table every step) it is the control: what dense "
        "per-step buffers of the embedding's size look like here. tf2sync "
        "with an embedding of 4 x the rows is the other control: a buffer "
        "of the table's size per worker would add 3 x "
        f"{EMBEDDING_MB:.1f} MB per added worker there.",
        "",
        *table(header, rows),
        "",
    ]


# The rate of accuracy runs recorded before the grid of rates (accuracy.py's
# LEARNING_RATE then): their records name none.
ACCURACY_UNRECORDED_RATE = 0.05


def accuracy_runs(records) -> dict:
    """{(system, learning rate): [runs]} of the accuracy scenario."""
    found = {}
    for r in runs(records, "accuracy"):
        rate = r.get("learning_rate", ACCURACY_UNRECORDED_RATE)
        found.setdefault((r["system"], rate), []).append(r)
    return found


def accuracy_section(records) -> list[str]:
    found = accuracy_runs(records)
    if not found:
        return []
    target = next(iter(found.values()))[0]["target"]
    rows = []
    for (system, rate), rs in sorted(found.items(), key=lambda i: i[0][1]):
        epoch_s = [
            b[0] - a[0] for r in rs for a, b in zip(r["curve"], r["curve"][1:])
        ]
        rows.append(
            [
                f"`{system}`",
                f"{rate:g}",
                fmt(median([r["epochs_to_target"] for r in rs]), ".1f"),
                fmt(median([r["seconds_to_target"] for r in rs]), ".2f"),
                fmt(median([r["curve"][0][0] for r in rs]), ".3f"),
                fmt(median(epoch_s), ".3f"),
                fmt(median([r["final_accuracy"] for r in rs]), ".4f"),
                f"{len(rs)} ({sum(r['epochs_to_target'] is None for r in rs)}"
                " missed)",
            ]
        )
    header = ["system", "learning rate", f"epochs to {target}"]
    header += [f"seconds to {target}", "1st epoch s"]
    header += ["s / epoch (after the 1st)", "final accuracy", "runs"]
    epochs = len(rs[0]["curve"])
    return [
        "scikit-learn digits (the launcher's default job: conv net, "
        "1,500 training and 297 held-out images), `model.fit`, 2 workers, "
        "batch 32 per worker, legacy momentum SGD (momentum 0.9) at each "
        f"rate, {epochs} epochs of 1,500 examples; held-out accuracy after "
        "each epoch, off the clock. Seconds include the first epoch's "
        "one-off tracing (larger for tf2sync); medians over the repeats. "
        "At one rate a synchronous epoch makes half the updates of an "
        "asynchronous one (each the mean of 2 replicas' gradients).",
        "",
        *table(header, rows),
        "",
    ]


# The sharding scenario (scenarios.scenario_sharding): w4's systems, the
# reference of its throughput targets, and its ps memory bound.
SHARDING_SYSTEMS = (
    "tf2sync_fit",
    "tf2sync_loop",
    "pss_async",
    "pss_async_unrolled",
    "tf1_sync",
)
SHARD_STATE_FACTOR = 1.25  # a ps's state <= this x its shards' bytes + fixed


def sharding_rates(records, field="examples_per_sec"):
    """{(workload, config, ps tasks, shards): [`field` of each timed run]}
    (shards 1 on several ps: whole variables placed round robin)."""
    found = {}
    for r in runs(records, "sharding"):
        if r.get(field) is not None:
            key = (
                r["workload"],
                r["config"],
                r["ps"],
                r.get("shards", r["ps"]),
            )
            found.setdefault(key, []).append(r[field])
    return found


def sharding_memory(records):
    """One dict per (system, ps task) set up on the 2-ps cluster, in the
    order set up: `bytes` of its variables and slots there, its `state`
    (MB: anonymous RSS after its setup minus before), `fixed` (the state of
    the small model set up first on that ps) and the bound
    SHARD_STATE_FACTOR x bytes + fixed."""
    found = [
        r
        for r in records
        if r.get("scenario") == "sharding" and r.get("event") == "ps_memory"
    ]
    peaks = {
        (r["config"], r["workload"], i): kb / 1e3
        for r in records
        if r.get("scenario") == "sharding" and r.get("event") == "ps_peak"
        for i, kb in enumerate(r["peak_kb"])
    }
    fixed = {}
    rows = []
    for r in found:
        for t in r["ps_tasks"]:
            state = (t["anon_after_kb"] - t["anon_before_kb"]) / 1e3
            row = {
                "system": r["config"],
                "workload": r["workload"],
                "rows": r.get("rows"),
                "task": t["task"],
                "bytes_mb": t["bytes"] / 1e6,
                "state_mb": state,
                "empty_rss_mb": t["rss_empty_kb"] / 1e3,
                "rss_after_mb": t["rss_after_kb"] / 1e3,
                "peak_mb": peaks.get((r["config"], r["workload"], t["task"])),
            }
            if r["workload"] == "w1":
                fixed[t["task"]] = state
            rows.append(row)
    for row in rows:
        row["fixed_mb"] = fixed.get(row["task"])
        row["bound_mb"] = (
            None
            if row["fixed_mb"] is None or row["workload"] == "w1"
            else SHARD_STATE_FACTOR * row["bytes_mb"] + row["fixed_mb"]
        )
    return rows


def sharding_section(records) -> list[str]:
    found = sharding_rates(records)
    failed = [
        r for r in records if "error" in r and r.get("scenario") == "sharding"
    ]
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

    def mid(config, workload="w4", ps=2, shards=None):
        return median(found.get((workload, config, ps, shards or ps)))

    lines = [
        f"w4: Embedding {fmt(rows_w4, ',')} x 32 over 20 ids per example, "
        "mean, dense 64 relu, dense 1 (mean squared error), batch 128 per "
        "worker, legacy momentum SGD; 2 workers and 2 ps, every variable of "
        "rank >= 1 in 2 shards, one per ps (`tf.distribute.experimental."
        "partitioners.FixedShardsPartitioner(2)`, the same for stock PSS; "
        "TF1: a partitioned variable, `tf.compat.v1.fixed_size_partitioner"
        '(2)`, read by `tf.nn.embedding_lookup` (its "div" layout), '
        "momentum `MomentumOptimizer`). Throughput as in the main scenario: "
        "in-process clusters on 127.0.0.1 (the PSS systems all on one of 2 "
        "workers + 2 ps, TF1 on its own of the same shape), every system "
        "set up once, the repeats interleaved. Memory on a separate, fresh "
        "cluster of subprocess tasks (below).",
        "",
    ]
    tf1, unrolled, stock = (
        mid("tf1_sync"),
        mid("pss_async_unrolled"),
        mid("pss_async"),
    )
    rows = []
    for config in SHARDING_SYSTEMS:
        values = found.get(("w4", config, 2, 2))
        if not values:
            continue
        m = median(values)
        rows.append(
            [
                f"`{config}`",
                fmt(m),
                f"{min(values):,.0f} - {max(values):,.0f}",
                len(values),
                fmt(ratio(m, tf1), ".2f"),
                fmt(ratio(m, unrolled), ".2f"),
                fmt(ratio(m, stock), ".2f"),
                fmt(median(cpu.get(("w4", config, 2, 2))), ".1f"),
            ]
        )
    for r in failed:
        rows.append([f"`{r['system']}`", "error", r["error"][:160], 0])
    header = ["system", "median ex/s", "min - max", "runs", "vs tf1_sync"]
    header += ["vs pss_async_unrolled", "vs pss_async", "CPU us / ex"]
    lines += ["### w4 throughput (2 workers + 2 ps)", ""]
    lines += table(header, rows) + [""]

    rows = []
    for config in ("tf2sync_loop", "pss_async_unrolled"):
        one = mid(config, "w3", 1)
        for ps in (1, 2):
            values = found.get(("w3", config, ps, ps))
            if not values:
                continue
            m = median(values)
            rows.append(
                [
                    f"`{config}`",
                    ps,
                    "none" if ps == 1 else f"{ps} shards",
                    fmt(m),
                    f"{min(values):,.0f} - {max(values):,.0f}",
                    len(values),
                    fmt(ratio(m, one), ".2f"),
                    fmt(median(cpu.get(("w3", config, ps, ps))), ".1f"),
                ]
            )
    if rows:
        lines += [
            "### w3 on 2 ps against 1 ps",
            "",
            "w3 (embedding 100,000 x 32) in 2 shards on the 2-ps cluster "
            "above (every variable of rank >= 1 in 2 shards), and "
            "unpartitioned on an in-process cluster of 1 ps and 2 workers, "
            "in the same rounds. On 2 shared cores a second ps adds no "
            "compute: each system's 2-ps / 1-ps ratio is what spreading "
            "over ps costs it.",
            "",
        ]
        header = ["system", "ps", "partitioned", "median ex/s", "min - max"]
        header += ["runs", "vs 1 ps", "CPU us / ex"]
        lines += table(header, rows) + [""]
    rows = []
    for workload in ("w1", "w3"):
        stock = mid("pss_async_unrolled", workload, 2, 1)
        for config in ("tf2sync_loop", "pss_async_unrolled"):
            values = found.get((workload, config, 2, 1))
            if not values:
                continue
            m = median(values)
            rows.append(
                [
                    workload,
                    f"`{config}`",
                    fmt(m),
                    f"{min(values):,.0f} - {max(values):,.0f}",
                    len(values),
                    fmt(ratio(m, stock), ".2f"),
                    fmt(median(cpu.get((workload, config, 2, 1))), ".1f"),
                ]
            )
    if rows:
        lines += [
            "### Whole variables round robin over 2 ps",
            "",
            "No partitioner: each variable whole on one of the 2 ps of the "
            "cluster above, placed round robin as PSS places them.",
            "",
        ]
        header = ["workload", "system", "median ex/s", "min - max", "runs"]
        header += ["vs pss_async_unrolled", "CPU us / ex"]
        lines += table(header, rows) + [""]

    memory = sharding_memory(records)
    if memory:
        lines += [
            "### ps memory under sharding",
            "",
            "A fresh cluster of subprocess tasks (`python -m tf2sync`: 2 "
            "ps, 2 workers; the chief another process) where each PSS "
            "system is set up (model, slots, traced functions, warm-up) "
            "one at a time, all on the same 2 ps; the ps tasks run "
            "with the memory scenario's settings (TF_ENABLE_ONEDNN_OPTS=0, "
            "glibc mmapping buffers from 128 kB up). *shards' bytes*: the "
            "bytes of the system's variables and optimizer slots on that ps "
            "(read from the variables' devices by the chief). *state*: that "
            "ps's anonymous RSS once settled after the system's setup minus "
            "the same before it. *fixed*: the state of the small model "
            "(tf2sync_loop on w1, 2 shards) set up first on the fresh ps: "
            "a system's fixed cost on a ps, which here also takes the ps's "
            "own one-time costs (so it bounds a later system's fixed cost "
            "from above). *bound*: "
            f"{SHARD_STATE_FACTOR} x shards' bytes + fixed. *empty ps RSS*: "
            "the ps's RSS before the chief connected (TensorFlow's code and "
            "runtime). *per-step peak*: after every setup, each tf2sync "
            "system on w4 runs 10 functions alone: that ps's peak RSS "
            "during the run minus its RSS before (peak reset through "
            "/proc/PID/clear_refs).",
            "",
        ]
        rows = [
            [
                m["system"],
                m["workload"] + (" (fixed)" if m["workload"] == "w1" else ""),
                m["task"],
                fmt(m["empty_rss_mb"], ".1f"),
                fmt(m["bytes_mb"], ".1f"),
                fmt(m["state_mb"], ".1f"),
                fmt(
                    None
                    if m["workload"] == "w1"
                    else ratio(m["state_mb"], m["bytes_mb"]),
                    ".2f",
                ),
                fmt(m["bound_mb"], ".1f"),
                fmt(m["peak_mb"], ".1f"),
                fmt(m["rss_after_mb"], ".1f"),
            ]
            for m in memory
        ]
        header = ["system", "workload", "ps", "empty ps RSS MB"]
        header += ["shards' bytes MB", "state MB", "state / bytes"]
        header += [f"bound MB ({SHARD_STATE_FACTOR} x bytes + fixed)"]
        header += ["per-step peak MB", "ps RSS after setup MB"]
        lines += table(header, rows) + [""]
    tf1_setup = next(
        (
            r
            for r in records
            if r.get("scenario") == "sharding"
            and r.get("event") == "setup"
            and r.get("config") == "tf1_sync"
        ),
        None,
    )
    if tf1_setup and tf1_setup.get("ps_bytes"):
        placed = tf1_setup["ps_bytes"]
        lines += [
            "TF1's variables (with slots and the SyncReplicasOptimizer's "
            "step variables) by ps: "
            + ", ".join(
                f"ps {k}: {v / 1e6:,.1f} MB" for k, v in sorted(placed.items())
            )
            + ".",
            "",
        ]
    return lines
