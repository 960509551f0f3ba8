"""TF1's `SyncReplicasOptimizer`, in TF2 eager on ParameterServerStrategy.

A migration shim: TF1 programs written against
`tf.compat.v1.train.SyncReplicasOptimizer` keep their calls
(`apply_gradients(grads_and_vars, global_step)`, `make_session_run_hook`,
`get_init_tokens_op`, ...) and their numbers, but run on
`tf2sync.SyncParameterServerStrategy` with a `ClusterCoordinator`, in a
custom loop or in `model.fit`. See docs/migrating.md. The accumulators are
in `compat_v1_accumulators.py`, the round the optimizers of one step share
in `compat_v1_round.py`.
"""

from __future__ import annotations

import itertools
import threading

import tensorflow as tf
from absl import logging

from tf2sync._src import aggregation
from tf2sync._src import compat_v1_accumulators as accumulators
from tf2sync._src import compat_v1_round as round_lib
from tf2sync._src import config as config_lib
from tf2sync._src import keras_compat
from tf2sync._src import strategy as strategy_lib

_UIDS = itertools.count()


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
                acc = accumulators.SparseAccumulator(var, name)
            elif isinstance(grad, tf.Tensor) or tf.is_tensor(grad):
                if isinstance(grad, tf.SparseTensor):
                    raise ValueError("Unknown grad type!")
                acc = accumulators.DenseAccumulator(var, name + "/grad_accum")
            else:
                raise ValueError("Unknown grad type!")
            self.accumulators.append(acc)


_KERAS = (keras_compat._NEW, keras_compat._LEGACY)


