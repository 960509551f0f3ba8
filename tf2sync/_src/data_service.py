"""Dynamic sharding: each epoch is one pass of a tf.data service job.

`tf.data.experimental.service` in `processing_mode="distributed_epoch"`
hands each element of a pass to whichever consumer asks for it next, so
faster workers read more. An epoch of a fixed number of steps cannot match
such a pass (consumers fetch ahead; batches made on several tf.data workers
end each one's share with a partial batch), so here the epoch ends with the
data. The protocol, for `model.fit` and `tf2sync.Trainer` reading a
`ServicePassPerEpoch`:

1. The chief registers the dataset with the dispatcher once.
2. At each epoch the chief adds 1 to a variable on a ps, the epoch number,
   and makes every worker's iterator again: it reads the job named after
   this run and that number, in `distributed_epoch` mode, so the epoch is
   a new pass whose every element goes to exactly one worker.
3. Each step of a scheduled function first asks its iterator for an
   element (`get_next_as_optional`). A step whose worker's pass has ended
   runs nothing (no token, no push) but marks the worker's pass ended
   (`Trainer`'s functions return it, with the steps they ran; `fit`'s set
   the worker's entry of a variable on a ps).
4. The chief keeps functions scheduled until every worker's pass has
   ended (its iterator gave everything it fetched to steps that pushed
   it), then joins. `fit` first schedules its `steps_per_epoch`, then
   rounds of two functions per worker until then.
5. The pushes of the last step, fewer than `replicas_to_aggregate`, are
   applied as their mean (`Aggregator.flush`), so no gradient of the pass
   is left for the next epoch.

Guarantees, with `total_num_replicas == replicas_to_aggregate` and no
worker fault: every element of the pass is in exactly one applied
gradient, and no element of another pass. With backup workers, pushes that
arrive after their step was applied are dropped as stale (counted in
`stale_dropped`): their elements were read in the epoch and are in no
update. A worker that fails loses the elements it had fetched and not
pushed; its rebuilt iterator joins the same job and reads on.
"""

from __future__ import annotations

import time
import uuid
import weakref

import tensorflow as tf

from tf2sync._src import step_context
from tf2sync._src.internals import cluster_coordinator
from tf2sync._src.internals import patches
from tf2sync._src.internals import tf_data_service


