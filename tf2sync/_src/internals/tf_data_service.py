"""tf.data service [2.21] [2.15]: jobs named by a tensor, dispatchers."""

from __future__ import annotations

from tensorflow.python.data.experimental.ops import data_service_ops


def service_dataset_of_job(service, dataset_id, element_spec, job_name):
    """`tf.data.experimental.service.from_dataset_id` in "distributed_epoch"
    mode with `job_name` a string *tensor* (computed on the worker).

    The public function takes only a Python string; its private
    `_from_dataset_id`, which it calls, takes a tensor too [2.21] [2.15].
    Its uncompression function is cached per element spec and added only
    to the graph that first made it; made again here, it is in the
    library of every worker's function (else a process that connects to
    a second cluster sends a function whose definition it lacks).
    """
    cache = getattr(data_service_ops, "_get_uncompress_func", None)
    if cache is not None and hasattr(cache, "cache_clear"):
        cache.cache_clear()
    return data_service_ops._from_dataset_id(
        processing_mode="distributed_epoch",
        service=service,
        dataset_id=dataset_id,
        element_spec=element_spec,
        job_name=job_name,
    )


def dispatcher_num_workers(dispatcher) -> int:
    """tf.data workers registered with a `DispatchServer` (its
    `_num_workers`) [2.21] [2.15]."""
    return int(dispatcher._num_workers())