class SyncReplicasOptimizer(tf.compat.v1.train.Optimizer):
    """TF1's `SyncReplicasOptimizer` for TF2 ParameterServerStrategy.

    Protocol (TF1's, per `tf.compat.v1.train.SyncReplicasOptimizer`):

    * Worker step (`apply_gradients`, called inside `strategy.run` of a
      function scheduled on a `ClusterCoordinator`): push every gradient to
      its variable's accumulator on the variable's ps, tagged with this
      worker's local step; then block for one token from the token queue
      (beside `global_step`) and store it as the new local step. A gradient
      is accepted iff its tag is at least the accumulator's step, otherwise
      it is silently dropped (stale).
    * Chief round (a daemon thread on the coordinator): `take(
      replicas_to_aggregate)` on every accumulator (the mean of all
      gradients accepted since the last take, per row for `IndexedSlices`;
      each take bumps that accumulator's step), one inner apply (which
      increments `global_step` by 1), then `max(total, replicas_to_aggregate)`
      tokens carrying the new `global_step`, then the optional moving
      averages.
    * Chief init: local steps := global step, accumulator steps := global
      step, `num_tokens` (default `replicas_to_aggregate`) tokens, then the
      round thread starts. The coordinator does this by itself after it
      traced the first scheduled step and before it dispatches it; TF1's
      `hook.begin(); hook.after_create_session()`, called first, does it
      with the hook's `num_tokens`.
    * Several shim optimizers applied in the same traced step form one
      round (unlike TF1): any one of them may be given `global_step`, the
      others may pass `None` and join it (if none is given, tracing the
      step raises TF1's error); one token queue, one local step per worker,
      one token per worker step (after every push), one chief round
      applying each inner optimizer once and incrementing each distinct
      global step once, tokens released once.

    Guarantees: the inner optimizer applies exactly once per round (never
    once per worker); each applied gradient is the mean of at least
    `replicas_to_aggregate` accepted gradients; `global_step` rises by 1 per
    round (with a `tf.compat.v1.train` optimizer, or with a tf_keras
    optimizer when `global_step` is not its `iterations`). Like TF1, each
    worker wastes one step after (re)start. Retracing a step adds no
    accumulator, local step or round.

    Requirements: a `tf2sync.SyncParameterServerStrategy` with no
    `tf2sync.SyncOptimizer`; construct this optimizer and every variable
    under `strategy.scope()`. In `model.compile(optimizer=...)` it runs
    through tf_keras's wrapper of TF1 optimizers, which passes the model's
    `optimizer.iterations` as `global_step`.

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

        for _ in range(10):
            coordinator.schedule(step)  # the first also starts the chief
        coordinator.join()

    With `model.fit`, compile with the shim under `strategy.scope()`::

        model.compile(
            optimizer=tf2sync.compat.v1.SyncReplicasOptimizer(
                tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), 2),
            loss="mse")
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

        Raises:
          TypeError: If `opt` is neither kind of optimizer, or a count is
            not an int.
          ValueError: If a count is not positive.
        """
        if not isinstance(opt, (tf.compat.v1.train.Optimizer, *_KERAS)):
            raise TypeError(
                "`opt` must be a tf.compat.v1.train.Optimizer or a tf_keras "
                f"optimizer. Received: opt={opt!r}"
            )
        config = config_lib.SyncConfig.create(
            replicas_to_aggregate, total_num_replicas
        )
        logging.info(
            "SyncReplicasV2: replicas_to_aggregate=%s; total_num_replicas=%s",
            config.replicas_to_aggregate,
            config.total_num_replicas,
        )
        self._opt = opt
        self._replicas_to_aggregate = config.replicas_to_aggregate
        self._total_num_replicas = config.total_num_replicas
        self._tokens_per_step = config.tokens_per_step
        self._variable_averages = variable_averages
        self._variables_to_average = variables_to_average
        super().__init__(use_locking, name)
        if isinstance(opt, tf.__internal__.tracking.Trackable):
            self._track_trackable(opt, name="opt")  # slots in checkpoints
        self._gradients_applied = False
        self._round = None
        self._given_step = None
        self._states = []
        self._lock = threading.Lock()
        self._strategy = tf.distribute.get_strategy()
        if isinstance(self._strategy, strategy_lib.SyncParameterServerStrategy):
            # Local steps are per worker: have the strategy's coordinator
            # pass each scheduled step its worker's index.
            self._strategy._tf2sync_worker_ids = True
            after_run = self._strategy._tf2sync_after_run
            if round_lib.end_traced_step not in after_run:
                after_run.append(round_lib.end_traced_step)
            before_run = self._strategy._tf2sync_before_run
            if round_lib.previous_token not in before_run:
                before_run.append(round_lib.previous_token)

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

    def __dir__(self):
        # TF2 checkpoints treat every object that lists `get_slot_names` as
        # a slot owner. The slots are the inner optimizer's (a tracked child,
        # saved and restored through it); listed here too, each would be
        # saved twice and the save would fail.
        return [n for n in super().__dir__() if n != "get_slot_names"]

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

    def _join_round(self, global_step, var):
        """Joins (or starts) the round of the current traced step, once."""
        if self._round is not None:
            if global_step is not None and global_step is not self._given_step:
                raise ValueError(
                    "This SyncReplicasOptimizer already uses another "
                    "global_step."
                )
            if round_lib.open_round() is None:
                round_lib.set_open_round(self._round)
            return self._round
        sync_round = round_lib.open_round()
        if sync_round is None:
            if global_step is None and tf.executing_eagerly():
                raise ValueError(round_lib._GLOBAL_STEP_REQUIRED)
            # In a traced step, a later member may name the global step;
            # the strategy checks after `run` that one did.
            device = (global_step if global_step is not None else var).device
            sync_round = round_lib.Round(self, device, global_step)
            round_lib.set_open_round(sync_round)
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
            sync_round = self._join_round(global_step, grads_and_vars[0][1])
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
                self._round.enqueue_tokens(num_tokens)

        return init_tokens

    def make_session_run_hook(self, is_chief, num_tokens=-1):
        """TF1's hook; optional in TF2, where the coordinator starts rounds.

        Args:
          is_chief: Whether `after_create_session` runs the chief's part.
          num_tokens: Initial tokens; -1 means `replicas_to_aggregate`.

        Returns:
          An object with TF1's `begin`, `after_create_session` and `end`.
        """
        return round_lib.SessionRunHook(self, is_chief, num_tokens)
