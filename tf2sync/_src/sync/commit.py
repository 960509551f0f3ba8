"""The commit: what the critical section decides for one push.

`CommitMixin` is part of `aggregation.Aggregator` (see that module for the
protocol): inside the section on the global step's ps, one switch picks
what a push does (stale, accumulated, non-finite, another step's leftovers
discarded first, over the plan), then one cond applies (one ps) or seals
the step (several ps, `sync.scale_out`).
"""

from __future__ import annotations

import tensorflow as tf

from tf2sync._src import step_context


class CommitMixin:
    """The critical section's body of `aggregation.Aggregator`."""

    def _push_body(self, wire, inputs, check_finite, stats):
        """The push on the ps, inside the critical section (taken around it
        by `push`, or inside the function of `_repeated_push_function`).

        One switch picks what the push does (it returns the pending count,
        -1 for a dropped push), then one cond applies: no nested conds
        (each level costs a measurable share of a small model's step), and
        the apply appears once in the graph (the ps instantiates each
        inlined copy for every worker).
        """
        arrived = wire.unpack(
            inputs["tensor"],
            inputs["packed"],
            inputs["sparse"],
            inputs["worker"],
        )
        scale_out = self._scale_out
        step = self._step()
        fresh = inputs["tag"] >= step
        same_step = tf.equal(self.acc_step.read_value(), step)
        ok = self._all_finite(arrived) if check_finite else tf.constant(True)
        if scale_out is not None:
            arrived["id"] = inputs["id"]
            # A sealed step admits no more: the ps may be mid-apply.
            fresh = tf.logical_and(fresh, tf.logical_not(scale_out.is_sealed()))
            ok = tf.logical_and(ok, inputs["ack"])
        # Past the plan, only a push that would complete an update drops.
        pending = tf.where(same_step, self.count.read_value(), 0)
        within = tf.logical_or(
            step < self.step_limit.read_value(),
            pending + 1 < self.config.replicas_to_aggregate,
        )
        branch = tf.where(
            within,
            tf.where(
                fresh,
                tf.where(ok, tf.where(same_step, 1, 3), 2),
                0,
            ),
            4,
        )
        count = tf.switch_case(
            branch,
            [
                lambda: self._reject(arrived),
                lambda: self._accumulate(arrived),
                self._drop_nonfinite,
                lambda: self._discard_then_accumulate(arrived),
                self._drop_over_plan,
            ],
        )
        applied = tf.cond(
            count >= self.config.replicas_to_aggregate,
            lambda: self._apply(count),
            lambda: (
                tf.constant(0, tf.int64) if scale_out else tf.constant(False)
            ),
        )
        if not stats:  # nobody reads them: no ps work per push
            read = tf.zeros([0], tf.float64)
        else:
            read = self._stats_after(applied)
        if scale_out is None:
            return applied, read
        # The seal (0: none), and what applying it needs.
        with tf.control_dependencies([applied]):
            return (
                tf.identity(applied),
                scale_out.admitted.read_value(),
                self.count.read_value(),
                read,
            )

    @staticmethod
    def _all_finite(arrived):
        """Whether every value that arrived is finite.

        A sum is non-finite iff a term is (or it overflows, which is worth
        dropping too); ids never enter it.
        """
        sums = [
            tf.reduce_sum(tf.cast(p, tf.float32))
            for p in arrived["packed"]
            if p is not None  # staged on its ps (scale-out)
        ]
        sums += [
            tf.reduce_sum(tf.cast(pair[1], tf.float32))
            for pair in arrived["sparse"]
            if pair is not None
        ]
        if not sums:
            return tf.constant(True)
        return tf.math.is_finite(tf.add_n(sums))

    def _accumulate(self, arrived):
        """Adds a fresh push to the accumulators; returns the new count."""
        layout = self._layout
        adds = [
            g.buffer.assign_add(p, read_value=False)
            for g, p in zip(layout.dense, arrived["packed"])
            if g.buffer is not None
        ]
        adds += [
            s.queue.enqueue(list(pair))
            for s, pair in zip(layout.sparse, arrived["sparse"])
            if s.queue is not None
        ]
        if self._scale_out is not None:
            adds.append(
                self._scale_out.admit(self.count.read_value(), arrived["id"])
            )
        with tf.control_dependencies(adds):
            self.accepted.assign_add(1, read_value=False)
            _count_worker(self.accepted_per_worker, arrived["worker"])
            return self.count.assign_add(1)

    def _discard_then_accumulate(self, arrived):
        # The accumulators hold pushes of another step (a checkpoint was
        # restored): drop them first. Rare.
        with tf.control_dependencies([self._discard(self._step())]):
            return self._accumulate(arrived)

    def _reject(self, arrived):
        """Drops and counts a stale push; returns -1."""
        with tf.control_dependencies(
            [
                self.stale_dropped.assign_add(1, read_value=False),
                _count_worker(self.stale_per_worker, arrived["worker"]),
            ]
        ):
            return tf.constant(-1, tf.int64)

    def _drop_nonfinite(self):
        """Drops and counts a non-finite push, gives its token back: -1."""
        with step_context.sync_apply_scope():
            ops = [
                self.nonfinite_dropped.assign_add(1, read_value=False),
                self.barrier.release(1),
            ] + [op for hook in self.on_nonfinite for op in hook()]
        with tf.control_dependencies(ops):
            return tf.constant(-1, tf.int64)

    def _drop_over_plan(self):
        """Drops and counts a push past the step limit, gives its token
        back (the steps still scheduled must not wait): -1."""
        ops = [
            self.over_plan.assign_add(1, read_value=False),
            self.barrier.release(1),
        ]
        with tf.control_dependencies(ops):
            return tf.constant(-1, tf.int64)

    def _discard(self, step):
        """Drops leftovers of another step (e.g. after a checkpoint restore)."""
        count = self.count.read_value()
        # Dequeue and drop: no concatenation or deduplication (this copy of
        # the loop is instantiated on the ps for every worker too).
        drained = [
            tf.while_loop(
                lambda i: i < count,
                lambda i, q=slot.queue: _after(q.dequeue(), i + 1),
                [tf.constant(0, tf.int64)],
            )
            for slot in self._layout.sparse
            if slot.queue is not None
        ]
        with tf.control_dependencies(drained):
            ops = self._reset_buffers()
            ops.append(self.stale_dropped.assign_add(count, read_value=False))
            # Each dropped push took a token its step will not get back
            # from an update: return them, or the barrier runs short.
            ops.append(self.barrier.release(count, step))
            ops.append(self.count.assign(0, read_value=False))
            ops.append(self.acc_step.assign(step, read_value=False))
        return tf.group(ops)


def _after(ops, value):
    """`value`, once `ops` ran."""
    with tf.control_dependencies(tf.nest.flatten(ops)):
        return tf.identity(value)


def _count_worker(counts, worker):
    """Adds 1 to `counts[worker]` (a no-op without a worker index)."""
    if worker is None:
        return tf.no_op()
    return counts.scatter_add(
        tf.IndexedSlices(
            tf.ones([1], tf.int64), tf.reshape(tf.cast(worker, tf.int64), [1])
        )
    )
