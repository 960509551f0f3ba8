"""Runners of the ParameterServerStrategy family, for one chief process.

Each runner is built once (model, optimizer, traced functions, a warm-up)
and then timed any number of times with `run(functions)`, so that the
harness can interleave repeats of several systems. A run returns examples,
seconds and examples/s; synchronous systems count only aggregated
gradients (accepted pushes x per-worker batch), asynchronous ones every
applied step. `LocalRunner`: one process, global batch N x B;
`LoopRunner`: a custom loop on a `ClusterCoordinator`, K steps per
function, stock or tf2sync; `FitRunner`: `model.fit`.
"""

from __future__ import annotations

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

WARMUP_FUNCTIONS = 4
_POLL_SECONDS = 0.02
_worker_index = tf.distribute.coordinator.experimental_get_current_worker_index


def result(examples, seconds, **extra) -> dict:
    return {
        "examples": int(examples),
        "seconds": round(seconds, 4),
        "examples_per_sec": round(examples / seconds, 1) if seconds else 0.0,
        **extra,
    }


def ps_bytes(variables) -> dict:
    """{ps task index (str): bytes} of `variables` (model weights, slots),
    by the device each lives on (a `ShardedVariable`'s shards each on
    theirs); what lives elsewhere counts under "other"."""
    found = {}
    for v in sharding.shards(variables):
        spec = tf.DeviceSpec.from_string(v.device or "")
        key = str(spec.task) if spec.job == "ps" else "other"
        size = v.shape.num_elements() * v.dtype.size
        found[key] = found.get(key, 0) + size
    return found


def state_bytes(model, opt) -> dict:
    """`ps_bytes` of the model's and the optimizer's variables."""
    return ps_bytes(list(model.variables) + list(opt.variables()))


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
    """One process, the global batch (workers x B), K steps per function."""

    def __init__(self, workload, workers, k, kind):
        self.batch = workloads.batch(workload) * workers
        self.k = k
        model = workloads.build_model(workload)
        opt = make_optimizer(model, kind, sync=False)
        loss = workloads.loss_fn(workload)
        self.iterator = iter(workloads.dataset(workload, self.batch))

        @tf.function
        def train(iterator):
            for _ in tf.range(k):
                x, y = next(iterator)
                with tf.GradientTape() as tape:
                    value = loss(y, model(x))
                grads = tape.gradient(value, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))

        self.train = train
        for _ in range(WARMUP_FUNCTIONS):
            train(self.iterator)

    def run(self, functions, window=False):
        del window
        start = time.perf_counter()
        for _ in range(functions):
            self.train(self.iterator)
        seconds = time.perf_counter() - start
        steps = functions * self.k
        return result(steps * self.batch, seconds, steps=steps)


class LoopRunner:
    """A custom loop on a ClusterCoordinator, stock or tf2sync.

    Args:
      strategy: A PSS (`sync=False`) or `tf2sync.SyncParameterServerStrategy`.
      workload: "w1", "w2" or "w3".
      k: Steps per scheduled function.
      kind: The optimizer family (see `workloads.optimizer`).
      sync: Whether the strategy and optimizer are tf2sync's.
      delay_s: Seconds each step of worker 0 sleeps (0: none), after the
        step's token and before its gradients: a straggler.
      group: How the function repeats the step: None, a `tf.while_loop`
        of single steps; an int, `tf2sync`'s loop with up to that many
        copies of the step per loop iteration (`group >= k`: all k steps
        repeated in the graph, no loop; `tf2sync.Trainer`'s default is
        the strategy's `options.max_unrolled_steps`).
    """

    def __init__(
        self, strategy, workload, k, kind, *, sync, delay_s=0.0, group=None
    ):
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(
            strategy
        )
        self.batch = workloads.batch(workload)
        self.k = k
        self.sync = sync
        loss = workloads.loss_fn(workload)
        with strategy.scope():
            model = workloads.build_model(workload)
            opt = make_optimizer(model, kind, sync)
        self.opt = opt
        self.model = model
        batch = self.batch
        self.iterator = iter(
            self.coordinator.create_per_worker_dataset(
                lambda: workloads.dataset(workload, batch)
            )
        )

        def replica(data, delay):
            x, y = data
            if delay is not None:
                slept = tf.py_function(_sleep, [delay], tf.float32)
                with tf.control_dependencies([slept]):
                    x = tf.identity(x)
            with tf.GradientTape() as tape:
                value = loss(y, model(x))
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
                return

            def step(count):
                strategy.run(replica, args=(next(iterator), delay))
                return count + 1

            loops.repeat(step, k, group, tf.constant(0))

        self.train = train
        for _ in range(WARMUP_FUNCTIONS):
            self.coordinator.schedule(train, args=(self.iterator,))
        self.coordinator.join()

    def _counts(self):
        """(gradients in updates, updates) so far, read from the ps."""
        if self.sync:
            return (
                int(self.opt.gradients_accepted.numpy()),
                int(self.opt.iterations.numpy()),
            )
        applied = int(self.opt.iterations.numpy())
        return applied, applied

    def _stale(self):
        return int(self.opt.stale_dropped.numpy()) if self.sync else 0

    def _per_worker(self):
        """Gradients accepted from each worker so far (sync only)."""
        if not self.sync:
            return []
        totals = sync_totals(self.opt)  # accepted_w0, accepted_w1, ...
        return [v for k, v in totals.items() if k.startswith("accepted_w")]

    def run(self, functions, window=False):
        """Times `functions` scheduled functions.

        With `window`, the rate is taken between 20 % and 80 % of the
        gradients counted (polled from the ps), which leaves out the start
        and the tail where some workers have no function left.
        """
        grads0, steps0 = self._counts()
        stale0 = self._stale()
        per_worker0 = self._per_worker()
        samples = []
        start = time.perf_counter()
        for _ in range(functions):
            self.coordinator.schedule(self.train, args=(self.iterator,))
        while window and not self.coordinator.done():
            samples.append((time.perf_counter(), self._counts()[0]))
            time.sleep(_POLL_SECONDS)
        self.coordinator.join()
        seconds = time.perf_counter() - start
        grads1, steps1 = self._counts()
        extra = {"steps": steps1 - steps0}
        if self.sync:
            extra["pushes"] = functions * self.k
            extra["stale_dropped"] = self._stale() - stale0
            extra["accepted_per_worker"] = [
                b - a for a, b in zip(per_worker0, self._per_worker())
            ]
        examples = (grads1 - grads0) * self.batch
        if window:
            windowed = _window(samples, grads0, grads1)
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


