"""The benchmark report from the harness's records (no TensorFlow):
benchmarks.md (targets, then each scenario's section through
`tables.lines`) and, when matplotlib imports, img/benchmarks.png."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import os
import platform

import driver
import memory
import scenarios
import startup
import tables

# Each scenario's targets, in the report's order.
TARGETS = (
    scenarios.main_targets,
    scenarios.straggler_targets,
    memory.memory_targets,
    startup.startup_targets,
    memory.sharding_targets,
)
SECTIONS = (
    ("Throughput (2 workers + 1 ps)", scenarios.main_section),
    ("Before and after", scenarios.before_after_section),
    ("Straggler", scenarios.straggler_section),
    ("ps memory", memory.memory_section),
    ("Sharding (w4 on 2 ps)", memory.sharding_section),
    ("ps scaling", scenarios.ps_scaling_section),
    ("Time to the first update", startup.startup_section),
)
# benchmarks.md from this heading on is kept when the report is rewritten.
KEPT = "## How to read these tables"


def machine():
    """What the numbers were measured on."""
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            names = [x for x in f if x.startswith("model name")]
        model = names[0].split(":", 1)[1].strip() if names else model
    except OSError:
        pass

    found = {"cpus": os.cpu_count(), "cpu": model}
    found["load_average"] = [round(x, 2) for x in os.getloadavg()]
    found["python"] = platform.python_version()
    for key, name in (("tensorflow", "tensorflow"), ("tf_keras", "tf-keras")):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[key] = None
            found[key] = importlib.metadata.version(name)
    now = datetime.datetime.now()
    return {**found, "date": now.isoformat(timespec="seconds")}


def targets(records):
    """Each target, its measured value and PASS / MISS / n/a."""
    return [row for found in TARGETS for row in found(records)]


def plot(records, path):
    """Draws the main scenario's medians; returns why not, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    found = tables.rates(records, "main")
    workloads = [
        w for w in scenarios.WORKLOADS if any(k[0] == w for k in found)
    ]
    if not workloads:
        return "no throughput measured"
    fig, axes = plt.subplots(
        1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False
    )
    for ax, workload in zip(axes[0], workloads):
        systems = [s for s in driver.SYSTEMS if (workload, s) in found]
        values = [found[(workload, s)] for s in systems]
        mids = [tables.median(v) for v in values]
        low = [m - min(v) for m, v in zip(mids, values)]
        high = [max(v) - m for m, v in zip(mids, values)]
        colors = ["C0" if s.startswith("tf2sync") else "C7" for s in systems]
        ax.bar(systems, mids, yerr=[low, high], color=colors, capsize=3)
        text = scenarios.WORKLOAD_TEXT[workload]
        ax.set_title(f"{workload}: {text}", fontsize=9)
        ax.set_yscale("log")
        ax.set_ylabel("examples/s, log scale (median, min-max)")
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def _header(config, done):
    info = config.get("machine", {})
    get = lambda d, k: d.get(k, "?")  # noqa: E731
    smoke = " **Smoke run: not a measurement.**" if config.get("smoke") else ""
    clusters = config.get("clusters", 1)
    builds = ""
    if isinstance(clusters, int) and clusters > 1:
        builds = f"; the main scenario built its processes {clusters} times"
    return (
        f"Measured {get(info, 'date')} with `{get(config, 'command')}` "
        f"({get(done, 'seconds')} s) on {get(info, 'cpus')} CPUs "
        f"({get(info, 'cpu')}; load average at start "
        f"{get(info, 'load_average')}), Python {get(info, 'python')}, "
        f"TensorFlow {get(info, 'tensorflow')}, tf_keras "
        f"{get(info, 'tf_keras')}.{smoke} {get(config, 'repeats')} "
        f"interleaved repeats{builds}; K = {get(config, 'k')}, functions "
        f"{get(config, 'functions')}, optimizer `{get(config, 'optimizer')}`"
        f". How to read the tables: [below](#how-to-read-these-tables)."
    )


def render(records, image_note):
    """The Markdown report."""
    config = next((r for r in records if r.get("event") == "config"), {})
    done = next((r for r in records if r.get("event") == "processes"), {})
    found = [list(t.values()) for t in targets(records)]
    blocks = ["# Benchmarks", _header(config, done), "## Targets"]
    blocks.append((["target", "measured", "required", "result"], found))
    for title, section in SECTIONS:
        found = section(records)
        if found:
            blocks += [f"## {title}", *found]
            blocks += [image_note] * (section is scenarios.main_section)
    alive = done.get("alive")
    blocks += [
        "## Reproduce",
        f"    {config.get('command', 'python benchmarks/harness.py')}",
        "Raw results: `benchmarks.jsonl` beside this file. Subprocesses "
        f"started: {len(done.get('started', []))}, left running: "
        f"{len(alive) if alive is not None else '?'}.",
    ]
    return "\n".join(tables.lines(blocks))


def write(records, output_dir):
    """Writes benchmarks.md (and img/benchmarks.png); returns the paths.
    What an existing benchmarks.md holds from `KEPT` on stays."""
    image = os.path.join(output_dir, "img", "benchmarks.png")
    error = plot(records, image)
    note = (
        f"(No plot: {error}.)" if error else "![Throughput](img/benchmarks.png)"
    )
    path = os.path.join(output_dir, "benchmarks.md")
    kept = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
        kept = text[text.index(KEPT) :] if KEPT in text else ""
    with open(path, "w") as f:
        f.write(render(records, note) + "\n" * bool(kept) + kept)
    return [path] + ([] if error else [image])
