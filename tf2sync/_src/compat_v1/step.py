"""One traced shim step: what it recorded, and what may use its result.

`engine.PushFirstStep` opens a `Step` per traced `strategy.run`; each
`apply_gradients` in it records its gradients there, and the step's one
push is made from them once the replica function returned.
"""

from __future__ import annotations

import tensorflow as tf

from tf2sync._src import step_context
from tf2sync._src.internals import graph_ops


class Step:
    """One traced replica step: the shim optimizers applied in it."""

    def __init__(self, worker, after):
        self.worker = worker
        self.after = after  # the previous step's token in the same graph
        self.entries = []  # (optimizer, grads_and_vars, global_step)
        self.results = []  # placeholders rewired to the step's token


def worker_or_zero():
    """The traced step's worker index, 0 where none is set (eagerly)."""
    worker = step_context.current_worker()
    return tf.constant(0, tf.int64) if worker is None else worker


def one_per_variable(entries):
    """The step's `(gradient, variable)` pairs, one per variable, in order.

    On a worker with several GPUs each replica applies its own gradients
    in the same traced step; the worker pushes once, with their sum (as
    `tf2sync.SyncOptimizer` does): dense gradients added, sparse rows
    concatenated.
    """
    order, grads = [], {}
    for _, gvs, _ in entries:
        for grad, var in gvs:
            if grad is None:
                continue
            if id(var) not in grads:
                order.append(var)
            grads.setdefault(id(var), []).append(grad)
    pairs = []
    for var in order:
        parts = grads[id(var)]
        if len(parts) == 1:
            grad = parts[0]
        elif isinstance(parts[0], tf.IndexedSlices):
            grad = tf.IndexedSlices(
                tf.concat([p.values for p in parts], 0),
                tf.concat([p.indices for p in parts], 0),
                parts[0].dense_shape,
            )
        else:
            grad = tf.add_n(parts)
        pairs.append((grad, var))
    return pairs


def check_results_unused(results, operations):
    """Refuses ops of the step that wait on `apply_gradients`'s result.

    The result is the step's token, which exists only once the step's one
    push is made, after the replica function returned. An op of the step
    that uses it (`tf.control_dependencies([train_op])` around a read of
    the global step or the weights, say) and touches a resource would be
    ordered before the push by automatic control dependencies: a cycle.
    Pure ops (an identity, a cast) are fine.
    """
    waiting = {r.op for r in results}
    for op in operations:
        if op in waiting:
            continue
        if any(t.op in waiting for t in op.inputs) or any(
            c in waiting for c in op.control_inputs
        ):
            if graph_ops.op_is_stateful(op) or any(
                t.dtype == tf.resource for t in op.inputs
            ):
                raise ValueError(
                    "An op of the replica step waits on the result of "
                    "SyncReplicasOptimizer.apply_gradients and touches a "
                    f"variable or queue ({op.type} {op.name!r}). The result "
                    "exists once the step has pushed, after the function "
                    "given to strategy.run returns: use it there (return it "
                    "from the replica function), not inside."
                )
            waiting.add(op)
