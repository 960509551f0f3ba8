"""The harness's driver: subprocesses, endpoints, interleaved repeats.

`Bench` starts the benchmark subprocesses (all through `procs.Registry`,
so that each is ended by PID), sets every system up once, then interleaves
the repeats in a balanced order (`balanced_order`). `Endpoint` is one
system on its subprocess(es); `Sink` writes one JSON line per record.
"""

from __future__ import annotations

import json
import os
import sys
import time

import procs

SYSTEMS = (
    "local",
    "tf2sync_fit",
    "tf2sync_fit_keras_loop",
    "tf2sync_loop",
    "tf2sync_loop_while",
    "pss_async",
    "pss_async_unrolled",
    "pss_async_fit",
    "tf1_sync",
    "mwms",
)
# The systems that run on the harness's PSS cluster (`pss_worker.py`).
PSS_SYSTEMS = tuple(s for s in SYSTEMS if s.startswith(("tf2sync", "pss")))
# The main scenario's default: all but stock PSS through `fit`.
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s != "pss_async_fit")
SCENARIOS = (
    "main",
    "straggler",
    "scaling",
    "model_size",
    "memory",
    "accuracy",
    "sharding",
    "startup",
)
# The harness's default: all but `sharding` (w4's 2 x 512 MB of tables and
# momentum on 2 ps; about 4 min more on 2 cores: --scenarios=...,sharding)
# and `startup` (24 fresh processes, about 6 min: --scenarios=startup).
DEFAULT_SCENARIOS = tuple(
    s for s in SCENARIOS if s not in ("sharding", "startup")
)
_HERE = os.path.dirname(os.path.abspath(__file__))
# A baseline tree's own worker (--baseline_tree): it imports that tree's
# tf2sync and its own benchmarks/ modules, and speaks the same protocol.
BASELINE_WORKER = os.path.join("benchmarks", "pss_worker.py")


class Sink:
    """JSON lines to a file and stdout; keeps every record."""

    def __init__(self, path):
        self.path = path
        self.records = []
        open(path, "w").close()

    def write(self, record: dict) -> None:
        self.records.append(record)
        line = json.dumps(record)
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


