"""Benchmark subprocess: time to the first applied update, in a fresh process.

One measurement per process (first-trace costs are per process): the
harness starts this chief with an in-process cluster (2 workers + 1 ps on
127.0.0.1), sends one `measure(system, workload, k, rounds)` and ends it by
PID. Systems: `tf2sync_fit`, `pss_async_fit` (`model.fit`), `tf2sync_trainer`
(`Trainer.train`), `tf2sync_loop`, `tf2sync_loop_while`, `pss_async` (a
custom loop as systems.LoopRunner builds it). Workloads: w1, `digits` (the
launcher's default job) and `resnet50` (`ResNet50(weights=None)`, 64x64x3
random images, batch 4 per worker).

Timed on the chief from t0, the call of `fit` or `Trainer.train` or a
loop's first line (which builds each worker's iterator):
`before_schedule_s` to the first `ClusterCoordinator.schedule`; `trace_s`
(a) inside that outermost first call (tracing); `first_function_s` to that
function's result (`RemoteValue.get()` in a thread); `first_update_s` to
the optimizer's `iterations` on the ps >= 1 (polled every 5 ms);
`steady_function_s` (c) one round of one function per worker once warm;
`register_s` (b) from the first schedule's return to the first result
minus (c): registration and first execution on the workers and ps. Each
clock starts right after a full `gc.collect()`, so that no system pays one
owed to its set-up; `gc_s` and `gc_full` are the collector's time and full
collections between t0 and the first update.

Started by benchmarks/harness.py (--scenarios=startup).
"""

from __future__ import annotations

import cProfile
import gc
import os
import threading
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_STARTED = time.perf_counter()

import numpy as np  # noqa: E402
import procs  # noqa: E402
import systems  # noqa: E402
import tensorflow as tf  # noqa: E402
import workloads  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import tf2sync  # noqa: E402
from tf2sync._src import coordinator as sync_coordinator  # noqa: E402
from tf2sync._src import loops  # noqa: E402
from tf2sync._src.jobs import digits  # noqa: E402

_WORKERS = flags.DEFINE_integer("workers", 2, "Worker tasks.")
_POLL_S = 0.005
# Set to a path prefix: the first schedule call runs under cProfile, its
# stats written to PREFIX.<pid> (for finding what the trace spends; the
# profiler slows it, so not for the numbers).
PROFILE_ENV = "TF2SYNC_STARTUP_PROFILE"
RESNET_SHAPE = (64, 64, 3)
RESNET_BATCH = 4


class _Collections:
    """The garbage collector's runs in this process: (start, seconds,
    generation), from a `gc.callbacks` hook."""

    def __init__(self):
        self.runs = []
        self._start = None
        gc.callbacks.append(self._hook)

    def _hook(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            now = time.perf_counter()
            self.runs.append(
                (self._start, now - self._start, info["generation"])
            )
            self._start = None

    def between(self, t0, t1):
        """`(seconds, full collections)` of the runs started in [t0, t1]."""
        runs = [(s, g) for start, s, g in self.runs if t0 <= start <= t1]
        return sum(s for s, _ in runs), sum(1 for _, g in runs if g == 2)


_COLLECTIONS = _Collections()


def _start_clock():
    """t0, right after a full collection (see the module docstring). The
    collection's own time is kept out of `setup_s` (`_COLLECTED_S`)."""
    before = time.perf_counter()
    gc.collect()
    t0 = time.perf_counter()
    _COLLECTED_S[0] = t0 - before
    return t0


_COLLECTED_S = [0.0]  # the last `_start_clock`'s collection, seconds


def _setup_s(start, t0):
    """`setup_s`: from `start` to the clock's `t0`, less the collection
    `_start_clock` ran just before `t0`."""
    return round(t0 - start - _COLLECTED_S[0], 4)


class _Clock:
    """Times the outermost first `schedule` and what follows it.

    Patches `ClusterCoordinator.schedule` and tf2sync's override (a
    subclass) for this process only; records the first outermost call's
    entry and return, then starts two chief threads: one waits for that
    call's `RemoteValue`, one polls `iterations` until it is >= 1.
    """

    def __init__(self, iterations):
        self.iterations = iterations
        self.enter = self.leave = self.done = self.update = None
        self.first = None  # the name of the first function scheduled
        self.polls = 0
        self._depth = threading.local()
        self._threads = []
        for cls in (
            tf.distribute.coordinator.ClusterCoordinator,
            sync_coordinator.SyncCoordinator,
        ):
            if "schedule" in vars(cls):
                cls.schedule = self._wrap(vars(cls)["schedule"])

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
                clock._start(value)
            return value

        return timed

    def _start(self, value):
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

        self._threads = [
            threading.Thread(target=f, daemon=True) for f in (wait, poll)
        ]
        for t in self._threads:
            t.start()

    def join(self, timeout=600):
        for t in self._threads:
            t.join(timeout)


def _model(workload):
    if workload == "digits":
        return digits.build_model()
    if workload == "resnet50":
        tf.keras.utils.set_random_seed(workloads.SEED)
        return tf.keras.applications.ResNet50(
            weights=None, input_shape=RESNET_SHAPE, classes=10
        )
    return workloads.build_model(workload)


def _optimizer(workload):
    if workload == "digits":
        return tf.keras.optimizers.legacy.SGD(0.05, momentum=0.9)
    return workloads.optimizer("legacy")


def _batch(workload):
    if workload == "digits":
        return 32
    if workload == "resnet50":
        return RESNET_BATCH
    return workloads.batch(workload)


def _dataset(workload, batch):
    """A dataset function's dataset (a worker's own, for digits: 1 of 1)."""
    if workload == "digits":
        return digits.train_dataset(tf.distribute.InputContext(), batch)
    if workload == "resnet50":
        rng = np.random.RandomState(workloads.SEED)
        x = rng.rand(batch * 2, *RESNET_SHAPE).astype("float32")
        y = rng.randint(0, 10, batch * 2)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)
    return workloads.dataset(workload, batch)


