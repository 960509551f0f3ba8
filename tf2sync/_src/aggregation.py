"""Gradient aggregation on the parameter servers: tokens, staleness, apply.

The protocol, for one synchronous optimizer with global step `g` (its
`iterations` variable), `N = replicas_to_aggregate` and
`M = total_num_replicas`:

1. The chief enqueues `max(M, N)` tokens into a queue on `g`'s ps.
2. Each replica step dequeues one token, then reads `g` as its *tag*. Every
   model-variable read of the step is ordered after the tag read, so the
   gradient is computed from weights at least as new as step `tag`.
3. The replica packs its dense gradients into one tensor per (ps, dtype) and
   its sparse gradients into `(indices, values)` pairs as computed
   (duplicate rows are summed once, at the apply; all float32 ones bound
   for `g`'s ps travel as one tensor, see `_Wire`), and
   pushes them inside a `tf.CriticalSection` whose body runs on `g`'s ps:
   * `tag < g`: the gradient is stale (its weights are older than the
     current step). It is dropped and counted, never applied.
   * otherwise it is added to the accumulators (dense: one buffer per
     (ps, dtype); sparse: a queue per variable, so nothing of the
     embedding's dense size is held per step) and the count rises.
   * the push that brings the count to `N` applies the **mean** (sum divided
     by the number of gradients accumulated) through the inner optimizer,
     increments `g` by exactly 1, resets the accumulators and releases
     `max(M, N)` tokens.
4. A step that pushes nothing (evaluation) puts its token back.

Guarantees: each update is applied exactly once (the critical section
serialises pushes and only one push can bring the count to `N`); `g` rises
by exactly 1 per update; a gradient tagged with an older step is never
applied. Weights change only inside the apply, which ends with the `g`
increment, so a step whose tag equals `g` at push time read only weights of
step `g`.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from tf2sync._src import loops
from tf2sync._src import watchdog

_STATE = threading.local()


def in_sync_apply() -> bool:
    """True while tf2sync traces its own update of the model variables."""
    return getattr(_STATE, "apply_depth", 0) > 0


class _SyncApplyScope:
    def __enter__(self):
        _STATE.apply_depth = getattr(_STATE, "apply_depth", 0) + 1

    def __exit__(self, *exc):
        _STATE.apply_depth -= 1


def sync_apply_scope():
    """Marks traced variable updates as synchronous applies (see strategy)."""
    return _SyncApplyScope()


def _ps_variable(initial_value, device, name, dtype=None):
    """A plain resource variable on `device`, outside any strategy creator."""
    with tf.init_scope(), tf.device(device):
        return resource_variable_ops.ResourceVariable(
            initial_value, trainable=False, name=name, dtype=dtype
        )


@dataclasses.dataclass
class _DenseGroup:
    """Dense gradients of the variables on one ps with one dtype, packed."""

    device: str
    dtype: tf.DType
    variables: list
    sizes: list
    buffer: tf.Variable


@dataclasses.dataclass
class _SparseSlot:
    """Sparse gradients of one variable: a queue of (indices, values)."""

    variable: object
    queue: tf.queue.FIFOQueue


class _Layout:
    """How one set of variables' gradients is packed; built once, eagerly."""

    def __init__(self, grads_and_vars, name):
        self.keys = [_key(v) for _, v in grads_and_vars]
        self.sparse_keys = frozenset(
            _key(v)
            for g, v in grads_and_vars
            if isinstance(g, tf.IndexedSlices)
        )
        groups = collections.OrderedDict()
        self.sparse = []
        for g, v in grads_and_vars:
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                with tf.init_scope(), tf.device(v.device):
                    queue = tf.queue.FIFOQueue(
                        capacity=-1,
                        dtypes=[tf.int64, v.dtype.base_dtype],
                        name=f"{name}_sparse",
                    )
                self.sparse.append(_SparseSlot(v, queue))
            else:
                key = (v.device, v.dtype.base_dtype)
                groups.setdefault(key, []).append(v)
        self.dense = []
        for (device, dtype), variables in groups.items():
            sizes = [int(np.prod(v.shape.as_list())) for v in variables]
            buffer = _ps_variable(
                tf.zeros([sum(sizes)], dtype), device, f"{name}_acc"
            )
            self.dense.append(
                _DenseGroup(device, dtype, variables, sizes, buffer)
            )

    def matches(self, grads_and_vars) -> bool:
        return [_key(v) for _, v in grads_and_vars] == self.keys and (
            frozenset(
                _key(v)
                for g, v in grads_and_vars
                if isinstance(g, tf.IndexedSlices)
            )
            == self.sparse_keys
        )