class Endpoint:
    """One system on its subprocess(es): set up once, then timed runs.

    `kind` is "pss" (a key on a pss_worker child), "tf1" or "mwms" (every
    child gets each command). A run does the same work whatever the system,
    functions x K x B examples: PSS systems schedule `functions` functions
    of K steps (each on one worker); `local` and `mwms` run functions / N
    functions of K steps of N x B examples; `tf1_sync` trains until its
    global step rose by functions x K / N (N x B examples each).
    """

    def __init__(self, name, kind, children, setup_args, workers=1):
        self.name = name
        self.kind = kind
        self.children = children
        self.setup_args = setup_args
        self.workers = workers
        self.failed = None

    def _all(self, op, timeout, **args):
        for child in self.children:
            child.send(op, **args)
        return [child.receive(timeout) for child in self.children]

    def setup(self, timeout):
        args = dict(self.setup_args)
        if self.kind == "pss":
            args["key"] = self.name
        return self._all("setup", timeout, **args)[0]

    def run(self, functions, k, timeout, window=False):
        if self.kind == "pss":
            if self.name.startswith("local"):
                functions = max(1, functions // self.workers)
            return self._all(
                "run",
                timeout,
                key=self.name,
                functions=functions,
                window=window,
            )[0]
        if self.kind == "tf1":
            steps = max(1, functions * k // self.workers)
            return self._all("run", timeout, steps=steps)[0]
        results = self._all(
            "run", timeout, functions=max(1, functions // self.workers)
        )
        result = dict(results[0])
        result["seconds"] = max(r["seconds"] for r in results)
        result["examples_per_sec"] = round(
            result["examples"] / result["seconds"], 1
        )
        return result


def balanced_order(count: int, round_index: int) -> list[int]:
    """The order of `count` systems in round `round_index`.

    A Williams design: over `count` rounds (`2 * count` where `count` is
    odd) each system runs right after each other one equally often. A
    system can leave work running when its run returns (the harness
    charges every child's CPU to the run in progress); a rotation of one
    order (A B C, B C A, ...) always put the same system before another,
    and an identical tree measured 0.962 x itself in such runs
    (docs/benchmarks.md).
    """
    first = [0]
    low, high = 1, count - 1
    while len(first) < count:
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    rounds = count if count % 2 == 0 else 2 * count
    shift = round_index % rounds
    order = [(i + shift) % count for i in first]
    return order[::-1] if shift >= count else order


class Bench:
    """Starts subprocesses, drives the scenarios, records everything."""

    def __init__(self, settings, registry, sink):
        self.s = settings
        self.registry = registry
        self.sink = sink

    # -- subprocesses -----------------------------------------------------

    def _start(self, name, argv, env=None, protocol=True, tree=None):
        child = self.registry.start(name, argv, env=env, protocol=protocol)
        where = {"tree": tree} if tree else {}
        self.sink.write({"event": "started", **child.record(), **where})
        return child

    def _python(self, script, *args):
        return [sys.executable, os.path.join(_HERE, script), *args]

    def start_pss(
        self,
        name,
        workers,
        local_workers=2,
        cluster_spec=None,
        optimizer=None,
        tree=None,
        ps=1,
    ):
        """A pss_worker.py child; from the checkout `tree` if given (its own
        script, with PYTHONPATH=tree so that it imports that tree's
        tf2sync), else from this one."""
        args = [
            f"--workers={workers}",
            f"--local_workers={local_workers}",
            f"--optimizer={optimizer or self.s.optimizer}",
        ]
        if ps != 1:
            args.append(f"--ps={ps}")
        if cluster_spec:
            args.append("--cluster_spec=" + json.dumps(cluster_spec))
        if tree is None:
            return self._start(name, self._python("pss_worker.py", *args))
        path = os.environ.get("PYTHONPATH")
        env = {"PYTHONPATH": os.pathsep.join([tree] + ([path] if path else []))}
        argv = [sys.executable, os.path.join(tree, BASELINE_WORKER), *args]
        return self._start(name, argv, env=env, tree=tree)

    def start_tf1(self, workload, workers, ps=1, shards=1, name=None):
        return self._start(
            name or f"tf1_sync_{workload}",
            self._python(
                "tf1_sync_worker.py",
                f"--workers={workers}",
                f"--workload={workload}",
                f"--ps={ps}",
                f"--shards={shards}",
            ),
        )

    def start_mwms(self, workload, workers, tag=""):
        ports = procs.pick_free_ports(workers)
        cluster = {"worker": [f"{procs.LOOPBACK}:{p}" for p in ports]}
        return [
            self._start(
                f"mwms_{workload}{tag}_{i}",
                self._python(
                    "mwms_worker.py",
                    f"--workload={workload}",
                    f"--optimizer={self.s.optimizer}",
                ),
                env={
                    "TF_CONFIG": json.dumps(
                        {
                            "cluster": cluster,
                            "task": {"type": "worker", "index": i},
                        }
                    ),
                    **self.worker_device_env(i),
                },
            )
            for i in range(workers)
        ]

    def start_tasks(self, name, workers, env=None, ps=1):
        """ps and worker tasks (`python -m tf2sync`), and their spec (the ps
        tasks first in the list returned)."""
        ports = procs.pick_free_ports(workers + 1 + ps)
        addresses = [f"{procs.LOOPBACK}:{p}" for p in ports]
        spec = {
            "chief": addresses[:1],
            "worker": addresses[1 : 1 + workers],
            "ps": addresses[1 + workers :],
        }
        hosts = [
            "--ps_hosts=" + ",".join(spec["ps"]),
            "--worker_hosts=" + ",".join(spec["worker"]),
            "--chief_host=" + spec["chief"][0],
        ]
        tasks = [
            self._start(
                f"{name}_{job}{i}",
                self._python(
                    "procs.py",
                    "tf2sync",
                    f"--job_name={job}",
                    f"--task_index={i}",
                    *hosts,
                ),
                env={
                    "CUDA_VISIBLE_DEVICES": "",
                    **(self.worker_device_env(i) if job == "worker" else {}),
                    **(env or {}),
                },
                protocol=False,
            )
            for job, count in (("ps", ps), ("worker", workers))
            for i in range(count)
        ]
        return spec, tasks

    def worker_device_env(self, index):
        """Worker `index`'s device environment: CPU only, or with
        `--worker_gpus` its GPUs (shared modulo the machine's count, each
        process growing its memory)."""
        per_worker = getattr(self.s, "worker_gpus", 0)
        if not per_worker:
            return {"CUDA_VISIBLE_DEVICES": ""}
        count = int(os.environ.get("TF2SYNC_BENCH_GPUS", "1"))
        return {
            "CUDA_VISIBLE_DEVICES": ",".join(
                str((index * per_worker + i) % count) for i in range(per_worker)
            ),
            "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        }

    # -- driving ----------------------------------------------------------

    def fail(self, endpoints, endpoint, error, base):
        """Records `error` for `endpoint`.

        A fatal error (no answer; or any error of a multi-process system,
        whose peers may wait forever) also ends its subprocesses and fails
        every system on them.
        """
        failing = [endpoint]
        fatal = getattr(error, "fatal", True) or len(endpoint.children) > 1
        if fatal:
            self.registry.stop(endpoint.children)
            failing += [
                e
                for e in endpoints
                if e is not endpoint
                and set(e.children) & set(endpoint.children)
            ]
        for other in failing:
            if not other.failed:
                other.failed = str(error)
                self.sink.write(
                    {**base, "system": other.name, "error": str(error)}
                )

    def wait_ready(self, endpoints, base):
        for endpoint in endpoints:
            for child in endpoint.children:
                if endpoint.failed:
                    break
                try:
                    if not getattr(child, "ready", None):
                        child.ready = child.receive(self.s.timeout)
                except procs.ChildError as e:
                    self.fail(endpoints, endpoint, e, base)

    def setup(self, endpoints, base, extra=None):
        """Sets each endpoint up; returns {name: its answer} of those that
        answered."""
        self.wait_ready(endpoints, base)
        answers = {}
        for endpoint in endpoints:
            if endpoint.failed:
                continue
            start = time.perf_counter()
            try:
                answer = endpoint.setup(self.s.timeout)
            except procs.ChildError as e:
                self.fail(endpoints, endpoint, e, base)
                continue
            answers[endpoint.name] = answer
            self.sink.write(
                {
                    **base,
                    "system": endpoint.name,
                    **(extra or {}).get(endpoint.name, {}),
                    "event": "setup",
                    "setup_s": round(time.perf_counter() - start, 2),
                    **(answer if isinstance(answer, dict) else {}),
                }
            )
        return answers

    def interleave(
        self, endpoints, functions, base, extra, window=False, first_repeat=0
    ):
        """Runs the repeats, each round in `balanced_order`; one record per
        run, its `repeat` counted from `first_repeat` (a later cluster
        build goes on with the next rounds' orders)."""
        for index in range(self.s.repeats):
            repeat = first_repeat + index
            order = balanced_order(len(endpoints), repeat)
            for endpoint in (endpoints[i] for i in order):
                if endpoint.failed:
                    continue
                cpu = self.registry.cpu_seconds()
                try:
                    result = endpoint.run(
                        functions, self.s.k, self.s.timeout, window=window
                    )
                except procs.ChildError as e:
                    self.fail(endpoints, endpoint, e, base)
                    continue
                self.sink.write(
                    {
                        **base,
                        "system": endpoint.name,
                        "repeat": repeat,
                        **extra.get(endpoint.name, {}),
                        **result,
                        **_cpu_per_example(
                            self.registry.cpu_seconds() - cpu, result
                        ),
                    }
                )

    def close(self, endpoints):
        self.registry.stop({c for e in endpoints for c in e.children})


def _cpu_per_example(cpu_s, result) -> dict:
    """The run's CPU seconds (all the harness's processes, one system
    running at a time) and CPU microseconds per example (of every example
    the run trained: `cpu_examples` where it timed only some)."""
    examples = result.get("cpu_examples") or result.get("examples") or 0
    record = {"cpu_s": round(cpu_s, 3)}
    if examples and not result.get("window"):  # a window counts fewer
        record["cpu_us_per_example"] = round(cpu_s / examples * 1e6, 2)
    return record