def _loss(workload):
    """(the loop's loss(y, output), the loss for `compile`)."""
    if workload in ("digits", "resnet50"):  # softmax outputs
        return (
            lambda y, p: tf.reduce_mean(
                tf.keras.losses.sparse_categorical_crossentropy(y, p)
            ),
            tf.keras.losses.SparseCategoricalCrossentropy(),
        )
    return workloads.loss_fn(workload), workloads.keras_loss(workload)


def _strategy(resolver, sync, workers):
    if sync:
        return tf2sync.SyncParameterServerStrategy(
            resolver, replicas_to_aggregate=workers, total_num_replicas=workers
        )
    return tf.distribute.experimental.ParameterServerStrategy(resolver)


class _Server:
    def __init__(self, resolver, workers):
        self.resolver = resolver
        self.workers = workers
        self.measured = False

    def measure(self, system, workload, k, rounds):
        if self.measured:
            raise RuntimeError("One measurement per process.")
        self.measured = True
        sync = system.startswith("tf2sync")
        start = time.perf_counter()
        strategy = _strategy(self.resolver, sync, self.workers)
        batch = _batch(workload)
        loop_loss, keras_loss = _loss(workload)
        with strategy.scope():
            model = _model(workload)
            inner = _optimizer(workload)
            opt = tf2sync.SyncOptimizer(inner) if sync else inner
        fit = system.endswith("_fit")
        if system == "tf2sync_trainer":
            result = self._trainer(
                strategy, model, opt, workload, batch, k, rounds, loop_loss
            )
            result["setup_s"] = _setup_s(start, result.pop("t0"))
        elif fit:
            with strategy.scope():
                model.compile(
                    optimizer=opt, loss=keras_loss, steps_per_execution=k
                )
            result = self._fit(model, opt, workload, batch, k, rounds, start)
        else:
            with strategy.scope():
                if sync:
                    opt.build(model.trainable_variables)
                else:
                    inner._create_all_weights(model.trainable_variables)
            result = self._loop(
                strategy,
                model,
                opt,
                workload,
                batch,
                k,
                rounds,
                loop_loss,
                unrolled=system == "tf2sync_loop",
            )
            result["setup_s"] = _setup_s(start, result.pop("t0"))
        return {
            "system": system,
            "workload": workload,
            "k": k,
            "rounds": rounds,
            "batch": batch,
            "parameters": int(model.count_params()),
            "ready_s": round(self.ready_s, 3),
            **result,
        }

    def _split(self, clock, t0, steady):
        clock.join()
        if clock.done is None or clock.update is None:
            raise RuntimeError("The first function or update was not seen.")
        first = clock.done - t0
        gc_s, gc_full = _COLLECTIONS.between(t0, clock.update)
        return {
            "before_schedule_s": round(clock.enter - t0, 4),
            "trace_s": round(clock.leave - clock.enter, 4),
            "register_s": round(clock.done - clock.leave - steady, 4),
            "steady_function_s": round(steady, 4),
            "first_function_s": round(first, 4),
            "first_update_s": round(clock.update - t0, 4),
            "update_polls": clock.polls,
            "gc_s": round(gc_s, 4),
            "gc_full": gc_full,
            "first_scheduled": clock.first,
        }

    def _loop(
        self, strategy, model, opt, workload, batch, k, rounds, loss, unrolled
    ):
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        group = strategy.options.max_unrolled_steps if unrolled else None

        def replica(data):
            x, y = data
            with tf.GradientTape() as tape:
                value = loss(y, model(x, training=True))
            grads = tape.gradient(value, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return value

        # As systems.LoopRunner: tf2sync_loop repeats the step in the graph
        # (tf2sync.Trainer's default), tf2sync_loop_while and pss_async run
        # a tf.while_loop of single steps.
        @tf.function
        def train(iterator):
            if group is None:
                for _ in tf.range(k):
                    strategy.run(replica, args=(next(iterator),))
                return tf.constant(0)

            def step(count):
                strategy.run(replica, args=(next(iterator),))
                return count + 1

            return loops.repeat(step, k, group, tf.constant(0))

        clock = _Clock(opt.iterations)
        t0 = _start_clock()
        # Inside the clock, as `fit` and `Trainer.train` build theirs.
        iterator = iter(
            coordinator.create_per_worker_dataset(
                lambda: _dataset(workload, batch)
            )
        )
        for _ in range(self.workers):  # one first function per worker
            coordinator.schedule(train, args=(iterator,))
        coordinator.join()
        steady_start = time.perf_counter()
        for _ in range(rounds * self.workers):
            coordinator.schedule(train, args=(iterator,))
        coordinator.join()
        steady = (time.perf_counter() - steady_start) / rounds
        result = self._split(clock, t0, steady)
        result["t0"] = t0
        result["steps"] = int(opt.iterations.numpy())
        return result

    def _trainer(self, strategy, model, opt, workload, batch, k, rounds, loss):
        # Its default loop (the step repeated in the graph, the first loop
        # as single steps); t0 = the `train` call.
        timer = systems._EpochTimer(1, lambda: [int(opt.iterations.numpy())])
        trainer = tf2sync.Trainer(
            strategy=strategy,
            model=model,
            optimizer=opt,
            loss_fn=loss,
            steps_per_loop=k,
            callbacks=[timer],
            verbose=0,
        )
        clock = _Clock(opt.iterations)
        t0 = _start_clock()
        trainer.train(
            lambda ctx: _dataset(workload, batch),
            epochs=2,
            steps_per_epoch=rounds * self.workers * k,
        )
        result = self._split(clock, t0, timer.seconds / rounds)
        result["t0"] = t0
        result["steps"] = int(opt.iterations.numpy())
        return result

    def _fit(self, model, opt, workload, batch, k, rounds, start):
        if workload == "digits":  # as the launcher
            data = tf.keras.utils.experimental.DatasetCreator(
                lambda ctx: digits.train_dataset(ctx, batch)
            )
        else:
            data = _dataset(workload, batch)
        timer = systems._EpochTimer(1, lambda: [int(opt.iterations.numpy())])
        clock = _Clock(opt.iterations)
        t0 = _start_clock()
        model.fit(
            data,
            epochs=2,
            steps_per_epoch=rounds * self.workers * k,
            verbose=0,
            callbacks=[timer],
        )
        steady = timer.seconds / rounds
        result = self._split(clock, t0, steady)
        result["setup_s"] = _setup_s(start, t0)
        result["call_s"] = round(time.perf_counter() - t0, 4)
        result["steps"] = int(opt.iterations.numpy())
        return result


def main(argv):
    del argv
    tf.get_logger().setLevel("ERROR")
    resolver = tf2sync.testing.local_cluster(_WORKERS.value, 1)
    server = _Server(resolver, _WORKERS.value)
    server.ready_s = time.perf_counter() - _STARTED
    procs.serve(
        {"measure": server.measure},
        ready={"workers": _WORKERS.value, "ready_s": round(server.ready_s, 3)},
    )


if __name__ == "__main__":
    app.run(main)
