"""Every difference between the two tf_keras optimizer families, in one place.

tf2sync applies an aggregated gradient through the inner optimizer's
per-variable update kernels, inside a critical section on the parameter
server. It cannot call the inner `apply_gradients`: that one does a
`merge_call` (not allowed inside a `tf.cond`) and increments `iterations`
once per caller. The two families expose their kernels differently:

* `tf_keras.optimizers.Optimizer` (the default since 2.11): `build`,
  `_update_step(grad, var)`, clipping in `_clip_gradients`.
* `tf_keras.optimizers.legacy.Optimizer` (`OptimizerV2`):
  `_create_all_weights`, `_prepare`, `_resource_apply_dense/_sparse`,
  clipping in `_transform_gradients`.
"""

from __future__ import annotations

import tensorflow as tf
import tf_keras

_NEW = tf_keras.optimizers.Optimizer
_LEGACY = tf_keras.optimizers.legacy.Optimizer


def check_optimizer(optimizer, argument="optimizer"):
    """Raises a clear `TypeError` unless `optimizer` is a tf_keras optimizer."""
    if isinstance(optimizer, (_NEW, _LEGACY)):
        return
    hint = ""
    module = type(optimizer).__module__ or ""
    if module.startswith("keras"):
        hint = (
            " This is a Keras 3 optimizer: Keras 3 does not support "
            "ParameterServerStrategy. Import tf2sync before tensorflow (it "
            "sets TF_USE_LEGACY_KERAS=1) or use `tf_keras.optimizers`."
        )
    raise TypeError(
        f"`{argument}` must be a tf_keras optimizer (tf_keras.optimizers.* "
        f"or tf_keras.optimizers.legacy.*). Received: {argument}="
        f"{optimizer!r}.{hint}"
    )


def check_created_in_scope(optimizer, strategy, argument="optimizer"):
    """Raises unless `optimizer`'s step (and its groups') live on the ps."""
    optimizers = [optimizer] + list(getattr(optimizer, "optimizers", []))
    for opt in optimizers:
        step = getattr(opt, "_iterations", None)
        if step is not None and not strategy.extended.variable_created_in_scope(
            step
        ):
            raise ValueError(
                f"`{argument}` ({opt.__class__.__name__}) was created outside "
                "`strategy.scope()`: its variables would live on the chief, "
                "not on the parameter servers. Create it under `with "
                f"strategy.scope():`. Received: {argument}={optimizer!r}"
            )


def is_legacy(optimizer) -> bool:
    return isinstance(optimizer, _LEGACY)


def iterations(optimizer) -> tf.Variable:
    """The inner optimizer's step counter, created now if still lazy."""
    return optimizer.iterations


def build(optimizer, var_list) -> None:
    """Creates every slot and hyperparameter variable of `optimizer` eagerly.

    Must run eagerly (or under `tf.init_scope()`), under the strategy scope:
    variables created inside a traced step cannot be lifted under PSS.
    """
    with tf.init_scope():
        if hasattr(optimizer, "apply_aggregated"):  # tf2sync.MultiOptimizer
            optimizer.build(var_list)
        elif is_legacy(optimizer):
            optimizer._create_all_weights(var_list)
        else:
            optimizer.build(var_list)
            if isinstance(
                optimizer._learning_rate,
                tf_keras.optimizers.schedules.LearningRateSchedule,
            ) and not hasattr(optimizer, "_current_learning_rate"):
                optimizer._compute_current_learning_rate()


def apply(optimizer, grads_and_vars, apply_state=None) -> tf.Operation:
    """Applies already-aggregated gradients once and increments `iterations`.

    Args:
      optimizer: The inner tf_keras optimizer, already built.
      grads_and_vars: `(gradient, variable)` pairs; a gradient may be a
        dense tensor or a deduplicated `tf.IndexedSlices`.
      apply_state: Unused; reserved for per-group state.

    Returns:
      An op that runs after every variable update and the increment.
    """
    del apply_state
    grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
    if hasattr(optimizer, "apply_aggregated"):  # tf2sync.MultiOptimizer
        return optimizer.apply_aggregated(grads_and_vars)
    if is_legacy(optimizer):
        _apply_legacy(optimizer, grads_and_vars)
    else:
        _apply_new(optimizer, grads_and_vars)
    # The update kernels of the new family return None, and a lowered
    # `tf.cond` may yield its outputs before its side effects finish. Reading
    # every updated variable and slot afterwards (automatic control
    # dependencies order same-resource ops) makes the step increment, and
    # everything after it, wait for all the writes.
    written = [v for _, v in grads_and_vars] + [
        v for v in optimizer.variables() if v is not optimizer.iterations
    ]
    reads = [tf.identity(v.read_value()) for v in written]
    with tf.control_dependencies(reads):
        return optimizer.iterations.assign_add(1).op


def _apply_legacy(optimizer, grads_and_vars):
    var_list = [v for _, v in grads_and_vars]
    grads_and_vars = optimizer._transform_gradients(grads_and_vars)
    apply_state = optimizer._prepare(var_list)
    updates = []
    if not grads_and_vars:
        return updates
    for grad, var in grads_and_vars:
        if isinstance(grad, tf.IndexedSlices):
            op = optimizer._resource_apply_sparse_duplicate_indices(
                grad.values, var, grad.indices, apply_state=apply_state
            )
        else:
            op = optimizer._resource_apply_dense(
                grad, var, apply_state=apply_state
            )
        updates.append(op)
    with tf.control_dependencies(updates):
        updates = updates + _constraints(var_list)
    return updates


def _apply_new(optimizer, grads_and_vars):
    var_list = [v for _, v in grads_and_vars]
    optimizer._compute_current_learning_rate()
    if not grads_and_vars:
        return []
    grads = optimizer._clip_gradients([g for g, _ in grads_and_vars])
    updates = []
    if optimizer.weight_decay is not None:
        optimizer._apply_weight_decay(var_list)
    for grad, var in zip(grads, var_list):
        updates.append(optimizer._update_step(grad, var))
    if optimizer.use_ema:
        with tf.control_dependencies([u for u in updates if u is not None]):
            optimizer._update_model_variables_moving_average(var_list)
    updates = [u for u in updates if u is not None]
    with tf.control_dependencies(updates):
        updates = updates + _constraints(var_list)
    return updates


def _constraints(var_list):
    ops = []
    for var in var_list:
        constraint = getattr(var, "constraint", None)
        if constraint is not None:
            ops.append(var.assign(constraint(var)))
    return ops
