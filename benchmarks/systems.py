"""The systems' runners, built once, timed often
(docs/benchmarks.md#systems)."""

from __future__ import annotations

import contextlib
import gc
import os
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402
import workloads  # noqa: E402

import tf2sync  # noqa: E402
from tf2sync._src import loops  # noqa: E402
from tf2sync._src import sharding  # noqa: E402
from tf2sync._src.callbacks import sync_totals  # noqa: E402

WARMUP = 4  # functions run before any timed one
_POLL_SECONDS = 0.02
_worker_index = tf.distribute.coordinator.experimental_get_current_worker_index


def result(examples, seconds, **extra) -> dict:
    rate = round(examples / seconds, 1) if seconds else 0.0
    found = {"examples": int(examples), "seconds": round(seconds, 4)}
    return {**found, "examples_per_sec": rate, **extra}


def ps_bytes(variables) -> dict:
    """{ps task index (str), or "other": bytes} of `variables`' shards."""
    found = {}
    for v in sharding.shards(variables):
        spec = tf.DeviceSpec.from_string(v.device or "")
        key = str(spec.task) if spec.job == "ps" else "other"
        size = v.shape.num_elements() * v.dtype.size
        found[key] = found.get(key, 0) + size
    return found


def strategy(resolver, sync, workers, rta=None, total=None, shards=None):
    """Stock PSS or tf2sync's (`rta` of `total`), in `shards` if given."""
    part = shards and tf.distribute.experimental.partitioners
    part = part and part.FixedShardsPartitioner(shards)
    if not sync:
        return tf.distribute.experimental.ParameterServerStrategy(
            resolver, variable_partitioner=part
        )
    return tf2sync.SyncParameterServerStrategy(
        resolver,
        replicas_to_aggregate=rta or workers,
        total_num_replicas=total or workers,
        **({"variable_partitioner": part} if part else {}),
    )


def loop_group(system, strategy, k):
    """LoopRunner's `group` of `system`: tf2sync.Trainer's default for
    tf2sync_loop, the whole function unrolled for *_unrolled, else None."""
    if system == "tf2sync_loop":
        return strategy.options.max_unrolled_steps
    return k if system.endswith("_unrolled") else None


def make_optimizer(model, kind, sync):
    """Momentum SGD (wrapped if `sync`), its slots built now, eagerly."""
    inner = workloads.optimizer(kind)
    opt = tf2sync.SyncOptimizer(inner) if sync else inner
    if sync or kind == "keras":
        opt.build(model.trainable_variables)
    else:
        inner._create_all_weights(model.trainable_variables)
    return opt


