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
   for `g`'s ps travel as one tensor, see `wire.Wire`), and
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
5. A push that would complete an update once `g` reached the step limit
   (`plan_updates`: the updates `fit` or `Trainer` planned so far) is
   dropped and counted as over the plan, and gives its token back.
   Re-run functions (PSS runs a function at least once: after a worker
   fault it runs again from its start) then cannot apply more updates
   than planned.

TF1's order (the `compat_v1` shim) uses the same barrier the other way
round: the tag is the worker's local step, the push comes first, and the
step then takes a token (`take_token`) carrying the global step after the
update it waited for, which becomes the worker's next local step. The
options `initial_tokens` and `sparse_mean="rows"` give TF1's start (the
chief's own init tokens) and TF1's per-row mean of sparse gradients.

Guarantees: each update is applied exactly once (the critical section
serialises pushes and only one push can bring the count to `N`); `g` rises
by exactly 1 per update; a gradient tagged with an older step is never
applied. Weights change only inside the apply, which ends with the `g`
increment, so a step whose tag equals `g` at push time read only weights of
step `g`.
"""

from __future__ import annotations

import weakref

import tensorflow as tf

from tf2sync._src import barrier as barrier_lib
from tf2sync._src import graph_rewrites
from tf2sync._src import loops
from tf2sync._src import wire as wire_lib
from tf2sync._src.internals import graph_ops
from tf2sync._src.sync import applying
from tf2sync._src.sync import commit
from tf2sync._src.sync import counters
from tf2sync._src.sync import hold_time
from tf2sync._src.sync import scale_out as scale_out_lib
from tf2sync._src.sync import sealed

# The step limit when nothing is planned: never reached.
NO_LIMIT = counters.NO_LIMIT


class Aggregator(
    counters.CountersMixin,
    commit.CommitMixin,
    applying.ApplyMixin,
    sealed.SealedMixin,
):
    """Token barrier and accumulators of one synchronous optimizer.

    See the module docstring for the protocol. Created eagerly under the
    strategy scope; `push` and `acquire` are called while tracing steps.
    Its parts: the counters and plan (`sync.counters`), the critical
    section's body (`sync.commit`), the apply (`sync.applying`) and, with
    variables on several ps, the stage and the sealed step's apply
    (`sync.sealed`, `sync.scale_out`).
    """

    def __init__(
        self,
        config,
        global_step,
        apply_fn,
        name="tf2sync",
        num_workers=1,
        initial_tokens=None,
        sparse_mean="pushes",
        increment_fn=None,
        variables_fn=None,
    ):
        """Creates the token queue, counters and critical section eagerly.

        Args:
          config: A `SyncConfig`.
          global_step: The step variable (the inner `iterations`, or a TF1
            global step of any integer dtype).
          apply_fn: `apply_fn(grads_and_vars, increment=True) -> op`:
            applies aggregated gradients once and increments `global_step`
            by 1 (with `increment=False`: applies one ps's share only).
          name: Prefix of the variables and queues created.
          num_workers: Workers in the cluster, for per-worker counts.
          initial_tokens: Tokens enqueued now; None means
            `config.tokens_per_step`.
          sparse_mean: "pushes" divides every sparse row by the number of
            gradients accumulated, as dense ones; "rows" divides each row
            by the number of pushes that contain it (TF1's
            `SparseConditionalAccumulator`; each push's rows must then be
            unique, see `wire.dedup`).
          increment_fn: `increment_fn(variables) -> op`: increments
            `global_step` (and what `apply_fn` would increment with them)
            by 1. Given, gradients on several ps aggregate by
            `sync.scale_out`'s protocol; None keeps them in one critical
            section.
          variables_fn: Returns the optimizer's variables (its step,
            hyperparameters and slots): what a ps's apply may read from
            another ps (`sync.local_apply`).
        """
        if sparse_mean not in ("pushes", "rows"):
            raise ValueError(
                '`sparse_mean` must be "pushes" or "rows". Received: '
                f"sparse_mean={sparse_mean!r}"
            )
        self._sparse_mean = sparse_mean
        self.config = config
        self.global_step = global_step
        self.device = global_step.device
        self._apply_fn = apply_fn
        self._increment_fn = increment_fn
        self._variables_fn = variables_fn or (lambda: [])
        self._scale_out = None
        self._name = name
        self._layout = None
        self._push_functions = {}
        self._finalizers = {}
        self._totals_function = None
        self._graphs_with_push = weakref.WeakSet()
        self.barrier = barrier_lib.TokenBarrier(global_step, name)
        self.wait_seconds = self.barrier.wait_seconds
        with tf.init_scope(), tf.device(self.device):
            self._cs = tf.CriticalSection(name=name + "_cs")
        self.hold_probe = None  # see `sync.hold_time`
        if hold_time.enabled():
            self.hold_probe = hold_time.HoldProbe(self.device, name)
        self.count = wire_lib.ps_variable(
            tf.constant(0, tf.int64), self.device, name + "_count"
        )
        self.acc_step = wire_lib.ps_variable(
            tf.constant(0, tf.int64), self.device, name + "_acc_step"
        )
        self.stale_dropped = wire_lib.ps_variable(
            tf.constant(0, tf.int64), self.device, name + "_stale"
        )
        self.accepted = wire_lib.ps_variable(
            tf.constant(0, tf.int64), self.device, name + "_accepted"
        )
        self.nonfinite_dropped = wire_lib.ps_variable(
            tf.constant(0, tf.int64), self.device, name + "_nonfinite"
        )
        self.step_limit = wire_lib.ps_variable(
            tf.constant(NO_LIMIT, tf.int64), self.device, name + "_limit"
        )
        self.over_plan = wire_lib.ps_variable(
            tf.constant(0, tf.int64), self.device, name + "_over_plan"
        )
        self.num_workers = max(1, int(num_workers))
        self.accepted_per_worker = wire_lib.ps_variable(
            tf.zeros([self.num_workers], tf.int64), self.device, name + "_wa"
        )
        self.stale_per_worker = wire_lib.ps_variable(
            tf.zeros([self.num_workers], tf.int64), self.device, name + "_ws"
        )
        # Hooks run inside the critical section: callables returning ops.
        # `after_apply` runs after each update, before tokens are released
        # (loss scaling, EMA); `on_nonfinite` when a push is non-finite.
        self.retired = False  # see `retire`
        self.after_apply = []
        self.on_nonfinite = []
        if initial_tokens is None:
            initial_tokens = config.tokens_per_step
        self.seed_tokens(initial_tokens)

    # Coordinator side -----------------------------------------------------

    def build(self, grads_and_vars) -> None:
        """Creates the accumulators for these gradient types, eagerly."""
        if self._layout is None:
            with tf.init_scope():  # eagerly, even when called while tracing
                staged = self._stages(grads_and_vars)
                self._layout = wire_lib.Layout(
                    grads_and_vars, self._name, staged
                )
                if staged:
                    self._scale_out = scale_out_lib.ScaleOut(
                        self, self._layout, self._name
                    )
        elif not self._layout.matches(grads_and_vars):
            raise ValueError(
                "SyncOptimizer was built for another list of variables (or "
                "other dense/sparse gradient types). A synchronous optimizer "
                "must update the same variables with the same gradient types "
                "every step. Received variables: "
                f"{[v.name for _, v in grads_and_vars]}. To train another "
                "set (after changing which layers are trainable), compile "
                "with a new tf2sync.SyncOptimizer: it replaces this one."
            )

    def optimizer_variables(self) -> list:
        """The global step and the optimizer's variables."""
        return [self.global_step] + list(self._variables_fn())

    def _stages(self, grads_and_vars) -> bool:
        """Whether pushes stage every share (`sync.scale_out`): where some
        gradient lives on another ps than this one. This ps's share is
        staged too, so that its commit holds no model variable and a
        repeated step calls it as one function of this ps. On one ps, one
        call per push that accumulates and applies is faster still."""
        if self._increment_fn is None:
            return False
        return any(
            g is not None
            and not scale_out_lib.same_device(v.device, self.device)
            for g, v in grads_and_vars
        )

    # Step side (traced) ---------------------------------------------------

    def acquire(self):
        """The core's order: one token, then the tag (see `TokenBarrier`)."""
        return self.barrier.acquire()

    def take_token(self, after):
        """TF1's order: one token once `after` ran (see `TokenBarrier`)."""
        return self.barrier.take(after)

    def give_back(self, after):
        """Returns one token after `after` (a step that pushed nothing)."""
        return self.barrier.give_back(after)

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
            of crossing as transfers of their own (see
            `graph_rewrites.riders`).
        """
        riders = []
        if riders_from is not None:  # before the push adds ops of its own
            graph = tf.compat.v1.get_default_graph()
            riders = graph_rewrites.riders(graph, riders_from, self.device)
        self.build(grads_and_vars)
        layout = self._layout
        packed, sparse = self._pack(grads_and_vars)
        if riders:  # a write the gradients wait for cannot wait for them
            ahead = graph_rewrites.among_ancestors(
                riders, packed + [t for pair in sparse for t in pair]
            )
            riders = [op for op in riders if op not in ahead]
        wire = wire_lib.Wire(
            self.device,
            layout,
            packed,
            sparse,
            worker,
            [op.inputs[1] for op in riders],
        )
        inputs = wire_lib.received(
            {"tag": tag, **wire.inputs()}, layout, self.device
        )
        for op, value in zip(riders, wire.riders(inputs["tensor"])):
            graph_ops.update_op_input(op, 1, value)
        if self._scale_out is not None:
            inputs = self._stage(inputs, check_finite)
        function = self._repeated_push_function(
            wire, inputs, check_finite, stats
        )
        with tf.device(self.device):
            if function is not None:
                result = function(inputs)
                if not tf.executing_eagerly():  # else it ran: no set-up
                    # The ps sets the function up for each worker, at its
                    # first call; Grappler's passes took half of that and
                    # made the push (variables, queues, one switch, one
                    # cond and the apply) no faster (docs/benchmarks.md,
                    # "Measurements behind the code").
                    graph_ops.set_up_without_grappler(result)
            else:
                result = self._in_section(
                    "push",
                    lambda: self._push_body(wire, inputs, check_finite, stats),
                )
        if self._scale_out is None:
            return result
        return self._apply_sealed(result, stats)

    def _in_section(self, kind, body, **kwargs):
        """Runs `body` in the critical section (timed by `hold_probe`)."""
        if self.hold_probe is not None:
            body = self.hold_probe.timed(kind, body)
        return self._cs.execute(body, **kwargs)

    def _pack(self, grads_and_vars):
        """`(packed, sparse)`: one flat tensor per dense group, and the
        `(int64 ids, rows)` of each sparse gradient, in layout order."""
        by_key = {wire_lib.variable_key(v): g for g, v in grads_and_vars}
        packed = [
            tf.concat(
                wire_lib.flatten(
                    [
                        tf.convert_to_tensor(by_key[wire_lib.variable_key(v)])
                        for v in group.variables
                    ]
                ),
                axis=0,
            )
            for group in self._layout.dense
        ]
        # Rows go as computed, duplicates included (as stock PSS takes
        # them): the apply sums duplicates once over all the pushes, and a
        # second sum on the worker costs more CPU than the rows it saves
        # (docs/benchmarks.md, "Measurements behind the code").
        sparse = [
            (tf.cast(g.indices, tf.int64), g.values)
            for g in (
                by_key[wire_lib.variable_key(s.variable)]
                for s in self._layout.sparse
            )
        ]
        return packed, sparse

    def _repeated_push_function(self, wire, inputs, check_finite, stats):
        """The push as one function of the ps, where the step repeats.

        A function that repeats the step (an unrolled loop) would otherwise
        hold a copy of the push and its apply per step, and the ps
        instantiates each copy for every worker. Inside
        `loops.repeat` (Trainer's and fit's default) every push is one
        function called, not inlined, so the ps holds it once per worker;
        elsewhere, from the second push traced into one graph on. A lone
        push stays inline (unless it is a copy of a shared trace, see
        `loops.repeating`): in a `tf.while_loop` of single steps the call
        costs CPU per step that inlining does not, while among repeated
        copies the two cost the same. A push whose accumulators or
        hooks live on another device stays inline too (the call would be a
        multi-device function of its own). Returns None where the push is
        inlined.

        The function takes the critical section itself: the ps sets a
        function up for each caller at its first call, and a call made
        inside the section set it up there, one worker after the other
        (docs/benchmarks.md, "Measurements behind the code").
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
                lambda args: self._in_section(
                    "push",
                    lambda: self._push_body(wire, args, check_finite, stats),
                ),
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
