"""The throughput scenarios: each one's run, targets and report section.

* `main`: each requested system on one workload, 2 workers + 1 ps (and,
  with --baseline_tree, each tf2sync system also from that tree, as
  `<system>@baseline`).
* `straggler`: 3 workers, worker 0 sleeping `straggler_factor` x its
  compute time per step: tf2sync with 0 and 1 backup worker, stock PSS.

A run writes records (`driver.Bench`); `*_targets(records)` and
`*_section(records)` read them (blocks for `tables.lines`).
"""

from __future__ import annotations

import itertools

from driver import PSS_SYSTEMS
from driver import SYSTEMS
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

WORKLOADS = ("w1", "w2", "w3")
WORKLOAD_TEXT = {
    "w1": "MLP 32-64-10, batch 32/worker",
    "w2": "CNN on 32x32x3, batch 64/worker",
    "w3": "Embedding 100,000 x 32 (20 ids), batch 128/worker",
}
# Issue 8's bars per workload: (baseline, custom loop at least, fit at
# least). Each form of tf2sync's loop and fit is held to its kind's bar.
MAIN_BARS = {
    "w1": ("tf1_sync", 1.5, 1.0),
    "w2": ("local", 0.95, 0.95),
    "w3": ("tf1_sync", 1.0, 1.0),
}
MAIN_FORMS = (
    ("tf2sync_loop", "tf2sync_fit"),  # the defaults
    ("tf2sync_loop_while", "tf2sync_fit_keras_loop"),  # the opt-outs
)
# The suffix of a system run from --baseline_tree (`tf2sync_loop@baseline`)
# and the share of the baseline's examples/s the current tree keeps at
# least (the "Before and after" section's PASS).
BASELINE = "@baseline"
BASELINE_KEEP = 0.95
PS_SCALING_STOCK = "pss_async_unrolled"  # the ps_scaling tables' "stock"
STRAGGLER_KEEP = 0.9  # tf2sync with 1 backup: with / without, at least


def scenario_main(bench, workload, workers=2):
    """Each requested system on `workload`, interleaved; with
    `--clusters=N`, on processes built anew N times."""
    s = bench.s
    for cluster in range(s.clusters):
        base = {
            "scenario": "main",
            "workload": workload,
            "workers": workers,
            "steps_per_function": s.k,
            "functions": s.functions[workload],
        }
        tag = ""
        if s.clusters > 1:
            base["cluster"] = cluster
            tag = f"_c{cluster}" if cluster else ""
        common = {"workload": workload, "k": s.k}

        def pss(name, child, system, common=common):
            args = {"system": system, **common}
            return Endpoint(name, "pss", [child], args, workers)

        endpoints, extra = [], {}
        chosen = [x for x in s.systems if x in PSS_SYSTEMS]
        if chosen:
            child = bench.start_pss(f"pss_{workload}{tag}", workers)
            endpoints += [pss(x, child, x) for x in chosen]
        compared = [x for x in chosen if x.startswith("tf2sync")]
        if s.baseline_tree and compared:
            # The baseline tree's tf2sync systems, on a cluster of their
            # own (one version per process), in the same rounds.
            name = f"pss_{workload}_baseline{tag}"
            child = bench.start_pss(name, workers, tree=s.baseline_tree)
            for x in compared:
                endpoints.append(pss(x + BASELINE, child, x))
                extra[x + BASELINE] = {"baseline_of": x}
        if "local" in s.systems:
            name = f"local_{workload}{tag}"
            child = bench.start_pss(name, 0, local_workers=workers)
            endpoints.append(pss("local", child, "local"))
        if "tf1_sync" in s.systems:
            name = f"tf1_sync_{workload}{tag}"
            child = bench.start_tf1(workload, workers, name=name)
            args = {"steps": 2 * s.k}
            endpoints.append(
                Endpoint("tf1_sync", "tf1", [child], args, workers)
            )
        if "mwms" in s.systems:
            children = bench.start_mwms(workload, workers, tag=tag)
            args = {"system": "mwms", **common}
            endpoints.append(Endpoint("mwms", "mwms", children, args, workers))
        # Each baseline beside its current system in the first round.
        endpoints.sort(
            key=lambda e: (
                s.systems.index(e.name.removesuffix(BASELINE)),
                e.name.endswith(BASELINE),
            )
        )
        first = cluster * s.repeats
        functions = s.functions[workload]
        bench.run_all(endpoints, functions, base, extra, first_repeat=first)


