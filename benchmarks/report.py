"""The benchmark report: targets, Markdown and a plot (no TensorFlow).

`write()` makes `benchmarks.md` and, when matplotlib imports,
`img/benchmarks.png` from the harness's JSON records. Every ratio is a
ratio of medians of the same run's interleaved repeats.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform

import sections
import startup
from sections import EMBEDDING_MB
from sections import fmt
from sections import median
from sections import ratio
from sections import table

# Issue 8's bars per workload: (baseline, custom loop at least, fit at
# least). Each form of tf2sync's loop and fit is held to its kind's bar.
_BARS = {
    "w1": ("tf1_sync", 1.5, 1.0),
    "w2": ("local", 0.95, 0.95),
    "w3": ("tf1_sync", 1.0, 1.0),
}
_FORMS = (
    ("tf2sync_loop", "tf2sync_fit"),  # the defaults
    ("tf2sync_loop_while", "tf2sync_fit_keras_loop"),  # the opt-outs
)
# (workload, system, baseline, at least)
THROUGHPUT_TARGETS = tuple(
    (workload, system, base, least)
    for forms in _FORMS
    for workload, (base, loop, fit) in _BARS.items()
    for system, least in zip(forms, (loop, fit))
)
STRAGGLER_KEEP = 0.9
# ps state growth per added worker, as a share of the embedding's size: a
# dense per-worker buffer of the table would add 1.0.
MEMORY_PER_WORKER = 0.25
# Issue 18 (the sharding scenario, w4 on 2 ps): (system, baseline, at
# least), then w3 in 2 shards on 2 ps / on 1 ps more than this.
SHARDING_BARS = (
    ("tf2sync_fit", "tf1_sync", 1.0),
    ("tf2sync_loop", "tf1_sync", 1.0),
    ("tf2sync_fit", "pss_async_unrolled", 0.9),
    ("tf2sync_loop", "pss_async_unrolled", 0.9),
)
# Issue 51: w3's 2-ps / 1-ps ratio at least this x stock PSS's own ratio
# (on shared cores a second ps adds no compute), and whole variables
# round robin over 2 ps at least this x stock PSS unrolled.
SHARDED_W3_OF_STOCK = 0.95
ROUND_ROBIN_AT_LEAST = 0.85
# Issue 21 (the startup scenario): tf2sync's time to its first applied
# update at most this x stock PSS's, per workload, fit and custom loop.
FIRST_UPDATE_AT_MOST = 1.5
STARTUP_PAIRS = (
    ("tf2sync_fit", "pss_async_fit"),
    ("tf2sync_trainer", "pss_async"),
    ("tf2sync_loop", "pss_async"),
)


def machine() -> dict:
    """What the numbers were measured on."""
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (
                    line.split(":", 1)[1].strip()
                    for line in f
                    if line.startswith("model name")
                ),
                model,
            )
    except OSError:
        pass

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "cpus": os.cpu_count(),
        "cpu": model,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "tensorflow": version("tensorflow"),
        "tf_keras": version("tf-keras"),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def _row(target, value, required, ok, spec=".2f"):
    if value is None:
        result = "n/a (not measured)"
    else:
        result = "PASS" if ok(value) else "MISS"
    return {
        "target": target,
        "measured": fmt(value, spec),
        "required": required,
        "result": result,
    }


def targets(records) -> list[dict]:
    """Each target, its measured value and PASS / MISS / n/a."""
    found = sections.rates(records, "main")
    rows = []
    for workload, system, base, least in THROUGHPUT_TARGETS:
        value = ratio(
            median(found.get((workload, system))),
            median(found.get((workload, base))),
        )
        rows.append(
            _row(
                f"{workload} {system} / {base}",
                value,
                f">= {least:.2f}",
                lambda v, least=least: v >= least,
            )
        )
    kept = sections.straggler_kept(records).get("tf2sync_b1")
    rows.append(
        _row(
            "straggler: tf2sync 1 backup, with / without the straggler",
            kept,
            f">= {STRAGGLER_KEEP:.2f}",
            lambda v: v >= STRAGGLER_KEEP,
        )
    )
    most = MEMORY_PER_WORKER * EMBEDDING_MB
    for system in ("tf2sync_loop", "tf2sync_loop_while"):
        growth, _ = sections.memory_summary(records, system)
        rows.append(
            _row(
                f"ps memory: {system} state growth per added worker, beyond "
                f"{sections.MEMORY_REFERENCE[system]}'s (MB)",
                growth,
                f"<= {most:.1f} ({MEMORY_PER_WORKER:.0%} of the embedding)",
                lambda v: v <= most,
                ".1f",
            )
        )
    extra = sections.memory_growth_with_table(records)
    rows.append(
        _row(
            "ps memory: tf2sync_loop state growth per added worker with 4 x "
            "the embedding, minus with w3's (MB)",
            extra,
            f"<= {most:.1f} ({MEMORY_PER_WORKER:.0%} of w3's embedding)",
            lambda v: v <= most,
            ".1f",
        )
    )
    _, peak = sections.memory_summary(records)
    rows.append(
        _row(
            "ps memory: tf2sync largest per-step peak (MB)",
            peak,
            f"< {EMBEDDING_MB:.1f} (the embedding's size)",
            lambda v: v < EMBEDDING_MB,
            ".1f",
        )
    )
    rows += accuracy_targets(records)
    return rows + startup_targets(records) + sharding_targets(records)


def accuracy_targets(records) -> list[dict]:
    """Issue 21: tf2sync's `fit` reaches the digits target no later than
    stock asynchronous PSS's (seconds, medians over the repeats): at the
    grid's first learning rate, and each system at its best rate."""

    def row(condition, value):
        return _row(
            f"digits: seconds to the accuracy target{condition}, "
            "tf2sync_fit / pss_async_fit",
            value,
            "<= 1.00",
            lambda v: v <= 1.0,
        )

    found = sections.accuracy_runs(records)
    if not found:
        return [row("", None)]

    def seconds_of(key):
        values = [r.get("seconds_to_target") for r in found.get(key, [])]
        if not values:
            return None
        if any(v is None for v in values):
            return float("inf")  # a missed run: the median would hide it
        return median(values)

    def best(system):
        """(seconds, rate) of the system's fastest rate, or None."""
        cells = [(seconds_of(key), key[1]) for key in found if key[0] == system]
        return min(cells, default=None)

    some = next(iter(found.values()))[0]
    grid = some.get("learning_rates", [sections.ACCURACY_UNRECORDED_RATE])
    first = grid[0]
    ours = seconds_of(("tf2sync_fit", first))
    theirs = seconds_of(("pss_async_fit", first))
    value = None if ours is None or theirs is None else ratio(ours, theirs)
    rows = [row(f" at learning rate {first:g}", value)]
    rates = sorted({rate for _, rate in found})
    if len(rates) > 1:
        ours, theirs = best("tf2sync_fit"), best("pss_async_fit")
        value = None if not (ours and theirs) else ratio(ours[0], theirs[0])

        def where(name, cell):
            if cell[0] == float("inf"):
                return f"{name} missed at every rate"
            return f"{name} at {cell[1]:g}"

        at = (
            f" ({where('tf2sync', ours)}, {where('stock', theirs)})"
            if ours and theirs
            else ""
        )
        listed = ", ".join(f"{r:g}" for r in rates)
        rows.append(row(f", each at its best rate of {listed}{at}", value))
    return rows


