"""SyncOptimizer: makes a tf_keras optimizer synchronous under the strategy."""

from __future__ import annotations

import tensorflow as tf
import tf_keras

from tf2sync._src import aggregation
from tf2sync._src import ema
from tf2sync._src import keras_compat
from tf2sync._src import loss_scale
from tf2sync._src import strategy as strategy_lib
from tf2sync._src.internals import checkpoints
from tf2sync._src.internals import keras_optimizers
from tf2sync._src.internals import mixed_precision
from tf2sync._src.internals import ps_strategy


@tf_keras.utils.register_keras_serializable(package="tf2sync")
class SyncOptimizer(tf_keras.optimizers.legacy.Optimizer):
    """Wraps a tf_keras optimizer so that its updates are synchronous.

    Create it under `SyncParameterServerStrategy.scope()`. Each replica step
    pushes its gradients to the parameter servers holding the variables; the
    `replicas_to_aggregate`-th fresh push applies their **mean** (sum divided
    by the number of gradients accumulated, not summed) through the wrapped
    optimizer, exactly once, and `iterations` (the wrapped optimizer's, which
    is the global step) rises by exactly 1. Gradients computed from weights
    older than the current step are dropped and counted (`stale_dropped`).
    Dense gradients are packed into one tensor per parameter server; sparse
    (`tf.IndexedSlices`) gradients stay sparse end to end.

    The wrapped optimizer keeps its own semantics: learning-rate schedules
    (evaluated at the global step), clipping (applied to the mean), slots,
    weight decay and EMA. Its slots and step are saved in checkpoints under
    `inner_optimizer`.

    A push whose gradients are not all finite (NaN/Inf) is, by default
    (`nonfinite="skip"`), dropped and counted (`nonfinite_dropped`), and its
    token goes back so that another replica step can fill its place: one bad
    worker never makes the weights NaN. `nonfinite="raise"` fails the step
    instead, before anything is applied.

    A strategy trains through one `SyncOptimizer` at a time: creating
    another one (to compile a model again, say after changing which layers
    are trainable) replaces it, between runs. The replaced optimizer's
    steps then fail, when traced or at their first token, and never
    update a weight; the new one starts its own global step, as a new
    tf_keras optimizer does.

    Mixed precision: under a `mixed_float16` policy, or given a
    `tf.keras.mixed_precision.LossScaleOptimizer` (its settings are kept),
    the constructor returns a `LossScaleOptimizer` around the `SyncOptimizer`.
    Each worker scales its loss and unscales its gradients once, before
    aggregation; the dynamic scale lives on the ps and changes once per
    synchronous step (halved on a non-finite push, doubled after
    `dynamic_growth_steps` applied steps). `model.compile` does not wrap it
    again.

    Example::

        with strategy.scope():
            model = build_model()
            model.compile(
                optimizer=tf2sync.SyncOptimizer(tf.keras.optimizers.Adam()),
                loss="sparse_categorical_crossentropy")
    """

    # Marks the class for `keras_compat.is_synchronous` (no import cycle).
    _tf2sync_synchronous = True

    def __new__(cls, optimizer, *args, **kwargs):
        if not loss_scale.wants_loss_scaling(optimizer):
            return super().__new__(cls)
        options = loss_scale.options_of(optimizer)
        inner = loss_scale.unwrap(optimizer)
        sync = super().__new__(cls)
        sync.__init__(inner, *args, **kwargs)
        return loss_scale.SyncLossScaleOptimizer(sync, **options)

    def __init__(
        self,
        optimizer,
        *,
        nonfinite: str = "skip",
        ema_decay: float | None = None,
        name: str | None = None,
    ):
        """Wraps `optimizer` and creates the synchronous state eagerly.

        Args:
          optimizer: A tf_keras optimizer, `tf.keras.optimizers.*` or
            `tf.keras.optimizers.legacy.*` (or `tf2sync.MultiOptimizer`),
            not yet used.
          nonfinite: "skip" (drop and count a push with NaN/Inf gradients)
            or "raise" (fail the step).
          ema_decay: If set, keep exponential moving averages of the
            trained variables, updated once per synchronous step after the
            apply (see `ema_weights`); saved in checkpoints.
          name: Name of the wrapper; defaults to "Sync" + the inner name.

        Raises:
          TypeError: If `optimizer` is not a tf_keras optimizer, or is
            already a `SyncOptimizer`.
          ValueError: If not created under a `SyncParameterServerStrategy`
            scope, if that strategy has a `tf2sync.compat.v1` optimizer or
            is running steps of its current `SyncOptimizer`, or if
            `nonfinite` is not "skip" or "raise".
        """
        if getattr(self, "_tf2sync_initialized", False):
            return  # Built by __new__ for loss scaling.
        self._tf2sync_initialized = True
        keras_compat.check_optimizer(optimizer)
        if nonfinite not in ("skip", "raise"):
            raise ValueError(
                '`nonfinite` must be "skip" or "raise". Received: '
                f"nonfinite={nonfinite!r}"
            )
        self._nonfinite = nonfinite
        strategy = tf.distribute.get_strategy()
        if not isinstance(strategy, strategy_lib.SyncParameterServerStrategy):
            raise ValueError(
                "SyncOptimizer must be created under "
                "`tf2sync.SyncParameterServerStrategy(...).scope()`. "
                f"Received strategy: {type(strategy).__name__}. A plain "
                "ParameterServerStrategy has no step barrier, so it cannot "
                "run a synchronous optimizer."
            )
        keras_compat.check_created_in_scope(optimizer, strategy)
        strategy._check_can_attach()
        super().__init__(name=name or "Sync" + _inner_name(optimizer))
        self._optimizer = optimizer
        keras_optimizers.track_child(self, optimizer, "inner_optimizer")
        self._strategy = strategy
        with strategy.scope():
            global_step = optimizer.iterations  # created now if lazy
        self._aggregator = aggregation.Aggregator(
            strategy._sync_config,
            global_step,
            self._apply_aggregated,
            name=self._name,
            num_workers=ps_strategy.num_workers(strategy),
            increment_fn=self._increment_aggregated,
            variables_fn=lambda: keras_optimizers.optimizer_state_variables(
                optimizer
            ),
        )
        strategy._attach(self._aggregator)
        self._ema = None
        if ema_decay is not None:
            self._ema = ema.MovingAverages(ema_decay, strategy)
            self._aggregator.after_apply.append(self._ema.update_ops)

    # Delegation -----------------------------------------------------------

    @property
    def inner_optimizer(self):
        """The wrapped optimizer."""
        return self._optimizer

    @property
    def iterations(self):
        """The global step: the wrapped optimizer's `iterations`."""
        return self._optimizer.iterations

    @iterations.setter
    def iterations(self, variable):
        self._optimizer.iterations = variable

    @property
    def learning_rate(self):
        """The wrapped optimizer's learning rate (settable by callbacks)."""
        return self._optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self._optimizer.learning_rate = value

    lr = learning_rate

    def variables(self):
        """The wrapped optimizer's variables (step, slots, hyperparameters)."""
        return self._optimizer.variables()

    @property
    def weights(self):
        return self.variables()

    def get_slot_names(self):
        """Slot names of a legacy inner optimizer ([] for the new family)."""
        names = getattr(self._optimizer, "get_slot_names", None)
        return names() if names else []

    def get_slot(self, var, slot_name):
        """The legacy inner optimizer's slot `slot_name` of `var`."""
        return self._optimizer.get_slot(var, slot_name)

    def __dir__(self):
        # The slots are saved through the inner optimizer (a child).
        return checkpoints.dir_without_slot_owner(super().__dir__())

    def get_config(self):
        return {
            "name": self._name,
            "nonfinite": self._nonfinite,
            "ema_decay": self._ema.decay if self._ema else None,
            "optimizer": tf_keras.optimizers.serialize(self._optimizer),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds the wrapper, or its inner optimizer outside PSS.

        A model saved with its optimizer (`.keras`, SavedModel, h5) loads
        with a `SyncOptimizer` under a `SyncParameterServerStrategy` scope.
        Loaded where no parameter server strategy is current (a process that
        evaluates, predicts or exports), it gets the inner optimizer alone
        (a warning says so): there is no ps to aggregate on, and one process
        trains synchronously with it. Under a plain `ParameterServerStrategy`
        it is refused, as `SyncOptimizer(...)` is there.
        """
        config = dict(config)
        inner = tf_keras.optimizers.deserialize(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        if strategy_lib.outside_parameter_servers():
            strategy_lib.warn_loaded_alone(config.get("name"), inner)
            return inner
        loaded = cls(inner, **config)
        strategy_lib.warn_loaded_fresh(config.get("name"))
        return loaded

    # Synchronous state ----------------------------------------------------

    @property
    def stale_dropped(self) -> tf.Variable:
        """Pushed gradients dropped as stale (total, on the ps)."""
        return self._aggregator.stale_dropped

    @property
    def nonfinite_dropped(self) -> tf.Variable:
        """Pushes dropped for NaN/Inf gradients (total, on the ps)."""
        return self._aggregator.nonfinite_dropped

    @property
    def gradients_accepted(self) -> tf.Variable:
        """Pushed gradients accepted into an update (total, on the ps)."""
        return self._aggregator.accepted

    @property
    def ema_variables(self) -> list:
        """The moving averages (empty unless `ema_decay` was given)."""
        return list(self._ema.shadows) if self._ema else []

    def ema_weights(self):
        """Context manager: within it the model variables hold their EMA.

        Use it to evaluate or export the averaged model::

            with optimizer.ema_weights():
                model.evaluate(...)
                model.save("model.keras", include_optimizer=False)

        Raises:
          ValueError: If the optimizer was created without `ema_decay`.
        """
        if self._ema is None:
            raise ValueError(
                "ema_weights() needs SyncOptimizer(..., ema_decay=...). "
                "Received: ema_decay=None"
            )
        return self._ema.swapped()

    def _check_current(self):
        """Raises `ValueError` if a later `SyncOptimizer` replaced this one.

        A strategy trains through one `SyncOptimizer` at a time (the class
        doc); `apply_gradients`, `build` and `tf2sync.Trainer.train` call
        this first, so a replaced optimizer changes nothing.
        """
        if self._aggregator.retired:
            raise ValueError(
                f"This SyncOptimizer ({self._name}) was replaced by a later "
                "one created under its strategy (a strategy trains through "
                "one SyncOptimizer at a time): compile the model with the "
                "new one, or create each one when its training begins."
            )

    def build(self, var_list):
        """Creates the wrapped optimizer's slots eagerly, under the scope.

        `apply_gradients` does this on first use; call it yourself in a
        custom loop to have every variable exist before training.

        Args:
          var_list: The trainable variables this optimizer will update.

        Raises:
          ValueError: If a later `SyncOptimizer` replaced this one.
        """
        self._check_current()
        with tf.init_scope(), self._strategy.scope():
            keras_compat.build(self._optimizer, var_list)
        if self._ema is not None:
            new = len(self._ema.shadows)
            self._ema.build(var_list)
            for i in range(new, len(self._ema.shadows)):
                keras_optimizers.track_child(
                    self, self._ema.shadows[i], f"ema_{i}"
                )

    def apply_gradients(
        self, grads_and_vars, name=None, experimental_aggregate_gradients=True
    ):
        """Pushes this replica's gradients for a synchronous update.

        Must be called once per step inside `strategy.run` (as `model.fit`
        and the documented custom loop do).

        Args:
          grads_and_vars: `(gradient, variable)` pairs.
          name: Ignored (kept for signature compatibility).
          experimental_aggregate_gradients: Ignored: gradients are always
            aggregated on the parameter servers.

        Returns:
          A boolean tensor: True iff this push completed a step and applied.

        Raises:
          RuntimeError: If called outside a step of the strategy.
          ValueError: If no gradient is given for any variable, or a later
            `SyncOptimizer` replaced this one.
        """
        del name, experimental_aggregate_gradients
        grads_and_vars = list(grads_and_vars)
        if mixed_precision.is_wrapped_by_loss_scale_optimizer(
            self
        ) and not getattr(self, "_tf2sync_loss_scaled", False):
            raise TypeError(
                "SyncOptimizer is wrapped in a tf_keras LossScaleOptimizer, "
                "whose skipped steps would move the global step without a "
                "push. Put the LossScaleOptimizer inside instead: "
                "tf2sync.SyncOptimizer(LossScaleOptimizer(opt)), or just "
                "tf2sync.SyncOptimizer(opt) under a mixed_float16 policy."
            )
        step = strategy_lib.current_step()
        if step is None:
            raise RuntimeError(
                "SyncOptimizer.apply_gradients must run inside "
                "`strategy.run(...)` of the SyncParameterServerStrategy it "
                "was created under (model.fit does this; in a custom loop, "
                "call it from the function passed to strategy.run)."
            )
        self._check_current()
        if step.pushed:
            raise RuntimeError(
                "SyncOptimizer.apply_gradients was called twice in one "
                "step: a synchronous step pushes its gradients once."
            )
        if not any(g is not None for g, _ in grads_and_vars):
            raise ValueError(
                "No gradients provided for any variable: "
                f"{[v.name for _, v in grads_and_vars]}."
            )
        outside = [
            v.name
            for _, v in grads_and_vars
            if not self._strategy.extended.variable_created_in_scope(v)
        ]
        if outside:
            raise ValueError(
                f"Variables {outside} were created outside "
                "`strategy.scope()`: build the model under the "
                "SyncParameterServerStrategy scope, so that its variables "
                "live on the parameter servers."
            )
        step.pushed = True
        context = tf.distribute.get_replica_context()
        return context.merge_call(self._push, args=(step, grads_and_vars))

    def _push(self, strategy, step, grads_and_vars):
        tag = step.tag
        grads_and_vars = [
            (_sum_local(strategy, g), v) for g, v in grads_and_vars
        ]
        self.build([v for _, v in grads_and_vars])
        values = [
            g.values if isinstance(g, tf.IndexedSlices) else g
            for g, _ in grads_and_vars
            if g is not None
        ]
        if self._nonfinite == "raise":
            checks = [
                tf.debugging.assert_all_finite(
                    v, "tf2sync: non-finite gradient (nonfinite='raise')"
                )
                for v in values
            ]
            with tf.control_dependencies(checks):
                tag = tf.identity(tag)
        applied, step.stats = self._aggregator.push(
            tag,
            grads_and_vars,
            # Otherwise checked on the ps, from what the push sends anyway.
            check_finite=self._nonfinite != "raise",
            worker=step.worker,
            stats=step.want_stats,
            riders_from=step.first_op_here(),
        )
        return applied

    def _apply_aggregated(self, grads_and_vars, increment=True):
        return keras_compat.apply(self._optimizer, grads_and_vars, increment)

    def _increment_aggregated(self, var_list):
        return keras_compat.increment(self._optimizer, var_list)


def _inner_name(optimizer):
    return (
        str(keras_optimizers.optimizer_name(optimizer))
        or type(optimizer).__name__
    )


def _sum_local(strategy, value):
    """Sums a per-replica gradient over this worker's local devices."""
    if value is None or not isinstance(value, tf.distribute.DistributedValues):
        return value
    parts = strategy.experimental_local_results(value)
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.concat([p.values for p in parts], 0),
            tf.concat([p.indices for p in parts], 0),
            parts[0].dense_shape,
        )
    return tf.add_n(parts)
