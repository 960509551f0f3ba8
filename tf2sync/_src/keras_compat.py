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

tensorflow-addons' `tfa.optimizers.MultiOptimizer` (TF <= 2.15) is a legacy
optimizer without kernels of its own: its `apply_gradients` routes each
gradient by `var.name` to every spec whose `weights` hold that name and calls
each spec optimizer's `apply_gradients`. tf2sync routes the same way and
calls each spec optimizer's kernels instead (see `_tfa_specs`).

Every private method of the optimizers is called through `internals`;
this module keeps the logic.
"""

from __future__ import annotations

import tensorflow as tf
import tf_keras

from tf2sync._src.internals import graph_ops
from tf2sync._src.internals import keras_optimizers

_NEW = tf_keras.optimizers.Optimizer
_LEGACY = tf_keras.optimizers.legacy.Optimizer
# Both tf_keras optimizer families (what `check_optimizer` accepts).
KERAS_OPTIMIZERS = (_NEW, _LEGACY)


is_tfa_multi = keras_optimizers.is_tfa_multi_optimizer


def _tfa_specs(optimizer):
    """`[(spec optimizer, set of variable names)]` of a tfa MultiOptimizer."""
    return [
        (spec["optimizer"], frozenset(spec["weights"]))
        for spec in optimizer.optimizer_specs
    ]


def _tfa_route(optimizer, items, name_of):
    """Groups `items` by spec exactly as tfa's `apply_gradients` does.

    An item goes to every spec whose weight names include its variable's
    name (tfa applies a variable listed by two specs twice, and ignores one
    listed by none). Empty groups are left out.
    """
    groups = []
    for spec_optimizer, names in _tfa_specs(optimizer):
        members = [i for i in items if name_of(i) in names]
        if members:
            groups.append((spec_optimizer, members))
    return groups


def is_synchronous(optimizer) -> bool:
    """Whether `optimizer` is a `tf2sync.SyncOptimizer` (or its loss-scaled
    form, whose `inner_optimizer` is one)."""
    return any(
        getattr(type(o), "_tf2sync_synchronous", False)
        for o in (optimizer, getattr(optimizer, "inner_optimizer", None))
    )


def check_optimizer(optimizer, argument="optimizer"):
    """Raises a clear `TypeError` unless `optimizer` is a tf_keras optimizer
    (and not already a `tf2sync.SyncOptimizer`)."""
    if is_synchronous(optimizer):
        raise TypeError(
            f"`{argument}` is already a tf2sync.SyncOptimizer: give the "
            "optimizer it wraps. One SyncOptimizer goes around the model's "
            "whole optimizer (around a tf2sync.MultiOptimizer for variable "
            f"groups). Received: {argument}={optimizer!r}"
        )
    if isinstance(optimizer, (_NEW, _LEGACY)):
        if is_tfa_multi(optimizer):
            for spec_optimizer, _ in _tfa_specs(optimizer):
                check_optimizer(spec_optimizer, "tfa MultiOptimizer spec")
        return
    hint = ""
    module = type(optimizer).__module__ or ""
    if keras_optimizers.standalone_keras_2_loaded() and any(
        (c.__module__ or "").startswith("keras.")
        for c in type(optimizer).__mro__
    ):
        hint = (
            " Its class derives from the standalone Keras 2 `keras` "
            "package, not tf_keras: on TF <= 2.15 set TF_USE_LEGACY_KERAS=1 "
            "(or import tf2sync) before importing tensorflow and "
            "tensorflow_addons."
        )
    elif module.startswith("keras"):
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
        step = keras_optimizers.created_step_variable(opt)
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


def build(optimizer, var_list) -> None:
    """Creates every slot and hyperparameter variable of `optimizer` eagerly.

    Must run eagerly (or under `tf.init_scope()`), under the strategy scope:
    variables created inside a traced step cannot be lifted under PSS.
    """
    with tf.init_scope():
        if hasattr(optimizer, "apply_aggregated"):  # tf2sync.MultiOptimizer
            optimizer.build(var_list)
        elif is_tfa_multi(optimizer):
            _ = optimizer.iterations  # The global step.
            # tfa does not track its spec optimizers: track them here so
            # that checkpoints hold each group's slots and step.
            for i, (spec_optimizer, _) in enumerate(_tfa_specs(optimizer)):
                name = f"tfa_spec_{i}"
                if not keras_optimizers.tracks_child(optimizer, name):
                    keras_optimizers.track_child(
                        optimizer, spec_optimizer, name
                    )
            for spec_optimizer, variables in _tfa_route(
                optimizer, list(var_list), lambda v: v.name
            ):
                build(spec_optimizer, variables)
        elif is_legacy(optimizer):
            keras_optimizers.legacy_create_all_weights(optimizer, var_list)
        else:
            optimizer.build(var_list)
            if keras_optimizers.new_learning_rate_uncomputed(optimizer):
                keras_optimizers.new_compute_learning_rate(optimizer)


def apply(optimizer, grads_and_vars, increment=True) -> tf.Operation:
    """Applies already-aggregated gradients once and increments `iterations`.

    Args:
      optimizer: The inner tf_keras optimizer, already built.
      grads_and_vars: `(gradient, variable)` pairs; a gradient may be a
        dense tensor or a deduplicated `tf.IndexedSlices`.
      increment: Whether to increment `iterations` (and each group
        optimizer's) after the updates. False applies one parameter
        server's share of an update whose step `increment` ends later.

    Returns:
      An op that runs after every variable update (and the increment).
    """
    grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
    if hasattr(optimizer, "apply_aggregated"):  # tf2sync.MultiOptimizer
        return optimizer.apply_aggregated(grads_and_vars, increment)
    if is_tfa_multi(optimizer):
        # Each spec optimizer applies its share once (and steps its own
        # `iterations`, as its `apply_gradients` would); then the global step.
        done = [
            apply(spec_optimizer, gv, increment)
            for spec_optimizer, gv in _tfa_route(
                optimizer, grads_and_vars, lambda gv: gv[1].name
            )
        ]
        with tf.control_dependencies(done):
            if not increment:
                return tf.no_op()
            return optimizer.iterations.assign_add(1).op
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    first = 0 if graph is None else len(graph.get_operations())
    if is_legacy(optimizer):
        _apply_legacy(optimizer, grads_and_vars)
    else:
        _apply_new(optimizer, grads_and_vars)
    # The update kernels of the new family return None, and a lowered
    # `tf.cond` may yield its outputs before its side effects finish. The
    # step increment, and everything after it, waits for every stateful op
    # the updates made here: control edges, no op of their own. (A read of
    # each variable and slot ordered after its write took an op per
    # variable on the ps every step: 428 one-row gathers on ResNet-50, and
    # 0.7 s of its trace.) Reads are inputs of the writes, or order nothing.
    writes = [] if graph is None else _stateful_writes(graph, first)
    with tf.control_dependencies(writes):
        if not increment:
            return tf.no_op()
        return optimizer.iterations.assign_add(1).op


def increment(optimizer, var_list) -> tf.Operation:
    """Increments `iterations` as `apply(optimizer, gv)` would, after an
    update whose shares were applied with `increment=False`.

    Args:
      optimizer: The inner tf_keras optimizer.
      var_list: Every variable the update had a gradient for (a group
        optimizer steps its own `iterations` where it had a share).
    """
    if hasattr(optimizer, "increment_aggregated"):  # tf2sync.MultiOptimizer
        return optimizer.increment_aggregated(var_list)
    ops = []
    if is_tfa_multi(optimizer):
        ops = [
            increment(spec_optimizer, variables)
            for spec_optimizer, variables in _tfa_route(
                optimizer, list(var_list), lambda v: v.name
            )
        ]
    with tf.control_dependencies(ops):
        return optimizer.iterations.assign_add(1).op


_READS = frozenset(
    ("ReadVariableOp", "ResourceGather", "VarIsInitializedOp", "VarHandleOp")
)


def _stateful_writes(graph, first):
    """The stateful ops of `graph` from its `first`th on, but reads."""
    return [
        op
        for op in graph.get_operations()[first:]
        if op.type not in _READS and graph_ops.op_is_stateful(op)
    ]


def _dedups_then_applies(optimizer) -> bool:
    """Whether the optimizer's duplicate-index path only deduplicates.

    Aggregated sparse gradients have unique rows already, so the unique-
    index kernel does the same work without a second unique and segment
    sum over every row (docs/benchmarks.md, "Measurements behind the code").
    """
    return keras_optimizers.legacy_sparse_dedup_is_plain(optimizer)


def _apply_legacy(optimizer, grads_and_vars):
    var_list = [v for _, v in grads_and_vars]
    grads_and_vars = keras_optimizers.legacy_transform_gradients(
        optimizer, grads_and_vars
    )
    apply_state = keras_optimizers.legacy_prepare(optimizer, var_list)
    updates = []
    if not grads_and_vars:
        return updates
    for grad, var in grads_and_vars:
        if isinstance(grad, tf.IndexedSlices):
            op = keras_optimizers.legacy_apply_sparse(
                optimizer,
                grad.values,
                var,
                grad.indices,
                apply_state,
                unique=_dedups_then_applies(optimizer),
            )
        else:
            op = keras_optimizers.legacy_apply_dense(
                optimizer, grad, var, apply_state
            )
        updates.append(op)
    with tf.control_dependencies(updates):
        updates = updates + _constraints(var_list)
    return updates


def _check_built_for(optimizer, var_list) -> None:
    """Refuses variables that a built new-family optimizer has no state for.

    tf_keras's new optimizers build their slots once, on the variables
    they are first given, and later fail inside the traced update with a
    `KeyError` that suggests `optimizer.build`. A subclassed model whose
    layers are built at its first call makes such variables after
    `tf2sync.Trainer` built the optimizer on the weights made in its
    `__init__`. (Legacy optimizers make slots as variables come.)

    Raises:
      ValueError: Naming the variables unknown to the optimizer.
    """
    unknown = keras_optimizers.new_unknown_variables(optimizer, var_list)
    if not unknown:
        return
    names = [v.name for v in unknown]
    raise ValueError(
        f"{type(optimizer).__name__} was built before the model made "
        f"{names}: its slots are made once, so every weight must exist "
        "first (a subclassed model builds its layers at its first call, "
        "and tf2sync.Trainer builds the optimizer when it is made). Build "
        "the model under `strategy.scope()` before that, with "
        "`model.build(input_shape)` or a call on one batch (a layer that "
        "only training calls: call it too), or use a "
        "`tf.keras.optimizers.legacy` optimizer. Received: "
        f"{len(unknown)} of {len(var_list)} variables with gradients "
        f"unknown to optimizer={type(optimizer).__name__}"
    )


def _apply_new(optimizer, grads_and_vars):
    var_list = [v for _, v in grads_and_vars]
    _check_built_for(optimizer, var_list)
    keras_optimizers.new_compute_learning_rate(optimizer)
    if not grads_and_vars:
        return []
    grads = keras_optimizers.new_clip_gradients(
        optimizer, [g for g, _ in grads_and_vars]
    )
    updates = []
    if optimizer.weight_decay is not None:
        keras_optimizers.new_apply_weight_decay(optimizer, var_list)
    for grad, var in zip(grads, var_list):
        updates.append(keras_optimizers.new_update_step(optimizer, grad, var))
    if optimizer.use_ema:
        with tf.control_dependencies([u for u in updates if u is not None]):
            keras_optimizers.new_update_moving_averages(optimizer, var_list)
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
