"""Staging: a push's gradients wait on their own ps until a commit decides.

With variables on several parameter servers, a push no longer carries the
gradients of every ps into one critical section. It *stages* them first on
each ps that holds variables (one queue per ps, no lock: an enqueue), and
only then commits on the global step's ps (`scale_out.ScaleOut`). The ps
of a sealed step later *drains* its queue once: it keeps the entries whose
push id the commit admitted and drops every other (stale, non-finite, over
the plan, or a push whose worker died before its commit).
"""

from __future__ import annotations

import tensorflow as tf

from tf2sync._src import wire as wire_lib


class Staging:
    """The staging queue of one parameter server, and what drains it.

    An entry is `(push id, one packed tensor per dense group of this ps,
    (int64 ids, rows) per sparse variable of this ps)`. Entries are only
    enqueued by pushes (`stage`) and only dequeued by the apply of a sealed
    step (`drain`), which runs inside this ps's critical section (`cs`) and
    at most once per seal (`last_seal`).
    """

    def __init__(self, device, dense, sparse, name):
        """Creates the queue, the section and the seal marker eagerly.

        Args:
          device: The ps.
          dense: The `wire.DenseGroup`s of variables on `device`.
          sparse: The `wire.SparseSlot`s of variables on `device`.
          name: Prefix of what is created.
        """
        self.device = device
        self.dense = list(dense)
        self.sparse = list(sparse)
        dtypes = [tf.int64] + [g.dtype for g in self.dense]
        for slot in self.sparse:
            dtypes += [tf.int64, slot.variable.dtype.base_dtype]
        with tf.init_scope(), tf.device(device):
            self.queue = tf.queue.FIFOQueue(
                capacity=-1, dtypes=dtypes, name=name + "_stage"
            )
            self.cs = tf.CriticalSection(name=name + "_apply_cs")
        # The last seal applied here: a seal id is applied iff it is newer.
        self.last_seal = wire_lib.ps_variable(
            tf.constant(0, tf.int64), device, name + "_last_seal"
        )

    def stage(self, push_id, packed, sparse, check_finite):
        """Enqueues one push's share here; returns whether it is finite.

        Traced on this ps. `packed` are the dense groups' tensors and
        `sparse` the `(ids, rows)` pairs, in this staging's order.
        """
        parts = [push_id] + list(packed)
        for ids, rows in sparse:
            parts += [ids, rows]
        enqueue = self.queue.enqueue(parts)
        if check_finite:
            sums = [tf.reduce_sum(tf.cast(p, tf.float32)) for p in packed]
            sums += [tf.reduce_sum(tf.cast(v, tf.float32)) for _, v in sparse]
            finite = tf.math.is_finite(tf.add_n(sums))
        else:
            finite = tf.constant(True)
        with tf.control_dependencies([enqueue]):
            return tf.identity(finite)

    def drain(self, admitted, count, expected):
        """Dequeues every entry staged so far; sums the admitted ones.

        Traced on this ps, inside `cs`. Every admitted push staged here
        before its commit, and the commit sealed the step before this
        runs, so all `count` of them are among the entries present.

        Args:
          admitted: int64 `[N]` push ids, the first `count` admitted.
          count: int64 scalar, the pushes admitted.
          expected: The usual `count` (a Python int, `N`). When exactly
            that many entries wait, all admitted (no push was dropped
            since the last drain), they are dequeued as a group; else one
            by one in a loop (several times slower per entry).

        Returns:
          `(dense sums per group, (ids, rows) per sparse variable)`: the
          admitted entries' dense sums and their sparse rows concatenated
          (duplicates not yet summed).
        """
        size = self.queue.size()
        ids = admitted[: tf.cast(count, tf.int32)]
        usual = tf.logical_and(
            tf.equal(size, expected), tf.equal(count, expected)
        )
        # The loop in a function of its own: in the function of the apply,
        # its mere presence, not taken, cost a fifth of w3's throughput.
        loop = tf.function(
            self._drain_loop,
            autograph=False,
            experimental_attributes={"_noinline": True},
        )
        return tf.cond(
            usual,
            lambda: self._drain_group(ids, expected),
            lambda: loop(ids, count, size),
        )

    def _check(self, kept, count, values):
        check = tf.debugging.assert_equal(
            tf.cast(kept, tf.int64),
            tf.cast(count, tf.int64),
            message="tf2sync: an admitted push was not staged on "
            + self.device,
        )
        with tf.control_dependencies([check]):
            return tf.nest.map_structure(tf.identity, values)

    def _drain_group(self, ids, expected):
        entries = [_listed(self.queue.dequeue()) for _ in range(expected)]
        kept = tf.add_n(
            [
                tf.cast(tf.reduce_any(tf.equal(ids, e[0])), tf.int32)
                for e in entries
            ]
        )
        d = len(self.dense)
        sums = [
            tf.add_n([tf.reshape(e[1 + i], [sum(g.sizes)]) for e in entries])
            for i, g in enumerate(self.dense)
        ]
        rows = [
            (
                tf.concat([e[1 + d + 2 * k] for e in entries], 0),
                tf.concat([e[2 + d + 2 * k] for e in entries], 0),
            )
            for k in range(len(self.sparse))
        ]
        return self._check(kept, expected, (sums, rows))

    def _drain_loop(self, ids, count, size):
        sums = [tf.zeros([sum(g.sizes)], g.dtype) for g in self.dense]
        arrays = []
        for slot in self.sparse:
            tail = slot.variable.shape[1:]
            arrays += [
                tf.TensorArray(
                    tf.int64,
                    size=size,
                    infer_shape=False,
                    element_shape=tf.TensorShape([None]),
                ),
                tf.TensorArray(
                    slot.variable.dtype.base_dtype,
                    size=size,
                    infer_shape=False,
                    element_shape=tf.TensorShape([None]).concatenate(tail),
                ),
            ]

        def body(i, kept, sums, arrays):
            entry = _listed(self.queue.dequeue())
            keep = tf.reduce_any(tf.equal(ids, entry[0]))
            d = len(self.dense)
            sums = [
                tf.where(keep, s + tf.reshape(p, s.shape), s)
                for s, p in zip(sums, entry[1 : 1 + d])
            ]
            written = []
            for array, part in zip(arrays, entry[1 + d :]):
                # A dropped entry adds no rows (its values may be NaN).
                rows = tf.shape(part)[0] * tf.cast(keep, tf.int32)
                written.append(array.write(i, part[:rows]))
            kept += tf.cast(keep, tf.int32)
            return i + 1, kept, sums, written

        _, kept, sums, arrays = tf.while_loop(
            lambda i, *_: i < size,
            body,
            [tf.constant(0, tf.int32), tf.constant(0, tf.int32), sums, arrays],
        )
        rows = [
            (arrays[2 * k].concat(), arrays[2 * k + 1].concat())
            for k in range(len(self.sparse))
        ]
        return self._check(kept, count, (sums, rows))


def _listed(entry):
    return list(entry) if isinstance(entry, (list, tuple)) else [entry]
