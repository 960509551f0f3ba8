"""Synchronous aggregation over several parameter servers: stage, commit,
apply.

Where a synchronous optimizer's variables live on more than one ps, a push
holds no lock while it touches another ps. With `H` the ps of the global
step `g` (the *home* ps), `N = replicas_to_aggregate`:

1. **Stage.** The push draws a random 62-bit push id on its worker (a
   function that runs again draws a new one) and enqueues, on every ps
   holding gradients (`H` included), its share there under that id
   (`staging.Staging.stage`): one call per ps, side by side, no lock. Each
   answers whether its share is finite.
2. **Commit.** One call on `H`, inside `H`'s critical section, by the
   one-ps protocol's rules (`aggregation`), with no gradient: the push is
   admitted iff its tag equals `g`, the step is not sealed, every share is
   finite and the plan allows it. Admitted ids are recorded in order
   (`admitted[count]`). The `N`-th admission *seals* the step: it marks
   the step sealed with a seal id, drawn from
   a counter that only grows (it starts at the wall clock's microseconds).
   While sealed, every push is dropped as stale: it may have read a ps
   halfway through its apply.
3. **Apply.** The push that sealed, outside `H`'s section, calls on each
   other ps `apply_staged`: inside that ps's own section, iff the seal id
   is newer than the last one applied there, it drains its staging queue,
   keeps the admitted ids' entries, applies their mean with the optimizer
   (whose `iterations` still reads `g`), and records the seal. Then
   **finalize**, on `H` inside its section, iff the step is still sealed
   with that id: applies `H`'s own share the same way (`H`'s section
   orders it, no seal marker needed), increments `g` (the optimizer's
   `iterations`) by 1, runs
   the hooks (EMA, loss scale), clears the seal and releases the next
   step's tokens.

Guarantees: each update is applied exactly once on every ps (only `H`'s
section admits and seals; each ps applies a seal at most once and in
order, since seal ids grow and the next step's tokens come only after the
finalize), and `g` rises by 1 per update (finalize is conditional on the
seal). A stale gradient is never applied, and an admitted push read every
ps as of step `g` (weights change only after the seal, which admits no
more). A worker dying between stage and commit leaves an entry no commit
admits, dropped by the next drain. One dying between the seal and the
finalize leaves the step sealed: `recover` (the chief's watchdog) applies
it; both may run, each ps applies once. Pushes cross to each ps once and
take `H`'s section for O(1) work, whatever the number of ps.
"""

from __future__ import annotations

import time

import tensorflow as tf

from tf2sync._src import wire as wire_lib
from tf2sync._src.sync import local_apply
from tf2sync._src.sync import staging as staging_lib

# Push ids are drawn in [1, 2**62): 0 marks no push.
_MAX_ID = 2**62


def same_device(a, b) -> bool:
    return tf.DeviceSpec.from_string(a) == tf.DeviceSpec.from_string(b)


