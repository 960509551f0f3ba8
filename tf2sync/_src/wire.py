"""How one replica's gradients travel to the parameter servers.

`Layout` fixes, once and eagerly, how a set of variables' gradients is
packed: dense gradients per (ps, dtype) into one accumulator buffer each,
sparse ones (`IndexedSlices`) into a queue of `(indices, values)` pushes per
variable. `Wire` packs what one push sends to the critical section's ps into
one float32 tensor and unpacks it there. `dedup` sums duplicate rows.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import tensorflow as tf

from tf2sync._src.internals import ps_variables


def ps_variable(initial_value, device, name, dtype=None):
    """A plain resource variable on `device`, outside any strategy creator."""
    return ps_variables.plain_resource_variable(
        initial_value, name, dtype, device=device
    )


@dataclasses.dataclass
class DenseGroup:
    """Dense gradients of the variables on one ps with one dtype, packed."""

    device: str
    dtype: tf.DType
    variables: list
    sizes: list
    buffer: tf.Variable


@dataclasses.dataclass
class SparseSlot:
    """Sparse gradients of one variable: a queue of (indices, values)."""

    variable: object
    queue: tf.queue.FIFOQueue


class Layout:
    """How one set of variables' gradients is packed; built once, eagerly.

    With `staged`, no variable gets an accumulator (`buffer` and `queue`
    are None): every gradient is staged on its ps instead (`tf2sync._src.
    sync.staging`).
    """

    def __init__(self, grads_and_vars, name, staged=False):
        self.keys = [variable_key(v) for _, v in grads_and_vars]
        self.sparse_keys = frozenset(
            variable_key(v)
            for g, v in grads_and_vars
            if isinstance(g, tf.IndexedSlices)
        )
        groups = collections.OrderedDict()
        self.sparse = []
        for g, v in grads_and_vars:
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                queue = None
                if not staged:
                    with tf.init_scope(), tf.device(v.device):
                        queue = tf.queue.FIFOQueue(
                            capacity=-1,
                            dtypes=[tf.int64, v.dtype.base_dtype],
                            name=f"{name}_sparse",
                        )
                self.sparse.append(SparseSlot(v, queue))
            else:
                key = (v.device, v.dtype.base_dtype)
                groups.setdefault(key, []).append(v)
        self.dense = []
        for (device, dtype), variables in groups.items():
            sizes = [int(np.prod(v.shape.as_list())) for v in variables]
            buffer = None
            if not staged:
                with tf.init_scope(), tf.device(device):  # made there
                    zeros = tf.zeros([sum(sizes)], dtype)
                buffer = ps_variable(zeros, device, f"{name}_acc")
            self.dense.append(
                DenseGroup(device, dtype, variables, sizes, buffer)
            )

    def matches(self, grads_and_vars) -> bool:
        return [variable_key(v) for _, v in grads_and_vars] == self.keys and (
            frozenset(
                variable_key(v)
                for g, v in grads_and_vars
                if isinstance(g, tf.IndexedSlices)
            )
            == self.sparse_keys
        )


def variable_key(variable):
    """Variables are told apart by identity, never by name."""
    return id(variable)


class Wire:
    """One float32 tensor carries a push to the critical section's ps.

    Each tensor that crosses from a worker to a ps is a transfer of its own,
    and on small models the transfers are most of a step. Everything bound
    for the ps of the critical section travels in one float32 tensor:
    `[rows per sparse gradient | dense float32 gradients | worker index |
    per sparse gradient: its int64 row ids bit-cast to float32 pairs, then
    its values | riders]`. Bit casts and slices copy bits, so ids arrive
    exact (they never enter arithmetic: the finiteness check sums the
    unpacked values only). Gradients of other dtypes, or for variables on
    other ps tasks, travel as before. Riders are other float32 values of the
    step bound for this ps (see `graph_rewrites.riders`): last, at static
    offsets from the end, so `unpack` ignores them. They travel only when
    the wire does.
    """

    DTYPE = tf.float32

    def __init__(self, device, layout, packed, sparse, worker, riders=()):
        # Staged gradients (no accumulator here) travel to their stage.
        self._dense = [
            i
            for i, g in enumerate(layout.dense)
            if g.device == device
            and g.dtype == self.DTYPE
            and g.buffer is not None
        ]
        self._sparse = [
            i
            for i, slot in enumerate(layout.sparse)
            if slot.variable.device == device
            and slot.variable.dtype.base_dtype == self.DTYPE
            and slot.queue is not None
        ]
        self._layout = layout
        self._packed = packed
        self._sparse_in = sparse
        self._worker = worker
        self.has_worker = worker is not None
        self._device = device
        self.tensor = None
        # The worker index alone gains nothing, and riders need a wire.
        carries = bool(self._dense or self._sparse)
        self._riders = list(riders) if carries else []
        if not carries:
            return
        parts = []
        if self._sparse:
            parts.append(
                tf.cast(
                    tf.stack([tf.size(sparse[i][0]) for i in self._sparse]),
                    self.DTYPE,
                )
            )
        parts += [packed[i] for i in self._dense]
        if worker is not None:
            parts.append(tf.cast(tf.reshape(worker, [1]), self.DTYPE))
        for i in self._sparse:
            ids, values = sparse[i]
            parts.append(tf.reshape(tf.bitcast(ids, self.DTYPE), [-1]))
            parts.append(tf.reshape(values, [-1]))
        parts += flatten(self._riders)
        self.tensor = tf.concat(parts, axis=0)

    def inputs(self):
        """What crosses to the ps: the wire, and what does not ride in it."""
        return {
            "tensor": self.tensor,
            "packed": [
                None if i in self._dense else p
                for i, p in enumerate(self._packed)
            ],
            "sparse": [
                None if i in self._sparse else p
                for i, p in enumerate(self._sparse_in)
            ],
            "worker": self._worker if self.tensor is None else None,
        }

    def riders(self, tensor):
        """The riders' values, sliced on the ps from the wire `tensor` there."""
        if not self._riders:
            return []
        sizes = [r.shape.num_elements() for r in self._riders]
        total = sum(sizes)
        with tf.device(self._device):
            # One slice and one split for all of them, not a slice each:
            # ResNet-50's 106 batch-norm statistics took 636 ops of the
            # ps's share of every step.
            pieces = tf.split(tensor[-total:] if total else tensor[:0], sizes)
            return [
                piece
                if rider.shape.rank == 1
                else tf.reshape(piece, rider.shape)
                for rider, piece in zip(self._riders, pieces)
            ]

    def unpack(self, tensor, packed, sparse, worker):
        """`{"packed", "sparse", "worker"}` as they arrived (on the ps)."""
        packed = list(packed)
        sparse = list(sparse)
        if tensor is None:
            return {"packed": packed, "sparse": sparse, "worker": worker}
        wire = tensor
        worker = self._worker
        offset = len(self._sparse)
        rows = tf.cast(tf.round(wire[:offset]), tf.int32)
        for i in self._dense:
            size = sum(self._layout.dense[i].sizes)
            packed[i] = wire[offset : offset + size]
            offset += size
        if worker is not None:
            worker = tf.cast(tf.round(wire[offset]), tf.int64)
            offset += 1
        at = tf.constant(offset, tf.int32)
        for j, i in enumerate(self._sparse):
            n = rows[j]
            tail = self._layout.sparse[i].variable.shape[1:].as_list()
            width = int(np.prod(tail))
            ids = tf.bitcast(
                tf.reshape(tf.slice(wire, [at], [2 * n]), [n, 2]), tf.int64
            )
            at += 2 * n
            values = tf.reshape(
                tf.slice(wire, [at], [n * width]),
                tf.concat([[n], tf.constant(tail, tf.int32)], axis=0),
            )
            at += n * width
            sparse[i] = (ids, values)
        return {"packed": packed, "sparse": sparse, "worker": worker}


