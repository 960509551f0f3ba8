"""TF1's step order on the core barrier: push first, then take a token.

The shim has no barrier or accumulators of its own: every shim optimizer
applied in one traced step records its gradients (`record`), and at the
end of `strategy.run` the step makes one core push (`aggregation`) of all
of them, tagged with the worker's local step, then takes one token and
stores it as the worker's next local step. The core does the rest, inside
its critical section on the ps: stale pushes dropped, the
`replicas_to_aggregate`-th fresh push applies the mean (per row for sparse
gradients, as TF1's `SparseConditionalAccumulator`), each member's inner
optimizer once, each distinct global step +1, then the moving averages,
then `max(total, aggregate)` tokens carrying the new global step. A push
is accepted or dropped as a whole, for every variable at once.

The chief's side is what TF1's hook did at session start: seed every
local step with the global step and enqueue the initial tokens
(`start`), done by the coordinator before the first dispatch if no hook
did it, and the core's token watchdog.
"""

from __future__ import annotations

import weakref

import tensorflow as tf

from tf2sync._src import aggregation
from tf2sync._src import config as config_lib
from tf2sync._src import step_context
from tf2sync._src import wire
from tf2sync._src.compat_v1 import chief_side
from tf2sync._src.compat_v1 import hooks
from tf2sync._src.compat_v1 import inner
from tf2sync._src.compat_v1 import step as step_lib
from tf2sync._src.internals import graph_ops
from tf2sync._src.internals import ps_strategy

GLOBAL_STEP_REQUIRED = "Global step is required to check staleness"


