"""The harness's driver: starts the subprocesses, sets each system up once,
interleaves the repeats (docs/benchmarks.md#how-the-harness-measures)."""

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
PSS_SYSTEMS = tuple(s for s in SYSTEMS if s.startswith(("tf2sync", "pss")))
# The main scenario's default: all but stock PSS through `fit`.
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s != "pss_async_fit")
_HERE = os.path.dirname(os.path.abspath(__file__))
BASELINE_WORKER = os.path.join("benchmarks", "pss_worker.py")


class Sink:
    """JSON lines to a file and stdout; keeps every record."""

    def __init__(self, path):
        self.path = path
        self.records = []
        open(path, "w").close()

    def write(self, record):
        self.records.append(record)
        line = json.dumps(record)
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


class Endpoint:
    """One system on its subprocess(es)."""

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
        key = {} if self.kind == "tf1" else {"key": self.name}
        return self._all("setup", timeout, **self.setup_args, **key)[0]

    def run(self, functions, k, timeout, window=False):
        if self.kind == "tf1":
            steps = max(1, functions * k // self.workers)
            return self._all("run", timeout, steps=steps)[0]
        if self.kind == "mwms" or self.name == "local":  # each on its batch
            functions = max(1, functions // self.workers)
        args = {"key": self.name, "functions": functions, "window": window}
        results = self._all("run", timeout, **args)
        seconds = max(r["seconds"] for r in results)
        rate = round(results[0]["examples"] / seconds, 1)
        return {**results[0], "seconds": seconds, "examples_per_sec": rate}


def balanced_order(count, round_index):
    """Round `round_index`'s order of `count` systems (a Williams design)."""
    first, low, high = [0], 1, count - 1
    while len(first) < count:
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    shift = round_index % (count if count % 2 == 0 else 2 * count)
    order = [(i + shift) % count for i in first]
    return order[::-1] if shift >= count else order


class Bench:
    def __init__(self, settings, registry, sink):
        self.s = settings
        self.registry = registry
        self.sink = sink

    def base(self, scenario, functions, **fields):
        """The fields of every record of a scenario's run."""
        k = {"steps_per_function": self.s.k, "functions": functions}
        return {"scenario": scenario, **fields, **k}

    def pss(self, name, child, workers, system, workload, shards=1, **args):
        """`system` on the pss_worker.py `child` (`args`: its options)."""
        args = {"system": system, "workload": workload, "k": self.s.k, **args}
        args.update({"shards": shards} if shards > 1 else {})
        return Endpoint(name, "pss", [child], args, workers)

    def tf1(self, name, child, workers):
        """The tf1_sync_worker.py `child`, warmed up for 2 K global steps."""
        return Endpoint(name, "tf1", [child], {"steps": 2 * self.s.k}, workers)

    def start(self, name, argv, env=None, protocol=True, tree=None):
        child = self.registry.start(name, argv, env=env, protocol=protocol)
        where = {"tree": tree} if tree else {}
        self.sink.write({"event": "started", **child.record(), **where})
        return child

    def python(self, script, *args):
        return [sys.executable, os.path.join(_HERE, script), *args]

    def start_pss(self, name, workers, local_workers=2, spec=None, **options):
        """A pss_worker.py child (options: `optimizer`, `ps`, `hold_time`,
        `tree`: a checkout whose own worker runs)."""
        optimizer = options.get("optimizer") or self.s.optimizer
        args = [f"--workers={workers}", f"--local_workers={local_workers}"]
        args.append(f"--optimizer={optimizer}")
        if options.get("ps", 1) != 1:
            args.append(f"--ps={options['ps']}")
        args += ["--hold_time"] * bool(options.get("hold_time"))
        args += ["--cluster_spec=" + json.dumps(spec)] * bool(spec)
        tree = options.get("tree")
        if tree is None:
            return self.start(name, self.python("pss_worker.py", *args))
        path = [tree, *filter(None, [os.environ.get("PYTHONPATH")])]
        argv = [sys.executable, os.path.join(tree, BASELINE_WORKER), *args]
        env = {"PYTHONPATH": os.pathsep.join(path)}
        return self.start(name, argv, env=env, tree=tree)

    def start_tf1(self, workload, workers, ps=1, shards=1, name=None):
        args = [f"--workers={workers}", f"--workload={workload}"]
        args += [f"--ps={ps}", f"--shards={shards}"]
        argv = self.python("tf1_sync_worker.py", *args)
        return self.start(name or f"tf1_sync_{workload}", argv)

    def start_mwms(self, workload, workers, tag=""):
        ports = procs.library("cluster").pick_free_ports(workers)
        cluster = {"worker": [f"{procs.LOOPBACK}:{p}" for p in ports]}
        children = []
        for i in range(workers):
            task = {"cluster": cluster, "task": {"type": "worker", "index": i}}
            env = {"TF_CONFIG": json.dumps(task), **self.worker_device_env(i)}
            args = ["--mwms", f"--optimizer={self.s.optimizer}"]
            argv = self.python("pss_worker.py", *args)
            children.append(self.start(f"mwms_{workload}{tag}_{i}", argv, env))
        return children

    def start_tasks(self, name, workers, env=None, ps=1):
        """ps, then worker tasks (`python -m tf2sync`), and their spec."""
        spec = procs.library("cluster").cluster_spec_dict(workers, ps)
        hosts = [f"--{j}_hosts=" + ",".join(spec[j]) for j in ("ps", "worker")]
        hosts.append("--chief_host=" + spec["chief"][0])
        tasks = []
        for job, count in (("ps", ps), ("worker", workers)):
            for i in range(count):
                devices = {"CUDA_VISIBLE_DEVICES": ""}  # a ps: CPU only
                if job == "worker":
                    devices = self.worker_device_env(i)
                task_env = {**devices, **(env or {})}
                args = [f"--job_name={job}", f"--task_index={i}", *hosts]
                argv = [sys.executable, "-m", "tf2sync", *args]
                tasks.append(
                    self.start(f"{name}_{job}{i}", argv, task_env, False)
                )
        return spec, tasks

    def worker_device_env(self, index):
        """Worker `index`'s devices (`--worker_gpus`: the launcher's plan)."""
        per_worker = getattr(self.s, "worker_gpus", 0)
        if not per_worker:
            return {"CUDA_VISIBLE_DEVICES": ""}
        count = int(os.environ.get("TF2SYNC_BENCH_GPUS", "1"))
        plan = procs.library("launcher.local_tasks").gpu_plan
        visible = plan(index + 1, per_worker, count)[0][index]
        return {
            "CUDA_VISIBLE_DEVICES": visible,
            "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        }

    def fail(self, endpoints, endpoint, error, base):
        """Records `error`; a fatal one (or any of a multi-process system)
        also ends its subprocesses and fails every system on them."""
        failing = [endpoint]
        if getattr(error, "fatal", True) or len(endpoint.children) > 1:
            self.registry.stop(endpoint.children)
            mine = set(endpoint.children)
            failing += [e for e in endpoints if set(e.children) & mine]
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
        """{name: its answer} of each endpoint set up."""
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
            record = {**base, "system": endpoint.name}
            record.update((extra or {}).get(endpoint.name, {}), event="setup")
            record["setup_s"] = round(time.perf_counter() - start, 2)
            self.sink.write(
                {**record, **(answer if isinstance(answer, dict) else {})}
            )
        return answers

    def interleave(
        self, endpoints, functions, base, extra, window=False, first_repeat=0
    ):
        """The repeats, each round in `balanced_order`, one record a run."""
        s = self.s
        for repeat in range(first_repeat, first_repeat + s.repeats):
            for i in balanced_order(len(endpoints), repeat):
                endpoint = endpoints[i]
                if endpoint.failed:
                    continue
                cpu = self.registry.cpu_seconds()
                try:
                    result = endpoint.run(functions, s.k, s.timeout, window)
                except procs.ChildError as e:
                    self.fail(endpoints, endpoint, e, base)
                    continue
                cpu = self.registry.cpu_seconds() - cpu
                record = {**base, "system": endpoint.name, "repeat": repeat}
                record.update(extra.get(endpoint.name, {}), **result)
                self.sink.write({**record, **_cpu_per_example(cpu, result)})

    def run_all(self, endpoints, functions, base, extra, **options):
        """`setup`, then `interleave`; ends the endpoints' processes."""
        try:
            self.setup(endpoints, base, options.pop("setup_extra", None))
            self.interleave(endpoints, functions, base, extra, **options)
        finally:
            self.registry.stop({c for e in endpoints for c in e.children})


def _cpu_per_example(cpu_s, result):
    """The run's CPU seconds and microseconds per example trained."""
    examples = result.get("cpu_examples") or result.get("examples") or 0
    record = {"cpu_s": round(cpu_s, 3)}
    if examples and not result.get("window"):  # a window counts fewer
        record["cpu_us_per_example"] = round(cpu_s / examples * 1e6, 2)
    return record