class ServicePassPerEpoch(tf.keras.utils.experimental.DatasetCreator):
    """Input for `fit` and `Trainer.train`: each epoch one tf.data service pass.

    The workers share one pass of `dataset` per epoch through a tf.data
    service dispatcher (`tf.data.experimental.service.DispatchServer`,
    usually on the chief) and its tf.data workers (`WorkerServer`, usually
    one beside each training worker): each element goes to whichever
    training worker asks first. The epoch ends when the pass does (see the
    protocol in `tf2sync/_src/data_service.py`): every element is then in
    exactly one applied gradient, without backup workers and faults, and
    the last update of an epoch is the mean of the pushes left (fewer than
    `replicas_to_aggregate`).

    `dataset` must be finite (one pass), batched, and made of dense
    tensors; it runs on the tf.data workers, which must read its sources.

    In `model.fit` it is a `DatasetCreator`: `steps_per_epoch` is then the
    steps `fit` schedules before it waits for the pass to end (rounds of
    two functions per worker follow until it has); about the pass's
    batches, or a few more, is fastest (steps past the end run nothing).
    In `Trainer.train`, leave `steps_per_epoch` None. It needs
    `tf2sync.SyncParameterServerStrategy` and a `tf2sync.SyncOptimizer`.
    """

    def __init__(self, dataset: tf.data.Dataset, service: str):
        """Registers nothing yet; see the class doc.

        Args:
          dataset: The finite, batched `tf.data.Dataset` of one pass.
          service: The dispatcher's address, e.g. `"grpc://host:port"`
            (`DispatchServer.target`).

        Raises:
          TypeError: If `dataset` is not a `tf.data.Dataset`.
          ValueError: If `service` is not a non-empty string, or `dataset`
            is infinite.
        """
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                "`dataset` must be a tf.data.Dataset. Received: "
                f"dataset={dataset!r}"
            )
        if not isinstance(service, str):
            raise TypeError(
                "`service` must be the tf.data service dispatcher's address, "
                'a str such as "grpc://localhost:5000". Received: '
                f"service={service!r}"
            )
        if not service.strip():
            raise ValueError(
                "`service` must be the tf.data service dispatcher's address, "
                f'e.g. "grpc://localhost:5000". Received: service={service!r}'
            )
        if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
            raise ValueError(
                "`dataset` must be finite: an epoch is one pass of it (drop "
                "its `repeat()`). Received: an infinite dataset"
            )
        super().__init__(_needs_tf2sync)
        self.dataset = dataset
        self.service = service
        self._run = f"tf2sync_{uuid.uuid4().hex[:12]}"
        self._bound = None
        self._ended = None

    def per_worker_dataset(self, strategy, coordinator):
        """Binds to `coordinator`'s cluster (once per coordinator).

        Registers the dataset with the dispatcher and creates the pass
        counter and the per-worker "pass ended" marks on a ps.

        Args:
          strategy: The `tf2sync.SyncParameterServerStrategy`.
          coordinator: Its `ClusterCoordinator`.

        Returns:
          `(per-worker dataset, next_epoch)`: `next_epoch()` (eager,
          between epochs) starts a new job, which iterators made after it
          read as a new pass.
        """
        if self._bound is not None and self._bound[2]() is coordinator:
            return self._bound[:2]
        workers = len(cluster_coordinator.coordinator_workers(coordinator))
        dataset_id = tf.data.experimental.service.register_dataset(
            self.service, self.dataset
        )
        spec = self.dataset.element_spec
        with strategy.scope():
            epoch = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="tf2sync_pass"
            )
            self._ended = tf.Variable(
                tf.zeros([workers], tf.int64),
                trainable=False,
                name="tf2sync_pass_ended",
            )
        service, run = self.service, self._run

        def dataset_fn():  # traced on each worker
            job = tf.strings.join(
                [run, "_", tf.strings.as_string(epoch.read_value())]
            )
            return tf_data_service.service_dataset_of_job(
                service, dataset_id, spec, job
            )

        dataset_fn.tf2sync_pass = True  # see `is_pass_dataset_fn`

        def next_epoch():
            self._ended.assign(tf.zeros_like(self._ended))
            epoch.assign_add(1)

        per_worker = coordinator.create_per_worker_dataset(dataset_fn)
        self._bound = (per_worker, next_epoch, weakref.ref(coordinator))
        return self._bound[:2]

    def mark_ended(self):
        """Marks the running worker's pass ended (step 3 of the protocol).

        Traced in a step whose iterator gave no element, after
        `per_worker_dataset`.

        Returns:
          The op (a no-op outside a worker's function).
        """
        worker = step_context.current_worker()
        if worker is None or self._ended is None:
            return tf.no_op()
        return self._ended.scatter_nd_update(
            tf.reshape(tf.cast(worker, tf.int64), [1, 1]),
            tf.ones([1], tf.int64),
        )

    def all_ended(self) -> bool:
        """Whether every worker's pass has ended (eager, after a join).

        Returns:
          True once each worker ran a step after its pass ended.
        """
        return bool(tf.reduce_all(self._ended.read_value() > 0))

    def any_ended(self) -> bool:
        """Whether some worker's pass has ended (eager)."""
        return bool(tf.reduce_any(self._ended.read_value() > 0))


def _needs_tf2sync(input_context):
    del input_context
    raise ValueError(
        "A tf2sync.ServicePassPerEpoch is read only by model.fit and "
        "tf2sync.Trainer under tf2sync.SyncParameterServerStrategy (not by "
        "evaluate, predict or another strategy)"
    )


# model.fit ------------------------------------------------------------------

_PASSES = weakref.WeakKeyDictionary()  # fit data handler -> its input


def is_pass_dataset_fn(dataset_fn) -> bool:
    """Whether `dataset_fn` is a `ServicePassPerEpoch`'s own (the
    coordinator then builds it as it is, on every worker)."""
    return getattr(dataset_fn, "tf2sync_pass", False) is True


def pass_of(handler):
    """The `ServicePassPerEpoch` a `fit` data handler reads, or None."""
    if handler is None:
        return None
    try:
        return _PASSES.get(handler)
    except TypeError:
        return None