class PushFirstStep(chief_side.ChiefSideMixin):
    """The step protocol of `tf2sync.compat.v1.SyncReplicasOptimizer`.

    One per strategy, shared by every shim optimizer under it: one
    `aggregation.Aggregator` (token queue beside the round's global step),
    one local step per worker, one round per synchronous step whatever the
    number of shim optimizers applied in it.

    Guarantees, per traced `strategy.run` that applies gradients: exactly
    one push (every variable of the step, the replicas of a multi-GPU
    worker summed), tagged with the worker's local step, then exactly one
    token, which becomes that local step; the step's ops follow the token
    of the step traced before it in the same graph. What `apply_gradients`
    returned inside the step is that token (rewired once the push exists),
    so nothing in the step may wait on it (refused at trace time). Every
    step of the strategy pushes the same variables (refused otherwise).
    """

    traces_before_dispatch = True

    def __init__(self, strategy):
        self.strategy = strategy
        self.members = []  # (optimizer, its global_step or None)
        self.global_step = None
        self.aggregator = None
        self.local_steps = None
        self.rounds = None
        self.parked = None
        self.started = False
        self.watchdog = None
        self._owner = {}  # id(variable) -> optimizer
        self._variables = []  # every variable pushed, in order
        self._claimed_by = set()
        self._token_queue = None
        self._open = weakref.WeakKeyDictionary()  # graph -> step_lib.Step
        self._last_token = weakref.WeakKeyDictionary()  # graph -> token

    @classmethod
    def of(cls, strategy):
        """The strategy's shim protocol, attached on first use."""
        protocol = strategy._protocol
        if protocol is None:
            protocol = cls(strategy)
            strategy._attach_protocol(protocol)
        elif not isinstance(protocol, cls):
            strategy._attach_protocol(cls(strategy))  # raises: kinds do not mix
        return protocol

    # Tracing ---------------------------------------------------------------

    def run_step(self, run, fn):
        """Traces `fn` as one step, then its push and token (TF1's order)."""
        graph = tf.compat.v1.get_default_graph()
        worker = step_lib.worker_or_zero()
        previous = self._last_token.get(graph)
        # Steps repeated in one function's graph have no order but their
        # data's, and TF1 runs one step per `session.run`: each step's ops
        # follow the previous step's token.
        step = step_lib.Step(worker, [] if previous is None else [previous])
        outer = self._open.get(graph)
        self._open[graph] = step

        def step_fn(*a, **k):
            with (
                step_context.WorkerScope(worker),
                tf.control_dependencies(step.after),
            ):
                return fn(*a, **k)

        first = len(graph.get_operations())
        try:
            result = run(step_fn)
        finally:
            if outer is None:
                self._open.pop(graph, None)
            else:
                self._open[graph] = outer
        if step.entries:
            self._finish(step, graph, first)
        return result

    def open_step(self):
        """The `step_lib.Step` being traced in the current graph, or None.

        Raises:
          ValueError: In a graph nested in a step's (a `tf.cond` branch, a
            loop body, a function called by the step): the step's one push
            is made in the step's own graph, which cannot use tensors of
            the nested one.
        """
        graph = tf.compat.v1.get_default_graph()
        step = self._open.get(graph)
        if step is not None:
            return step
        outer = getattr(graph, "outer_graph", None)
        while outer is not None:
            if outer in self._open:
                raise ValueError(
                    "SyncReplicasOptimizer.apply_gradients was called inside "
                    "a tf.cond, loop or nested tf.function of a replica "
                    "step: call it in the body of the function passed to "
                    "strategy.run (the step pushes once, after it)."
                )
            outer = getattr(outer, "outer_graph", None)
        return None

    def record(self, opt, grads_and_vars, global_step):
        """Adds one `apply_gradients` call; returns its result.

        Inside a traced `run`, the result is rewired to the step's token
        once the step ends; elsewhere (eagerly, or a traced function that
        is not a `run`) the call is a step of its own, pushed now.
        """
        step = None if tf.executing_eagerly() else self.open_step()
        if step is None:
            step = step_lib.Step(step_lib.worker_or_zero(), [])
            step.entries.append((opt, grads_and_vars, global_step))
            return self._push(step, start=tf.executing_eagerly())
        step.entries.append((opt, grads_and_vars, global_step))
        placeholder = tf.identity(tf.zeros([], self.token_dtype(global_step)))
        step.results.append(placeholder)
        return placeholder

    def _finish(self, step, graph, first):
        step_lib.check_results_unused(
            step.results, graph.get_operations()[first:]
        )
        token = self._push(step)
        for placeholder in step.results:
            graph_ops.update_op_input(
                placeholder.op, 0, tf.cast(token, placeholder.dtype)
            )
        self._last_token[graph] = token

    def _push(self, step, start=False):
        """The step's one push, then its token; returns the token (in the
        global step's dtype, as the local steps: the core's are int64).

        With `start`, the chief's side starts first if nothing started it
        (an eager call: no coordinator dispatch will).
        """
        self._join(step.entries)
        grads_and_vars = []
        for grad, var in step_lib.one_per_variable(step.entries):
            if isinstance(grad, tf.IndexedSlices):
                # TF1 counts a row once per push: sum it within one.
                ids, rows = wire.dedup(grad)
                grad = tf.IndexedSlices(rows, ids, grad.dense_shape)
            grads_and_vars.append((grad, var))
        aggregator = self._aggregator_for(grads_and_vars)
        if start:
            self.before_dispatch()
        with tf.control_dependencies(step.after):
            tag = tf.cast(tf.gather(self.local_steps, step.worker), tf.int64)
        applied, _ = aggregator.push(
            tag, grads_and_vars, worker=step.worker, stats=False
        )
        # Between its push and its token the step is parked: the watchdog
        # releases a drained round's tokens only once every running step
        # is (`watch_state`).
        with tf.device(aggregator.device), tf.control_dependencies([applied]):
            parked = self.parked.assign_add(1, read_value=False)
        raw = aggregator.take_token([applied, parked])
        with tf.device(aggregator.device), tf.control_dependencies([raw]):
            unparked = self.parked.assign_sub(1, read_value=False)
        token = tf.cast(raw, self.local_steps.dtype)
        update = self.local_steps.scatter_update(
            tf.IndexedSlices(
                tf.reshape(token, [1]), tf.reshape(step.worker, [1])
            )
        )
        with tf.control_dependencies([update, unparked]):
            return tf.identity(token)

    def _join(self, entries):
        """Registers the step's optimizers and variables (checked first)."""
        owners = dict(self._owner)
        for opt, gvs, _ in entries:
            for _, var in gvs:
                if owners.setdefault(id(var), opt) is not opt:
                    raise ValueError(
                        f"Variable {var.name} is applied by two "
                        "SyncReplicasOptimizers in one step: each variable "
                        "belongs to one."
                    )
        applied = {id(v) for _, gvs, _ in entries for g, v in gvs}
        if self.aggregator is not None and applied != set(self._owner):
            new = [v.name for _, gvs, _ in entries for _, v in gvs]
            raise ValueError(
                "Every step under one SyncParameterServerStrategy is one "
                "round of the same SyncReplicasOptimizers over the same "
                "variables, and this step applies others: "
                f"{sorted(set(new))}, where the round was built for "
                f"{[v.name for v in self._variables]}. Apply all of them in "
                "one step, or use one strategy per round."
            )
        step = self.global_step
        if step is None:
            step = next((g for _, _, g in entries if g is not None), None)
        if step is None:
            raise ValueError(GLOBAL_STEP_REQUIRED)
        self.global_step = step
        for opt, gvs, global_step in entries:
            for _, var in gvs:
                if id(var) not in self._owner:
                    self._variables.append(var)
                    self._owner[id(var)] = opt
            if all(opt is not m for m, _ in self.members):
                self.members.append((opt, global_step))

    def token_dtype(self, global_step=None):
        """The dtype TF1 gave tokens and local steps: the global step's.

        The round's global step, else `global_step` (a step's first call
        that gives one), else int64 (a call without one, traced before any
        call that gives one).
        """
        step = self.global_step if self.global_step is not None else global_step
        return tf.int64 if step is None else step.dtype.base_dtype

    def token_queue(self):
        """TF1's token queue, in the global step's dtype; None before the
        first step built the round."""
        if self.aggregator is None:
            return None
        if self._token_queue is None:
            self._token_queue = hooks.TokenQueue(
                self.aggregator.token_queue, self.token_dtype()
            )
        return self._token_queue

    def variables_of(self, opt):
        """The variables `opt` pushes, in order."""
        return [v for v in self._variables if self._owner[id(v)] is opt]

    # State, built eagerly on the first step ----------------------------------

    def _aggregator_for(self, grads_and_vars):
        if self.aggregator is None:
            with tf.init_scope():
                self._build(grads_and_vars)
        return self.aggregator  # its `push` checks the layout

    def _build(self, grads_and_vars):
        leader = self.members[0][0]
        counts = {
            (o._replicas_to_aggregate, o._total_num_replicas)
            for o, _ in self.members
        }
        if len(counts) > 1:
            raise ValueError(
                "The SyncReplicasOptimizers applied in one step form one "
                "round and must agree on replicas_to_aggregate and "
                f"total_num_replicas. Received: {sorted(counts)}"
            )
        config = config_lib.SyncConfig.create(
            leader._replicas_to_aggregate, leader._total_num_replicas
        )
        num_workers = max(
            config.total_num_replicas, ps_strategy.num_workers(self.strategy)
        )
        for opt, gvs, _ in self._by_member(grads_and_vars):
            with self.strategy.scope():
                inner.build(opt._opt, [v for _, v in gvs])
                if opt._variable_averages is not None:
                    inner.build_averages(
                        opt._variable_averages, opt._variables_to_average
                    )
        self.aggregator = aggregation.Aggregator(
            config,
            self.global_step,
            self._apply,
            name=f"{leader._name}_sync",
            num_workers=num_workers,
            initial_tokens=0,  # the chief's `start` enqueues them
            sparse_mean="rows",
        )
        device = self.aggregator.device
        # TF1's local step and tokens have the global step's dtype.
        step = tf.cast(self.global_step.read_value(), self.token_dtype())
        self.local_steps = wire.ps_variable(
            tf.fill([num_workers], step), device, f"{leader._name}_local_step"
        )
        self.rounds = wire.ps_variable(
            tf.constant(0, tf.int64), device, f"{leader._name}_rounds"
        )
        # Steps that pushed and wait for their token (see `_push`).
        self.parked = wire.ps_variable(
            tf.constant(0, tf.int64), device, f"{leader._name}_parked"
        )
        self.aggregator.after_apply.append(self._after_apply)

    def _by_member(self, grads_and_vars):
        """`(optimizer, its pairs, its global step)` per member, in order."""
        found = []
        for opt, global_step in self.members:
            gvs = [
                (g, v) for g, v in grads_and_vars if self._owner[id(v)] is opt
            ]
            found.append((opt, gvs, global_step))
        return found

    def _apply(self, grads_and_vars):
        """The round's apply (inside the core's critical section)."""
        members = [m for m in self._by_member(grads_and_vars) if m[1]]
        # A tf_keras optimizer's apply increments its own `iterations`
        # whatever it is given: no other member increments that one again.
        incremented = {
            id(opt._opt.iterations)
            for opt, _, _ in members
            if not inner.is_tf1(opt._opt)
        }
        updates = []
        for opt, gvs, global_step in members:
            own = not inner.is_tf1(opt._opt) and (
                global_step is opt._opt.iterations
            )
            if global_step is not None and not own:
                if id(global_step) in incremented:
                    global_step = None
                else:
                    incremented.add(id(global_step))
            if gvs:
                update = inner.apply(
                    opt._opt, self.strategy, gvs, global_step, opt._name
                )
                if update is not None:
                    updates.append(update)
        return tf.group(updates)

    def _after_apply(self):
        ops = [self.rounds.assign_add(1, read_value=False)]
        for opt, _ in self.members:
            if opt._variable_averages is not None:
                ops.append(
                    opt._variable_averages.apply(opt._variables_to_average)
                )
        return ops