def _key(variable):
    return id(variable)


class Aggregator:
    """Token barrier and accumulators of one synchronous optimizer.

    See the module docstring for the protocol. Created eagerly under the
    strategy scope; `push` and `acquire` are called while tracing steps.
    """

    def __init__(
        self, config, global_step, apply_fn, name="tf2sync", num_workers=1
    ):
        """Creates the token queue, counters and critical section eagerly.

        Args:
          config: A `SyncConfig`.
          global_step: The int64 step variable (the inner `iterations`).
          apply_fn: `apply_fn(grads_and_vars) -> op`: applies aggregated
            gradients once and increments `global_step` by 1.
          name: Prefix of the variables and queues created.
          num_workers: Workers in the cluster, for per-worker counts.
        """
        self.config = config
        self.global_step = global_step
        self.device = global_step.device
        self._apply_fn = apply_fn
        self._name = name
        self._layout = None
        self._push_functions = {}
        self._graphs_with_push = weakref.WeakSet()
        with tf.init_scope(), tf.device(self.device):
            self._tokens = tf.queue.FIFOQueue(
                capacity=-1, dtypes=[tf.int64], shapes=[[]], name=name + "_q"
            )
            self._cs = tf.CriticalSection(name=name + "_cs")
        self.count = _ps_variable(
            tf.constant(0, tf.int64), self.device, name + "_count"
        )
        self.acc_step = _ps_variable(
            tf.constant(0, tf.int64), self.device, name + "_acc_step"
        )
        self.stale_dropped = _ps_variable(
            tf.constant(0, tf.int64), self.device, name + "_stale"
        )
        self.accepted = _ps_variable(
            tf.constant(0, tf.int64), self.device, name + "_accepted"
        )
        self.nonfinite_dropped = _ps_variable(
            tf.constant(0, tf.int64), self.device, name + "_nonfinite"
        )
        self.wait_seconds = _ps_variable(
            tf.constant(0.0, tf.float64), self.device, name + "_wait"
        )
        self.num_workers = max(1, int(num_workers))
        self.accepted_per_worker = _ps_variable(
            tf.zeros([self.num_workers], tf.int64), self.device, name + "_wa"
        )
        self.stale_per_worker = _ps_variable(
            tf.zeros([self.num_workers], tf.int64), self.device, name + "_ws"
        )
        # Hooks run inside the critical section: callables returning ops.
        # `after_apply` runs after each update, before tokens are released
        # (loss scaling, EMA); `on_nonfinite` when a push is non-finite.
        self.after_apply = []
        self.on_nonfinite = []
        self.seed_tokens(config.tokens_per_step)

    # Coordinator side -----------------------------------------------------

    def seed_tokens(self, num_tokens: int) -> None:
        """Enqueues `num_tokens` tokens now (eagerly, from the coordinator)."""
        if num_tokens > 0:
            with tf.init_scope(), tf.device(self.device):
                self._tokens.enqueue_many(
                    tf.fill([num_tokens], tf.constant(0, tf.int64))
                )

    def tokens_available(self) -> int:
        with tf.init_scope(), tf.device(self.device):
            return int(self._tokens.size())

    def watch_state(self) -> watchdog.WatchState:
        """The `watchdog.WatchState` of this barrier, read eagerly."""
        step = int(self.global_step.numpy())
        return watchdog.WatchState(
            progress=(
                step,
                int(self.accepted.numpy()),
                int(self.stale_dropped.numpy()),
            ),
            step=step,
            tokens=self.tokens_available(),
            pending=int(self.count.numpy()),
            required=self.config.replicas_to_aggregate,
        )

    def build(self, grads_and_vars) -> None:
        """Creates the accumulators for these gradient types, eagerly."""
        if self._layout is None:
            with tf.init_scope():  # eagerly, even when called while tracing
                self._layout = _Layout(grads_and_vars, self._name)
        elif not self._layout.matches(grads_and_vars):
            raise ValueError(
                "SyncOptimizer was built for another list of variables (or "
                "other dense/sparse gradient types). A synchronous optimizer "
                "must update the same variables with the same gradient types "
                "every step. Received variables: "
                f"{[v.name for _, v in grads_and_vars]}"
            )

    # Step side (traced) ---------------------------------------------------

    def acquire(self):
        """Dequeues one token; returns the tag (global step read after it).

        The wait for the token is timed and added to `wait_seconds` on the
        ps.
        """
        # Timed and counted on the ps: no worker<->ps edge but the tag's.
        with tf.device(self.device):
            start = tf.timestamp()
            with tf.control_dependencies([start]):
                token = self._tokens.dequeue()
            with tf.control_dependencies([token]):
                tag = tf.identity(self.global_step.read_value())
                waited = tf.timestamp() - start
            count = self.wait_seconds.assign_add(waited, read_value=False)
            with tf.control_dependencies([count]):
                return tf.identity(tag)

    def metrics_from(self, stats):
        """The sync metrics of the logs, from the counters a push returned."""
        values = tf.unstack(stats)
        counts = [tf.cast(v, tf.int64) for v in values[:-1]]
        n = self.num_workers
        metrics = {
            "sync_steps": counts[0],
            "stale_dropped": counts[1],
            "nonfinite_dropped": counts[2],
            "barrier_wait_s": values[-1],
        }
        for i in range(n):
            metrics[f"accepted_w{i}"] = counts[3 + i]
            metrics[f"stale_w{i}"] = counts[3 + n + i]
        return metrics

    def give_back(self, after):
        """Returns one token after `after` (a step that pushed nothing)."""
        with tf.control_dependencies(after), tf.device(self.device):
            return self._tokens.enqueue(tf.constant(0, tf.int64))

    def push(
        self,
        tag,
        grads_and_vars,
        check_finite=False,
        worker=None,
        stats=True,
        riders_from=None,
    ):
        """Pushes one replica's gradients.

        Returns `(applied, stats)`: True iff this push completed a step;
        then, read on the ps right after it, one float64 vector of the
        counters `[global step, stale, non-finite, accepted per worker...,
        stale per worker..., total barrier wait]`. It rides back with the
        push's answer, so the logs cost no extra round trip.

        Args:
          tag: The step tag from `acquire`.
          grads_and_vars: This replica's `(gradient, variable)` pairs.
          check_finite: Whether the ps checks what arrived (no extra
            tensor crosses to it): a non-finite push is dropped and counted,
            its token given back for another replica.
          worker: Optional int64 index of the pushing worker, for the
            per-worker counts.
          stats: Whether to read the counters for the caller (`model.fit`'s
            logs); otherwise `stats` is empty.
          riders_from: Optional index of the step's first op in the current
            graph. The step's writes of float32 values computed on the worker
            to variables on this ps (a compiled metric's total and count)
            then take their values from the push's tensor on the ps instead
            of crossing as transfers of their own (see `_riders`).
        """
        riders = []
        if riders_from is not None:  # before the push adds ops of its own
            graph = tf.compat.v1.get_default_graph()
            riders = _riders(graph, riders_from, self.device)
        self.build(grads_and_vars)
        layout = self._layout
        by_key = {_key(v): g for g, v in grads_and_vars}
        packed = [
            tf.concat(
                [
                    tf.reshape(tf.convert_to_tensor(by_key[_key(v)]), [-1])
                    for v in group.variables
                ],
                axis=0,
            )
            for group in layout.dense
        ]
        # Rows go as computed, duplicates included (as TF1's accumulator and
        # stock PSS take them): the apply sums duplicates once over all the
        # pushes. Summing them here too cost the w3 loop 12-18 % more CPU
        # per example for ~1 % fewer rows.
        sparse = [
            (tf.cast(g.indices, tf.int64), g.values)
            for g in (by_key[_key(s.variable)] for s in layout.sparse)
        ]
        if riders:  # a write the gradients wait for cannot wait for them
            ahead = _among_ancestors(
                riders, packed + [t for pair in sparse for t in pair]
            )
            riders = [op for op in riders if op not in ahead]
        wire = _Wire(
            self.device,
            layout,
            packed,
            sparse,
            worker,
            [op.inputs[1] for op in riders],
        )
        inputs = self._received({"tag": tag, **wire.inputs()})
        for op, value in zip(riders, wire.riders(inputs["tensor"])):
            op._update_input(1, value)
        function = self._repeated_push_function(
            wire, inputs, check_finite, stats
        )
        with tf.device(self.device):
            if function is not None:
                return self._cs.execute(lambda: function(inputs))
            return self._cs.execute(
                lambda: self._push_body(wire, inputs, check_finite, stats)
            )

    def _received(self, inputs):
        """`inputs`, each copied onto the ps that uses it, before the push.

        The critical section locks only after every input of its body has
        been computed: a control edge from each. From a tensor on the
        worker, that edge is a second transfer besides the data's own; from
        a copy already on a ps it is not (w3 in-process: one transfer fewer
        per step, and 1.12-1.14 x examples/s on w1). Each copy sits where
        its data is used: the wire and the worker index on the critical
        section's ps, other gradients on their variables' ps.
        """
        layout = self._layout

        def copy(value, device):
            if value is None:
                return None
            with tf.device(device):
                return tf.nest.map_structure(tf.identity, value)

        return {
            "tag": inputs["tag"],  # read on this ps
            "tensor": copy(inputs["tensor"], self.device),
            "packed": [
                copy(p, g.device)
                for p, g in zip(inputs["packed"], layout.dense)
            ],
            "sparse": [
                copy(p, slot.variable.device)
                for p, slot in zip(inputs["sparse"], layout.sparse)
            ],
            "worker": copy(inputs["worker"], self.device),
        }

    def _repeated_push_function(self, wire, inputs, check_finite, stats):
        """The push as one function of the ps, where the step repeats.

        A function that repeats the step (an unrolled loop) would otherwise
        hold a copy of the push and its apply per step, and the ps
        instantiates each copy for every worker: ~2 MB each on W3. Inside
        `loops.repeat` (Trainer's and fit's default) every push is one
        function called, not inlined, so the ps holds it once per worker;
        elsewhere, from the second push traced into one graph on. A lone
        push stays inline: in a `tf.while_loop` of single steps the call
        cost 3-5 % more CPU per example on w1 (in-process), while among
        repeated copies it measured the same. A push whose accumulators or
        hooks live on another device stays inline too (the call would be a
        multi-device function of its own). Returns None where the push is
        inlined.
        """
        graph = tf.compat.v1.get_default_graph()
        if graph not in self._graphs_with_push:
            self._graphs_with_push.add(graph)
            if not loops.repeating():
                return None
        key = (
            check_finite,
            stats,
            wire.tensor is None,
            wire.has_worker,
        )
        if key not in self._push_functions:
            function = tf.function(
                lambda args: self._push_body(wire, args, check_finite, stats),
                autograph=False,
                experimental_attributes={"_noinline": True},
            )
            with tf.device(self.device):
                concrete = function.get_concrete_function(inputs)
            here = tf.DeviceSpec.from_string(self.device)
            local = all(
                tf.DeviceSpec.from_string(t.device) == here
                for t in concrete.captured_inputs
                if getattr(t, "device", "")
            )
            self._push_functions[key] = function if local else None
        return self._push_functions[key]

    def _push_body(self, wire, inputs, check_finite, stats):
        """The push on the ps, inside the critical section (see `push`)."""
        layout = self._layout
        tag = inputs["tag"]
        arrived = wire.unpack(
            inputs["tensor"],
            inputs["packed"],
            inputs["sparse"],
            inputs["worker"],
        )

        def accumulate():
            adds = [
                g.buffer.assign_add(p, read_value=False)
                for g, p in zip(layout.dense, arrived["packed"])
            ]
            adds += [
                s.queue.enqueue([idx, val])
                for s, (idx, val) in zip(layout.sparse, arrived["sparse"])
            ]
            with tf.control_dependencies(adds):
                self.accepted.assign_add(1, read_value=False)
                _count_worker(self.accepted_per_worker, arrived["worker"])
                return self.count.assign_add(1)

        def discard_then_accumulate():
            # The accumulators hold pushes of another step (a checkpoint
            # was restored): drop them first. Rare.
            with tf.control_dependencies(
                [self._discard(self.global_step.read_value())]
            ):
                return accumulate()

        def reject():
            with tf.control_dependencies(
                [
                    self.stale_dropped.assign_add(1, read_value=False),
                    _count_worker(self.stale_per_worker, arrived["worker"]),
                ]
            ):
                return tf.constant(-1, tf.int64)

        def nonfinite():
            with _SyncApplyScope():
                ops = [
                    self.nonfinite_dropped.assign_add(1, read_value=False),
                    self._tokens.enqueue(tf.constant(0, tf.int64)),
                ] + [op for hook in self.on_nonfinite for op in hook()]
            with tf.control_dependencies(ops):
                return tf.constant(-1, tf.int64)

        def body():
            # One switch picks what the push does (it returns the pending
            # count, -1 for a dropped push), then one cond applies: no
            # nested conds (each level costs a measurable share of a small
            # model's step), and the apply appears once in the graph (each
            # inlined copy costs the ps ~2 MB per worker on W3).
            step = self.global_step.read_value()
            fresh = tag >= step
            same_step = tf.equal(self.acc_step.read_value(), step)
            ok = tf.constant(True)
            if check_finite:
                # A sum is non-finite iff a term is (or it overflows,
                # which is worth dropping too).
                sums = [
                    tf.reduce_sum(tf.cast(p, tf.float32))
                    for p in arrived["packed"]
                ]
                sums += [
                    tf.reduce_sum(tf.cast(v, tf.float32))
                    for _, v in arrived["sparse"]
                ]
                ok = tf.math.is_finite(tf.add_n(sums))
            branch = tf.where(
                fresh,
                tf.where(ok, tf.where(same_step, 1, 3), 2),
                0,
            )
            count = tf.switch_case(
                branch,
                [reject, accumulate, nonfinite, discard_then_accumulate],
            )
            applied = tf.cond(
                count >= self.config.replicas_to_aggregate,
                lambda: self._apply(count),
                lambda: tf.constant(False),
            )
            if not stats:  # nobody reads them: no ps work per push
                return applied, tf.zeros([0], tf.float64)
            with tf.control_dependencies([applied]):
                counts = tf.concat(
                    [
                        tf.stack(
                            [
                                self.global_step.read_value(),
                                self.stale_dropped.read_value(),
                                self.nonfinite_dropped.read_value(),
                            ]
                        ),
                        self.accepted_per_worker.read_value(),
                        self.stale_per_worker.read_value(),
                    ],
                    axis=0,
                )
                # One float64 tensor (counts exact below 2**53): one
                # transfer back to the worker when the logs use them.
                packed_stats = tf.concat(
                    [
                        tf.cast(counts, tf.float64),
                        tf.reshape(
                            tf.cast(self.wait_seconds.read_value(), tf.float64),
                            [1],
                        ),
                    ],
                    axis=0,
                )
                return applied, packed_stats

        return body()

    def _drain_sparse(self):
        """Dequeues the step's pushes of each sparse variable: sum, unique.

        An update happens when the count reaches `replicas_to_aggregate`:
        pushes are serialised and each adds exactly 1 (a discard resets the
        count to 0), so each queue holds exactly that many pushes here. They
        are dequeued one by one and concatenated once. A `tf.while_loop` of
        dequeues over the count, concatenating as it went, copied the rows
        again at each push and cost the w3 loop 4-10 % of its throughput
        (in-process, interleaved A/B).
        """
        grads = []
        for slot in self._layout.sparse:
            parts = [
                slot.queue.dequeue()
                for _ in range(self.config.replicas_to_aggregate)
            ]
            indices = tf.concat([idx for idx, _ in parts], 0)
            values = tf.concat([val for _, val in parts], 0)
            grads.append(_dedup(tf.IndexedSlices(values, indices)))
        return grads

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
        ]
        with tf.control_dependencies(drained):
            ops = [
                g.buffer.assign(tf.zeros_like(g.buffer), read_value=False)
                for g in self._layout.dense
            ]
            ops.append(self.stale_dropped.assign_add(count, read_value=False))
            # Each dropped push took a token its step will not get back
            # from an update: return them, or the barrier runs short.
            ops.append(
                self._tokens.enqueue_many(
                    [tf.zeros(tf.reshape(count, [1]), tf.int64)]
                )
            )
            ops.append(self.count.assign(0, read_value=False))
            ops.append(self.acc_step.assign(step, read_value=False))
        return tf.group(ops)

    def _apply(self, count):
        """Applies the mean of the accumulated gradients; releases tokens."""
        layout = self._layout
        grads_and_vars = []
        for group in layout.dense:
            n = tf.cast(count, group.dtype)
            flat = group.buffer.read_value() / n
            for var, part in zip(group.variables, tf.split(flat, group.sizes)):
                grads_and_vars.append((tf.reshape(part, var.shape), var))
        for slot, (idx, val) in zip(layout.sparse, self._drain_sparse()):
            n = tf.cast(count, val.dtype)
            grads_and_vars.append(
                (
                    tf.IndexedSlices(
                        # Static: tf.shape(variable) would read the whole
                        # table (12.8 MB of W3's ps, every step).
                        val / n,
                        idx,
                        tf.constant(slot.variable.shape.as_list(), tf.int64),
                    ),
                    slot.variable,
                )
            )
        with _SyncApplyScope():
            applied = self._apply_fn(grads_and_vars)
            with tf.control_dependencies([applied]):
                hooks = [op for hook in self.after_apply for op in hook()]
            if hooks:
                with tf.control_dependencies(hooks):
                    applied = tf.identity(self.global_step.read_value())
        with tf.control_dependencies([applied]):
            resets = [
                g.buffer.assign(tf.zeros_like(g.buffer), read_value=False)
                for g in layout.dense
            ]
            resets.append(self.count.assign(0, read_value=False))
            new_step = self.global_step.read_value()
            resets.append(self.acc_step.assign(new_step, read_value=False))
        with tf.control_dependencies(resets):
            release = self._tokens.enqueue_many(
                tf.fill([self.config.tokens_per_step], new_step)
            )
        with tf.control_dependencies([release]):
            return tf.constant(True)


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


