"""The coordinator of a SyncParameterServerStrategy, and what it reads.

`SyncCoordinator` is what `ClusterCoordinator(strategy)` returns under
tf2sync: it passes each scheduled function its worker's index, lets the
strategy's step protocol start its chief side before the first dispatch,
and iterates CPU workers' datasets directly.
"""

from __future__ import annotations

import weakref

import tensorflow as tf

from tf2sync._src import data_service
from tf2sync._src import keras_calls
from tf2sync._src import step_context
from tf2sync._src import watchdog
from tf2sync._src.internals import autograph
from tf2sync._src.internals import cluster_coordinator
from tf2sync._src.internals import patches
from tf2sync._src.internals import ps_strategy

# `hook(coordinator, dataset_fn)`: a per-worker dataset, or None
# (`add_input_hook`).
_INPUT_HOOKS = []


def add_input_hook(hook) -> None:
    """Has `SyncCoordinator.create_per_worker_dataset` ask
    `hook(coordinator, dataset_fn)` first (once however often added).

    `hook` is given the dataset function as the coordinator will build it
    (see `create_per_worker_dataset`) and returns the per-worker dataset
    to give instead, or None (then the next hook, then the coordinator).
    `fit_hooks` adds its own: what `fit` and `evaluate` do with their
    input.
    """
    if hook not in _INPUT_HOOKS:
        _INPUT_HOOKS.append(hook)


class SyncCoordinator(tf.distribute.coordinator.ClusterCoordinator):
    """Passes each scheduled function the index of the worker running it.

    A scheduled function cannot tell which worker runs it; the coordinator
    can. Every `tf.function` scheduled while a synchronous optimizer (a
    SyncOptimizer or the TF1 shim) is attached is
    wrapped to take a per-worker value (each worker's own index, built as a
    per-worker resource, rebuilt when a worker restarts) and traced under it,
    so that pushes are counted per worker. `ClusterCoordinator(strategy)`
    returns this instance: tf_keras and user loops get it unchanged.

    On workers without GPUs, per-worker datasets are iterated directly (see
    `create_per_worker_dataset`). A dataset function is traced once per
    worker: `distribute_datasets_from_function` (and so `DatasetCreator`
    in `fit`) gives it an `InputContext` whose `input_pipeline_id` is that
    worker's index and whose `num_input_pipelines` is the number of
    workers, so that `dataset.shard(ctx.num_input_pipelines,
    ctx.input_pipeline_id)` gives each worker its own shard (under stock
    PSS every worker gets 0 of 1). tf_keras's exact evaluation keeps
    stock PSS's context: it shards its dataset itself.

    `plan_epoch` caps the updates of an epoch that `fit` or `Trainer` is
    starting (see `Aggregator.plan_updates`); scheduling a function they
    did not plan lifts the cap, so a loop of the user's after `fit` is not
    capped by `fit`'s last epoch.
    """

    def __init__(self, strategy):
        first = not getattr(self, "_has_initialized", False)
        super().__init__(strategy)
        if first:
            self._worker_ids = None
            self._wrapped = weakref.WeakKeyDictionary()
            self._planned = None  # functions under the current cap
            self._plan_run = None  # (weakref to the run, base, pushes)
            patches.worker_failure_hook.install(self, _worker_failed)
            patches.function_error_hook.install(self, _function_failed)

    def create_per_worker_dataset(self, dataset_fn):
        """See base class. On CPU workers, without the per-device iterator.

        A distributed dataset (what `model.fit` builds from a
        `tf.data.Dataset`, and what `distribute_datasets_from_function`
        returns) is iterated on each worker through a multi-device iterator,
        which prefetches every element to the replica's device. A worker
        without GPUs has one replica on its own CPU: the copy is to the
        device the element is already on, a cost on a small model's step
        that skipping it saves. There the worker
        iterates the dataset that the distributed dataset wraps, which
        yields the same elements in the same order (one input pipeline and
        one replica per worker: PSS neither shards nor rebatches it).
        Workers with GPUs keep the prefetch. The input hooks
        (`add_input_hook`: `fit`'s and `evaluate`'s) are asked first.
        """
        if data_service.is_pass_dataset_fn(dataset_fn):
            return super().create_per_worker_dataset(dataset_fn)
        if ps_strategy.num_gpus_per_worker(self.strategy) == 0:
            dataset_fn = _single_pipeline(dataset_fn)
        for hook in _INPUT_HOOKS:
            made = hook(self, dataset_fn)
            if made is not None:
                return made
        if (
            not callable(dataset_fn)
            or isinstance(dataset_fn, tf.types.experimental.ConcreteFunction)
            # tf_keras shards its finite dataset over functions itself.
            or keras_calls.building_exact_evaluation()
        ):
            return super().create_per_worker_dataset(dataset_fn)

        def dataset_fn_of(worker: int):  # traced for that worker
            def traced():
                # As stock PSS's top-level tf.function, the user's function
                # is converted by AutoGraph, this wrapper is not.
                with step_context.DatasetWorkerScope(worker):
                    return autograph.convert_as_caller(dataset_fn)()

            return traced

        return cluster_coordinator.indexed_per_worker_dataset(
            self, dataset_fn_of
        )

    def _ids(self):
        if self._worker_ids is None:
            ids = []
            for i, worker in enumerate(
                cluster_coordinator.coordinator_workers(self)
            ):
                index = tf.function(
                    lambda i=i: tf.constant(i, tf.int64), autograph=False
                )
                ids.append(worker.create_resource(index))
            self._worker_ids = (
                tf.distribute.experimental.coordinator.PerWorkerValues(
                    tuple(ids)
                )
            )
        return self._worker_ids

    def planned(self, fn) -> None:
        """Marks `fn` as one the current plan's epochs schedule."""
        if self._planned is None:
            self._planned = weakref.WeakSet()
        self._planned.add(fn)

    def plan_epoch(self, fn, pushes: int, run) -> None:
        """Caps the updates at what the epochs of `run` planned so far.

        `run` identifies one training run (`fit`'s data handler, a
        `Trainer.train` call): at its first epoch the global step and the
        gradients pending are its base, and each epoch adds `pushes`; the
        cap is `Aggregator.plan_updates` of the total. Call between epochs,
        before scheduling the epoch's first function `fn`; without a
        `tf2sync.SyncOptimizer` attached, does nothing.
        """
        aggregator = core_aggregator(self.strategy)
        if aggregator is None:
            return
        current = self._plan_run
        if current is None or current[0]() is not run:
            self._plan_run = (weakref.ref(run), aggregator.plan_run(), 0)
            self._planned = None
        reference, base, total = self._plan_run
        total += int(pushes)
        self._plan_run = (reference, base, total)
        self.planned(fn)
        aggregator.plan_updates(base, total)

    def in_plan(self, run) -> bool:
        """Whether `run` (see `plan_epoch`) made the current plan."""
        current = self._plan_run
        return current is not None and current[0]() is run

    def lift_plan(self) -> None:
        """Removes the cap (a function nobody planned is scheduled)."""
        self._planned = None
        self._plan_run = None
        aggregator = core_aggregator(self.strategy)
        if aggregator is not None:
            aggregator.clear_plan()

    def _lift_plan(self, fn) -> None:
        if self._planned is not None and fn not in self._planned:
            self.lift_plan()

    def schedule(self, fn, args=None, kwargs=None):
        self._lift_plan(fn)
        protocol = self.strategy._protocol
        if protocol is None or not isinstance(
            fn, tf.types.experimental.GenericFunction
        ):
            return super().schedule(fn, args=args, kwargs=kwargs)
        wrapped = self._wrapped.get(fn)
        if wrapped is None:
            traced = fn
            if protocol.traces_before_dispatch:
                # The TF1 shim reads the worker's index (its local step)
                # when the step is traced. A trace the user made before
                # (`step.get_concrete_function()` to call TF1's chief
                # methods) has none, and `fn` would reuse it here: every
                # worker would push with worker 0's local step. A copy of
                # `fn` without traces is traced under the worker's index.
                traced = autograph.untraced_copy(fn)

            def with_worker(worker, *a, **k):
                with step_context.WorkerScope(worker):
                    return traced(*a, **k)

            # Nothing here to convert: `fn` converts itself when traced.
            wrapped = tf.function(with_worker, autograph=False)
            self._wrapped[fn] = wrapped
        args = (self._ids(), *(args or ()))
        if protocol.traces_before_dispatch:
            # Trace now (as `schedule` would), so that what the trace built
            # (the TF1 shim's barrier, even on the very first schedule)
            # starts before any worker runs it.
            with cluster_coordinator.being_scheduled(self.strategy):
                wrapped.get_concrete_function(
                    *cluster_coordinator.worker_slice_specs(args),
                    **cluster_coordinator.worker_slice_specs(kwargs or {}),
                )
            protocol.before_dispatch()
        return super().schedule(wrapped, args=args, kwargs=kwargs)


