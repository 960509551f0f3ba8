"""The `ClusterCoordinator` [2.21] [2.15: kept]: its workers, per-worker
datasets, closure queue, pings and the specs it traces with.

`tf.distribute.coordinator.ClusterCoordinator` and
`tf.distribute.experimental.coordinator.PerWorkerValues` are public: the very
classes of `cluster_coordinator` and `coordinator.values` [2.21]. The hooks
tf2sync puts on its workers and queue are in `patches`
(`worker_failure_hook`, `function_error_hook`, `closure_tracking`).
"""

from __future__ import annotations

import contextlib

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

from tf2sync._src.internals import autograph
from tf2sync._src.internals import fingerprints


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
                    autograph.function_of_tf2sync(
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


@contextlib.contextmanager
def being_scheduled(strategy):
    """Marks `strategy` as tracing a function for `ClusterCoordinator.
    schedule` (its `_being_scheduled`, which `schedule` sets around its
    own trace): PSS then does not warn, once per `run` in the trace, that
    the call is not scheduled [2.21] [2.15]."""
    extended = strategy.extended
    before = getattr(extended, "_being_scheduled", False)
    extended._being_scheduled = True
    try:
        yield
    finally:
        extended._being_scheduled = before


def worker_slice_specs(structure, worker: int = 0):
    """Worker `worker`'s slice of `schedule` arguments, as the specs
    `ClusterCoordinator.schedule` traces a function with."""
    return tf.nest.map_structure(
        coordinator_lib._maybe_as_type_spec,
        coordinator_lib._select_worker_slice(worker, structure),
    )


def _copied(method, recheck, digest):
    return fingerprints.CopiedSource(
        original=method,
        name="tensorflow.python.distribute.coordinator." + method.__qualname__,
        copy="internals.cluster_coordinator._IndexedPerWorkerDataset",
        recheck=recheck,
        package="tensorflow",
        hashes={"2.21": digest},
    )


# The TF sources `_IndexedPerWorkerDataset` copies (see `fingerprints`).
COPIED_SOURCES = (
    _copied(
        coordinator_values.PerWorkerDatasetFromDatasetFunction.__init__,
        "its __init__: variables refused while tracing (`_no_variables`), "
        "the attributes it sets",
        "a2f8c6ccbbb0554d",
    ),
    _copied(
        coordinator_values.PerWorkerDatasetFromDatasetFunction.build,
        "its build: one resource per worker, the datasets' type spec",
        "38b63edbdddeb46d",
    ),
    _copied(
        coordinator_values.PerWorkerDatasetFromDatasetFunction.__iter__,
        "its __iter__: the eager-only check, the iterators' type spec, "
        "the `PerWorkerDistributedIterator` returned",
        "e3047700203efb21",
    ),
    _copied(
        coordinator_lib.ClusterCoordinator._create_per_worker_resources,
        "its _per_worker: one `create_resource` per worker, in order, "
        "wrapped in `PerWorkerValues`",
        "f8b3e78316b0e559",
    ),
)


def closure_queue(coordinator):
    """The coordinator's closure queue (`_cluster.closure_queue`)."""
    return coordinator._cluster.closure_queue


def hooked_closure_failure(worker, callback):
    """`worker._on_closure_failure`, then `callback(worker_index, error)`
    (for `patches.worker_failure_hook`)."""
    original = worker._on_closure_failure
    index = worker.worker_index

    def hooked(closure, error):
        original(closure, error)
        callback(index, error)

    return hooked


def hooked_mark_failed(queue, callback):
    """`queue.mark_failed`, then `callback(error)` (for
    `patches.function_error_hook`)."""
    original = queue.mark_failed

    def hooked(error):
        original(error)
        callback(error)

    return hooked
