"""What the replica step being traced knows: its tag, worker, push, apply.

`StepContext` is set while `SyncParameterServerStrategy.run` traces a step
of the core protocol (`current_step`); the worker index is set while the
coordinator traces a scheduled function (`current_worker`), and the worker a
dataset function is traced for (`dataset_worker`).
"""

from __future__ import annotations

import threading

import tensorflow as tf

_STEP = threading.local()


class StepContext:
    """What one traced replica step knows: its tag, and whether it pushed."""

    def __init__(self, tag, worker=None, want_stats=True, first_op=None):
        self.tag = tag
        self.worker = worker
        # Where the step's ops start: its graph, and its first op's index.
        self._graph = tf.compat.v1.get_default_graph()
        self._first_op = first_op
        self.pushed = False
        self.want_stats = want_stats  # whether the push reads the counters
        self.stats = None  # set by the push: counters read on the ps

    def first_op_here(self):
        """The index of the step's first op if the current graph is the
        step's own (not a function nested in it), else None."""
        if tf.compat.v1.get_default_graph() is self._graph:
            return self._first_op
        return None


def current_step():
    """The `StepContext` of the replica step being traced, or None."""
    return getattr(_STEP, "context", None)


class _Scope:
    """Sets `_STEP.<name>` to a value inside a `with`, then restores it."""

    def __init__(self, name, value):
        self._name = name
        self._value = value

    def __enter__(self):
        self._previous = getattr(_STEP, self._name, None)
        setattr(_STEP, self._name, self._value)

    def __exit__(self, *exc):
        setattr(_STEP, self._name, self._previous)


class StepScope(_Scope):
    """Makes `context` the `current_step()` inside a `with`."""

    def __init__(self, context):
        super().__init__("context", context)


def current_worker():
    """The int64 index of the worker running the traced step, or None."""
    return getattr(_STEP, "worker", None)


class WorkerScope(_Scope):
    """Makes `worker` the `current_worker()` inside a `with`."""

    def __init__(self, worker):
        super().__init__("worker", worker)


def dataset_worker():
    """The index (int) of the worker a dataset function is traced for."""
    return getattr(_STEP, "dataset_worker", None)


class DatasetWorkerScope(_Scope):
    """Makes `worker` the `dataset_worker()` inside a `with`."""

    def __init__(self, worker):
        super().__init__("dataset_worker", worker)


def in_sync_apply() -> bool:
    """True while tf2sync traces its own update of the model variables."""
    return getattr(_STEP, "apply_depth", 0) > 0


class _SyncApplyScope:
    def __enter__(self):
        _STEP.apply_depth = getattr(_STEP, "apply_depth", 0) + 1

    def __exit__(self, *exc):
        _STEP.apply_depth -= 1


def sync_apply_scope():
    """Marks traced variable updates as synchronous applies.

    The strategy refuses any other variable update traced in a step (it
    would be an asynchronous apply); the aggregator's apply, its hooks and
    the shim's inner optimizers run inside this scope.
    """
    return _SyncApplyScope()
