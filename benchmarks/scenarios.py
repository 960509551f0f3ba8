"""The benchmark scenarios, each on subprocesses that `driver.Bench` starts.

* `main`: each requested system on one workload, 2 workers + 1 ps (and,
  with --baseline_tree, each tf2sync system also from that tree, as
  `<system>@baseline`).
* `straggler`: 3 workers, worker 0 sleeping `straggler_factor` x its
  compute time per step: tf2sync with 0 and 1 backup worker, stock PSS.
* `scaling`: the step cost of tf2sync's custom loop with 1..4 workers (w1).
* `model_size`: tf2sync's custom loop and stock PSS on w1 with 64..4096
  hidden units, 2 workers.
* `memory`: the RSS of a ps running as its own process (w3), 1..4 workers.
* `accuracy`: time to a held-out accuracy on digits, tf2sync vs stock PSS.
* `sharding`: w4 (a 2,000,000 x 32 embedding) partitioned over 2 ps:
  tf2sync (`fit`, loop), stock PSS (loop, unrolled) and TF1's
  `SyncReplicasOptimizer` (`fixed_size_partitioner`), each ps's state beside
  the bytes of its shards; and tf2sync on w3 in 2 shards on 2 ps against w3
  on 1 ps. Not in the default run (see `driver.DEFAULT_SCENARIOS`).
"""

from __future__ import annotations

import itertools
import time

import procs
from driver import PSS_SYSTEMS
from driver import Endpoint
from sections import BASELINE

MEMORY_FUNCTIONS = 10  # timed functions per memory cell (peaks show at once)


def scenario_main(bench, workload, workers=2):
    """Each requested system on `workload`, 2 workers, interleaved; with
    `--clusters=N`, N times over, each time on processes built anew."""
    for cluster in range(bench.s.clusters):
        _main_on_new_processes(bench, workload, workers, cluster)


def _main_on_new_processes(bench, workload, workers, cluster):
    """One build of the main scenario's processes and its repeats on them.

    A system built once keeps its speed for every repeat on it (the same
    two trees measured 0.84 x in one run and 1.02 x in the next), so the
    `cluster`-th build's records carry `cluster` and continue the repeat
    count, and the medians span every build."""
    s = bench.s
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
    endpoints, extra = [], {}
    pss = [x for x in s.systems if x in PSS_SYSTEMS]
    if pss:
        child = bench.start_pss(f"pss_{workload}{tag}", workers)
        endpoints += [
            Endpoint(x, "pss", [child], {"system": x, **common}, workers)
            for x in pss
        ]
    compared = [x for x in pss if x.startswith("tf2sync")]
    if s.baseline_tree and compared:
        # The baseline tree's tf2sync systems, on a cluster of their own
        # (one version per process), in the same rounds as the current.
        child = bench.start_pss(
            f"pss_{workload}_baseline{tag}", workers, tree=s.baseline_tree
        )
        for x in compared:
            name = x + BASELINE
            endpoints.append(
                Endpoint(name, "pss", [child], {"system": x, **common}, workers)
            )
            extra[name] = {"baseline_of": x}
    if "local" in s.systems:
        child = bench.start_pss(
            f"local_{workload}{tag}", 0, local_workers=workers
        )
        endpoints.append(
            Endpoint(
                "local", "pss", [child], {"system": "local", **common}, workers
            )
        )
    if "tf1_sync" in s.systems:
        child = bench.start_tf1(
            workload, workers, name=f"tf1_sync_{workload}{tag}"
        )
        endpoints.append(
            Endpoint("tf1_sync", "tf1", [child], {"steps": 2 * s.k}, workers)
        )
    if "mwms" in s.systems:
        children = bench.start_mwms(workload, workers, tag=tag)
        endpoints.append(
            Endpoint("mwms", "mwms", children, {"k": s.k}, workers)
        )
    # Each baseline beside its current system (in the first round's order;
    # `driver.balanced_order` varies it).
    endpoints.sort(
        key=lambda e: (
            s.systems.index(e.name.removesuffix(BASELINE)),
            e.name.endswith(BASELINE),
        )
    )
    try:
        bench.setup(endpoints, base)
        bench.interleave(
            endpoints,
            s.functions[workload],
            base,
            extra,
            first_repeat=cluster * s.repeats,
        )
    finally:
        bench.close(endpoints)


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
    cells = [
        ("tf2sync_b0", "tf2sync_loop", workers, workers),
        ("tf2sync_b1", "tf2sync_loop", workers - 1, workers),
        ("pss_async", "pss_async", None, None),
    ]
    endpoints, extra = [], {}
    for label, system, rta, total in cells:
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
    try:
        bench.setup(endpoints, base)
        bench.interleave(
            endpoints, s.straggler_functions, base, extra, window=True
        )
    finally:
        bench.close(endpoints)