def flatten(tensors) -> list:
    """`tensors`, each reshaped to one dimension where it has another rank.

    The reshapes share one shape constant: a model of hundreds of
    variables otherwise adds hundreds of ops to every step's graph, each
    traced, set up and run.
    """
    flat = []
    minus_one = None
    for t in tensors:
        if t.shape.rank != 1:
            if minus_one is None:
                minus_one = tf.constant([-1], tf.int32)
            t = tf.reshape(t, minus_one)
        flat.append(t)
    return flat


def dedup(grad):
    """Sums duplicate rows of an `IndexedSlices`; returns (indices, values)."""
    indices = tf.cast(grad.indices, tf.int64)
    unique, positions = tf.unique(indices)
    values = tf.math.unsorted_segment_sum(
        grad.values, positions, tf.shape(unique)[0]
    )
    return unique, values


def row_mean(indices, values):
    """TF1's sparse mean: each row's sum over the number of its pushes.

    `indices` concatenates several pushes, each with unique ids, so a row's
    count of occurrences is the number of pushes that contain it.
    """
    indices = tf.cast(indices, tf.int64)
    unique, positions = tf.unique(indices)
    n = tf.shape(unique)[0]
    total = tf.math.unsorted_segment_sum(values, positions, n)
    counts = tf.math.unsorted_segment_sum(
        tf.ones_like(positions, values.dtype), positions, n
    )
    counts = tf.reshape(
        counts, tf.concat([[n], tf.ones_like(tf.shape(total)[1:])], 0)
    )
    return unique, total / counts


def received(inputs, layout, device):
    """A push's `inputs`, each copied onto the ps that uses it.

    The critical section of an inlined push locks only after every input
    of its body has been computed: a control edge from each (a push
    function's call waits for its inputs as data). From a tensor on the
    worker, that edge is a second transfer besides the data's own; from a
    copy already on a ps it is not: one transfer fewer per step. Each copy
    sits where its data is used: the wire and the worker index on the
    critical section's ps (`device`), other gradients on their variables'
    ps.
    """

    def copy(value, where):
        if value is None:
            return None
        with tf.device(where):
            return tf.nest.map_structure(tf.identity, value)

    return {
        "tag": inputs["tag"],  # read on the critical section's ps
        "tensor": copy(inputs["tensor"], device),
        "packed": [
            copy(p, g.device) for p, g in zip(inputs["packed"], layout.dense)
        ],
        "sparse": [
            copy(p, slot.variable.device)
            for p, slot in zip(inputs["sparse"], layout.sparse)
        ],
        "worker": copy(inputs["worker"], device),
    }
