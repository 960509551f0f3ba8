"""The throughput scenarios `main`, `straggler` and `ps_scaling`: each
one's run, targets and report section (docs/benchmarks.md#systems,
#straggler, #ps-scaling); `--baseline_tree` runs each tf2sync system of
`main` also from that tree, as `<system>@baseline`."""

from __future__ import annotations

import itertools

import tables
from driver import PSS_SYSTEMS
from driver import SYSTEMS
from driver import Endpoint
from tables import fmt
from tables import median
from tables import ratio
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
# The suffix of a system run from --baseline_tree and the share of the
# baseline's examples/s the current tree keeps at least (PASS).
BASELINE = "@baseline"
BASELINE_KEEP = 0.95
PS_SCALING_STOCK = "pss_async_unrolled"  # the ps_scaling tables' "stock"
STRAGGLER_KEEP = 0.9  # tf2sync with 1 backup: with / without, at least


def scenario_main(bench, workload, workers=2):
    """Each requested system on `workload`, interleaved; with
    `--clusters=N`, on processes built anew N times."""
    s = bench.s
    functions = s.functions[workload]
    for cluster in range(s.clusters):
        base = bench.base("main", functions, workload=workload, workers=workers)
        tag = f"_c{cluster}" if cluster else ""
        if s.clusters > 1:
            base["cluster"] = cluster
        endpoints, extra = [], {}
        chosen = [x for x in s.systems if x in PSS_SYSTEMS]
        if chosen:
            child = bench.start_pss(f"pss_{workload}{tag}", workers)
            endpoints += [
                bench.pss(x, child, workers, x, workload) for x in chosen
            ]
        compared = [x for x in chosen if x.startswith("tf2sync")]
        if s.baseline_tree and compared:
            # The baseline tree's tf2sync systems, on a cluster of their
            # own (one version per process), in the same rounds.
            name = f"pss_{workload}_baseline{tag}"
            child = bench.start_pss(name, workers, tree=s.baseline_tree)
            for x in compared:
                endpoints.append(
                    bench.pss(x + BASELINE, child, workers, x, workload)
                )
                extra[x + BASELINE] = {"baseline_of": x}
        if "local" in s.systems:
            name = f"local_{workload}{tag}"
            child = bench.start_pss(name, 0, local_workers=workers)
            endpoints.append(
                bench.pss("local", child, workers, "local", workload)
            )
        if "tf1_sync" in s.systems:
            name = f"tf1_sync_{workload}{tag}"
            child = bench.start_tf1(workload, workers, name=name)
            endpoints.append(bench.tf1("tf1_sync", child, workers))
        if "mwms" in s.systems:
            children = bench.start_mwms(workload, workers, tag=tag)
            args = {"system": "mwms", "workload": workload, "k": s.k}
            endpoints.append(Endpoint("mwms", "mwms", children, args, workers))
        # Each baseline beside its current system in the first round.
        endpoints.sort(
            key=lambda e: (
                s.systems.index(e.name.removesuffix(BASELINE)),
                e.name.endswith(BASELINE),
            )
        )
        first = cluster * s.repeats
        bench.run_all(endpoints, functions, base, extra, first_repeat=first)


def scenario_straggler(bench, workers=3):
    """tf2sync with 0 and 1 backup worker, and stock PSS, +- a straggler."""
    s = bench.s
    workload, functions = s.straggler_workload, s.straggler_functions
    base = bench.base(
        "straggler", functions, workload=workload, workers=workers
    )
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
            args = {"rta": rta, "total": total, "delay_factor": factor}
            endpoints.append(
                bench.pss(name, child, workers, system, workload, **args)
            )
            extra[name] = {"config": label, "straggler": straggler}
            extra[name].update(
                replicas_to_aggregate=rta, total_num_replicas=total
            )
    bench.run_all(endpoints, functions, base, extra, window=True)