def scenario_scaling(bench, workload="w1"):
    """The step cost of tf2sync's custom loop with 1..4 workers."""
    s = bench.s
    base = {
        "scenario": "scaling",
        "workload": workload,
        "steps_per_function": s.k,
        "functions": s.functions[workload],
    }
    endpoints, extra = [], {}
    for n in s.scaling_workers:
        child = bench.start_pss(f"pss_scaling_{n}w", n)
        name = f"tf2sync_loop_{n}w"
        args = {"system": "tf2sync_loop", "workload": workload, "k": s.k}
        endpoints.append(Endpoint(name, "pss", [child], args, n))
        extra[name] = {"config": "tf2sync_loop", "workers": n}
    try:
        bench.setup(endpoints, base)
        bench.interleave(endpoints, s.functions[workload], base, extra)
    finally:
        bench.close(endpoints)


def scenario_model_size(bench, workers=2):
    """tf2sync's loop and stock PSS on w1 as its hidden layer widens."""
    s = bench.s
    base = {
        "scenario": "model_size",
        "workers": workers,
        "steps_per_function": s.k,
        "functions": s.functions["w1"],
    }
    endpoints, extra = [], {}
    for width in s.model_widths:
        workload = f"w1_h{width}"
        child = bench.start_pss(f"pss_size_{width}", workers)
        for system in ("tf2sync_loop", "pss_async"):
            name = f"{system}_h{width}"
            args = {"system": system, "workload": workload, "k": s.k}
            endpoints.append(Endpoint(name, "pss", [child], args, workers))
            extra[name] = {
                "config": system,
                "workload": workload,
                "width": width,
                # 32 -> width relu -> 10 (workloads.py; this process does
                # not import TensorFlow).
                "parameters": 32 * width + width + width * 10 + 10,
            }
    try:
        bench.setup(endpoints, base)
        bench.interleave(endpoints, s.functions["w1"], base, extra)
    finally:
        bench.close(endpoints)


# So that the ps's RSS follows what it holds and a transient buffer shows in
# its peak: TF's plain CPU allocator (oneDNN's caches freed buffers in a BFC
# pool), and glibc mmaps allocations from 128 kB up and unmaps them when
# freed (by default, freed buffers stay in the heap).
_MEMORY_ENV = {
    "TF_ENABLE_ONEDNN_OPTS": "0",
    "MALLOC_MMAP_THRESHOLD_": "131072",
    "MALLOC_TRIM_THRESHOLD_": "131072",
    "MALLOC_ARENA_MAX": "2",
}


def scenario_memory(bench, workload="w3"):
    """RSS of a subprocess ps on w3, tf2sync with 1..4 workers.

    Then stock PSS with the same optimizer, in both function forms, with
    the fewest and the most workers (the references), and two controls:
    tf2sync with an embedding 4 x as large (`w3_x4`: what of the growth
    per worker comes with the table), and a ps that does hold dense
    per-step buffers of the embedding's size: stock PSS with
    `tf.keras.optimizers.SGD`, whose momentum rewrites the whole table
    every step.

    Every cell is measured `memory_repeats` times on a fresh cluster, the
    cells interleaved (all once, then all again): one reading of a cell
    moved by up to 6 MB between runs, as much as a target's margin.
    """
    s = bench.s
    fewest, most = min(s.memory_workers), max(s.memory_workers)
    ends = sorted({fewest, most})
    cells = [
        ("tf2sync_loop", n, s.optimizer, workload) for n in s.memory_workers
    ]
    cells += [
        (system, n, s.optimizer, workload)
        for system in ("tf2sync_loop_while", "pss_async", "pss_async_unrolled")
        for n in ends
    ]
    cells += [("tf2sync_loop", n, s.optimizer, "w3_x4") for n in ends]
    cells.append(("pss_async", most, "keras", workload))
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
        spec, tasks = bench.start_tasks(name, n, env=_MEMORY_ENV)
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
    s = bench.s
    bench.wait_ready([endpoint], base)
    if endpoint.failed:
        return
    idle = _settled(ps_pid)
    bench.setup([endpoint], base)
    if endpoint.failed:
        return
    state = procs.memory_kb(ps_pid)
    reset = procs.reset_peak(ps_pid)
    result = endpoint.run(base["functions"], s.k, s.timeout)
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


