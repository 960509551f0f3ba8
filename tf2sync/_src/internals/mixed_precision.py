"""Mixed precision [2.21] [2.15: kept]: loss scaling and autocast weights
under PSS.

`tf_keras.mixed_precision.LossScaleOptimizer` (public) is the base class of
both families' loss-scale optimizers [2.21], for `isinstance`. tf_keras
refuses loss scaling under PSS, with no hook: `patches.loss_scaling_predicate`
replaces its predicate, and `patches.sharded_autocast` its autocast
wrapper with `create_autocast_sharded`.
"""

from __future__ import annotations

from tf_keras.src.mixed_precision import autocast_variable
from tf_keras.src.mixed_precision import loss_scale_optimizer as lso

from tf2sync._src.internals import ps_variables

# The legacy family's loss-scale optimizer, to subclass: the public class
# picks the family from its inner optimizer (a metaclass) when called.
LegacyLossScaleOptimizer = lso.LossScaleOptimizer


# tf_keras's own answer, kept before `patches.loss_scaling_predicate`
# replaces it.
_KERAS_SUPPORTS_LOSS_SCALING = lso.strategy_supports_loss_scaling


def keras_supports_loss_scaling() -> bool:
    """tf_keras's own `strategy_supports_loss_scaling()`."""
    return _KERAS_SUPPORTS_LOSS_SCALING()


_CREATE_AUTOCAST = autocast_variable.create_autocast_variable


def create_autocast_sharded(variable):
    if not ps_variables.is_sharded_variable(variable):
        return _CREATE_AUTOCAST(variable)
    parts = [_CREATE_AUTOCAST(v) for v in variable.variables]
    return ps_variables.ShardedVariable(parts, name=variable.name)


def dynamic_loss_scale_state(optimizer):
    """A dynamic loss-scale optimizer's state (`_loss_scale`), with public
    `current_loss_scale`, `counter`, `multiplier` and `growth_steps`."""
    return optimizer._loss_scale


def is_wrapped_by_loss_scale_optimizer(optimizer) -> bool:
    """Whether a tf_keras loss-scale optimizer wraps `optimizer` (the flag
    it sets on it)."""
    return bool(getattr(optimizer, "_is_wrapped_by_loss_scale_optimizer", 0))
