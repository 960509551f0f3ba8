"""Loss scaling for synchronous training under PSS (mixed precision).

tf_keras refuses its `LossScaleOptimizer` under ParameterServerStrategy:
it would unscale once per compute replica where variables are not
replicated. tf2sync unscales on each worker, once, before aggregation, and
moves the dynamic scale once per synchronous step inside the ps critical
section, which is right for PSS. `SyncLossScaleOptimizer` subclasses the
legacy `LossScaleOptimizer` so that `model.compile` under `mixed_float16`
recognises it and does not wrap it a second time.

tf_keras asks one function, `strategy_supports_loss_scaling()`, both before
building a `mixed_float16` layer and before creating a loss-scale optimizer.
`first_use.install()` (run when a `SyncParameterServerStrategy` is made)
extends it to answer True under that strategy, and only there; every other
strategy gets tf_keras's own answer. The private tf_keras parts this takes
(the legacy loss-scale optimizer class, that function, the dynamic scale's
state) are in `internals.mixed_precision`; the replacement is
`internals.patches`'s `loss_scaling_predicate`.
"""

from __future__ import annotations

import tensorflow as tf
import tf_keras

from tf2sync._src import strategy as strategy_lib
from tf2sync._src.internals import checkpoints
from tf2sync._src.internals import mixed_precision

# Both families' loss-scale optimizers (the public class is their base).
_ANY_LSO = tf_keras.mixed_precision.LossScaleOptimizer


def wants_loss_scaling(optimizer) -> bool:
    """True for a loss-scale optimizer, or under a float16 global policy."""
    if isinstance(optimizer, _ANY_LSO):
        return True
    policy = tf_keras.mixed_precision.global_policy()
    return policy.compute_dtype == "float16"


def options_of(optimizer) -> dict:
    """The loss-scale settings of `optimizer` (defaults: dynamic)."""
    if not isinstance(optimizer, _ANY_LSO):
        return {}
    options = {"dynamic": bool(optimizer.dynamic)}
    options["initial_scale"] = float(optimizer.initial_scale)
    if optimizer.dynamic:
        options["dynamic_growth_steps"] = int(optimizer.dynamic_growth_steps)
    return options


def unwrap(optimizer):
    """The optimizer inside a loss-scale optimizer, or `optimizer`."""
    if isinstance(optimizer, _ANY_LSO):
        return optimizer.inner_optimizer
    return optimizer


@tf_keras.utils.register_keras_serializable(package="tf2sync")
class SyncLossScaleOptimizer(mixed_precision.LegacyLossScaleOptimizer):
    """A `LossScaleOptimizer` around a `SyncOptimizer`.

    Protocol per replica step: the loss is multiplied by the current scale
    (read from the ps), the gradients are divided by it on the worker, and
    the unscaled gradients are pushed. On the ps, inside the critical
    section: a push with non-finite gradients is dropped (its token goes
    back) and halves a dynamic scale (never below 1); each applied update
    counts a good step, and `dynamic_growth_steps` of them double the scale.
    The scale therefore moves once per synchronous step, not once per
    worker. Created by `tf2sync.SyncOptimizer(...)` when loss scaling is
    wanted; not constructed directly.
    """

    def __init__(
        self,
        inner_optimizer,
        dynamic=True,
        initial_scale=None,
        dynamic_growth_steps=None,
    ):
        super().__init__(
            inner_optimizer,
            dynamic=dynamic,
            initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps,
        )
        inner_optimizer._tf2sync_loss_scaled = True
        if dynamic:
            state = mixed_precision.dynamic_loss_scale_state(self)
            aggregator = inner_optimizer._aggregator
            aggregator.on_nonfinite.append(lambda: _halve(state))
            aggregator.after_apply.append(lambda: _count_good_step(state))

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds it, or a tf_keras `LossScaleOptimizer` outside PSS.

        Where no parameter server strategy is current, the `SyncOptimizer`
        inside loads as its inner optimizer alone (see
        `SyncOptimizer.from_config`), wrapped in tf_keras's own loss-scale
        optimizer of its family, with the same settings.
        """
        # The SyncOptimizer class, by its registered name: optimizer.py,
        # which defines it, imports this module.
        sync_class = tf_keras.utils.get_registered_object(
            "tf2sync>SyncOptimizer"
        )
        config = dict(config)
        # The SyncOptimizer's own config: deserializing it by class would
        # make a loss-scale optimizer of it under a float16 policy.
        sync_config = dict(config.pop("inner_optimizer")["config"])
        inner = tf_keras.optimizers.deserialize(
            sync_config.pop("optimizer"), custom_objects=custom_objects
        )
        if not strategy_lib.outside_parameter_servers():
            # Refused under a plain PSS, as SyncOptimizer(...) is there.
            if not isinstance(
                tf.distribute.get_strategy(),
                strategy_lib.SyncParameterServerStrategy,
            ):
                return sync_class(inner, **sync_config)
            scaled = tf_keras.mixed_precision.LossScaleOptimizer(
                inner, **config
            )
            loaded = sync_class(scaled, **sync_config)
            strategy_lib.warn_loaded_fresh(sync_config.get("name"))
            return loaded
        strategy_lib.warn_loaded_alone(sync_config.get("name"), inner)
        scaled = tf_keras.mixed_precision.LossScaleOptimizer(inner, **config)
        if not isinstance(inner, tf_keras.optimizers.legacy.Optimizer):
            # tf_keras's new-family one has no name, and its
            # load_own_variables names it when the file holds no optimizer
            # state (a SyncOptimizer's holds none).
            scaled.name = inner.name
        return scaled

    def __dir__(self):
        # Its checkpoint node is the SyncOptimizer's, whose inner optimizer
        # (a child) saves the slots.
        return checkpoints.dir_without_slot_owner(super().__dir__())

    @property
    def sync_optimizer(self):
        """The wrapped `SyncOptimizer`."""
        return self.inner_optimizer

    @property
    def stale_dropped(self):
        return self.inner_optimizer.stale_dropped

    @property
    def nonfinite_dropped(self):
        return self.inner_optimizer.nonfinite_dropped

    @property
    def gradients_accepted(self):
        return self.inner_optimizer.gradients_accepted

    @property
    def ema_variables(self):
        return self.inner_optimizer.ema_variables

    def ema_weights(self):
        """See `SyncOptimizer.ema_weights`."""
        return self.inner_optimizer.ema_weights()

    def build(self, var_list):
        self.inner_optimizer.build(var_list)

    def apply_gradients(
        self, grads_and_vars, name=None, experimental_aggregate_gradients=True
    ):
        """Pushes the (already unscaled) gradients; see the class doc."""
        del name, experimental_aggregate_gradients
        return self.inner_optimizer.apply_gradients(grads_and_vars)


def _halve(state):
    scale = state.current_loss_scale
    return [
        state.counter.assign(0),
        scale.assign(tf.maximum(scale / state.multiplier, 1.0)),
    ]


def _count_good_step(state):
    scale = state.current_loss_scale

    def grow():
        return tf.group(
            scale.assign(scale * state.multiplier), state.counter.assign(0)
        )

    def count():
        return tf.group(state.counter.assign_add(1))

    return [tf.cond(state.counter + 1 >= state.growth_steps, grow, count)]
