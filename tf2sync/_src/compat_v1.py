"""TF1's `SyncReplicasOptimizer`, in TF2 eager on ParameterServerStrategy.

A migration shim: TF1 programs written against
`tf.compat.v1.train.SyncReplicasOptimizer` keep their calls
(`apply_gradients(grads_and_vars, global_step)`, `make_session_run_hook`,
`get_init_tokens_op`, ...) and their numbers, but run on
`tf2sync.SyncParameterServerStrategy` with a `ClusterCoordinator`. See
docs/migrating.md.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import tensorflow as tf
from absl import logging
from tensorflow.python.ops import resource_variable_ops

from tf2sync._src import aggregation
from tf2sync._src import strategy as strategy_lib

_UIDS = itertools.count()
# Per traced graph: the `_Round` started there, and each round's step context.
_OPEN_ROUNDS = weakref.WeakKeyDictionary()
_STEP_CONTEXTS = weakref.WeakKeyDictionary()


def _plain_variable(initial_value, device, name, dtype=None):
    """A resource variable on `device`, outside any strategy's creator."""
    with tf.init_scope(), tf.device(device):
        return resource_variable_ops.ResourceVariable(
            initial_value, trainable=False, name=name, dtype=dtype
        )


class _DenseAccumulator:
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


class _SparseAccumulator:
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
        self.step = _plain_variable(
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

    def set_global_step(self, step):
        return self.step.assign(tf.cast(step, tf.int64), read_value=False)

    def unblock(self, num):
        empty_i = tf.zeros([0], tf.int64)
        empty_v = tf.zeros([0] + self.var.shape.as_list()[1:], self.dtype)
        for _ in range(num):
            self.queue.enqueue([empty_i, empty_v])


class ChiefRunner:
    """The TF2 counterpart of TF1's chief `QueueRunner`.

    A daemon thread on the coordinator runs the sync round (take every
    accumulator, apply once, release tokens, moving averages) back to back.
    """

    def __init__(self, sync_round):
        self._optimizer = sync_round
        self._thread = None
        self._stopping = False
        self.error = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self):
        """Starts the round thread (no-op if it already runs)."""
        if self.running:
            return self
        self._stopping = False
        self._optimizer._stop_flag.assign(False)
        self._thread = threading.Thread(
            target=self._loop, name="sync_replicas_chief", daemon=True
        )
        self._thread.start()
        return self

    def _loop(self):
        try:
            while not self._stopping:
                self._optimizer._round_fn()
        except Exception as e:  # noqa: BLE001 - reported through .error
            if not self._stopping:
                self.error = e
                logging.exception(
                    "SyncReplicasOptimizer chief round failed: %s", e
                )

    def stop(self, timeout: float = 30.0):
        """Stops the thread: unblocks its takes and skips that round's apply.

        The accumulators are left with their steps bumped; a new
        `after_create_session` reseeds them.
        """
        if not self.running:
            return
        self._stopping = True
        self._optimizer._stop_flag.assign(True)
        for acc, rta in self._optimizer._accumulators_and_rta():
            acc.unblock(rta)
        self._thread.join(timeout)
        self._thread = None


