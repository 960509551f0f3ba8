"""The ClusterCoordinator: its workers, closures and per-worker datasets,
and `fit`'s data handler.

Part of `tf2sync._src.tf_internals`, the one door to private TensorFlow
and tf_keras API: see its docstring for the version tags.
"""

from __future__ import annotations

import sys
import threading

import tensorflow as tf
from tensorflow.python.distribute import input_lib
from tensorflow.python.distribute.coordinator import (
    cluster_coordinator as coordinator_lib,
)
from tensorflow.python.distribute.coordinator import (
    values as coordinator_values,
)
from tensorflow.python.eager import context as eager_context
from tensorflow.python.eager import executor as eager_executor

from tf2sync._src.tf_internals.autograph import function_of_tf2sync

# Coordinator [2.21] [2.15: kept] ---------------------------------------------
# `tf.distribute.coordinator.ClusterCoordinator` and
# `tf.distribute.experimental.coordinator.PerWorkerValues` are public: the very
# classes of `cluster_coordinator` and `coordinator.values` [2.21].


def strategy_coordinator(strategy):
    """The `ClusterCoordinator` of `strategy`, or None
    (`_cluster_coordinator`; `ClusterCoordinator(strategy)` makes one)."""
    return getattr(strategy, "_cluster_coordinator", None)


def coordinator_workers(coordinator) -> list:
    """The coordinator's workers, in task order (`_cluster.workers`); each
    has `create_resource(fn)`. No public list."""
    return list(coordinator._cluster.workers)


def indexed_per_worker_dataset(coordinator, dataset_fn_of):
    """`coordinator.create_per_worker_dataset`, with one function per worker:
    worker i's dataset and iterator resources are made by
    `dataset_fn_of(i)` (a function of no arguments), traced for it, so a
    worker that restarts rebuilds them with its own function. It is traced
    as tf2sync's code (`function_of_tf2sync`): it converts the user's
    function it calls (`convert_as_caller`).

    `values.PerWorkerDatasetFromDatasetFunction` traces one function for
    every worker; this subclass keeps one per worker and overrides the two
    methods that call it (`build`, `__iter__`), as they are in [2.21] and
    [2.15]. `element_spec` is worker 0's (the same for all).
    """
    return _IndexedPerWorkerDataset(dataset_fn_of, coordinator)


def _no_variables(next_creator, **kwargs):
    del next_creator, kwargs
    raise ValueError("Creating variables in `dataset_fn` is not allowed.")


class _IndexedPerWorkerDataset(
    coordinator_values.PerWorkerDatasetFromDatasetFunction
):
    def __init__(self, dataset_fn_of, coordinator):
        functions = []
        with tf.variable_creator_scope(_no_variables):
            for i in range(len(coordinator_workers(coordinator))):
                functions.append(
                    function_of_tf2sync(
                        dataset_fn_of(i)
                    ).get_concrete_function()
                )
        super().__init__(functions[0], coordinator)
        self._functions = functions

    def _per_worker(self, make):
        workers = coordinator_workers(self._coordinator)
        return coordinator_values.PerWorkerValues(
            tuple(
                worker.create_resource(make(function))
                for worker, function in zip(workers, self._functions)
            )
        )

    def build(self):
        def dataset_maker(function):
            return lambda: function()

        datasets = self._per_worker(dataset_maker)
        spec = self._dataset_fn.structured_outputs._type_spec
        for remote in datasets._values:
            remote._type_spec = spec
        return datasets

    def __iter__(self):
        if (
            not tf.executing_eagerly()
            or tf.compat.v1.get_default_graph().building_function
        ):
            raise RuntimeError(
                "__iter__() is not supported inside of tf.function or in "
                "graph mode."
            )

        def iterator_maker(function):
            return lambda: iter(function())

        iterators = self._per_worker(iterator_maker)
        spec = input_lib.get_iterator_spec_from_dataset(
            self._coordinator.strategy, self._dataset_fn.structured_outputs
        )
        for remote in iterators._values:
            remote._type_spec = spec
        return coordinator_values.PerWorkerDistributedIterator(
            iterators._values
        )


def inflight_closures(coordinator) -> tuple[int, bool]:
    """`(closures running on workers, whether none waits for a worker)`,
    from the closure queue; `coordinator.done()` is both in one bool."""
    queue = coordinator._cluster.closure_queue
    return int(queue._inflight_closure_count), queue._queue.empty()


def on_worker_failure(coordinator, callback) -> None:
    """Calls `callback(worker_index, error)` when a worker fails a closure.

    PSS tells nobody: its `Worker._on_closure_failure` (run once the
    failure handler has classified the error as a worker failure, before
    it waits for the worker to come back) puts the closure back. Wrapped
    per worker instance, after the closure is back in the queue.
    """
    for worker in coordinator._cluster.workers:
        original = worker._on_closure_failure
        if getattr(original, "_tf2sync_hooked", False):
            continue

        def hooked(
            closure, error, original=original, index=worker.worker_index
        ):
            original(closure, error)
            callback(index, error)

        hooked._tf2sync_hooked = True
        worker._on_closure_failure = hooked


def track_closures(coordinator) -> None:
    """Lets `take_over_closure` move a worker's in-flight closure.

    Replaces each worker's `_process_closure` (per instance; its thread
    looks the method up for every closure) with `_process_tracked`: TF's
    own [2.21] [2.15: the same], plus the record of the closure running and
    the check, when it returns or fails, that nobody took it over.
    """
    for worker in coordinator._cluster.workers:
        if getattr(worker, "_tf2sync_lock", None) is not None:
            continue
        worker._tf2sync_lock = threading.Lock()
        worker._tf2sync_running = None
        worker._tf2sync_taken = None
        worker._process_closure = lambda closure, worker=worker: (
            _process_tracked(worker, closure)
        )