def startup_targets(records) -> list[dict]:
    """Issue 21: the first applied update, tf2sync / stock PSS (medians of
    the startup scenario); none when it did not run."""
    found = startup.medians(records)
    rows = []
    for workload in startup.WORKLOADS:
        for ours, theirs in STARTUP_PAIRS:
            a, b = found.get((workload, ours)), found.get((workload, theirs))
            if a is None and b is None:
                continue
            value = (
                ratio(a["first_update_s"], b["first_update_s"])
                if a and b
                else None
            )
            rows.append(
                _row(
                    f"{workload}: first applied update, {ours} / {theirs}",
                    value,
                    f"<= {FIRST_UPDATE_AT_MOST:.2f}",
                    lambda v: v <= FIRST_UPDATE_AT_MOST,
                )
            )
    return rows


def sharding_targets(records) -> list[dict]:
    """The sharding scenario's targets (none when it did not run)."""
    if not any(r.get("scenario") == "sharding" for r in records):
        return []
    found = sections.sharding_rates(records)
    rows = []
    for system, base, least in SHARDING_BARS:
        value = ratio(
            median(found.get(("w4", system, 2, 2))),
            median(found.get(("w4", base, 2, 2))),
        )
        rows.append(
            _row(
                f"w4 (2 shards, 2 ps) {system} / {base}",
                value,
                f">= {least:.2f}",
                lambda v, least=least: v >= least,
            )
        )
    factor = sections.SHARD_STATE_FACTOR
    memory = [
        m
        for m in sections.sharding_memory(records)
        if m["workload"] == "w4" and m["system"].startswith("tf2sync")
    ]
    for m in memory:
        bound = m["bound_mb"]
        rows.append(
            _row(
                f"ps memory, w4: {m['system']} state on ps {m['task']} (MB)",
                m["state_mb"],
                f"<= {fmt(bound, '.1f')} ({factor} x its shards' "
                f"{m['bytes_mb']:.1f} MB + the fixed "
                f"{fmt(m['fixed_mb'], '.1f')} MB)",
                lambda v, bound=bound: bound is not None and v <= bound,
                ".1f",
            )
        )
    if not memory:
        rows.append(
            _row(
                "ps memory, w4: tf2sync state per ps",
                None,
                f"<= {factor} x its shards' bytes + the fixed cost",
                lambda v: False,
            )
        )

    def over(config, workload, ps, shards, base):
        return ratio(
            median(found.get((workload, config, ps, shards))),
            median(found.get(base)),
        )

    own = [
        over(config, "w3", 2, 2, ("w3", config, 1, 1))
        for config in ("tf2sync_loop", "pss_async_unrolled")
    ]
    rows.append(
        _row(
            "w3 2 shards on 2 ps / on 1 ps: tf2sync_loop's ratio / "
            "pss_async_unrolled's",
            ratio(*own) if None not in own else None,
            f">= {SHARDED_W3_OF_STOCK:.2f}",
            lambda v: v >= SHARDED_W3_OF_STOCK,
        )
    )
    for workload in ("w1", "w3"):
        rows.append(
            _row(
                f"{workload} round robin on 2 ps: tf2sync_loop / "
                "pss_async_unrolled",
                over(
                    "tf2sync_loop",
                    workload,
                    2,
                    1,
                    (workload, "pss_async_unrolled", 2, 1),
                ),
                f">= {ROUND_ROBIN_AT_LEAST:.2f}",
                lambda v: v >= ROUND_ROBIN_AT_LEAST,
            )
        )
    return rows


