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

import tensorflow as tf
from absl import logging
from tensorflow.python.ops import resource_variable_ops

from tf2sync._src import aggregation
from tf2sync._src import strategy as strategy_lib

_UIDS = itertools.count()


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

    def __init__(self, optimizer):
        self._optimizer = optimizer
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
                logging.error("SyncReplicasOptimizer chief round failed: %s", e)

    def stop(self, timeout: float = 30.0):
        """Stops the thread: unblocks its takes and skips that round's apply.

        The accumulators are left with their steps bumped; a new
        `after_create_session` reseeds them.
        """
        if not self.running:
            return
        self._stopping = True
        self._optimizer._stop_flag.assign(True)
        rta = self._optimizer._replicas_to_aggregate
        for acc in self._optimizer._accumulators():
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
        opt = self._sync_optimizer
        if self._is_chief:
            self._q_runner.stop()
            opt._chief_init()
            self._init_tokens()
            self._q_runner.start()
        else:
            opt._local_step_init()

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

    Guarantees: the inner optimizer applies exactly once per round (never
    once per worker); each applied gradient is the mean of at least
    `replicas_to_aggregate` accepted gradients; `global_step` rises by 1 per
    round (with a `tf.compat.v1.train` optimizer, or with a tf_keras
    optimizer when `global_step` is not its `iterations`). Like TF1, each
    worker wastes one step after (re)start.

    Requirements: a `tf2sync.SyncParameterServerStrategy` with no
    `tf2sync.SyncOptimizer` and `strategy._tf2sync_worker_ids = True` set
    before its `ClusterCoordinator` is created; construct this optimizer and
    every variable under `strategy.scope()`.

    Example::

        strategy = tf2sync.SyncParameterServerStrategy(
            resolver, replicas_to_aggregate=2)
        strategy._tf2sync_worker_ids = True
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
        self._global_step = None
        self._sync_token_queue = None
        self._chief_queue_runner = None
        self._local_steps = None
        self._states = []
        self._lock = threading.Lock()
        self._round_fn = None
        self._stop_flag = None
        self._rounds = None
        self._strategy = tf.distribute.get_strategy()

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
        """The int vector of every worker's local step (on the step's ps)."""
        return self._local_steps

    @property
    def rounds(self):
        """An int64 variable counting chief rounds that applied."""
        return self._rounds

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
        self._round_fn = self._make_round_fn()
        return state

    def _build_shared(self, global_step):
        """The token queue, local steps and flags, once, eagerly."""
        if self._sync_token_queue is not None:
            if global_step is not self._global_step:
                raise ValueError(
                    "This SyncReplicasOptimizer already uses another "
                    "global_step."
                )
            return
        dtype = global_step.dtype.base_dtype
        device = global_step.device
        num_workers = max(
            self._total_num_replicas,
            getattr(self._strategy.extended, "_num_workers", 1),
        )
        with tf.init_scope():
            current = global_step.read_value()
            self._local_steps = _plain_variable(
                tf.fill([num_workers], current),
                device,
                f"{self._name}_sync_rep_local_step",
            )
            with tf.device(device):
                self._sync_token_queue = tf.queue.FIFOQueue(
                    capacity=-1,
                    dtypes=[dtype],
                    shapes=[()],
                    name=f"{self._name}_sync_token_q",
                )
            self._stop_flag = resource_variable_ops.ResourceVariable(
                False, trainable=False, name=f"{self._name}_stop"
            )
            self._rounds = _plain_variable(
                tf.constant(0, tf.int64), device, f"{self._name}_rounds"
            )
        self._global_step = global_step
        self._chief_queue_runner = ChiefRunner(self)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Pushes this worker's gradients, then waits for one token.

        Call inside `strategy.run` in a function scheduled on the
        coordinator. The first call (while tracing) creates the
        accumulators, the token queue and the local steps eagerly.

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
        if global_step is None:
            raise ValueError("Global step is required to check staleness")
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            raise ValueError("No variables provided.")
        if all(g is None for g, _ in grads_and_vars):
            raise ValueError(
                "No gradients provided for any variable: "
                f"{[v.name for _, v in grads_and_vars]}."
            )
        with self._lock, tf.init_scope():
            self._build_shared(global_step)
            state = self._state_for(grads_and_vars)
        worker = strategy_lib.current_worker()
        if worker is None:
            worker = tf.constant(0, tf.int64)
        local_step = tf.gather(self._local_steps, worker)
        pushes = []
        for (grad, _), acc in zip(grads_and_vars, state.accumulators):
            if acc is not None:
                pushes.append(acc.apply(grad, local_step))
        with tf.control_dependencies(pushes):
            with tf.device(self._global_step.device):
                token = self._sync_token_queue.dequeue()
        self._gradients_applied = True
        update = self._local_steps.scatter_update(
            tf.IndexedSlices(tf.reshape(token, [1]), tf.reshape(worker, [1]))
        )
        with tf.control_dependencies([update]):
            return tf.identity(token)

    # Chief side ------------------------------------------------------------

    def _inner_apply(self, grads_and_vars):
        opt = self._opt
        strategy = self._strategy
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        global_step = self._global_step
        with strategy.scope(), aggregation.sync_apply_scope():
            if isinstance(opt, tf.compat.v1.train.Optimizer):
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
            if iterations is global_step:
                return update
            deps = [update] if update is not None else []
            with tf.control_dependencies(deps):
                return global_step.assign_add(1, read_value=False)

    def _make_round_fn(self):
        states = list(self._states)
        rta = self._replicas_to_aggregate

        @tf.function
        def sync_round():
            grads_and_vars = []
            for state in states:
                for var, acc in zip(state.variables, state.accumulators):
                    grad = acc.take(rta) if acc is not None else None
                    grads_and_vars.append((grad, var))
            taken = [
                t
                for g, _ in grads_and_vars
                if g is not None
                for t in tf.nest.flatten(g, expand_composites=True)
            ]

            def apply():
                update = self._inner_apply(grads_and_vars)
                with tf.control_dependencies(
                    [update] if update is not None else []
                ):
                    step = self._global_step.read_value()
                    with tf.device(self._global_step.device):
                        release = self._sync_token_queue.enqueue_many(
                            [tf.fill([self._tokens_per_step], step)]
                        )
                ops = [release]
                if self._variable_averages is not None:
                    with tf.control_dependencies([release]):
                        ops.append(
                            self._variable_averages.apply(
                                self._variables_to_average
                            )
                        )
                with tf.control_dependencies(ops):
                    return self._rounds.assign_add(1, read_value=False)

            with tf.control_dependencies(taken):
                stop = self._stop_flag.read_value()
            with tf.control_dependencies(taken):
                tf.cond(stop, tf.no_op, apply)

        return sync_round

    def _chief_init(self):
        step = self._global_step.read_value()
        self._local_steps.assign(tf.fill(tf.shape(self._local_steps), step))
        for acc in self._accumulators():
            acc.set_global_step(step)

    def _local_step_init(self):
        step = self._global_step.read_value()
        self._local_steps.assign(tf.fill(tf.shape(self._local_steps), step))

    def get_chief_queue_runner(self):
        """The `ChiefRunner` (start()/stop()) running the sync rounds."""
        if not self._gradients_applied:
            raise ValueError("Should be called after apply_gradients().")
        return self._chief_queue_runner

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