def scenario_ps_scaling(bench, workers=2):
    """Per ps count, one in-process cluster with the hold probe (and TF1's
    own per cell): each workload whole round robin (`rr`) and, w3 on 2 or
    more ps, `sharded` in one shard per ps; the systems interleaved."""
    s = bench.s
    for ps in s.ps_counts:
        base = bench.base("ps_scaling", s.ps_functions, workers=workers, ps=ps)
        name = f"ps_scaling_{ps}ps"
        child = bench.start_pss(name, workers, ps=ps, hold_time=True)
        endpoints, extra = [], {}
        for workload in s.ps_workloads:
            sharded = workload == "w3" and ps > 1
            for placement in ("rr", "sharded")[: 1 + sharded]:
                shards = ps if placement == "sharded" else 1
                for system in s.ps_systems:
                    cell = f"{system}_{workload}_{placement}"
                    extra[cell] = {"config": system, "workload": workload}
                    extra[cell]["placement"] = placement
                    if system == "tf1_sync":
                        tf1 = bench.start_tf1(
                            workload, workers, ps, shards, f"{name}_{cell}"
                        )
                        endpoint = bench.tf1(cell, tf1, workers)
                    else:
                        endpoint = bench.pss(
                            cell, child, workers, system, workload, shards
                        )
                    endpoints.append(endpoint)
        bench.run_all(endpoints, s.ps_functions, base, extra, setup_extra=extra)


# -- targets --------------------------------------------------------------


def main_targets(records):
    found = tables.rates(records, "main")
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
    found = tables.rates(records, "main")
    cpu = tables.rates(records, "main", "cpu_us_per_example")
    blocks = []
    for workload in WORKLOADS:
        failed = tables.errors(records, "main")
        failed = [r for r in failed if r["workload"] == workload]
        systems = [s for s in SYSTEMS if (workload, s) in found]
        if not systems and not failed:
            continue
        header, rows = tables.throughput(
            found,
            cpu,
            [(workload, system) for system in systems],
            ["system"],
            lambda w, system: [f"`{system}`"],
            {
                "vs tf1_sync": (None, "tf1_sync"),
                "vs pss_async": (None, "pss_async"),
            },
        )
        rows += [tables.error_row(r) for r in failed]
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
    for r in tables.runs(records, "main"):
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
    found = tables.rates(records, "main")
    cpu = tables.rates(records, "main", "cpu_us_per_example")
    ran = set(found) | {
        (r.get("workload"), r.get("system"))
        for r in tables.errors(records, "main")
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
    missed = [
        f"{r['workload']} `{r['system']}`"
        for r in found
        if r["result"] != "PASS"
    ]
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

    def pair(r, key, spec):
        return " / ".join(fmt(v, spec) for v in r[key])

    rows = [
        [
            r["workload"],
            f"`{r['system']}`",
            fmt(r["current"]),
            fmt(r["baseline"]),
            pair(r, "runs", "d"),
            fmt(r["ratio"], ".3f"),
            f"{fmt(r['paired'], '.3f')} ({r['rounds']})",
            pair(r, "vs_local", ".2f"),
            pair(r, "vs_tf1_sync", ".2f"),
            pair(r, "cpu_us", ".1f"),
            r["result"],
        ]
        for r in found
    ]
    return [
        "This tree against the baseline tree "
        f"`{config.get('baseline_tree') or '?'}` "
        f"(`<system>{BASELINE}`), interleaved in the same rounds; see "
        f"docs/benchmarks.md#before-and-after. {verdict}",
        (header, rows),
    ]


def _by_straggler(records):
    key = lambda r: (r["config"], r["straggler"])  # noqa: E731
    return tables.rates(records, "straggler", key=key)


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
    setups = tables.events(records, "straggler", "setup")
    delay = max((r.get("delay_s", 0) for r in setups), default=0)
    compute = max((r.get("compute_s", 0) for r in setups), default=0)
    kept = straggler_kept(records)
    slow_async = median(by.get(("pss_async", True)))
    dropped = {}
    for r in tables.runs(records, "straggler"):
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
    first = tables.runs(records, "straggler")[0]
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


def ps_scaling_section(records):
    key = lambda r: (r["workload"], r["placement"], r["config"], r["ps"])
    found = tables.rates(records, "ps_scaling", key=key)
    if not found:
        return []
    held = {}  # (cell, kind): [holds, seconds] over the runs
    for r in tables.runs(records, "ps_scaling"):
        for kind in ("push", "finalize"):
            if f"{kind}_holds" in r:
                total = held.setdefault((key(r), kind), [0, 0.0])
                total[0] += r[f"{kind}_holds"]
                total[1] += r[f"{kind}_hold_s"]
    setup = tables.events(records, "ps_scaling", "setup")
    setup = {key(r): r["setup_s"] for r in setup}

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