def core_aggregator(strategy):
    """The `Aggregator` of the strategy's SyncOptimizer, or None (none
    attached, or the TF1 shim's, which plans nothing)."""
    protocol = strategy._protocol
    if protocol is None or protocol.traces_before_dispatch:
        return None
    return protocol.aggregator


def _worker_failed(index, error):
    """Releases the tokens a failed worker's step held (see `watchdog`)."""
    _alarm(f"worker {index} failed", error)


def _function_failed(error):
    """Releases the tokens a failed function's step held: a step that
    raised (its data ran out, a check failed) took its token and will not
    push, and the next `fit` or `train` would wait for the token timeout."""
    if isinstance(error, tf.errors.CancelledError):
        return  # the functions cancelled after a first failure
    _alarm("a function failed", error)


def _alarm(what, error):
    """Alarms every token watchdog: `what` happened, with `error`."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    watchdog.alarm_all(f"{what} ({type(error).__name__}: {first[:120]})")


def _single_pipeline(dataset_or_fn):
    """The dataset a PSS distributed dataset wraps (see the coordinator)."""
    if ps_strategy.is_distributed_dataset(dataset_or_fn):
        if ps_strategy.distributed_dataset_is_built(dataset_or_fn):
            return dataset_or_fn  # built eagerly elsewhere: leave it
        return ps_strategy.distributed_dataset_source(dataset_or_fn)
    if not callable(dataset_or_fn) or isinstance(
        dataset_or_fn, tf.types.experimental.ConcreteFunction
    ):
        return dataset_or_fn

    def dataset_fn():  # traced on each worker
        user_fn = autograph.convert_as_caller(dataset_or_fn)
        return ps_strategy.worker_local_dataset(user_fn())

    return dataset_fn