class _Wire:
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
    step bound for this ps (see `_riders`): last, at static offsets from
    the end, so `unpack` ignores them. They travel only when the wire does.
    """

    DTYPE = tf.float32

    def __init__(self, device, layout, packed, sparse, worker, riders=()):
        self._dense = [
            i
            for i, g in enumerate(layout.dense)
            if g.device == device and g.dtype == self.DTYPE
        ]
        self._sparse = [
            i
            for i, slot in enumerate(layout.sparse)
            if slot.variable.device == device
            and slot.variable.dtype.base_dtype == self.DTYPE
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
        parts += [tf.reshape(r, [-1]) for r in self._riders]
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
        offset = -sum(r.shape.num_elements() for r in self._riders)
        values = []
        with tf.device(self._device):
            for rider in self._riders:
                end = offset + rider.shape.num_elements()
                piece = tensor[offset : end or None]
                values.append(tf.reshape(piece, rider.shape))
                offset = end
        return values

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


_WRITES = frozenset(
    ["AssignAddVariableOp", "AssignSubVariableOp", "AssignVariableOp"]
)


def _riders(graph, start, device):
    """The step's writes whose values can ride in the push to `device`.

    Each write to a variable on a ps of a value computed on the worker is a
    transfer of its own: `model.fit`'s compiled loss adds two per step (its
    `Mean`'s total and count), where the push is the only other transfer
    from the worker. Those writes (ops `start` on in `graph`, traced before
    the push) may take the value from the push's tensor on the ps instead:
    the same value, written once the push has arrived rather than when it
    was computed. A write rides if its variable lives on `device`, its
    value is float32 with a static shape, and the op computing the value
    sits on no ps and reads no resource (it runs on the worker).
    """
    here = tf.DeviceSpec.from_string(device)
    found = []
    for op in graph.get_operations()[start:]:
        if op.type not in _WRITES:
            continue
        handle_device = _captured_device(graph, op.inputs[0])
        value = op.inputs[1]
        producer = value.op
        if (
            handle_device
            and tf.DeviceSpec.from_string(handle_device) == here
            and value.dtype == tf.float32
            and value.shape.is_fully_defined()
            and "/job:" not in producer.device
            and not any(t.dtype == tf.resource for t in producer.inputs)
        ):
            found.append(op)
    return found


def _among_ancestors(ops, tensors):
    """The ops of `ops` that `tensors` depend on (data or control)."""
    wanted = set(ops)
    found = set()
    seen = set()
    stack = [t.op for t in tensors]
    while stack and found != wanted:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if op in wanted:
            found.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return found


def _captured_device(graph, tensor):
    """The device of the eager tensor that `tensor` captures, or None."""
    while tf.is_symbolic_tensor(tensor):
        outer = None
        for captured, inner in graph.captures:
            if inner is tensor:
                outer = captured
                break
        if outer is None:
            return None
        if not tf.is_symbolic_tensor(outer):
            return outer.device
        graph, tensor = outer.graph, outer
    return None


def _dedup(grad):
    """Sums duplicate rows of an `IndexedSlices`; returns (indices, values)."""
    indices = tf.cast(grad.indices, tf.int64)
    unique, positions = tf.unique(indices)
    values = tf.math.unsorted_segment_sum(
        grad.values, positions, tf.shape(unique)[0]
    )
    return unique, values
