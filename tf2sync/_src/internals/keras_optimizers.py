"""tf_keras optimizers [2.21] [2.15: kept], and TF1's.

Both tf_keras families' update kernels, for `keras_compat` to call in the
ps's critical section, where the public `apply_gradients` (a `merge_call`;
`iterations` + 1 per caller) cannot run.

tf.compat.v1.train optimizers (the TF1 shim) [2.21] [2.15: kept]: a TF1
optimizer's `apply_gradients` under a strategy does a `merge_call`; the
shim applies in cross-replica context itself.
"""

from __future__ import annotations

import sys

import tensorflow as tf
import tf_keras

from tf2sync._src.internals import checkpoints
from tf2sync._src.internals import patches


def is_trackable(obj) -> bool:
    """Whether `obj` can be saved in a TF2 checkpoint as a child
    (`tf.__internal__.tracking.Trackable`: public only under `__internal__`)."""
    return isinstance(obj, tf.__internal__.tracking.Trackable)


def track_child(parent, child, name: str) -> None:
    """Saves `child` in `parent`'s checkpoints as `name` (`_track_trackable`;
    optimizers do not track their attributes)."""
    parent._track_trackable(child, name)


def tracks_child(parent, name: str) -> bool:
    """Whether `parent` tracks a child named `name` (`_lookup_dependency`)."""
    parent._maybe_initialize_trackable()  # as `_track_trackable` does
    return parent._lookup_dependency(name) is not None


def created_step_variable(optimizer):
    """`optimizer.iterations` if created, else None (reading it creates it)."""
    return getattr(optimizer, "_iterations", None)


def optimizer_name(optimizer) -> str:
    """The optimizer's name (`_name`, else `name`), or ""."""
    return getattr(optimizer, "_name", None) or getattr(optimizer, "name", "")


def legacy_create_all_weights(optimizer, var_list) -> None:
    """Creates a legacy optimizer's slots and hyperparameters."""
    early = checkpoints.early_sharded_slots(
        optimizer, checkpoints.sharded_containers(var_list)
    )
    optimizer._create_all_weights(var_list)
    patches.sharded_slot_views.install(optimizer)
    checkpoints.adopt_early_sharded_slots(optimizer, early)


def legacy_transform_gradients(optimizer, grads_and_vars):
    """A legacy optimizer's clipping of `(gradient, variable)` pairs."""
    return optimizer._transform_gradients(grads_and_vars)


def legacy_prepare(optimizer, var_list):
    """A legacy optimizer's per-step `apply_state`."""
    return optimizer._prepare(var_list)


def legacy_apply_dense(optimizer, grad, var, apply_state):
    """A legacy optimizer's dense update kernel."""
    return optimizer._resource_apply_dense(grad, var, apply_state=apply_state)


def legacy_apply_sparse(
    optimizer, values, var, indices, apply_state, *, unique
):
    """A legacy optimizer's sparse update kernel: for `indices` without
    duplicates if `unique`, else the one that sums duplicates first."""
    if unique:
        apply = optimizer._resource_apply_sparse
    else:
        apply = optimizer._resource_apply_sparse_duplicate_indices
    return apply(values, var, indices, apply_state=apply_state)


def legacy_sparse_dedup_is_plain(optimizer) -> bool:
    """Whether a legacy optimizer's duplicate-index kernel only sums the
    duplicates: the base's, or SGD's with momentum (without, it scatters)."""
    base = tf_keras.optimizers.legacy.Optimizer
    method = type(optimizer)._resource_apply_sparse_duplicate_indices
    if method is base._resource_apply_sparse_duplicate_indices:
        return True
    sgd = tf_keras.optimizers.legacy.SGD
    return (
        isinstance(optimizer, sgd)
        and method is sgd._resource_apply_sparse_duplicate_indices
        and bool(optimizer._momentum)
    )


def new_learning_rate_uncomputed(optimizer) -> bool:
    """Whether a new-family optimizer's schedule has no current rate yet."""
    schedule = tf_keras.optimizers.schedules.LearningRateSchedule
    return isinstance(optimizer._learning_rate, schedule) and not hasattr(
        optimizer, "_current_learning_rate"
    )


