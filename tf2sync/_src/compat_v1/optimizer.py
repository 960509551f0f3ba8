"""TF1's `SyncReplicasOptimizer`, in TF2 on tf2sync's core barrier.

A migration shim: TF1 programs written against
`tf.compat.v1.train.SyncReplicasOptimizer` keep their calls
(`apply_gradients(grads_and_vars, global_step)`, `make_session_run_hook`,
`get_init_tokens_op`, ...) and their numbers, but run on
`tf2sync.SyncParameterServerStrategy` with a `ClusterCoordinator`, in a
custom loop or in `model.fit`. See docs/migrating.md. The step protocol is
in `engine.py`; the barrier, accumulation and apply are the core's
(`aggregation.py`).
"""

from __future__ import annotations

import tensorflow as tf
from absl import logging

from tf2sync._src import config as config_lib
from tf2sync._src import keras_compat
from tf2sync._src import sharding
from tf2sync._src import strategy as strategy_lib
from tf2sync._src.compat_v1 import engine
from tf2sync._src.compat_v1 import hooks
from tf2sync._src.compat_v1 import inner
from tf2sync._src.internals import checkpoints
from tf2sync._src.internals import keras_optimizers

_KERAS = keras_compat.KERAS_OPTIMIZERS

# TF1's messages, word for word, then what to do in TF2.
TF1_NOT_APPLIED = "Should be called after apply_gradients()."
TF1_TOKENS_NOT_APPLIED = (
    "get_init_tokens_op() should be called after apply_gradients()."
)
_CALLED_TOO_EARLY = (
    "{} In TF2, trace the step first (`step.get_concrete_function(...)`, "
    "whose strategy.run calls apply_gradients), or drop the call: the "
    "coordinator starts the round before the first scheduled step."
)