class _SyncReplicasOptimizerHook:
    """TF1's hook; in TF2 call `begin()` then `after_create_session()` once.

    Call them after the training step was traced (scheduled once, or its
    `apply_gradients` otherwise called) and before waiting on any step.
    """

    def __init__(self, sync_optimizer, is_chief, num_tokens):
        self._sync_optimizer = sync_optimizer
        self._is_chief = is_chief
        self._num_tokens = num_tokens
        self._begun = False

    def begin(self):
        """Checks `apply_gradients` was called; builds the init tokens."""
        if not self._sync_optimizer._gradients_applied:
            raise ValueError(
                "SyncReplicasOptimizer.apply_gradient should be called before "
                "using the hook."
            )
        if self._is_chief:
            self._init_tokens = self._sync_optimizer.get_init_tokens_op(
                self._num_tokens
            )
            self._q_runner = self._sync_optimizer.get_chief_queue_runner()
        self._begun = True

    def after_create_session(self, session=None, coord=None):
        """Chief: seeds steps, enqueues init tokens, starts the round thread.

        Non-chief: resets the local steps to the global step. `session` and
        `coord` are accepted for TF1 signature compatibility and ignored.
        """
        del session, coord
        if not self._begun:
            self.begin()
        sync_round = self._sync_optimizer._round
        if self._is_chief:
            if not sync_round._hook_initialized(self):
                return  # another member's hook initialized this round
            self._q_runner.stop()
            sync_round._chief_init()
            self._init_tokens()
            self._q_runner.start()
        else:
            sync_round._local_step_init()

    def end(self, session=None):
        """Stops the chief's round thread."""
        del session
        if self._is_chief and self._begun:
            self._q_runner.stop()


class _State:
    """What one `apply_gradients` variable list needs, created eagerly."""

    def __init__(self, opt, grads_and_vars):
        self.variables = [v for _, v in grads_and_vars]
        self.accumulators = []  # parallel to variables; None for None grads
        for grad, var in grads_and_vars:
            name = f"{opt._name}_{next(_UIDS)}_{var.name.split(':')[0]}"
            if grad is None:
                acc = None
            elif isinstance(grad, tf.IndexedSlices):
                acc = _SparseAccumulator(var, name)
            elif isinstance(grad, tf.Tensor) or tf.is_tensor(grad):
                if isinstance(grad, tf.SparseTensor):
                    raise ValueError("Unknown grad type!")
                acc = _DenseAccumulator(var, name + "/grad_accum")
            else:
                raise ValueError("Unknown grad type!")
            self.accumulators.append(acc)


class _StepContext:
    """One traced replica step's shared worker side for one `_Round`."""

    def __init__(self, local_step):
        self.local_step = local_step
        self.dequeue = None
        self.result = None


