"""Dynamic sharding: each epoch is one pass of a tf.data service job.

`tf.data.experimental.service` in `processing_mode="distributed_epoch"`
hands each element of a pass to whichever consumer asks for it next, so
faster workers read more. An epoch of a fixed number of steps cannot match
such a pass (consumers fetch ahead; batches made on several tf.data workers
end each one's share with a partial batch), so here the epoch ends with the
data. The protocol, for `tf2sync.Trainer` with a `ServicePassPerEpoch`:

1. The chief registers the dataset with the dispatcher once.
2. At each epoch the chief adds 1 to a variable on a ps, the epoch number,
   and makes every worker's iterator again: it reads the job named after
   this run and that number, in `distributed_epoch` mode, so the epoch is
   a new pass whose every element goes to exactly one worker.
3. Each step of a scheduled function first asks its iterator for an
   element (`get_next_as_optional`). A step whose worker's pass has ended
   runs nothing: no token, no push. A function returns the steps it ran
   and its worker's index.
4. The chief keeps functions scheduled until every worker has returned one
   in which its pass had ended (its iterator gave everything it fetched to
   steps that pushed it), then joins.
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

import uuid

import tensorflow as tf

from tf2sync._src import tf_internals


class ServicePassPerEpoch:
    """Input for `tf2sync.Trainer.train`: each epoch one tf.data service pass.

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
    tensors of a known rank; it runs on the tf.data workers, which must
    read its sources.
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
        if not isinstance(service, str) or not service.strip():
            raise ValueError(
                "`service` must be the tf.data service dispatcher's address, "
                f'e.g. "grpc://localhost:5000". Received: service={service!r}'
            )
        if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
            raise ValueError(
                "`dataset` must be finite: an epoch is one pass of it (drop "
                "its `repeat()`). Received: an infinite dataset"
            )
        self.dataset = dataset
        self.service = service
        self._run = f"tf2sync_{uuid.uuid4().hex[:12]}"
        self._bound = None

    def per_worker_dataset(self, strategy, coordinator):
        """Registers the dataset; returns `(per-worker dataset, next_epoch)`.

        `next_epoch()` (eager, between epochs) starts a new job: iterators
        made after it read a new pass.
        """
        if self._bound is not None:
            return self._bound
        dataset_id = tf.data.experimental.service.register_dataset(
            self.service, self.dataset
        )
        spec = self.dataset.element_spec
        with strategy.scope():
            epoch = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="tf2sync_pass"
            )
        service, run = self.service, self._run

        def dataset_fn():  # traced on each worker
            job = tf.strings.join(
                [run, "_", tf.strings.as_string(epoch.read_value())]
            )
            return tf_internals.service_dataset_of_job(
                service, dataset_id, spec, job
            )

        def next_epoch():
            epoch.assign_add(1)

        per_worker = coordinator.create_per_worker_dataset(dataset_fn)
        self._bound = (per_worker, next_epoch)
        return self._bound