def optimizer_state_variables(optimizer) -> list:
    """Every variable an optimizer's apply may read: `variables()`, a
    legacy optimizer's hyperparameters (`_hyper`, not listed there), a new
    one's rate variables, and those of the optimizers it holds (tf2sync's
    `MultiOptimizer`, tensorflow-addons'). Checked on tf_keras 2.21."""
    found = list(optimizer.variables())
    found += [
        v
        for v in getattr(optimizer, "_hyper", {}).values()
        if isinstance(v, tf.Variable)
    ]
    for name in ("_learning_rate", "_current_learning_rate", "_iterations"):
        value = getattr(optimizer, name, None)
        if isinstance(value, tf.Variable):
            found.append(value)
    for inner in getattr(optimizer, "optimizers", None) or ():
        found += optimizer_state_variables(inner)
    for spec in getattr(optimizer, "optimizer_specs", None) or ():
        found += optimizer_state_variables(spec["optimizer"])
    return found


def new_compute_learning_rate(optimizer) -> None:
    """Evaluates a new-family optimizer's rate at its `iterations`."""
    optimizer._compute_current_learning_rate()


def new_clip_gradients(optimizer, grads):
    """A new-family optimizer's clipping."""
    return optimizer._clip_gradients(grads)


def new_apply_weight_decay(optimizer, var_list) -> None:
    """A new-family optimizer's decoupled weight decay."""
    optimizer._apply_weight_decay(var_list)


def new_update_step(optimizer, grad, var):
    """A new-family optimizer's per-variable update kernel."""
    return optimizer._update_step(grad, var)


def new_unknown_variables(optimizer, var_list) -> list:
    """The variables of `var_list` a built new-family optimizer has no
    slots for: its update step would fail on them with a `KeyError`
    (`_index_dict` maps the variables it was built on). Empty while it is
    not built, or where it keeps no such map."""
    known = getattr(optimizer, "_index_dict", None)
    if not getattr(optimizer, "_built", False) or known is None:
        return []
    return [v for v in var_list if optimizer._var_key(v) not in known]


def new_update_moving_averages(optimizer, var_list) -> None:
    """A new-family optimizer's `use_ema` update of the model's variables."""
    optimizer._update_model_variables_moving_average(var_list)


def legacy_distributed_apply(optimizer, strategy, grads_and_vars, state, name):
    """A legacy optimizer's cross-replica apply (`_distributed_apply`, with
    `state` from `legacy_prepare`): its kernels, then `iterations` + 1."""
    return optimizer._distributed_apply(
        strategy, grads_and_vars, state, name=name
    )


def new_distributed_apply(optimizer, strategy, grads_and_vars):
    """A new-family optimizer's cross-replica apply, `iterations` + 1."""
    return optimizer._distributed_apply_gradients_fn(strategy, grads_and_vars)


def is_tfa_multi_optimizer(optimizer) -> bool:
    """True for `tfa.optimizers.MultiOptimizer`, without importing tfa.

    Version gate: tensorflow-addons imports only up to TF 2.15 [2.15:
    kept]; on 2.21 nothing is one [2.21]. `optimizer_specs` is public.
    """
    cls = type(optimizer)
    return (
        cls.__name__ == "MultiOptimizer"
        and (cls.__module__ or "").startswith("tensorflow_addons.")
        and isinstance(getattr(optimizer, "optimizer_specs", None), list)
    )


def standalone_keras_2_loaded() -> bool:
    """Whether `import keras` gave Keras 2, not tf_keras: a version gate
    (TF <= 2.15 ships Keras 2 as `keras` [2.15: kept]; 2.16+ Keras 3)."""
    version = getattr(sys.modules.get("keras"), "__version__", "")
    return version.startswith("2.")


def tf1_optimizer_apply(optimizer, strategy, grads_and_vars, global_step):
    """A TF1 optimizer's cross-replica apply (`_distributed_apply`)."""
    return optimizer._distributed_apply(strategy, grads_and_vars, global_step)


def tf1_optimizer_create_slots(optimizer, var_list) -> None:
    """A TF1 optimizer's slots for `var_list` (`_create_slots`)."""
    optimizer._create_slots(var_list)


def tf1_optimizer_variables(optimizer) -> list:
    """A TF1 optimizer's non-slot variables and slots, of any graph (its
    `variables()` keeps those of the thread's default graph)."""
    found = list(optimizer._non_slot_variables())
    for slots in optimizer._slots.values():
        found.extend(slots.values())
    return found