class _Round:
    """What the shim optimizers used in one training step share.

    One token queue (beside the round's global step), one local step per
    worker, one chief round that takes every member's accumulators, applies
    each inner optimizer once, increments each distinct global step once
    and releases `tokens_per_step` tokens once.
    """

    def __init__(self, leader, global_step):
        dtype = global_step.dtype.base_dtype
        device = global_step.device
        strategy = leader._strategy
        num_workers = max(
            leader._total_num_replicas,
            getattr(strategy.extended, "_num_workers", 1),
        )
        name = leader._name
        self.members = []  # (optimizer, its global_step or None)
        self.global_step = global_step
        self.strategy = strategy
        self.tokens_per_step = leader._tokens_per_step
        with tf.init_scope():
            current = global_step.read_value()
            self.local_steps = _plain_variable(
                tf.fill([num_workers], current),
                device,
                f"{name}_sync_rep_local_step",
            )
            with tf.device(device):
                self.token_queue = tf.queue.FIFOQueue(
                    capacity=-1,
                    dtypes=[dtype],
                    shapes=[()],
                    name=f"{name}_sync_token_q",
                )
            self._stop_flag = resource_variable_ops.ResourceVariable(
                False, trainable=False, name=f"{name}_stop"
            )
            self.rounds = _plain_variable(
                tf.constant(0, tf.int64), device, f"{name}_rounds"
            )
        self.runner = ChiefRunner(self)
        self._round_fn = None
        self._initialized_hooks = set()

    def add_member(self, opt, global_step):
        self.members.append((opt, global_step))

    def _accumulators_and_rta(self):
        return [
            (acc, opt._replicas_to_aggregate)
            for opt, _ in self.members
            for acc in opt._accumulators()
        ]

    def _hook_initialized(self, hook):
        """True if `hook` should (re)initialize the round now."""
        if not self._initialized_hooks or hook in self._initialized_hooks:
            self._initialized_hooks = {hook}
            return True
        self._initialized_hooks.add(hook)
        return False

    def rebuild(self):
        self._round_fn = self._make_round_fn()

    def _make_round_fn(self):
        members = [(opt, gs, list(opt._states)) for opt, gs in self.members]

        @tf.function(autograph=False)
        def sync_round():
            applies = []  # (optimizer, grads_and_vars, global_step)
            incremented = set()
            for opt, gs, states in members:
                grads_and_vars = []
                for state in states:
                    for var, acc in zip(state.variables, state.accumulators):
                        grad = None
                        if acc is not None:
                            grad = acc.take(opt._replicas_to_aggregate)
                        grads_and_vars.append((grad, var))
                if gs is not None and id(gs) in incremented:
                    gs = None
                if gs is not None:
                    incremented.add(id(gs))
                applies.append((opt, grads_and_vars, gs))
            taken = [
                t
                for _, gvs, _ in applies
                for g, _ in gvs
                if g is not None
                for t in tf.nest.flatten(g, expand_composites=True)
            ]

            def apply():
                updates = []
                for opt, gvs, gs in applies:
                    update = opt._inner_apply(gvs, gs)
                    if update is not None:
                        updates.append(update)
                with tf.control_dependencies(updates):
                    step = self.global_step.read_value()
                    with tf.device(self.global_step.device):
                        release = self.token_queue.enqueue_many(
                            [tf.fill([self.tokens_per_step], step)]
                        )
                ops = [release]
                for opt, _ in self.members:
                    if opt._variable_averages is not None:
                        with tf.control_dependencies([release]):
                            ops.append(
                                opt._variable_averages.apply(
                                    opt._variables_to_average
                                )
                            )
                with tf.control_dependencies(ops):
                    return self.rounds.assign_add(1, read_value=False)

            with tf.control_dependencies(taken):
                stop = self._stop_flag.read_value()
            with tf.control_dependencies(taken):
                tf.cond(stop, tf.no_op, apply)

        return sync_round

    def _chief_init(self):
        step = self.global_step.read_value()
        self.local_steps.assign(tf.fill(tf.shape(self.local_steps), step))
        for acc, _ in self._accumulators_and_rta():
            acc.set_global_step(step)

    def _local_step_init(self):
        step = self.global_step.read_value()
        self.local_steps.assign(tf.fill(tf.shape(self.local_steps), step))

    def step_context(self):
        """The current traced step's `_StepContext` (a new one eagerly)."""
        worker = strategy_lib.current_worker()
        if worker is None:
            worker = tf.constant(0, tf.int64)
        if tf.executing_eagerly():
            ctx = None
        else:
            graph = tf.compat.v1.get_default_graph()
            contexts = _STEP_CONTEXTS.setdefault(graph, {})
            ctx = contexts.get(id(self))
        if ctx is None:
            ctx = _StepContext(tf.gather(self.local_steps, worker))
            ctx.worker = worker
            if not tf.executing_eagerly():
                contexts[id(self)] = ctx
        return ctx

    def finish_step(self, ctx, pushes):
        """Makes the step's one token dequeue wait for `pushes` too."""
        push_ops = [p if isinstance(p, tf.Operation) else p.op for p in pushes]
        if ctx.dequeue is not None:
            ctx.dequeue.op._add_control_inputs(push_ops)
            return ctx.result
        with tf.control_dependencies(push_ops):
            with tf.device(self.global_step.device):
                ctx.dequeue = self.token_queue.dequeue()
        update = self.local_steps.scatter_update(
            tf.IndexedSlices(
                tf.reshape(ctx.dequeue, [1]), tf.reshape(ctx.worker, [1])
            )
        )
        with tf.control_dependencies([update]):
            ctx.result = tf.identity(ctx.dequeue)
        return ctx.result


def _open_round():
    """The `_Round` a shim optimizer started in the current traced step."""
    if tf.executing_eagerly():
        return None
    return _OPEN_ROUNDS.get(tf.compat.v1.get_default_graph())