def scenario_straggler(bench, workers=3):
    """tf2sync with 0 and 1 backup worker, and stock PSS, +- a straggler."""
    s = bench.s
    workload = s.straggler_workload
    base = {
        "scenario": "straggler",
        "workload": workload,
        "workers": workers,
        "steps_per_function": s.k,
        "functions": s.straggler_functions,
    }
    child = bench.start_pss("pss_straggler", workers)
    endpoints, extra = [], {}
    for label, system, rta, total in (
        ("tf2sync_b0", "tf2sync_loop", workers, workers),
        ("tf2sync_b1", "tf2sync_loop", workers - 1, workers),
        ("pss_async", "pss_async", None, None),
    ):
        for straggler in (False, True):
            name = label + ("_straggler" if straggler else "")
            factor = s.straggler_factor if straggler else 0.0
            args = {"system": system, "workload": workload, "k": s.k}
            args.update(rta=rta, total=total, delay_factor=factor)
            endpoints.append(Endpoint(name, "pss", [child], args, workers))
            extra[name] = {
                "config": label,
                "straggler": straggler,
                "replicas_to_aggregate": rta,
                "total_num_replicas": total,
            }
    functions = s.straggler_functions
    bench.run_all(endpoints, functions, base, extra, window=True)


# -- targets --------------------------------------------------------------


def main_targets(records):
    found = rates(records, "main")
    return [
        target(
            f"{workload} {system} / {base}",
            ratio(
                median(found.get((workload, system))),
                median(found.get((workload, base))),
            ),
            ">=",
            least,
        )
        for forms in MAIN_FORMS
        for workload, (base, *bars) in MAIN_BARS.items()
        for system, least in zip(forms, bars)
    ]


def straggler_targets(records):
    kept = straggler_kept(records).get("tf2sync_b1")
    name = "straggler: tf2sync 1 backup, with / without the straggler"
    return [target(name, kept, ">=", STRAGGLER_KEEP)]


# -- report sections ------------------------------------------------------


def main_section(records):
    found = rates(records, "main")
    cpu = rates(records, "main", "cpu_us_per_example")
    blocks = []
    header = ["system", "median ex/s", "min - max", "runs", "vs tf1_sync"]
    header += ["vs pss_async", "CPU us / ex"]
    for workload in WORKLOADS:
        failed = [
            r for r in errors(records, "main") if r["workload"] == workload
        ]
        systems = [s for s in SYSTEMS if (workload, s) in found]
        if not systems and not failed:
            continue
        tf1 = median(found.get((workload, "tf1_sync")))
        pss = median(found.get((workload, "pss_async")))
        rows = []
        for system in systems:
            mid = median(found[(workload, system)])
            rows.append(
                [
                    f"`{system}`",
                    *spread(found[(workload, system)]),
                    fmt(ratio(mid, tf1), ".2f"),
                    fmt(ratio(mid, pss), ".2f"),
                    fmt(median(cpu.get((workload, system))), ".1f"),
                ]
            )
        rows += [error_row(r) for r in failed]
        blocks += [f"### {workload}: {WORKLOAD_TEXT[workload]}", (header, rows)]
    if blocks:
        blocks.insert(
            0,
            "Medians of the repeats; what each system runs: "
            "docs/benchmarks.md#systems.",
        )
    return blocks


def paired_ratios(records, workload, system):
    """current / baseline of `system` in each round both trees ran (a
    slower cluster build slows both alike; the round's ratio cancels it)."""
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