class ScaleOut:
    """The state and the steps of the protocol above, for one aggregator.

    Created eagerly by `aggregation.Aggregator.build` when its layout puts
    gradients on a ps other than the global step's.
    """

    def __init__(self, aggregator, layout, name):
        self._agg = aggregator
        self.home = aggregator.device
        by_device = {}  # every share is staged (`wire.Layout(staged=True)`)
        for index, group in enumerate(layout.dense):
            by_device.setdefault(group.device, ([], []))[0].append(index)
        for index, slot in enumerate(layout.sparse):
            device = slot.variable.device
            by_device.setdefault(device, ([], []))[1].append(index)
        self.stagings = []
        self._indices = []
        for k, (device, (dense, sparse)) in enumerate(
            sorted(by_device.items())
        ):
            self.stagings.append(
                staging_lib.Staging(
                    device,
                    [layout.dense[i] for i in dense],
                    [layout.sparse[i] for i in sparse],
                    f"{name}_{k}",
                )
            )
            self._indices.append((dense, sparse))
        # The global step's ps's own share: applied by the finalize.
        self.home_staging = None
        for st in self.stagings:
            if same_device(st.device, self.home):
                self.home_staging = st
        n = aggregator.config.replicas_to_aggregate
        home = self.home
        self.admitted = wire_lib.ps_variable(
            tf.zeros([n], tf.int64), home, name + "_admitted"
        )
        self.sealed = wire_lib.ps_variable(
            tf.constant(0, tf.int64), home, name + "_sealed"
        )
        self.seals = wire_lib.ps_variable(
            tf.constant(time.time_ns() // 1000, tf.int64), home, name + "_seals"
        )
        self._appliers = {}
        self._all_variables = [v for g in layout.dense for v in g.variables] + [
            s.variable for s in layout.sparse
        ]

    # Step side (traced) ---------------------------------------------------

    @staticmethod
    def new_push_id():
        """A fresh push id, drawn where the push runs.

        Seeded by the kernel itself, never by TF's global seed: under
        `tf.random.set_seed` (or `tf.keras.utils.set_random_seed`) every
        worker's copy of a function would draw the same sequence.
        """
        return tf.raw_ops.RandomUniformInt(
            shape=tf.constant([], tf.int32),
            minval=tf.constant(1, tf.int64),
            maxval=tf.constant(_MAX_ID, tf.int64),
            seed=0,
            seed2=0,
        )

    def stage(self, push_id, inputs, check_finite):
        """Stages the push's shares; returns its acknowledgement on `H`
        (whether every share is finite, known once all are staged)."""
        acks = []
        for st, (dense, sparse) in zip(self.stagings, self._indices):
            with tf.device(st.device):
                acks.append(
                    st.stage(
                        push_id,
                        [inputs["packed"][i] for i in dense],
                        [inputs["sparse"][i] for i in sparse],
                        check_finite,
                    )
                )
        with tf.device(self.home):
            return tf.reduce_all(tf.stack(acks))

    def admit(self, count, push_id):
        """Records `push_id` as the `count`-th admitted push (in `H`'s
        section, `count` before the increment)."""
        return self.admitted.scatter_nd_update(
            tf.reshape(count, [1, 1]), tf.reshape(push_id, [1])
        )

    def seal(self):
        """Seals the step (in `H`'s section): marks it sealed with a new
        seal id; returns the id."""
        seal = self.seals.assign_add(1)
        with tf.control_dependencies([self.sealed.assign(seal)]):
            return tf.identity(seal)

    def is_sealed(self):
        return tf.not_equal(self.sealed.read_value(), 0)

    def apply_staged(self, ticket, sparse_mean):
        """Applies the sealed step's mean on every other ps.

        `ticket`: int64 `[seal, count, admitted...]` from the commit (seal
        0: the push did not seal). Each ps in its own section, at most once
        per seal id (see the module docstring), outside `H`'s section.
        Each ps decides on its own whether to apply, from the ticket it is
        sent: a push that did not seal sends it and the apply's reads of
        `H`, and nothing else crosses. Returns one bool per ps.
        """
        done = []
        for k, st in enumerate(self.stagings):
            if st is self.home_staging:  # applied by the finalize
                continue
            apply = self._applier(k, st, sparse_mean)
            call = apply.prepare(ticket)
            values = apply.reads() if call else []
            with tf.device(st.device):
                # Received here first: the cond's switches and its
                # predicate then sit here too, and a dead branch sends
                # nothing across.
                here = tf.identity(ticket)
                values = [tf.identity(v) for v in values]

                def run(apply=apply, here=here, values=values, call=call):
                    if call:
                        return apply.call((here,), values)
                    return apply.inline(here)

                done.append(
                    tf.cond(here[0] > 0, run, lambda: tf.constant(False))
                )
        return done

    def _applier(self, k, st, sparse_mean):
        apply = self._appliers.get((k, sparse_mean))
        if apply is None:

            def body(ticket):
                seal, count, admitted = ticket[0], ticket[1], ticket[2:]
                return st.cs.execute(
                    lambda: self._apply_on(
                        st, admitted, count, seal, sparse_mean
                    ),
                    # It reads what `H`'s section holds too (the step,
                    # hyperparameters): the seal orders the two.
                    exclusive_resource_access=False,
                )

            apply = local_apply.LocalApply(
                st.device, body, self._agg.optimizer_variables
            )
            self._appliers[(k, sparse_mean)] = apply
        return apply

    def _apply_on(self, st, admitted, count, seal, sparse_mean):
        def run():
            with tf.control_dependencies(
                [self._apply_share(st, admitted, count, sparse_mean)]
            ):
                mark = st.last_seal.assign(seal, read_value=False)
            with tf.control_dependencies([mark]):
                return tf.constant(True)

        return tf.cond(
            seal > st.last_seal.read_value(), run, lambda: tf.constant(False)
        )

    def _apply_share(self, st, admitted, count, sparse_mean):
        """Drains `st` and applies the admitted pushes' mean; an op."""
        sums, rows = st.drain(
            admitted, count, self._agg.config.replicas_to_aggregate
        )
        grads_and_vars = []
        for group, total in zip(st.dense, sums):
            flat = total / tf.cast(count, group.dtype)
            for var, part in zip(group.variables, tf.split(flat, group.sizes)):
                if var.shape.rank != 1:
                    part = tf.reshape(part, var.shape)
                grads_and_vars.append((part, var))
        for slot, (ids, values) in zip(st.sparse, rows):
            if sparse_mean == "rows":
                unique, mean = wire_lib.row_mean(ids, values)
            else:
                unique, total = wire_lib.dedup(tf.IndexedSlices(values, ids))
                mean = total / tf.cast(count, total.dtype)
            shape = tf.constant(slot.variable.shape.as_list(), tf.int64)
            grads_and_vars.append(
                (tf.IndexedSlices(mean, unique, shape), slot.variable)
            )
        return self._agg.apply_share(grads_and_vars)

    def finalize(self, seal, admitted, count, sparse_mean, end_step):
        """Ends the sealed step (in `H`'s section) iff `seal` is still the
        seal: applies `H`'s own share (under `H`'s section, which orders
        it: it needs no seal marker), then `end_step()` (the increment,
        hooks, resets and tokens) and clears the seal. Returns whether it
        ended it."""

        def run():
            ops = []
            if self.home_staging is not None:
                ops.append(
                    self._apply_share(
                        self.home_staging, admitted, count, sparse_mean
                    )
                )
            with tf.control_dependencies(ops):
                ended = end_step()
            with tf.control_dependencies([ended]):
                clear = self.sealed.assign(0, read_value=False)
            with tf.control_dependencies([clear]):
                return tf.constant(True)

        return tf.cond(
            tf.equal(self.sealed.read_value(), seal),
            run,
            lambda: tf.constant(False),
        )

    @property
    def all_variables(self):
        return self._all_variables