class LocalRunner:
    """One process on the global batch (workers x B), K steps per function;
    with a `MultiWorkerMirroredStrategy`, one of its workers (B each)."""

    def __init__(self, workload, workers, k, kind, strategy=None):
        replicas = strategy.num_replicas_in_sync if strategy else 1
        self.batch = workloads.batch(workload) * workers * replicas
        self.k = k
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = workloads.build_model(workload)
            opt = make_optimizer(model, kind, sync=False)
        loss = workloads.loss_fn(workload)
        batch = self.batch // replicas
        if strategy:
            data = strategy.distribute_datasets_from_function(
                lambda _: workloads.dataset(workload, batch)
            )
        else:
            data = workloads.dataset(workload, batch)
        self.iterator = iter(data)

        def replica(batch):
            x, y = batch
            with tf.GradientTape() as tape:
                value = loss(y, model(x))
                if replicas > 1:  # MWMS sums the replicas' gradients
                    value = value / replicas
            grads = tape.gradient(value, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        @tf.function
        def train(iterator):
            for _ in tf.range(k):
                if strategy:
                    strategy.run(replica, args=(next(iterator),))
                else:
                    replica(next(iterator))

        self.train = train
        self.run(WARMUP)

    def run(self, functions, window=False):
        start = time.perf_counter()
        for _ in range(functions):
            self.train(self.iterator)
        seconds = time.perf_counter() - start
        steps = functions * self.k
        return result(steps * self.batch, seconds, steps=steps)


class _Runner:
    """A runner on a ParameterServerStrategy, stock or tf2sync's (`sync`)."""

    def __init__(self, workload, k, sync):
        self.workload = workload
        self.batch = workloads.batch(workload)
        self.k = k
        self.sync = sync

    def _counts(self):
        """(gradients in updates, updates) so far, read from the ps."""
        applied = int(self.opt.iterations.numpy())
        if self.sync:
            return int(self.opt.gradients_accepted.numpy()), applied
        return applied, applied


class LoopRunner(_Runner):
    """A custom loop on a ClusterCoordinator (`group`: None, a while loop of
    single steps, else up to that many per iteration; `delay_s`: worker 0's
    sleep per step; `warmup` 0: the caller calls `start()`)."""

    def __init__(self, strategy, workload, k, kind, sync, **options):
        super().__init__(workload, k, sync)
        group, delay_s = options.get("group"), options.get("delay_s", 0.0)
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(
            strategy
        )
        loss = workloads.loss_fn(workload)
        with strategy.scope():
            model = self.model = workloads.build_model(workload)
            opt = self.opt = make_optimizer(model, kind, sync)

        def replica(data, delay):
            x, y = data
            if delay is not None:
                slept = tf.py_function(_sleep, [delay], tf.float32)
                with tf.control_dependencies([slept]):
                    x = tf.identity(x)
            with tf.GradientTape() as tape:
                value = loss(y, model(x, training=True))
            grads = tape.gradient(value, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        @tf.function
        def train(iterator):
            delay = None
            if delay_s > 0:
                index = _worker_index()
                delay = tf.where(tf.equal(index, 0), delay_s, 0.0)
            if group is None:
                for _ in tf.range(k):
                    strategy.run(replica, args=(next(iterator), delay))
                return tf.constant(0)

            def step(count):
                strategy.run(replica, args=(next(iterator), delay))
                return count + 1

            return loops.repeat(step, k, group, tf.constant(0))

        self.train = train
        warmup = options.get("warmup", WARMUP)
        if warmup:
            self.start()
            self.schedule(warmup)
            self.coordinator.join()

    def start(self):
        workload, batch = self.workload, self.batch
        self.iterator = iter(
            self.coordinator.create_per_worker_dataset(
                lambda: workloads.dataset(workload, batch)
            )
        )

    def schedule(self, functions):
        for _ in range(functions):
            self.coordinator.schedule(self.train, args=(self.iterator,))

    def _sync_counts(self):
        """[stale dropped, accepted from worker 0, 1, ...] so far."""
        if not self.sync:
            return []
        totals = sync_totals(self.opt)
        accepted = [v for k, v in totals.items() if k.startswith("accepted_w")]
        return [int(self.opt.stale_dropped.numpy()), *accepted]

    def run(self, functions, window=False):
        """Times `functions` functions (`window`: from 20 % to 80 %)."""
        grads0, steps0 = self._counts()
        sync0 = self._sync_counts()
        samples = []
        start = time.perf_counter()
        self.schedule(functions)
        while window and not self.coordinator.done():
            samples.append((time.perf_counter(), self._counts()[0]))
            time.sleep(_POLL_SECONDS)
        self.coordinator.join()
        seconds = time.perf_counter() - start
        grads1, steps1 = self._counts()
        extra = {"steps": steps1 - steps0}
        if self.sync:
            delta = [b - a for a, b in zip(sync0, self._sync_counts())]
            extra.update(pushes=functions * self.k, stale_dropped=delta[0])
            extra["accepted_per_worker"] = delta[1:]
        examples = (grads1 - grads0) * self.batch
        windowed = window and _window(samples, grads0, grads1)
        if windowed:
            seconds, grads = windowed
            examples = grads * self.batch
            extra["window"] = True
        return result(examples, seconds, **extra)


def _window(samples, first, last):
    """(seconds, count) between 20 % and 80 % of `first..last`, or None."""
    low = first + 0.2 * (last - first)
    high = first + 0.8 * (last - first)
    a = next((s for s in samples if s[1] >= low), None)
    b = next((s for s in samples if s[1] >= high), None)
    if a is None or b is None or b[0] <= a[0] or b[1] <= a[1]:
        return None
    return b[0] - a[0], b[1] - a[1]


@tf.function
def _nothing():
    return tf.constant(0)


def _sleep(seconds):
    time.sleep(float(seconds.numpy()))
    return tf.constant(0.0)


class EpochTimer(tf.keras.callbacks.Callback):
    """Times epoch `epoch` and what `counts()` moved in it."""

    def __init__(self, epoch, counts=list):
        super().__init__()
        self.epoch = epoch
        self.counts = counts  # () -> (gradients, updates) so far

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            self.before = self.counts()
            self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            self.seconds = time.perf_counter() - self.start
            self.done = [a - b for a, b in zip(self.counts(), self.before)]


class FitRunner(_Runner):
    """`model.fit` with `steps_per_execution=k`, stock or tf2sync (options:
    `keras_loop`: tf_keras's own loop; `warmup` functions)."""

    def __init__(self, strategy, workload, k, kind, sync, **options):
        super().__init__(workload, k, sync)
        with strategy.scope():
            self.model = workloads.build_model(workload)
            inner = workloads.optimizer(kind)
            self.opt = tf2sync.SyncOptimizer(inner) if sync else inner
            loss = workloads.keras_loss(workload)
            self.model.compile(self.opt, loss, steps_per_execution=k)
        if options.get("keras_loop"):
            tf2sync.unroll_fit_steps(self.model, False)
        self.data = workloads.dataset(workload, self.batch)
        warmup = options.get("warmup", WARMUP)
        if warmup:
            self.model.fit(
                self.data, epochs=1, steps_per_epoch=warmup * k, verbose=0
            )

    def run(self, functions, window=False):
        """One `fit` of 2 epochs of `functions` x k steps; times the 2nd."""
        timer = EpochTimer(1, self._counts)
        start = time.perf_counter()
        steps = functions * self.k
        self.model.fit(
            self.data,
            epochs=2,
            steps_per_epoch=steps,
            verbose=0,
            callbacks=[timer],
        )
        call_seconds = time.perf_counter() - start
        grads, steps = timer.done
        self._settle()
        examples = grads * self.batch
        return result(
            examples,
            timer.seconds,
            steps=steps,
            call_seconds=round(call_seconds, 4),
            cpu_examples=2 * examples,
        )

    def _settle(self):
        """Deletes this `fit`'s iterators now, not in the next system's run."""
        gc.collect()
        coordinator = self.model._cluster_coordinator
        if coordinator is not None:
            for _ in coordinator._cluster.workers:
                coordinator.schedule(_nothing)
            coordinator.join()
