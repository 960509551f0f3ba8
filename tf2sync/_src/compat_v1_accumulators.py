"""The shim's accumulators: TF1's conditional accumulators with resource ops.

Dense gradients go through TF's own `ConditionalAccumulator` kernel (MEAN);
sparse ones through a queue and critical section with TF1's per-row mean
(`SparseConditionalAccumulator`, whose kernel is ref-typed only).
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops


def plain_variable(initial_value, device, name, dtype=None):
    """A resource variable on `device`, outside any strategy's creator."""
    with tf.init_scope(), tf.device(device):
        return resource_variable_ops.ResourceVariable(
            initial_value, trainable=False, name=name, dtype=dtype
        )


class DenseAccumulator:
    """TF's own `ConditionalAccumulator` kernel (MEAN) on the variable's ps."""

    def __init__(self, var, shared_name):
        self.var = var
        self.dtype = var.dtype.base_dtype
        with tf.init_scope(), tf.device(var.device):
            self.handle = tf.raw_ops.ResourceConditionalAccumulator(
                dtype=self.dtype,
                shape=var.shape,
                shared_name=shared_name,
                reduction_type="MEAN",
            )

    def apply(self, grad, local_step):
        with tf.device(self.var.device):
            return tf.raw_ops.ResourceAccumulatorApplyGradient(
                handle=self.handle,
                local_step=tf.cast(local_step, tf.int64),
                gradient=tf.convert_to_tensor(grad, self.dtype),
            )

    def take(self, num_required):
        with tf.device(self.var.device):
            return tf.raw_ops.ResourceAccumulatorTakeGradient(
                handle=self.handle,
                num_required=num_required,
                dtype=self.dtype,
            )

    def num_accumulated(self):
        """Gradients accepted since the last take."""
        with tf.device(self.var.device):
            return tf.raw_ops.ResourceAccumulatorNumAccumulated(
                handle=self.handle
            )

    def set_global_step(self, step):
        with tf.device(self.var.device):
            return tf.raw_ops.ResourceAccumulatorSetGlobalStep(
                handle=self.handle,
                new_global_step=tf.cast(step, tf.int64),
            )

    def unblock(self, num):
        """Pushes `num` zero gradients that any accumulator step accepts."""
        for _ in range(num):
            self.apply(tf.zeros(self.var.shape, self.dtype), tf.int64.max)


class SparseAccumulator:
    """TF1's `SparseConditionalAccumulator` semantics, with resource ops.

    The sparse kernel is ref-typed only, so this keeps a queue of
    `(indices, values)` pushes on the variable's ps, an accumulator step and
    a critical section: a push is accepted iff its local step is at least
    the accumulator step; a take waits for `num_required` pushes, also takes
    any that arrived since, bumps the accumulator step and returns the
    per-row mean (each row divided by the number of pushes containing it;
    rows are deduplicated inside a push first).
    """

    def __init__(self, var, name):
        self.var = var
        self.dtype = var.dtype.base_dtype
        with tf.init_scope(), tf.device(var.device):
            self.queue = tf.queue.FIFOQueue(
                capacity=-1,
                dtypes=[tf.int64, self.dtype],
                name=f"{name}_sparse_q",
            )
            self.section = tf.CriticalSection(name=f"{name}_sparse_cs")
        self.step = plain_variable(
            tf.constant(0, tf.int64), var.device, f"{name}_sparse_step"
        )

    def apply(self, grad, local_step):
        indices = tf.cast(grad.indices, tf.int64)
        values = tf.convert_to_tensor(grad.values, self.dtype)
        unique, position = tf.unique(indices)
        summed = tf.math.unsorted_segment_sum(values, position, tf.size(unique))
        local_step = tf.cast(local_step, tf.int64)

        def push():
            def enqueue():
                with tf.control_dependencies(
                    [self.queue.enqueue([unique, summed])]
                ):
                    return tf.constant(True)

            return tf.cond(
                local_step >= self.step.read_value(),
                enqueue,
                lambda: tf.constant(False),
            )

        with tf.device(self.var.device):
            return self.section.execute(push)

    def take(self, num_required):
        with tf.device(self.var.device):
            first = [self.queue.dequeue() for _ in range(num_required)]

            def drain():
                n = self.queue.size()

                def body(i, idx, vals):
                    pi, pv = self.queue.dequeue()
                    return i + 1, idx.write(i, pi), vals.write(i, pv)

                idx = tf.TensorArray(
                    tf.int64,
                    size=0,
                    dynamic_size=True,
                    infer_shape=False,
                    element_shape=tf.TensorShape([None]),
                )
                vals = tf.TensorArray(
                    self.dtype,
                    size=0,
                    dynamic_size=True,
                    infer_shape=False,
                    element_shape=tf.TensorShape([None]).concatenate(
                        self.var.shape[1:]
                    ),
                )
                _, idx, vals = tf.while_loop(
                    lambda i, *_: i < n, body, [0, idx, vals]
                )
                with tf.control_dependencies(
                    [self.step.assign_add(1, read_value=False)]
                ):
                    return (
                        tf.identity(idx.concat()),
                        tf.identity(vals.concat()),
                    )

            with tf.control_dependencies([t for pair in first for t in pair]):
                more_idx, more_vals = self.section.execute(drain)
            indices = tf.concat([p[0] for p in first] + [more_idx], 0)
            values = tf.concat([p[1] for p in first] + [more_vals], 0)
            unique, position = tf.unique(indices)
            n = tf.size(unique)
            total = tf.math.unsorted_segment_sum(values, position, n)
            count = tf.math.unsorted_segment_sum(
                tf.ones_like(position, self.dtype), position, n
            )
            count = tf.reshape(
                count, tf.concat([[n], tf.ones_like(tf.shape(total)[1:])], 0)
            )
            return tf.IndexedSlices(
                total / count, unique, tf.constant(self.var.shape.as_list())
            )

    def num_accumulated(self):
        """Pushes accepted since the last take."""
        with tf.device(self.var.device):
            return self.queue.size()

    def set_global_step(self, step):
        return self.step.assign(tf.cast(step, tf.int64), read_value=False)

    def unblock(self, num):
        empty_i = tf.zeros([0], tf.int64)
        empty_v = tf.zeros([0] + self.var.shape.as_list()[1:], self.dtype)
        for _ in range(num):
            self.queue.enqueue([empty_i, empty_v])