def _set_open_round(sync_round):
    if not tf.executing_eagerly():
        _OPEN_ROUNDS[tf.compat.v1.get_default_graph()] = sync_round


class SyncReplicasOptimizer:
    """TF1's `SyncReplicasOptimizer` for TF2 ParameterServerStrategy.

    Protocol (TF1's, per `tf.compat.v1.train.SyncReplicasOptimizer`):

    * Worker step (`apply_gradients`, called inside `strategy.run` of a
      function scheduled on a `ClusterCoordinator`): push every gradient to
      its variable's accumulator on the variable's ps, tagged with this
      worker's local step; then block for one token from the token queue
      (beside `global_step`) and store it as the new local step. A gradient
      is accepted iff its tag is at least the accumulator's step, otherwise
      it is silently dropped (stale).
    * Chief round (a daemon thread on the coordinator, started by the hook):
      `take(replicas_to_aggregate)` on every accumulator (the mean of all
      gradients accepted since the last take, per row for `IndexedSlices`;
      each take bumps that accumulator's step), one inner apply (which
      increments `global_step` by 1), then `max(total, replicas_to_aggregate)`
      tokens carrying the new `global_step`, then the optional moving
      averages.
    * Chief init (`hook.after_create_session()`): local steps := global step,
      accumulator steps := global step, `num_tokens` (default
      `replicas_to_aggregate`) tokens.
    * Several shim optimizers applied in the same traced step form one
      round (unlike TF1): the first applied must be given `global_step`,
      the others may pass `None` and join it; one token queue, one local
      step per worker, one token per worker step (after every push), one
      chief round applying each inner optimizer once and incrementing each
      distinct global step once, tokens released once.

    Guarantees: the inner optimizer applies exactly once per round (never
    once per worker); each applied gradient is the mean of at least
    `replicas_to_aggregate` accepted gradients; `global_step` rises by 1 per
    round (with a `tf.compat.v1.train` optimizer, or with a tf_keras
    optimizer when `global_step` is not its `iterations`). Like TF1, each
    worker wastes one step after (re)start.

    Requirements: a `tf2sync.SyncParameterServerStrategy` with no
    `tf2sync.SyncOptimizer`; construct this optimizer and every variable
    under `strategy.scope()`.

    Example::

        strategy = tf2sync.SyncParameterServerStrategy(
            resolver, replicas_to_aggregate=2)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(0.0)
            global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
            opt = tf2sync.compat.v1.SyncReplicasOptimizer(
                tf.compat.v1.train.GradientDescentOptimizer(0.1), 2)

        @tf.function
        def step():
            def replica():
                with tf.GradientTape() as tape:
                    loss = (w - 3.0) ** 2
                grads = tape.gradient(loss, [w])
                return opt.apply_gradients(zip(grads, [w]), global_step)
            return strategy.run(replica)

        coordinator.schedule(step)  # traces: apply_gradients builds state
        hook = opt.make_session_run_hook(is_chief=True)
        hook.begin()
        hook.after_create_session()
        for _ in range(10):
            coordinator.schedule(step)
        coordinator.join()
        hook.end()
    """

    def __init__(
        self,
        opt,
        replicas_to_aggregate,
        total_num_replicas=None,
        variable_averages=None,
        variables_to_average=None,
        use_locking=False,
        name="sync_replicas",
    ):
        """Wraps `opt`; see `tf.compat.v1.train.SyncReplicasOptimizer`.

        Args:
          opt: A `tf.compat.v1.train.Optimizer` or a tf_keras optimizer.
          replicas_to_aggregate: Gradients taken per variable per round.
          total_num_replicas: Workers; `None` means `replicas_to_aggregate`.
          variable_averages: Optional `tf.train.ExponentialMovingAverage`.
          variables_to_average: Passed to `variable_averages.apply`.
          use_locking: Kept for compatibility (TF1 uses it for nothing).
          name: Name prefix of the created resources.
        """
        if total_num_replicas is None:
            total_num_replicas = replicas_to_aggregate
        logging.info(
            "SyncReplicasV2: replicas_to_aggregate=%s; total_num_replicas=%s",
            replicas_to_aggregate,
            total_num_replicas,
        )
        self._opt = opt
        self._replicas_to_aggregate = replicas_to_aggregate
        self._total_num_replicas = total_num_replicas
        self._tokens_per_step = max(total_num_replicas, replicas_to_aggregate)
        self._variable_averages = variable_averages
        self._variables_to_average = variables_to_average
        self._use_locking = use_locking
        self._name = name
        self._gradients_applied = False
        self._round = None
        self._given_step = None
        self._states = []
        self._lock = threading.Lock()
        self._strategy = tf.distribute.get_strategy()
        # Local steps are per worker: have the strategy's coordinator pass
        # each scheduled step its worker's index (read at schedule time).
        self._strategy._tf2sync_worker_ids = True

    # Pass-throughs ---------------------------------------------------------

    def compute_gradients(self, *args, **kwargs):
        """Returns `opt.compute_gradients(...)` unchanged (TF1 optimizers)."""
        return self._opt.compute_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        """Returns `opt.get_slot(...)`."""
        return self._opt.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        """Returns `opt.get_slot_names(...)`."""
        return self._opt.get_slot_names(*args, **kwargs)

    def variables(self):
        """The inner optimizer's variables (local steps excluded)."""
        opt = self._opt
        if isinstance(opt, tf.compat.v1.train.Optimizer):
            # Optimizer.variables() filters by the thread's default graph;
            # the slots were created by the chief's round thread.
            found = list(opt._non_slot_variables()) + [
                v for slots in opt._slots.values() for v in slots.values()
            ]
            return sorted(found, key=lambda v: v.name)
        variables = opt.variables
        return variables() if callable(variables) else list(variables)

    # Observability ---------------------------------------------------------

    @property
    def local_steps(self):
        """The int vector of every worker's local step (on the step's ps).

        Shared by every shim optimizer of the same round.
        """
        return None if self._round is None else self._round.local_steps

    @property
    def rounds(self):
        """An int64 variable counting chief rounds that applied."""
        return None if self._round is None else self._round.rounds

    # Worker side -----------------------------------------------------------

    def _accumulators(self):
        return [a for s in self._states for a in s.accumulators if a]

    def _state_for(self, grads_and_vars):
        keys = [id(v) for _, v in grads_and_vars]
        for state in self._states:
            if [id(v) for v in state.variables] == keys:
                return state
        state = _State(self, grads_and_vars)
        self._states.append(state)
        self._round.rebuild()
        return state

    def _join_round(self, global_step):
        """Joins (or starts) the round of the current traced step, once."""
        if self._round is not None:
            if global_step is not None and global_step is not self._given_step:
                raise ValueError(
                    "This SyncReplicasOptimizer already uses another "
                    "global_step."
                )
            if _open_round() is None:
                _set_open_round(self._round)
            return self._round
        sync_round = _open_round()
        if sync_round is None:
            if global_step is None:
                raise ValueError("Global step is required to check staleness")
            sync_round = _Round(self, global_step)
            _set_open_round(sync_round)
        sync_round.add_member(self, global_step)
        self._round = sync_round
        self._given_step = global_step
        return sync_round

    @property
    def _global_step(self):
        return None if self._round is None else self._round.global_step

    @property
    def _sync_token_queue(self):
        return None if self._round is None else self._round.token_queue

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Pushes this worker's gradients, then waits for one token.

        Call inside `strategy.run` in a function scheduled on the
        coordinator. The first call (while tracing) creates the
        accumulators, the token queue and the local steps eagerly.

        Several shim optimizers applied in the same traced step form one
        round: the first one applied must be given `global_step`; the
        others may pass `global_step=None` (or their own step variable)
        and join it. The step then takes one token, after all the pushes.

        Args:
          grads_and_vars: `(gradient, variable)` pairs.
          global_step: The variable the inner apply increments.
          name: Ignored, as in TF1.

        Returns:
          The new local step of this worker (the token's value).

        Raises:
          ValueError: As TF1 (see the messages in the spec).
        """
        del name
        if not grads_and_vars:
            raise ValueError("Must supply at least one variable")
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            raise ValueError("No variables provided.")
        if all(g is None for g, _ in grads_and_vars):
            raise ValueError(
                "No gradients provided for any variable: "
                f"{[v.name for _, v in grads_and_vars]}."
            )
        with self._lock:
            sync_round = self._join_round(global_step)
            with tf.init_scope():
                state = self._state_for(grads_and_vars)
        ctx = sync_round.step_context()
        pushes = []
        for (grad, _), acc in zip(grads_and_vars, state.accumulators):
            if acc is not None:
                pushes.append(acc.apply(grad, ctx.local_step))
        self._gradients_applied = True
        return sync_round.finish_step(ctx, pushes)

    # Chief side ------------------------------------------------------------

    def _inner_apply(self, grads_and_vars, global_step):
        opt = self._opt
        strategy = self._strategy
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        with strategy.scope(), aggregation.sync_apply_scope():
            if isinstance(opt, tf.compat.v1.train.Optimizer):
                # Each apply appends to this (round) graph's TRAIN_OP and
                # compares with `==`, which fails on a previous member's
                # variable-valued update: start each one empty.
                key = tf.compat.v1.GraphKeys.TRAIN_OP
                del tf.compat.v1.get_collection_ref(key)[:]
                return opt._distributed_apply(
                    strategy, grads_and_vars, global_step
                )
            if isinstance(opt, tf.keras.optimizers.legacy.Optimizer):
                var_list = [v for _, v in grads_and_vars]
                with tf.init_scope():
                    opt._create_all_weights(var_list)
                update = opt._distributed_apply(
                    strategy,
                    grads_and_vars,
                    opt._prepare(var_list),
                    name=self._name,
                )
            else:
                with tf.init_scope():
                    opt.build([v for _, v in grads_and_vars])
                update = opt._distributed_apply_gradients_fn(
                    strategy, grads_and_vars
                )
            iterations = getattr(opt, "iterations", None)
            if global_step is None or iterations is global_step:
                return update
            deps = [update] if update is not None else []
            with tf.control_dependencies(deps):
                return global_step.assign_add(1, read_value=False)

    def get_chief_queue_runner(self):
        """The `ChiefRunner` (start()/stop()) running the sync rounds."""
        if not self._gradients_applied:
            raise ValueError("Should be called after apply_gradients().")
        return self._round.runner

    def get_init_tokens_op(self, num_tokens=-1):
        """A callable that enqueues `num_tokens` tokens of `global_step`.

        Args:
          num_tokens: Tokens; -1 means `replicas_to_aggregate`.

        Returns:
          A zero-argument callable (TF2's counterpart of the op).

        Raises:
          ValueError: Before `apply_gradients`, or with too few tokens.
        """
        if not self._gradients_applied:
            raise ValueError(
                "get_init_tokens_op() should be called after apply_gradients()."
            )
        tokens_needed = self._replicas_to_aggregate - self._total_num_replicas
        if num_tokens == -1:
            num_tokens = self._replicas_to_aggregate
        elif num_tokens < tokens_needed:
            raise ValueError(
                f"Too few tokens to finish the first step: {int(num_tokens)} "
                f"(given) vs {int(tokens_needed)} (needed)"
            )

        def init_tokens():
            if num_tokens > 0:
                step = self._global_step.read_value()
                with tf.device(self._global_step.device):
                    self._sync_token_queue.enqueue_many(
                        [tf.fill([num_tokens], step)]
                    )

        return init_tokens

    def make_session_run_hook(self, is_chief, num_tokens=-1):
        """TF1's hook: call `begin()` and `after_create_session()` once."""
        return _SyncReplicasOptimizerHook(self, is_chief, num_tokens)