class SyncReplicasOptimizer(tf.compat.v1.train.Optimizer):
    """TF1's `SyncReplicasOptimizer` for TF2 ParameterServerStrategy.

    Protocol (TF1's, per `tf.compat.v1.train.SyncReplicasOptimizer`):

    * Worker step (`apply_gradients`, called inside `strategy.run` of a
      function scheduled on a `ClusterCoordinator`): push the step's
      gradients once (every shim optimizer's of the step), tagged with
      this worker's local step; then block for one token from the token
      queue (beside `global_step`) and store it as the new local step. A
      push is accepted iff its tag is at least the global step, otherwise
      it is dropped (stale).
    * Round (on the ps, in the core's critical section, by the push that
      completes it: see `aggregation`): the `replicas_to_aggregate`-th
      accepted push applies the mean of the accepted gradients (per row
      for `IndexedSlices`, as TF1's sparse accumulator), one inner apply
      (which increments `global_step` by 1), the optional moving averages
      of the updated values, then `max(total, replicas_to_aggregate)`
      tokens carrying the new `global_step`. A push is accepted or dropped
      for all its variables at once.
    * Chief init: local steps := global step, `num_tokens` (default
      `replicas_to_aggregate`) tokens carrying it. The coordinator does
      this by itself after it traced the first scheduled step and before
      it dispatches it; TF1's `hook.begin(); hook.after_create_session()`,
      called first, does it with the hook's `num_tokens`.
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
          opt: A `tf.compat.v1.train.Optimizer` or a tf_keras optimizer
            (a `tf2sync.MultiOptimizer` of them too: one per variable group).
          replicas_to_aggregate: Gradients taken per variable per round.
          total_num_replicas: Workers; `None` means `replicas_to_aggregate`.
          variable_averages: Optional `tf.train.ExponentialMovingAverage`.
          variables_to_average: Passed to `variable_averages.apply`.
          use_locking: Kept for compatibility (TF1 uses it for nothing).
          name: Name prefix of the created resources.

        Raises:
          TypeError: If `opt` is neither kind of optimizer (or is already
            synchronous: a shim or a `tf2sync.SyncOptimizer`), or a count
            is not an int.
          ValueError: If a count is not positive.
        """
        if isinstance(
            opt,
            (SyncReplicasOptimizer, tf.compat.v1.train.SyncReplicasOptimizer),
        ) or keras_compat.is_synchronous(opt):
            raise TypeError(
                "`opt` is already synchronous: give the optimizer it wraps "
                "(one SyncReplicasOptimizer goes around the whole optimizer, "
                "around a tf2sync.MultiOptimizer for variable groups). "
                f"Received: opt={opt!r}"
            )
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
        if variables_to_average is not None:
            # A sharded variable's average is one shadow per shard.
            variables_to_average = sharding.shards(
                tf.nest.flatten(variables_to_average)
            )
        self._variables_to_average = variables_to_average
        super().__init__(use_locking, name)
        if keras_optimizers.is_trackable(opt):  # slots in checkpoints
            keras_optimizers.track_child(self, opt, "opt")
        self._gradients_applied = False
        self._given_step = None
        self._strategy = tf.distribute.get_strategy()
        self._protocol = None
        if isinstance(self._strategy, strategy_lib.SyncParameterServerStrategy):
            self._protocol = engine.PushFirstStep.of(self._strategy)

    # Pass-throughs ---------------------------------------------------------

    def compute_gradients(self, loss, var_list=None, *args, **kwargs):
        """Returns `opt.compute_gradients(...)` (TF1 optimizers).

        A `ShardedVariable` in `var_list` (a table created under the
        strategy's `variable_partitioner`, TF1's `PartitionedVariable`)
        stands for its shards: one `(gradient, shard)` pair each, in order,
        as TF1 listed the partitions.
        """
        if var_list is not None:
            flat = tf.nest.flatten(var_list)
            if any(sharding.is_sharded(v) for v in flat):
                var_list = sharding.shards(flat)
        return self._opt.compute_gradients(loss, var_list, *args, **kwargs)

    def get_slot(self, *args, **kwargs):
        """Returns `opt.get_slot(...)`."""
        return self._opt.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        """Returns `opt.get_slot_names(...)`."""
        return self._opt.get_slot_names(*args, **kwargs)

    def __dir__(self):
        # The slots are saved through the inner optimizer (a child).
        return checkpoints.dir_without_slot_owner(super().__dir__())

    def variables(self):
        """The inner optimizer's variables (local steps excluded)."""
        return inner.variables(self._opt)

    # Observability ---------------------------------------------------------

    @property
    def local_steps(self):
        """The vector of every worker's local step (on the step's ps).

        Indexed by the worker that runs the step (decided when it runs),
        in the global step's dtype (TF1's local step's). Shared by every
        shim optimizer of the same round; None before the first
        `apply_gradients`.
        """
        return self._protocol.local_steps if self._protocol else None

    @property
    def rounds(self):
        """An int64 variable counting the rounds applied."""
        return self._protocol.rounds if self._protocol else None

    @property
    def _sync_token_queue(self):
        # TF1's attribute: the token queue (the core barrier's, int64),
        # seen in the global step's dtype as TF1's was.
        return self._protocol.token_queue() if self._protocol else None

    @property
    def _accumulator_list(self):
        # TF1's attribute: `(accumulator, device)` per variable with a
        # gradient. The core accumulates a push for all its variables at
        # once, so each one's count is the round's pending count.
        aggregator = self._protocol.aggregator if self._protocol else None
        if aggregator is None:
            return []
        return [
            (_PendingCount(aggregator), var.device)
            for var in self._protocol.variables_of(self)
        ]

    # Worker side -----------------------------------------------------------

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Pushes this worker's gradients, then waits for one token.

        Call inside `strategy.run` in a function scheduled on the
        coordinator (or eagerly, one step per call). The first call creates
        the barrier, the local steps and the inner optimizer's slots
        eagerly.

        Several shim optimizers applied in the same traced step form one
        round: at least one of them must be given `global_step`; the
        others may pass `global_step=None` (or their own step variable)
        and join it. The step pushes once and takes one token, after all
        of them.

        Args:
          grads_and_vars: `(gradient, variable)` pairs.
          global_step: The variable the inner apply increments.
          name: Ignored, as in TF1.

        Returns:
          The new local step of this worker (the token's value).

        Raises:
          ValueError: With TF1's messages (listed in docs/migrating.md), or
            where a step cannot be one push (see the messages).
        """
        del name
        if not grads_and_vars:
            raise ValueError("Must supply at least one variable")
        grads_and_vars = _per_shard(list(grads_and_vars))
        if not grads_and_vars:
            raise ValueError("No variables provided.")
        if all(g is None for g, _ in grads_and_vars):
            raise ValueError(
                "No gradients provided for any variable: "
                f"{[v.name for _, v in grads_and_vars]}."
            )
        for grad, _ in grads_and_vars:
            if grad is None or isinstance(grad, tf.IndexedSlices):
                continue
            if isinstance(grad, tf.SparseTensor) or not tf.is_tensor(grad):
                raise ValueError("Unknown grad type!")
        if global_step is not None:
            if self._given_step is not None and global_step is not (
                self._given_step
            ):
                raise ValueError(
                    "This SyncReplicasOptimizer already uses another "
                    "global_step."
                )
            self._given_step = global_step
        protocol = self._protocol
        if protocol is None:
            if tf.executing_eagerly() and global_step is None:
                raise ValueError(engine.GLOBAL_STEP_REQUIRED)
            raise ValueError(
                "SyncReplicasOptimizer must be created under "
                "`tf2sync.SyncParameterServerStrategy(...).scope()`. "
                f"Received strategy: {type(self._strategy).__name__}."
            )
        if (
            tf.executing_eagerly()
            and global_step is None
            and protocol.global_step is None
        ):
            raise ValueError(engine.GLOBAL_STEP_REQUIRED)
        result = protocol.record(
            self,
            [(g, v) for g, v in grads_and_vars if g is not None],
            global_step,
        )
        self._gradients_applied = True
        return result

    # Chief side ------------------------------------------------------------

    def get_chief_queue_runner(self):
        """The `ChiefRunner` (start()/stop()) of the chief's side."""
        if not self._gradients_applied:
            raise ValueError(_CALLED_TOO_EARLY.format(TF1_NOT_APPLIED))
        return hooks.ChiefRunner(self._protocol)

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
            raise ValueError(_CALLED_TOO_EARLY.format(TF1_TOKENS_NOT_APPLIED))
        tokens_needed = self._replicas_to_aggregate - self._total_num_replicas
        if num_tokens == -1:
            num_tokens = self._replicas_to_aggregate
        elif num_tokens < tokens_needed:
            raise ValueError(
                f"Too few tokens to finish the first step: {int(num_tokens)} "
                f"(given) vs {int(tokens_needed)} (needed)"
            )
        return hooks.InitTokens(self._protocol, num_tokens)

    def make_session_run_hook(self, is_chief, num_tokens=-1):
        """TF1's hook; optional in TF2, where the coordinator starts rounds.

        Args:
          is_chief: Whether `after_create_session` runs the chief's part.
          num_tokens: Initial tokens; -1 means `replicas_to_aggregate`.

        Returns:
          An object with TF1's `begin`, `after_create_session` and `end`.
        """
        return hooks.SessionRunHook(self, is_chief, num_tokens)


def _per_shard(grads_and_vars):
    """`grads_and_vars` with each `ShardedVariable` paired shard by shard.

    A shard is a variable of its own (on its own ps, accumulated and
    applied there): a `ShardedVariable` is accepted with one gradient per
    shard (a list or tuple, `None` for a shard without one) or with no
    gradient, and refused with a gradient of the whole variable.
    """
    pairs = []
    for grad, var in grads_and_vars:
        if not sharding.is_sharded(var):
            pairs.append((grad, var))
            continue
        parts = var.variables
        if grad is None:
            grad = [None] * len(parts)
        if not isinstance(grad, (list, tuple)) or len(grad) != len(parts):
            raise ValueError(
                "SyncReplicasOptimizer.apply_gradients got the sharded "
                f"variable {_sharded_name(parts)} ({len(parts)} shards) with "
                f"{_describe(grad)}: pass one gradient per shard, paired "
                "with the shards (`var.variables`), as "
                "`compute_gradients(loss, var_list=[var, ...])` or "
                "`tape.gradient(loss, var.variables)` give them."
            )
        pairs.extend(zip(grad, parts))
    return pairs


def _sharded_name(parts):
    # A `ShardedVariable` is named "ShardedVariable"; its shards
    # "<name>/part_<i>:0".
    return parts[0].name.rsplit("/part_", 1)[0]


def _describe(grad):
    if isinstance(grad, (list, tuple)):
        return f"{len(grad)} gradients"
    return f"one gradient ({type(grad).__name__}) of the whole variable"


class _PendingCount:
    """TF1's accumulator `num_accumulated()`, read from the core barrier."""

    def __init__(self, aggregator):
        self._aggregator = aggregator

    def num_accumulated(self):
        """Gradients accepted since the round's last apply."""
        return self._aggregator.count.read_value()