def plot(records, path) -> str | None:
    """Draws the main scenario's medians; returns why not, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    found = sections.rates(records, "main")
    workloads = [w for w in sections.WORKLOADS if any(k[0] == w for k in found)]
    if not workloads:
        return "no throughput measured"
    fig, axes = plt.subplots(
        1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False
    )
    for ax, workload in zip(axes[0], workloads):
        systems = [s for s in sections.SYSTEM_TEXT if (workload, s) in found]
        values = [found[(workload, s)] for s in systems]
        mids = [median(v) for v in values]
        low = [m - min(v) for m, v in zip(mids, values)]
        high = [max(v) - m for m, v in zip(mids, values)]
        colors = ["C0" if s.startswith("tf2sync") else "C7" for s in systems]
        ax.bar(systems, mids, yerr=[low, high], color=colors, capsize=3)
        ax.set_title(
            f"{workload}: {sections.WORKLOAD_TEXT[workload]}", fontsize=9
        )
        ax.set_yscale("log")
        ax.set_ylabel("examples/s, log scale (median, min-max)")
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def _clusters_text(clusters) -> str:
    """The header's words for `--clusters` (nothing for one build)."""
    if not isinstance(clusters, int) or clusters <= 1:
        return ""
    return (
        f"; the main scenario built its processes {clusters} times, "
        "each build running all those repeats, and its medians span them"
    )