class _EpochTimer(tf.keras.callbacks.Callback):
    """Times one epoch of `fit` and counts what it did (DESIGN_NOTES C).

    Under a ClusterCoordinator, `on_epoch_end` comes after the epoch's
    `join`, so the counters read there (and at `on_epoch_begin`, after the
    previous epoch's) are exact.
    """

    def __init__(self, epoch, counts):
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
            after = self.counts()
            self.done = [a - b for a, b in zip(after, self.before)]


class FitRunner:
    """`model.fit` with `steps_per_execution=k`, stock or tf2sync.

    tf2sync's `fit` repeats its steps in each function by default; with
    `keras_loop`, after `tf2sync.unroll_fit_steps(model, False)` (tf_keras's
    `tf.range` loop).
    """

    def __init__(self, strategy, workload, k, kind, *, sync, keras_loop=False):
        self.batch = workloads.batch(workload)
        self.k = k
        self.sync = sync
        with strategy.scope():
            self.model = workloads.build_model(workload)
            inner = workloads.optimizer(kind)
            self.opt = tf2sync.SyncOptimizer(inner) if sync else inner
            self.model.compile(
                optimizer=self.opt,
                loss=workloads.keras_loss(workload),
                steps_per_execution=k,
            )
        if keras_loop:
            tf2sync.unroll_fit_steps(self.model, False)
        self.data = workloads.dataset(workload, self.batch)
        self.model.fit(
            self.data, epochs=1, steps_per_epoch=WARMUP_FUNCTIONS * k, verbose=0
        )

    def _counts(self):
        """(gradients in updates, updates) so far, read from the ps."""
        steps = int(self.opt.iterations.numpy())
        if self.sync:
            return int(self.opt.gradients_accepted.numpy()), steps
        return steps, steps

    def run(self, functions, window=False):
        """One `fit` call of 2 epochs of `functions` x k steps; times the 2nd.

        The second epoch is what a `fit` of several epochs sustains (its
        iterators, its steps, its end-of-epoch logs). The first also holds
        the call's own start: tf_keras builds each worker's input pipeline
        again for every `fit` call and ships it, data included (w2: 6 MB of
        images per worker), as it does under stock PSS; the loops build
        theirs once, untimed. The CPU per example is over both epochs.
        """
        del window
        timer = _EpochTimer(1, self._counts)
        start = time.perf_counter()
        self.model.fit(
            self.data,
            epochs=2,
            steps_per_epoch=functions * self.k,
            verbose=0,
            callbacks=[timer],
        )
        call_seconds = time.perf_counter() - start
        grads, steps = timer.done
        self._settle()
        return result(
            grads * self.batch,
            timer.seconds,
            steps=steps,
            call_seconds=round(call_seconds, 4),
            cpu_examples=2 * grads * self.batch,
        )

    def _settle(self):
        """Deletes this `fit`'s per-worker iterators now, untimed.

        They become garbage when `fit` returns, and their deletion runs on
        each worker's queue of remote work, ahead of the functions of
        whatever runs next on the same cluster: a custom loop timed right
        after `fit` took up to 1.5 x its usual time with its usual CPU.
        """
        gc.collect()
        coordinator = self.model._cluster_coordinator
        if coordinator is not None:
            for _ in coordinator._cluster.workers:
                coordinator.schedule(_nothing)
            coordinator.join()