def _settled(pid, seconds=1.0, slack_kb=64, most=15.0):
    """memory_kb(pid) once RssAnon has moved < slack_kb for `seconds`."""
    deadline = time.monotonic() + most
    last = procs.memory_kb(pid)
    while time.monotonic() < deadline:
        time.sleep(seconds)
        now = procs.memory_kb(pid)
        if abs(now.get("RssAnon", 0) - last.get("RssAnon", 0)) < slack_kb:
            return now
        last = now
    return last


def scenario_accuracy(bench, workers=2):
    """Time to accuracy on digits (accuracy.py), fresh models each repeat,
    each system at each of the rates of `accuracy_learning_rates`."""
    s = bench.s
    base = {
        "scenario": "accuracy",
        "workload": "digits",
        "workers": workers,
        "steps_per_function": s.k,
        "learning_rates": list(s.accuracy_learning_rates),
    }
    child = bench.start_pss("pss_accuracy", workers)
    options = {"epochs": s.accuracy_epochs, "target": s.accuracy_target}
    endpoints, extra = [], {}
    for rate in s.accuracy_learning_rates:
        for system in ("tf2sync_fit", "pss_async_fit"):
            # The endpoint's name keys its runner on the child; the record
            # names the system and the rate.
            name = f"{system}_lr{rate:g}"
            args = {"system": system, "workload": "digits", "k": s.k}
            args.update(options, learning_rate=rate)
            endpoints.append(Endpoint(name, "pss", [child], args, workers))
            extra[name] = {"system": system, "learning_rate": rate}
    try:
        bench.setup(endpoints, base)
        bench.interleave(endpoints, 0, base, extra)
    finally:
        bench.close(endpoints)


SHARDS = 2  # the sharding scenario's shards and ps tasks
# The sharding scenario's timed cells, (system, workload kind, ps tasks).
SHARDING_CELLS = (
    # (system, workload, ps tasks, shards per variable)
    ("tf2sync_fit", "w4", SHARDS, SHARDS),
    ("tf2sync_loop", "w4", SHARDS, SHARDS),
    ("pss_async", "w4", SHARDS, SHARDS),
    ("pss_async_unrolled", "w4", SHARDS, SHARDS),
    ("tf1_sync", "w4", SHARDS, SHARDS),
    # w3 sharded on 2 ps and whole on 1, tf2sync and stock PSS: each
    # system's own 2-ps / 1-ps ratio.
    ("tf2sync_loop", "w3", SHARDS, SHARDS),
    ("pss_async_unrolled", "w3", SHARDS, SHARDS),
    ("tf2sync_loop", "w3", 1, 1),
    ("pss_async_unrolled", "w3", 1, 1),
    # No partitioner: whole variables placed round robin over 2 ps.
    ("tf2sync_loop", "w3", SHARDS, 1),
    ("pss_async_unrolled", "w3", SHARDS, 1),
    ("tf2sync_loop", "w1", SHARDS, 1),
    ("pss_async_unrolled", "w1", SHARDS, 1),
)
# Its memory cells, on a fresh cluster of subprocess tasks, in the order set
# up: first a small model, the fixed cost of a system on a ps.
SHARDING_MEMORY_CELLS = (
    ("tf2sync_loop", "w1"),
    ("tf2sync_fit", "w4"),
    ("tf2sync_loop", "w4"),
    ("pss_async", "w4"),
    ("pss_async_unrolled", "w4"),
)


def _sharding_cell(s, system, kind, ps, shards):
    """(endpoint name, setup args, record fields) of a sharding cell."""
    name = f"{system}_{kind}_{ps}ps" + ("_rr" if shards < ps else "")
    args = {"system": system, "workload": s.sharding_workload, "k": s.k}
    if kind != "w4":
        args["workload"] = kind
    if shards > 1:
        args["shards"] = shards
    fields = {
        "config": system,
        "workload": kind,
        "ps": ps,
        "shards": shards,
        "rows": _ROWS.get(kind, s.sharding_rows),
    }
    return name, args, fields