def for_fit(creator, handler, model, coordinator, aggregator):
    """The per-worker dataset of `fit`'s `handler`, which now ends each
    epoch with the pass (steps 2, 4 and 5 of the protocol); `aggregator`
    is the core's (None: nothing to flush)."""
    per_worker, next_pass = creator.per_worker_dataset(
        coordinator.strategy, coordinator
    )
    iterators = _EpochIterators(per_worker, next_pass)
    _PASSES[handler] = creator
    patches.new_iterator_each_epoch.install(handler)
    workers = len(cluster_coordinator.coordinator_workers(coordinator))

    def end_of_pass(join):  # after the join of the epoch's steps
        idle = 0
        while not creator.all_ended():
            before = int(aggregator.accepted.numpy())
            for _ in range(2 * workers):
                model.train_function(iterators.last)
            join()
            if int(aggregator.accepted.numpy()) != before:
                idle = 0
                continue
            # Every function of the round ran on a live worker and pushed
            # nothing: its worker's pass had ended, and it said so.
            idle += 1
            if idle < 2:
                continue
            if not creator.any_ended():  # the steps mark nothing: a bug
                raise RuntimeError(
                    "tf2sync: the data service pass did not end: two rounds "
                    "of functions pushed nothing and marked no pass ended"
                )
            break  # a worker that never came back
        aggregator.flush()

    patches.epoch_end_hook.install(handler, end_of_pass)
    return iterators


class _EpochIterators:
    """What `fit`'s data handler iterates: a new pass at each `iter`.

    tf_keras's `enumerate_epochs` calls `iter` once before its first epoch
    and again at each epoch once its adapter asks for a new iterator
    (`patches.new_iterator_each_epoch`) [2.21] [2.15]: the first call
    makes no iterator (it would start a job nobody reads); should an epoch
    read it, it fails at once rather than silently.
    """

    def __init__(self, per_worker, next_pass):
        self._per_worker = per_worker
        self._next_pass = next_pass
        self._calls = 0
        self.last = None

    def __iter__(self):
        self._calls += 1
        if self._calls == 1:
            return _Unused()
        self._next_pass()
        self.last = iter(self._per_worker)
        return self.last

    @property
    def element_spec(self):
        return self._per_worker.element_spec


class _Unused:
    """The iterator `enumerate_epochs` makes first and replaces unread."""

    def __iter__(self):
        return self

    def __next__(self):
        raise RuntimeError("tf2sync: a ServicePassPerEpoch epoch not begun")


# Servers (the launcher's --input_sharding=service) --------------------------


def start_dispatcher(port: int):
    """Starts a tf.data service dispatcher on `port` of this process.

    Keep the returned server referenced while it serves. It listens on all
    interfaces, as TensorFlow's other gRPC servers (docs/guide/launcher.md,
    "Security: keep the cluster private").
    """
    return tf.data.experimental.service.DispatchServer(
        tf.data.experimental.service.DispatcherConfig(port=port)
    )


def wait_for_workers(dispatcher, count: int, timeout: float, where) -> None:
    """Waits until `count` tf.data workers registered with `dispatcher`.

    Raises:
      TimeoutError: After `timeout` seconds, naming `where` (the workers'
        expected addresses) and how many came.
    """
    deadline = time.monotonic() + timeout
    while tf_data_service.dispatcher_num_workers(dispatcher) < count:
        if time.monotonic() > deadline:
            came = tf_data_service.dispatcher_num_workers(dispatcher)
            raise TimeoutError(
                f"{came} of {count} tf.data workers registered with the "
                f"dispatcher within {timeout:g} s (`--connect_timeout`); "
                f"expected at {', '.join(where)}: start every worker with "
                "--input_sharding=service and the chief's --data_service_port"
            )
        time.sleep(0.1)


def start_worker(dispatcher_address: str, worker_address: str):
    """Starts a tf.data worker at `worker_address` ("host:port", how the
    dispatcher and the training workers reach it), registered with the
    dispatcher at `dispatcher_address` ("host:port"). It waits for the
    dispatcher (retrying) before it returns."""
    port = int(worker_address.rsplit(":", 1)[1])
    return tf.data.experimental.service.WorkerServer(
        tf.data.experimental.service.WorkerConfig(
            dispatcher_address=dispatcher_address,
            worker_address=worker_address,
            port=port,
        )
    )


def addresses(spec: dict, task_index: int, port: int, worker_port=None):
    """`(dispatcher "host:port", this worker's tf.data worker "host:port")`
    for cluster `spec`: the dispatcher on the chief's host at `port`, the
    tf.data worker on worker `task_index`'s host at `worker_port`
    (default `port + 1 + task_index`)."""
    chief_host = spec["chief"][0].rsplit(":", 1)[0]
    worker_host = spec["worker"][task_index].rsplit(":", 1)[0]
    if worker_port is None:
        worker_port = port + 1 + task_index
    return f"{chief_host}:{port}", f"{worker_host}:{worker_port}"