def before_after_rows(records):
    """Per workload and tf2sync system run from --baseline_tree: both
    trees' medians, their ratios and PASS / MISS / n/a."""
    found = rates(records, "main")
    cpu = rates(records, "main", "cpu_us_per_example")
    ran = set(found) | {
        (r.get("workload"), r.get("system")) for r in errors(records, "main")
    }
    if not any(system.endswith(BASELINE) for _, system in ran):
        return []
    rows = []
    for workload, system in itertools.product(WORKLOADS, PSS_SYSTEMS):
        both = (system, system + BASELINE)
        if not system.startswith("tf2sync") or (workload, both[1]) not in ran:
            continue
        mid = {x: median(found.get((workload, x))) for x in SYSTEMS + both}
        now, then = mid[system], mid[both[1]]
        paired = paired_ratios(records, workload, system)
        kept = median(paired) if paired else ratio(now, then)
        result = "PASS" if kept and kept >= BASELINE_KEEP else "MISS"
        rows.append(
            {
                "workload": workload,
                "system": system,
                "current": now,
                "baseline": then,
                "runs": [len(found.get((workload, x), [])) for x in both],
                "ratio": ratio(now, then),
                "paired": median(paired),
                "rounds": len(paired),
                "kept": kept,
                "vs_local": [ratio(mid[x], mid["local"]) for x in both],
                "vs_tf1_sync": [ratio(mid[x], mid["tf1_sync"]) for x in both],
                "cpu_us": [median(cpu.get((workload, x))) for x in both],
                "result": "n/a (not measured)" if kept is None else result,
            }
        )
    return rows


def before_after_section(records):
    """The current tree against --baseline_tree (none without it)."""
    found = before_after_rows(records)
    if not found:
        return []
    config = next((r for r in records if r.get("event") == "config"), {})
    missed = [f"{r['workload']} `{r['system']}`" for r in found]
    missed = [m for m, r in zip(missed, found) if r["result"] != "PASS"]
    verdict = f"Every cell keeps >= {BASELINE_KEEP:.2f} x the baseline."
    if missed:
        verdict = f"Not PASS (MISS or not measured): {', '.join(missed)}."
    both = " (current / baseline)"
    header = (
        f"workload|system|current ex/s|baseline ex/s|runs{both}|current / "
        f"baseline|paired rounds: median (rounds)|vs local{both}|vs "
        f"tf1_sync{both}|CPU us / ex{both}|current / baseline >= "
        f"{BASELINE_KEEP:.2f}"
    ).split("|")

    def row(r):
        def pair(key, spec):
            return " / ".join(fmt(v, spec) for v in r[key])

        return [
            r["workload"],
            f"`{r['system']}`",
            fmt(r["current"]),
            fmt(r["baseline"]),
            pair("runs", "d"),
            fmt(r["ratio"], ".3f"),
            f"{fmt(r['paired'], '.3f')} ({r['rounds']})",
            pair("vs_local", ".2f"),
            pair("vs_tf1_sync", ".2f"),
            pair("cpu_us", ".1f"),
            r["result"],
        ]

    return [
        "This tree against the baseline tree "
        f"`{config.get('baseline_tree') or '?'}` "
        f"(`<system>{BASELINE}`), interleaved in the same rounds; see "
        f"docs/benchmarks.md#before-and-after. {verdict}",
        (header, [row(r) for r in found]),
    ]


def _by_straggler(records):
    key = lambda r: (r["config"], r["straggler"])  # noqa: E731
    return rates(records, "straggler", key=key)


def straggler_kept(records):
    """{config: median with the straggler / median without}."""
    by = _by_straggler(records)
    return {
        c: ratio(median(by.get((c, True))), median(by.get((c, False))))
        for c, _ in by
    }