def scenario_sharding(bench, workers=2):
    """w4 partitioned over 2 ps, side by side; w3 on 2 ps against 1 ps.

    Memory first, as the memory scenario measures it: a fresh cluster of
    subprocess tasks (`python -m tf2sync`, 2 ps with `_MEMORY_ENV`, 2
    workers, a chief) where the systems are set up one at a time, each
    ps's anonymous RSS settled before and after (a system's state on a ps
    is that difference), then each tf2sync system's per-step peak over one
    short run. The small model set up first gives the fixed cost of a
    system on a ps (and takes the ps's own one-time costs).

    Then throughput, as the main scenario measures it: in-process clusters
    (2 workers + 2 ps for w4 and w3 in 2 shards, 2 workers + 1 ps for w3
    whole, TF1's own of 2 workers + 2 ps), every system set up, then the
    repeats interleaved.
    """
    s = bench.s
    functions = s.functions["w4"]
    base = {
        "scenario": "sharding",
        "workers": workers,
        "steps_per_function": s.k,
        "functions": functions,
    }
    _sharding_memory(bench, base, workers)
    chief2 = bench.start_pss("sharding_2ps", workers, ps=SHARDS)
    chief1 = bench.start_pss("sharding_1ps", workers)
    tf1 = bench.start_tf1(
        s.sharding_workload,
        workers,
        ps=SHARDS,
        shards=SHARDS,
        name="sharding_tf1_sync",
    )
    endpoints, extra = [], {}
    for system, kind, ps, shards in SHARDING_CELLS:
        name, args, extra[name] = _sharding_cell(s, system, kind, ps, shards)
        if system == "tf1_sync":
            endpoint = Endpoint(name, "tf1", [tf1], {"steps": 2 * s.k}, workers)
        else:
            chief = chief2 if ps == SHARDS else chief1
            endpoint = Endpoint(name, "pss", [chief], args, workers)
        endpoints.append(endpoint)
    try:
        bench.setup(endpoints, base, extra)
        bench.interleave(endpoints, functions, base, extra)
    finally:
        bench.close(endpoints)


def _sharding_memory(bench, base, workers):
    s = bench.s
    spec, tasks = bench.start_tasks(
        "sharding_memory", workers, env=_MEMORY_ENV, ps=SHARDS
    )
    chief = bench.start_pss("sharding_memory", workers, cluster_spec=spec)
    ps_pids = [t.pid for t in tasks[:SHARDS]]
    endpoints, extra = [], {}
    for system, kind in SHARDING_MEMORY_CELLS:
        name, args, extra[name] = _sharding_cell(
            s, system, kind, SHARDS, SHARDS
        )
        endpoints.append(Endpoint(name, "pss", [chief], args, workers))
    memory = {**base, "memory_cluster": True}
    try:
        bench.wait_ready(endpoints, memory)
        empty = _settled_all(ps_pids)
        for endpoint in endpoints:
            if endpoint.failed:
                continue
            before = _settled_all(ps_pids)
            got = bench.setup([endpoint], memory, extra).get(endpoint.name)
            if got is None:
                continue
            after = _settled_all(ps_pids)
            by_ps = got.get("ps_bytes", {})
            bench.sink.write(
                {
                    **memory,
                    **extra[endpoint.name],
                    "system": endpoint.name,
                    "event": "ps_memory",
                    "ps_tasks": [
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
                        for i, pid in enumerate(ps_pids)
                    ],
                }
            )
        for endpoint in endpoints:  # each tf2sync system's per-step peak
            if endpoint.failed or not endpoint.name.startswith("tf2sync"):
                continue
            if extra[endpoint.name]["workload"] != "w4":
                continue
            rss = [procs.memory_kb(pid)["VmRSS"] for pid in ps_pids]
            reset = [procs.reset_peak(pid) for pid in ps_pids]
            endpoint.run(
                min(base["functions"], MEMORY_FUNCTIONS), s.k, s.timeout
            )
            hwm = [procs.memory_kb(pid)["VmHWM"] for pid in ps_pids]
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
        bench.sink.write(
            {**memory, "system": "sharding_memory", "error": str(e)}
        )
    finally:
        bench.registry.stop([chief, *tasks])


# Embedding rows of the sharding scenario's fixed workloads (w4's: the flag).
_ROWS = {"w1": 0, "w3": 100_000}


def _settled_all(pids, seconds=1.0, slack_kb=64, most=15.0):
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
