"""The apply: the mean of a step's pushes, once; the step's end.

`ApplyMixin` is part of `aggregation.Aggregator` (see that module for the
protocol). With one ps the apply runs inside the critical section; with
several, this ps's share waits in its staging queue and the apply on each
ps is `sync.scale_out`'s.
"""

from __future__ import annotations

import tensorflow as tf

from tf2sync._src import step_context
from tf2sync._src import wire as wire_lib


class ApplyMixin:
    """The apply, the flush and the step's end of `aggregation.Aggregator`."""

    def flush(self) -> bool:
        """Applies the pushes of an incomplete step as their mean (eagerly).

        For an epoch that ends with its data (`data_service`): call once no
        step runs (after a join). With `c` gradients of the current step
        accumulated, `0 < c < replicas_to_aggregate`, applies their mean as
        an update (the global step rises by 1) and leaves the barrier with
        one step's tokens, as after any update. Returns whether it applied.
        """
        if self.recover():  # a sealed step: ended first
            return True
        with tf.init_scope():
            step = int(self.global_step.numpy())
            pushes = int(self.count.numpy())
            if pushes <= 0 or int(self.acc_step.numpy()) != step:
                return False
            queue = self.token_queue

            def flush():
                # The step's unused tokens go: the apply releases a step's.
                left = queue.dequeue_many(queue.size())
                with tf.control_dependencies([left]):
                    return self._apply(self.count.read_value(), pushes)

            def on_ps():  # the chief's function; each op where it lives
                with tf.device(self.device):
                    return self._cs.execute(flush)

            tf.function(on_ps, autograph=False)()
        self.recover()  # scale-out: the sealed step applied on every ps
        return True

    def _drain_sparse(self, count, pushes=None):
        """Dequeues the step's pushes of each sparse variable: their mean.

        Returns `(unique ids, mean rows)` per sparse variable: the rows'
        sums divided by `count` (`sparse_mean="pushes"`), or each by the
        number of pushes containing it (`"rows"`).

        An update happens when the count reaches `replicas_to_aggregate`:
        pushes are serialised and each adds exactly 1 (a discard resets the
        count to 0), so each queue holds exactly that many pushes here. They
        are dequeued one by one and concatenated once: a `tf.while_loop` of
        dequeues over the count, concatenating as it went, would copy the
        rows again at each push. `pushes` (a Python int) is the count when
        it is known to be another (`flush`).
        """
        if pushes is None:
            pushes = self.config.replicas_to_aggregate
        grads = []
        for slot in self._layout.sparse:
            parts = [slot.queue.dequeue() for _ in range(pushes)]
            indices = tf.concat([idx for idx, _ in parts], 0)
            values = tf.concat([val for _, val in parts], 0)
            if self._sparse_mean == "rows":
                grads.append(wire_lib.row_mean(indices, values))
                continue
            unique, total = wire_lib.dedup(tf.IndexedSlices(values, indices))
            grads.append((unique, total / tf.cast(count, total.dtype)))
        return grads

    def _apply(self, count, pushes=None):
        """Applies the mean of the accumulated gradients; releases tokens.

        Scale-out: every share is staged, so it only seals the step
        (`ScaleOut.seal`); returns the seal id. `pushes`: the Python int
        count of a `flush`, else None."""
        if self._scale_out is not None:
            return self._scale_out.seal()
        layout = self._layout
        grads_and_vars = []
        for group in layout.dense:
            n = tf.cast(count, group.dtype)
            flat = group.buffer.read_value() / n
            for var, part in zip(group.variables, tf.split(flat, group.sizes)):
                if var.shape.rank != 1:  # a split's part has rank 1
                    part = tf.reshape(part, var.shape)
                grads_and_vars.append((part, var))
        drained = self._drain_sparse(count, pushes)
        for slot, (idx, val) in zip(layout.sparse, drained):
            grads_and_vars.append(
                (
                    tf.IndexedSlices(
                        # Static: tf.shape(variable) would read the whole
                        # table on the ps, every step.
                        val,
                        idx,
                        tf.constant(slot.variable.shape.as_list(), tf.int64),
                    ),
                    slot.variable,
                )
            )
        with step_context.sync_apply_scope():
            applied = self._apply_fn(grads_and_vars)
        return self._end_step(applied, True)

    def apply_share(self, grads_and_vars):
        """Scale-out: applies one ps's share of an update, leaving the step
        to the finalize (`ScaleOut`)."""
        with step_context.sync_apply_scope():
            return self._apply_fn(grads_and_vars, increment=False)

    def _reset_buffers(self):
        return [
            g.buffer.assign(tf.zeros_like(g.buffer), read_value=False)
            for g in self._layout.dense
            if g.buffer is not None
        ]

    def _end_step(self, applied, reset_buffers):
        """After `applied` (the update, the step incremented): the hooks,
        the resets and the next step's tokens; returns True."""
        with step_context.sync_apply_scope():
            with tf.control_dependencies([applied]):
                hooks = [op for hook in self.after_apply for op in hook()]
            if hooks:
                with tf.control_dependencies(hooks):
                    applied = tf.identity(self._step())
        with tf.control_dependencies([applied]):
            resets = self._reset_buffers() if reset_buffers else []
            resets.append(self.count.assign(0, read_value=False))
            new_step = self._step()
            resets.append(self.acc_step.assign(new_step, read_value=False))
        with tf.control_dependencies(resets):
            release = self.barrier.release(
                self.config.tokens_per_step, new_step
            )
        with tf.control_dependencies([release]):
            return tf.constant(True)
