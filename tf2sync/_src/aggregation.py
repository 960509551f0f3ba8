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
from tf2sync._src import step_context
from tf2sync._src import tf_internals
from tf2sync._src import watchdog
from tf2sync._src import wire as wire_lib
from tf2sync._src.sync import local_apply
from tf2sync._src.sync import scale_out as scale_out_lib


class Aggregator:
    """Token barrier and accumulators of one synchronous optimizer.

    See the module docstring for the protocol. Created eagerly under the
    strategy scope; `push` and `acquire` are called while tracing steps.
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

    def seed_tokens(self, num_tokens: int) -> None:
        """Enqueues `num_tokens` tokens of the current step now (eagerly)."""
        self.barrier.seed(num_tokens)

    def retire(self) -> None:
        """A later SyncOptimizer replaced this one (`strategy._attach`):
        steps traced for it fail at their token from now on. One token per
        worker suffices: the first failure cancels the others' functions,
        and the extra ones cover steps already waiting."""
        self.retired = True
        self.barrier.retire(self.num_workers + self.config.tokens_per_step)

    def _step(self):
        return self.barrier.step()

    def totals(self) -> dict:
        """The counters, read on the ps by one function: one round trip.

        Read one by one they took ten or more (~4 ms each here), two or
        three times per `fit` epoch. Keys: `sync_steps`, `stale_dropped`,
        `nonfinite_dropped`, `barrier_wait_s`, `accepted`,
        `over_plan_dropped`, and per worker i `accepted_w<i>`, `stale_w<i>`.
        Counts are exact below 2**53 (they cross as one float64 vector).
        """
        if self._totals_function is None:

            def read():
                with tf.device(self.device):
                    extra = tf.stack(
                        [
                            self.accepted.read_value(),
                            self.over_plan.read_value(),
                        ]
                    )
                    return tf.concat(
                        [self._counters(), tf.cast(extra, tf.float64)], axis=0
                    )

            # One per aggregator, each traced once: no retracing to warn of.
            self._totals_function = tf_internals.without_retracing_warning(
                tf.function(read, autograph=False)
            )
        values = self._totals_function().numpy()
        n = self.num_workers
        totals = {
            "sync_steps": int(values[0]),
            "stale_dropped": int(values[1]),
            "nonfinite_dropped": int(values[2]),
            "barrier_wait_s": float(values[3 + 2 * n]),
            "accepted": int(values[4 + 2 * n]),
            "over_plan_dropped": int(values[5 + 2 * n]),
        }
        for i in range(n):
            totals[f"accepted_w{i}"] = int(values[3 + i])
            totals[f"stale_w{i}"] = int(values[3 + n + i])
        return totals

    def _counters(self):
        """`[global step, stale, non-finite, accepted per worker...,
        stale per worker..., total barrier wait]` as one float64 vector
        (counts exact below 2**53): what a push returns for the logs, and
        the head of `totals`."""
        counts = tf.concat(
            [
                tf.stack(
                    [
                        self._step(),
                        self.stale_dropped.read_value(),
                        self.nonfinite_dropped.read_value(),
                    ]
                ),
                self.accepted_per_worker.read_value(),
                self.stale_per_worker.read_value(),
            ],
            axis=0,
        )
        wait = tf.cast(self.wait_seconds.read_value(), tf.float64)
        return tf.concat(
            [tf.cast(counts, tf.float64), tf.reshape(wait, [1])], axis=0
        )

    def plan_run(self) -> tuple:
        """`(global step, gradients pending)` now: the base of a run's plan
        (read eagerly, between epochs)."""
        with tf.init_scope():
            step = int(self.global_step.numpy())
            pending = int(self.count.numpy())
            if int(self.acc_step.numpy()) != step:
                pending = 0  # of another step: discarded by the next push
        return step, pending

    def plan_updates(self, base, pushes: int) -> int:
        """Caps the global step at `base`'s step plus
        `(pending + pushes) // replicas_to_aggregate` (eagerly, between
        epochs); returns the limit.

        `base` is `plan_run()` at the run's start and `pushes` the pushes
        planned since, so the plan holds over the run whatever the epochs
        left in the accumulators. A push past the limit that would complete
        an update is dropped (see the module docstring, 5.); one that would
        not is accumulated as usual (an epoch's leftovers, which the next
        epoch completes).
        """
        step, pending = base
        limit = step + max(0, (pending + int(pushes))) // (
            self.config.replicas_to_aggregate
        )
        with tf.init_scope():
            self.step_limit.assign(limit)
        return limit

    def clear_plan(self) -> None:
        """Removes the cap of `plan_updates` (eagerly)."""
        with tf.init_scope():
            self.step_limit.assign(NO_LIMIT)

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

    @property
    def token_queue(self) -> tf.queue.FIFOQueue:
        """The barrier's queue of tokens, on the global step's ps."""
        return self.barrier.queue

    def tokens_available(self) -> int:
        return self.barrier.available()

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
            sealed=self._scale_out is not None
            and int(self._scale_out.sealed.numpy()) != 0,
        )

    def build(self, grads_and_vars) -> None:
        """Creates the accumulators for these gradient types, eagerly."""
        if self._layout is None:
            with tf.init_scope():  # eagerly, even when called while tracing
                staged = self._staged_devices(grads_and_vars)
                self._layout = wire_lib.Layout(
                    grads_and_vars, self._name, staged
                )
                if staged is not None:
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

    def _staged_devices(self, grads_and_vars):
        """The predicate of the devices whose gradients are staged, or None
        where every gradient aggregates in this ps's critical section."""
        if self._increment_fn is None:
            return None
        others = {
            v.device
            for g, v in grads_and_vars
            if g is not None
            and not scale_out_lib.same_device(v.device, self.device)
        }
        if not others:  # one call of one ps per push is faster still
            return None
        # This ps's share too: its commit then holds no model variable,
        # so a repeated step calls it as one function of this ps.
        return lambda device: True

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
            tf_internals.update_op_input(op, 1, value)
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
                    # cond and the apply) no faster (docs/performance_log.md,
                    # "Measurements behind the code").
                    tf_internals.set_up_without_grappler(result)
            else:
                result = self._cs.execute(
                    lambda: self._push_body(wire, inputs, check_finite, stats)
                )
        if self._scale_out is None:
            return result
        return self._apply_sealed(result, stats)

    def _stage(self, inputs, check_finite):
        """Scale-out: stages the shares of the other ps (`sync.staging`);
        returns the commit's inputs (this ps's share, the push id and the
        stages' acknowledgement)."""
        push_id = scale_out_lib.ScaleOut.new_push_id()
        ack = self._scale_out.stage(push_id, inputs, check_finite)
        layout = self._layout
        with tf.device(self.device):
            push_id = tf.identity(push_id)
        return {
            **inputs,
            "packed": [
                p if g.buffer is not None else None
                for p, g in zip(inputs["packed"], layout.dense)
            ],
            "sparse": [
                p if slot.queue is not None else None
                for p, slot in zip(inputs["sparse"], layout.sparse)
            ],
            "id": push_id,
            "ack": ack,
        }

    def _apply_sealed(self, committed, stats):
        """Scale-out: the push that sealed a step applies it on the other
        ps, then ends it on this one (`sync.scale_out`). Returns
        `(applied, stats)` as `push`."""
        seal, admitted, count, read = committed
        scale_out = self._scale_out

        def apply():
            staged = scale_out.apply_staged(
                admitted, count, seal, self._sparse_mean
            )
            with tf.control_dependencies([staged]):
                return self._finalizer(stats)(seal, admitted, count)

        # Decided where the seal is: the dead branches of the pushes that
        # did not seal cost no round trip through the worker.
        with tf.device(self.device):
            return tf.cond(seal > 0, apply, lambda: (tf.constant(False), read))

    def _finalizer(self, stats):
        """The finalize as one function of this ps where it can be (it
        holds nothing of another ps: no EMA or group optimizer there)."""
        if stats not in self._finalizers:
            self._finalizers[stats] = local_apply.LocalApply(
                self.device,
                lambda seal, admitted, count: self._cs.execute(
                    lambda: self._finalize(seal, admitted, count, stats),
                    # The other ps' sections read the step too: the seal
                    # orders them before this.
                    exclusive_resource_access=False,
                ),
                self.optimizer_variables,
            )
        return self._finalizers[stats]

    def _finalize(self, seal, admitted, count, stats):
        """Scale-out, in the critical section: ends the step sealed as
        `seal` (see `ScaleOut.finalize`); returns `(ended, stats)`."""
        ended = self._scale_out.finalize(
            seal,
            admitted,
            count,
            self._sparse_mean,
            lambda: self._end_step(self._increment(), False),
        )
        if not stats:
            return ended, tf.zeros([0], tf.float64)
        return ended, self._stats_after(ended)

    def _increment(self):
        with step_context.sync_apply_scope():
            return self._increment_fn(self._scale_out.all_variables)

    def recover(self) -> bool:
        """Applies and ends a step sealed but not ended (eagerly).

        Scale-out only: the push that sealed a step may die before it
        applied it on every ps. Safe while that push still runs: each ps
        applies a seal once, and the step ends once. Returns whether a
        sealed step was found.
        """
        scale_out = self._scale_out
        if scale_out is None:
            return False
        with tf.init_scope():
            seal = int(scale_out.sealed.numpy())
            if not seal:
                return False

            def run():
                return self._apply_sealed(
                    (
                        tf.constant(seal, tf.int64),
                        scale_out.admitted.read_value(),
                        self.count.read_value(),
                        tf.zeros([0], tf.float64),
                    ),
                    stats=False,
                )

            tf.function(run, autograph=False)()
            return True

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
        # (docs/performance.md, "Measurements behind the code").
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
        (each call's set-up took about 70 ms on digits).
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
                lambda args: self._cs.execute(
                    lambda: self._push_body(wire, args, check_finite, stats)
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

    def _stats_after(self, applied):
        """The counters (`_counters`), read on the ps once `applied` ran
        (see `push`): one transfer back to the worker when the logs use
        them."""
        with tf.control_dependencies([applied]):
            return self._counters()

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
            if slot.queue is None:  # staged on its ps
                continue
            parts = [slot.queue.dequeue() for _ in range(pushes)]
            indices = tf.concat([idx for idx, _ in parts], 0)
            values = tf.concat([val for _, val in parts], 0)
            if self._sparse_mean == "rows":
                grads.append(wire_lib.row_mean(indices, values))
                continue
            unique, total = wire_lib.dedup(tf.IndexedSlices(values, indices))
            grads.append((unique, total / tf.cast(count, total.dtype)))
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

    def _apply(self, count, pushes=None):
        """Applies the mean of the accumulated gradients; releases tokens.

        Scale-out: applies this ps's share only and seals the step
        (`ScaleOut.seal`); returns the seal id. `pushes`: the Python int
        count of a `flush`, else None."""
        layout = self._layout
        grads_and_vars = []
        for group in layout.dense:
            if group.buffer is None:  # staged on its ps
                continue
            n = tf.cast(count, group.dtype)
            flat = group.buffer.read_value() / n
            for var, part in zip(group.variables, tf.split(flat, group.sizes)):
                if var.shape.rank != 1:  # a split's part has rank 1
                    part = tf.reshape(part, var.shape)
                grads_and_vars.append((part, var))
        drained = self._drain_sparse(count, pushes)
        here = [slot for slot in layout.sparse if slot.queue is not None]
        for slot, (idx, val) in zip(here, drained):
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
        if self._scale_out is not None:  # every share is staged
            return self._scale_out.seal(tf.no_op)
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


# The step limit when nothing is planned: never reached.
NO_LIMIT = 2**62


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
