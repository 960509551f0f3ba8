"""Mixed precision and tf_keras's weight files.

Part of `tf2sync._src.tf_internals`, the one door to private TensorFlow
and tf_keras API: see its docstring for the version tags.
"""

from __future__ import annotations

import numpy as np
from tensorflow.python.distribute import sharded_variable
from tf_keras.src.engine import base_layer as keras_base_layer
from tf_keras.src.mixed_precision import autocast_variable
from tf_keras.src.mixed_precision import loss_scale_optimizer as lso

from tf2sync._src.tf_internals.ps_strategy import is_sharded_variable

# Mixed precision [2.21] [2.15: kept] -----------------------------------------
# `tf_keras.mixed_precision.LossScaleOptimizer` (public) is the base class of
# both families' loss-scale optimizers [2.21], for `isinstance`. tf_keras
# refuses loss scaling under PSS, with no hook.

# The legacy family's loss-scale optimizer, to subclass: the public class
# picks the family from its inner optimizer (a metaclass) when called.
LegacyLossScaleOptimizer = lso.LossScaleOptimizer

# tf_keras's own answer, kept before `install_loss_scaling_predicate`.
_KERAS_SUPPORTS_LOSS_SCALING = lso.strategy_supports_loss_scaling


def keras_supports_loss_scaling() -> bool:
    """tf_keras's own `strategy_supports_loss_scaling()`."""
    return _KERAS_SUPPORTS_LOSS_SCALING()


def install_loss_scaling_predicate(predicate) -> None:
    """Makes tf_keras ask `predicate()` whether the strategy in scope
    supports loss scaling, before it builds a mixed_float16 layer or a
    loss-scale optimizer (it looks the function up at each call)."""
    lso.strategy_supports_loss_scaling = predicate


_CREATE_AUTOCAST = autocast_variable.create_autocast_variable


def _create_autocast_sharded(variable):
    if not is_sharded_variable(variable):
        return _CREATE_AUTOCAST(variable)
    parts = [_CREATE_AUTOCAST(v) for v in variable.variables]
    return sharded_variable.ShardedVariable(parts, name=variable.name)


def install_sharded_autocast() -> None:
    """Lets a mixed_float16 layer create a sharded weight.

    tf_keras wraps each float weight of such a layer in an
    `AutoCastVariable` (`autocast_variable.create_autocast_variable`, looked
    up at each call by `Layer.add_weight`), which refuses a
    `ShardedVariable` (tf_keras 2.21 fails so under stock PSS too). Once
    installed, a `ShardedVariable` becomes a `ShardedVariable` of
    autocast shards: each shard reads as float16 in the layer's compute,
    stays float32 on its ps, and is a variable of its own to the
    optimizer and to tf2sync. Idempotent; other variables are wrapped as
    before.
    """
    autocast_variable.create_autocast_variable = _create_autocast_sharded


_SAVE_OWN_VARIABLES = keras_base_layer.Layer.save_own_variables
_LOAD_OWN_VARIABLES = keras_base_layer.Layer.load_own_variables


def _weight_groups(layer):
    """A layer's saved weights (`_trainable_weights` then
    `_non_trainable_weights`, which list a sharded weight as its shards, in
    order), each sharded weight's shards as one group: `[(sharded or None,
    [variables])]`."""
    return group_shards(layer._trainable_weights + layer._non_trainable_weights)


def sharded_container(var):
    """The `ShardedVariable` `var` is a shard of, or None
    (`_sharded_container`, a weak reference `ShardedVariable` sets on each
    of its shards)."""
    ref = getattr(var, "_sharded_container", None)
    return ref() if ref is not None else None


def group_shards(variables) -> list:
    """`[(sharded or None, [variables])]`: consecutive shards of one
    `ShardedVariable` as one group, in order (as Keras lists them)."""
    groups = []
    for var in variables:
        container = sharded_container(var)
        if container is not None and groups and groups[-1][0] is container:
            groups[-1][1].append(var)
        else:
            groups.append((container, [var]))
    return groups


def _save_own_variables(layer, store):
    groups = _weight_groups(layer)
    if all(container is None for container, _ in groups):
        return _SAVE_OWN_VARIABLES(layer, store)
    for i, (_, parts) in enumerate(groups):
        store[f"{i}"] = np.concatenate([p.numpy() for p in parts], axis=0)
    return None


def _load_own_variables(layer, store):
    layer._update_trackables()
    groups = _weight_groups(layer)
    if all(container is None for container, _ in groups):
        return _LOAD_OWN_VARIABLES(layer, store)
    if len(store.keys()) != len(groups):
        raise ValueError(
            f"Layer '{layer.name}' expected {len(groups)} variables, but "
            f"received {len(store.keys())} variables during loading."
        )
    for i, (_, parts) in enumerate(groups):
        value = store[f"{i}"]
        offset = 0
        for part in parts:
            rows = int(part.shape[0]) if part.shape.rank else 1
            part.assign(
                value[offset : offset + rows] if part.shape.rank else value
            )
            offset += rows
    return None


def install_whole_weights_in_keras_files() -> None:
    """Makes the `.keras` format save a sharded weight whole.

    tf_keras's `Layer.save_own_variables` (and `load_own_variables`)
    store `layer.weights` one entry each, and a layer lists a sharded
    weight as its shards: a `.keras` file of a model with 3 shards would
    load only into a model with 3 shards (no other file of tf_keras
    splits a weight). Once installed, a layer with sharded weights stores
    each whole (its shards concatenated) and loads it into however many
    shards it has, 1 included; other layers are saved as before.
    """
    keras_base_layer.Layer.save_own_variables = _save_own_variables
    keras_base_layer.Layer.load_own_variables = _load_own_variables


def dynamic_loss_scale_state(optimizer):
    """A dynamic loss-scale optimizer's state (`_loss_scale`), with public
    `current_loss_scale`, `counter`, `multiplier` and `growth_steps`."""
    return optimizer._loss_scale


def is_wrapped_by_loss_scale_optimizer(optimizer) -> bool:
    """Whether a tf_keras loss-scale optimizer wraps `optimizer` (the flag
    it sets on it)."""
    return bool(getattr(optimizer, "_is_wrapped_by_loss_scale_optimizer", 0))