def _header(config, done):
    info = config.get("machine", {})
    smoke = " **Smoke run: not a measurement.**" if config.get("smoke") else ""
    return [
        "# Benchmarks",
        "",
        f"Measured {info.get('date', '?')} with `{config.get('command', '?')}`"
        f" ({done.get('seconds', '?')} s) on {info.get('cpus', '?')} CPUs "
        f"({info.get('cpu', '?')}; load average at start "
        f"{info.get('load_average', '?')}), Python {info.get('python', '?')},"
        f" TensorFlow {info.get('tensorflow', '?')}, tf_keras "
        f"{info.get('tf_keras', '?')}.{smoke}",
        "",
        "Every system runs on this one machine, on a cluster of 2 workers "
        "and 1 ps on 127.0.0.1 (unless said otherwise), in subprocesses of "
        "its own; each is built and warmed up once, then the "
        f"{config.get('repeats', '?')} repeats are interleaved (the order "
        "is balanced: each system runs after each other one equally often) "
        "so that machine noise hits all systems alike"
        f"{_clusters_text(config.get('clusters', 1))}. "
        "Ratios are ratios of medians of the same run. A run is the same "
        f"work for every system: functions x K x B examples (K = "
        f"{config.get('k', '?')}, functions {config.get('functions', '?')}). "
        "Synchronous systems count aggregated examples only (accepted "
        "gradients x B; TF1: N x B per global step); asynchronous ones "
        "count every applied step. Optimizer: momentum SGD 0.01 / 0.9, "
        f"`{config.get('optimizer', '?')}` (`legacy`: tf_keras's legacy SGD, "
        "fused kernels and lazy sparse momentum like TF1's "
        "MomentumOptimizer; `keras`: `tf.keras.optimizers.SGD`).",
        "",
    ]


def render(records, image_note) -> str:
    """The Markdown report."""
    config = next((r for r in records if r.get("event") == "config"), {})
    done = next((r for r in records if r.get("event") == "processes"), {})
    lines = _header(config, done) + ["## Targets", ""]
    lines += table(
        ["target", "measured", "required", "result"],
        [list(t.values()) for t in targets(records)],
    )
    lines += ["", "## Throughput (2 workers + 1 ps)", ""]
    lines += sections.systems_section(records)
    lines += [
        "CPU us / ex: the user + system CPU time of all the harness's "
        "processes during a run (one system runs at a time), per example. "
        "On a machine whose cores every process shares it moves less "
        "between runs than examples/s. `fit` runs 2 epochs of that work per "
        "run and is timed over the second, as a `fit` of several epochs "
        "runs: the first also holds the call's start (tf_keras builds and "
        "ships each worker's input pipeline, data included, at every `fit` "
        "call; the loops build theirs once, untimed). Its CPU per example "
        "is over both epochs.",
        "",
    ]
    lines += sections.main_section(records) + [image_note, ""]
    for title, section in (
        ("Before and after", sections.before_after_section(records)),
        ("Straggler", sections.straggler_section(records)),
        ("Scaling", sections.scaling_section(records)),
        ("Model size", sections.model_size_section(records)),
        ("ps memory", sections.memory_section(records)),
        ("Time to accuracy", sections.accuracy_section(records)),
        ("Sharding (w4 on 2 ps)", sections.sharding_section(records)),
        ("Time to the first update", startup.startup_section(records)),
    ):
        if section:
            lines += [f"## {title}", "", *section]
    alive = done.get("alive")
    lines += [
        "## Reproduce",
        "",
        f"    {config.get('command', 'python benchmarks/harness.py')}",
        "",
        "Raw results: `benchmarks.jsonl` beside this file. Subprocesses "
        f"started: {len(done.get('started', []))}, left running: "
        f"{len(alive) if alive is not None else '?'}.",
        "",
    ]
    return "\n".join(lines)


def write(records, output_dir) -> list[str]:
    """Writes benchmarks.md (and img/benchmarks.png); returns the paths."""
    image = os.path.join(output_dir, "img", "benchmarks.png")
    error = plot(records, image)
    note = (
        f"(No plot: {error}.)"
        if error
        else ("![Throughput by system](img/benchmarks.png)")
    )
    path = os.path.join(output_dir, "benchmarks.md")
    with open(path, "w") as f:
        f.write(render(records, note))
    return [path] + ([] if error else [image])