def take_over_closure(coordinator, index: int) -> bool:
    """Puts worker `index`'s in-flight closure back in the queue.

    Another worker then runs it, and the coordinator's count of closures in
    flight no longer includes it (`join` does not wait for it). Whatever
    the original run returns or raises later is ignored. Returns whether
    there was a closure to move (`track_closures` must have run).
    """
    worker = coordinator._cluster.workers[index]
    lock = getattr(worker, "_tf2sync_lock", None)
    if lock is None:
        return False
    with lock:
        closure = worker._tf2sync_running
        if closure is None or worker._tf2sync_taken is closure:
            return False
        worker._tf2sync_taken = closure
        coordinator._cluster.closure_queue.put_back(closure)
    return True


def _process_tracked(worker, closure):
    """`Worker._process_closure`, for `track_closures`."""
    lock = worker._tf2sync_lock
    queue = worker._cluster.closure_queue
    with lock:
        worker._tf2sync_running = closure

    def taken_over():
        # Else the closure is ours to finish: nobody may take it over now.
        with lock:
            if worker._tf2sync_taken is closure:
                return True
            worker._tf2sync_running = None
            return False

    def on_failure(error):
        if not taken_over():
            worker._on_closure_failure(closure, error)
            return
        with worker._resource_tracking_lock:  # the rest of that method
            worker._is_dead_with_error = error
            worker._set_resources_aborted(error)

    def on_transient_failure():
        if not taken_over():
            queue.put_back(closure)

    try:
        with worker.failure_handler.wait_on_failure(
            on_failure_fn=on_failure,
            on_transient_failure_fn=on_transient_failure,
            on_recovery_fn=worker._on_worker_recovery,
            worker_device_name=worker.device_name,
        ):
            closure.execute_on(worker)
            # The fetch waits on the worker too: it can be taken over still.
            closure.maybe_call_with_output_remote_value(lambda r: r.get())
            if taken_over():
                return
            queue.mark_finished()
    except Exception as e:  # noqa: BLE001 - as TF's, which reports it
        with lock:
            if worker._tf2sync_taken is closure:
                return
            worker._tf2sync_running = None  # ours to fail: not movable now
        if not isinstance(e, tf.errors.CancelledError):
            tf.compat.v1.logging.error(
                " /job:worker/task:%d encountered the following error when "
                "processing closure: %r:%s",
                worker.worker_index,
                e,
                e,
            )
        closure.maybe_call_with_output_remote_value(
            lambda r, error=e: r._set_error(error)
        )
        queue.mark_failed(e)
    finally:
        with lock:
            if worker._tf2sync_running is closure:
                worker._tf2sync_running = None
            if worker._tf2sync_taken is closure:
                worker._tf2sync_taken = None


def worker_pinger(device: str):
    """`ping()`: runs a scalar op on `device` and waits for its answer.

    With an executor of its own (as PSS gives each worker), so that a ping
    waiting on a frozen worker blocks nothing else. No public way to pick
    an executor.
    """
    executor = eager_executor.new_executor(enable_async=False)
    one = tf.constant(1, tf.int64)

    def ping():
        with eager_context.executor_scope(executor), tf.device(device):
            return int(tf.identity(one).numpy())

    return ping


def worker_slice_specs(structure, worker: int = 0):
    """Worker `worker`'s slice of `schedule` arguments, as the specs
    `ClusterCoordinator.schedule` traces a function with."""
    return tf.nest.map_structure(
        coordinator_lib._maybe_as_type_spec,
        coordinator_lib._select_worker_slice(worker, structure),
    )


def caller_self_of_type(type_name):
    """The nearest caller's `self` whose class is named `type_name`, or None.

    tf_keras's data handlers call the strategy without saying who they are;
    the stack does (`sys._getframe`). If tf_keras renamed the class, this
    finds nothing and each caller falls to its safe side. The names used
    (`_ClusterCoordinatorDataHandler`, `..ExactEvalDataHandler`) [2.21].
    """
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if type(owner).__name__ == type_name:
            return owner
        frame = frame.f_back
    return None


def keras_entry_point(model):
    """Which of `model`'s `fit`, `evaluate` or `predict` is running now
    (the nearest on the stack: `evaluate` inside `fit` for its validation
    data), or None (`sys._getframe`; tf_keras's method names [2.21]
    [2.15])."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_name
        if name in ("fit", "evaluate", "predict") and (
            frame.f_locals.get("self") is model
        ):
            return name
        frame = frame.f_back
    return None


def after_each_epoch_join(handler, fn) -> None:
    """Makes a `_ClusterCoordinatorDataHandler` call `fn()` after each join
    that ends an epoch's steps: its `sync`, which `catch_stop_iteration`
    calls once the epoch's functions are scheduled [2.21] [2.15]."""
    join = handler.sync

    def sync():
        join()
        fn(join)

    handler.sync = sync


def data_handler_model(handler):
    """The model a tf_keras data handler serves (`_model`), or None."""
    return getattr(handler, "_model", None)


def data_handler_dataset_creator(handler):
    """The `DatasetCreator` a data handler reads (its adapter's), or None."""
    adapter = getattr(handler, "_adapter", None)
    return getattr(adapter, "dataset_creator", None)


def new_iterator_each_epoch(handler) -> None:
    """Makes a data handler create its iterator again at each epoch.

    `DatasetCreatorAdapter.should_recreate_iterator` is False (tf_keras
    expects a dataset function's shuffle to run across epochs); the handler
    asks its adapter at every epoch (`enumerate_epochs`) [2.21] [2.15].
    """
    handler._adapter.should_recreate_iterator = lambda: True