def straggler_section(records):
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
    slow_async = median(by.get(("pss_async", True)))
    dropped = {}
    for r in runs(records, "straggler"):
        if r.get("pushes"):
            share = r.get("stale_dropped", 0) / r["pushes"]
            dropped.setdefault((r["config"], r["straggler"]), []).append(share)
    rows = [
        [
            config,
            fmt(median(by.get((config, False)))),
            fmt(median(by.get((config, True)))),
            fmt(kept.get(config), ".2f"),
            fmt(ratio(median(by.get((config, True))), slow_async), ".2f"),
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
        f"its compute alone, {compute * 1e3:.1f} ms); *kept*: with / without "
        "the straggler. See docs/benchmarks.md#straggler.",
        (header, rows),
    ]


def scenario_ps_scaling(bench, workers=2):
    """Per ps count, one in-process cluster with the hold probe (and TF1's
    own per cell): each workload whole round robin (`rr`) and, w3 on 2 or
    more ps, `sharded` in one shard per ps; the systems interleaved."""
    s = bench.s
    for ps in s.ps_counts:
        base = {"scenario": "ps_scaling", "workers": workers, "ps": ps}
        base.update(steps_per_function=s.k, functions=s.ps_functions)
        name = f"ps_scaling_{ps}ps"
        child = bench.start_pss(name, workers, ps=ps, hold_time=True)
        endpoints, extra = [], {}
        for workload in s.ps_workloads:
            sharded = workload == "w3" and ps > 1
            for placement in ("rr", "sharded")[: 1 + sharded]:
                shards = ps if placement == "sharded" else 1
                for system in s.ps_systems:
                    cell = f"{system}_{workload}_{placement}"
                    fields = {"config": system, "workload": workload}
                    extra[cell] = {**fields, "placement": placement}
                    if system == "tf1_sync":
                        tf1 = bench.start_tf1(
                            workload, workers, ps, shards, f"{name}_{cell}"
                        )
                        args, kind, children = {"steps": 2 * s.k}, "tf1", [tf1]
                    else:
                        args = {
                            "system": system,
                            "workload": workload,
                            "k": s.k,
                        }
                        args.update({"shards": shards} if shards > 1 else {})
                        kind, children = "pss", [child]
                    endpoints.append(
                        Endpoint(cell, kind, children, args, workers)
                    )
        bench.run_all(endpoints, s.ps_functions, base, extra, setup_extra=extra)


def ps_scaling_section(records):
    key = lambda r: (r["workload"], r["placement"], r["config"], r["ps"])
    found = rates(records, "ps_scaling", key=key)
    if not found:
        return []
    held = {}  # (cell, kind): [holds, seconds] over the runs
    for r in runs(records, "ps_scaling"):
        for kind in ("push", "finalize"):
            if f"{kind}_holds" in r:
                total = held.setdefault((key(r), kind), [0, 0.0])
                total[0] += r[f"{kind}_holds"]
                total[1] += r[f"{kind}_hold_s"]
    setup = {
        key(r): r["setup_s"] for r in events(records, "ps_scaling", "setup")
    }

    def mid(*cell):
        return median(found.get(cell))

    def hold(cell, kind):
        n, seconds = held.get((cell, kind), (0, 0.0))
        return fmt(ratio(1e6 * seconds, n), ".1f") if n else ""

    rows = []
    for cell in sorted(found):
        workload, placement, system, ps = cell
        rate = mid(*cell)
        versus = [
            mid(workload, placement, PS_SCALING_STOCK, ps),
            mid(workload, placement, "tf1_sync", ps),
            mid(workload, "rr", system, 1),
        ]
        rows.append(
            [
                *cell,
                fmt(rate),
                *[fmt(ratio(rate, v), ".2f") for v in versus],
                hold(cell, "push"),
                hold(cell, "finalize"),
                fmt(setup.get(cell), ".2f"),
            ]
        )
    header = ["workload", "placement", "system", "ps", "ex/s", "/ stock"]
    header += ["/ TF1", "/ own 1 ps", "push hold us", "finalize hold us"]
    return [
        "2 workers, 1 to 4 ps; medians; `rr`: variables whole, round robin; "
        "`sharded`: w3 in one shard per ps. See docs/benchmarks.md#ps-scaling.",
        (header + ["set-up s"], rows),
    ]
