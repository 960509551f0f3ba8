"""Taking over a worker's in-flight closure [2.21] [2.15: kept].

`take_over_closure` puts the closure a worker is running back in the
coordinator's queue, for another worker to run. No public API moves a
closure: `patches.closure_tracking` replaces each worker's
`_process_closure` with `process_tracked`, a copy of TF's own
`Worker._process_closure` [2.21] [2.15: the same] that records the closure
running (`COPIED_SOURCES` fingerprints the source it copies, see
`tests/fingerprints_test.py`).
"""

from __future__ import annotations

import threading

import tensorflow as tf
from tensorflow.python.distribute.coordinator import (
    cluster_coordinator as coordinator_lib,
)

from tf2sync._src.internals import fingerprints


def take_over_closure(coordinator, index: int) -> bool:
    """Puts worker `index`'s in-flight closure back in the queue.

    Another worker then runs it, and the coordinator's count of closures in
    flight no longer includes it (`join` does not wait for it). Whatever
    the original run returns or raises later is ignored. Returns whether
    there was a closure to move (`patches.closure_tracking` must be
    installed).
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


def process_tracked(worker, closure):
    """`Worker._process_closure`, for `patches.closure_tracking`."""
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


def tracked_process_closure(worker):
    """`worker`'s `_process_closure` as `process_tracked`, with the record
    it keeps (for `patches.closure_tracking`)."""
    worker._tf2sync_lock = threading.Lock()
    worker._tf2sync_running = None
    worker._tf2sync_taken = None
    return lambda closure, worker=worker: process_tracked(worker, closure)


def untrack(worker) -> None:
    """`take_over_closure` finds nothing to move on `worker` from now on."""
    del worker._tf2sync_lock


# The TF source `process_tracked` copies (see `fingerprints`).
COPIED_SOURCES = (
    fingerprints.CopiedSource(
        original=coordinator_lib.Worker._process_closure,
        name="tensorflow.python.distribute.coordinator.cluster_coordinator."
        "Worker._process_closure",
        copy="internals.closures.process_tracked",
        recheck="that process_tracked does what it does, plus the record of "
        "the closure running: the same `wait_on_failure` callbacks, "
        "`execute_on`, the output fetch, `mark_finished`, the error log, "
        "`_set_error` and `mark_failed`",
        package="tensorflow",
        hashes={"2.21": "859ce2d4581b4f40"},
    ),
    fingerprints.CopiedSource(
        original=coordinator_lib.Worker._on_closure_failure,
        name="tensorflow.python.distribute.coordinator.cluster_coordinator."
        "Worker._on_closure_failure",
        copy="internals.closures.process_tracked's on_failure",
        recheck="that the end of process_tracked's `on_failure` (a closure "
        "taken over) is still the rest of that method: under "
        "`_resource_tracking_lock`, `_is_dead_with_error` and "
        "`_set_resources_aborted`",
        package="tensorflow",
        hashes={"2.21": "0ac7640bc0a26059"},
    ),
)
