"""Benchmark subprocess: time to the first applied update, in a fresh
process (one `measure` per process; docs/benchmarks.md#startup)."""

from __future__ import annotations

import cProfile
import gc
import os
import threading
import time
import types

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_STARTED = time.perf_counter()

import procs  # noqa: E402
import systems  # noqa: E402
import tensorflow as tf  # noqa: E402
import workloads  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import tf2sync  # noqa: E402
from tf2sync._src import coordinator as sync_coordinator  # noqa: E402

_WORKERS = flags.DEFINE_integer("workers", 2, "Worker tasks.")
_POLL_S = 0.005
# A path prefix: the first schedule call runs under cProfile, its stats in
# PREFIX.<pid> (to find what the trace spends; not for the numbers).
PROFILE_ENV = "TF2SYNC_STARTUP_PROFILE"
_GC_RUNS = []  # (start, seconds, generation) of each collection
_gc_start = [None]


def _gc_hook(phase, info):
    now = time.perf_counter()
    if phase == "start":
        _gc_start[0] = now
    elif _gc_start[0] is not None:
        _GC_RUNS.append((_gc_start[0], now - _gc_start[0], info["generation"]))
        _gc_start[0] = None


gc.callbacks.append(_gc_hook)


class _Clock:
    """Starts right after a full collection (`collected`: its seconds);
    times the outermost first `schedule` (patched in this process) and,
    from two threads, its function's result and the first update."""

    def __init__(self, iterations):
        self.iterations = iterations
        self.enter = self.leave = self.done = self.update = self.first = None
        self.polls = 0
        self._depth = threading.local()
        self._threads = []
        for cls in (
            tf.distribute.coordinator.ClusterCoordinator,
            sync_coordinator.SyncCoordinator,
        ):
            if "schedule" in vars(cls):
                cls.schedule = self._wrap(vars(cls)["schedule"])
        before = time.perf_counter()
        gc.collect()
        self.t0 = time.perf_counter()
        self.collected = self.t0 - before

    def _wrap(self, schedule):
        clock = self

        def timed(coordinator, fn, args=None, kwargs=None):
            depth = getattr(clock._depth, "n", 0)
            first = depth == 0 and clock.enter is None
            if first:
                clock.enter = time.perf_counter()
                clock.first = getattr(fn, "__name__", type(fn).__name__)
            clock._depth.n = depth + 1
            profile = first and os.environ.get(PROFILE_ENV)
            profiler = cProfile.Profile() if profile else None
            try:
                if profiler:
                    profiler.enable()
                value = schedule(coordinator, fn, args=args, kwargs=kwargs)
            finally:
                clock._depth.n = depth
                if profiler:
                    profiler.disable()
                    profiler.dump_stats(f"{profile}.{os.getpid()}")
            if first:
                clock.leave = time.perf_counter()
                clock._watch(value)
            return value

        return timed

    def _watch(self, value):
        def wait():
            try:
                value.get()
            finally:
                self.done = time.perf_counter()

        def poll():
            deadline = time.perf_counter() + 600
            while time.perf_counter() < deadline:
                self.polls += 1
                if int(self.iterations.numpy()) >= 1:
                    self.update = time.perf_counter()
                    return
                time.sleep(_POLL_S)

        self._threads = [threading.Thread(target=f) for f in (wait, poll)]
        for t in self._threads:
            t.daemon = True
            t.start()

    def split(self, steady):
        """The measurement's fields (docs/benchmarks.md#startup)."""
        for t in self._threads:
            t.join(600)
        if self.done is None or self.update is None:
            raise RuntimeError("The first function or update was not seen.")
        t0 = self.t0
        runs = [(s, g) for a, s, g in _GC_RUNS if t0 <= a <= self.update]
        return {
            "before_schedule_s": round(self.enter - t0, 4),
            "trace_s": round(self.leave - self.enter, 4),
            "register_s": round(self.done - self.leave - steady, 4),
            "steady_function_s": round(steady, 4),
            "first_function_s": round(self.done - t0, 4),
            "first_update_s": round(self.update - t0, 4),
            "update_polls": self.polls,
            "gc_s": round(sum(s for s, _ in runs), 4),
            "gc_full": sum(1 for _, g in runs if g == 2),
            "first_scheduled": self.first,
        }


class _Server:
    def __init__(self, resolver, workers):
        self.resolver = resolver
        self.workers = workers
        self.measured = False

    def measure(self, system, workload, k, rounds):
        """`system` on `workload` from its first call to its first update."""
        if self.measured:
            raise RuntimeError("One measurement per process.")
        self.measured = True
        sync = system.startswith("tf2sync")
        start = time.perf_counter()
        strategy = systems.strategy(self.resolver, sync, self.workers)
        functions = rounds * self.workers
        common = (strategy, workload, k, "legacy", sync)
        if system.endswith("_fit"):
            runner = systems.FitRunner(*common, warmup=0)
            clock = _Clock(runner.opt.iterations)
            steady = runner.run(functions)["seconds"] / rounds
        elif system == "tf2sync_trainer":
            clock, steady, runner = self._trainer(strategy, workload, k, rounds)
        else:
            group = systems.loop_group(system, strategy, k)
            runner = systems.LoopRunner(*common, group=group, warmup=0)
            clock = _Clock(runner.opt.iterations)
            runner.start()  # on the clock, as fit and Trainer build theirs
            runner.schedule(self.workers)  # one first function per worker
            runner.coordinator.join()
            steady_start = time.perf_counter()
            runner.schedule(functions)
            runner.coordinator.join()
            steady = (time.perf_counter() - steady_start) / rounds
        return {
            "system": system,
            "workload": workload,
            "k": k,
            "rounds": rounds,
            "batch": workloads.batch(workload),
            "parameters": int(runner.model.count_params()),
            "ready_s": round(self.ready_s, 3),
            "setup_s": round(clock.t0 - start - clock.collected, 4),
            "steps": int(runner.opt.iterations.numpy()),
            **clock.split(steady),
        }

    def _trainer(self, strategy, workload, k, rounds):
        """`Trainer.train` (its default loop) of 2 epochs, the 2nd timed."""
        with strategy.scope():
            model = workloads.build_model(workload)
            opt = tf2sync.SyncOptimizer(workloads.optimizer())
        timer = systems.EpochTimer(1, lambda: [int(opt.iterations.numpy())])
        trainer = tf2sync.Trainer(
            strategy=strategy,
            model=model,
            optimizer=opt,
            loss_fn=workloads.loss_fn(workload),
            steps_per_loop=k,
            callbacks=[timer],
            verbose=0,
        )
        clock = _Clock(opt.iterations)
        batch = workloads.batch(workload)
        trainer.train(
            lambda ctx: workloads.dataset(workload, batch),
            epochs=2,
            steps_per_epoch=rounds * self.workers * k,
        )
        built = types.SimpleNamespace(model=model, opt=opt)
        return clock, timer.seconds / rounds, built


def main(argv):
    del argv
    tf.get_logger().setLevel("ERROR")
    resolver = tf2sync.testing.local_cluster(_WORKERS.value, 1)
    server = _Server(resolver, _WORKERS.value)
    server.ready_s = time.perf_counter() - _STARTED
    ready = {"workers": _WORKERS.value, "ready_s": round(server.ready_s, 3)}
    procs.serve({"measure": server.measure}, ready=ready)


if __name__ == "__main__":
    app.run(main)
