"""The shim's inner optimizers: built eagerly, applied inside the round.

A shim wraps a `tf.compat.v1.train.Optimizer` or a tf_keras optimizer
(either family, or a `tf2sync.MultiOptimizer` of them: one per variable
group). Their slots and moving averages are created eagerly under
the strategy's scope on the first traced step (PSS cannot create variables
inside a scheduled function), so `variables()` and `get_slot()` answer
right after `apply_gradients`; the apply itself runs inside the core's
critical section on the ps. Each call into an optimizer's internals goes
through `internals.keras_optimizers`.
"""

from __future__ import annotations

import tensorflow as tf

from tf2sync._src import multi_optimizer
from tf2sync._src import sharding
from tf2sync._src import step_context
from tf2sync._src.internals import keras_optimizers


def is_tf1(opt) -> bool:
    return isinstance(opt, tf.compat.v1.train.Optimizer)


def is_keras_legacy(opt) -> bool:
    return isinstance(opt, tf.keras.optimizers.legacy.Optimizer)


def is_multi(opt) -> bool:
    return isinstance(opt, multi_optimizer.MultiOptimizer)


def build(opt, var_list):
    """Creates `opt`'s slots for `var_list` now (call eagerly, in scope)."""
    if is_multi(opt):  # routes the variables, builds each group's slots
        opt.build(var_list)
    elif is_tf1(opt):
        keras_optimizers.tf1_optimizer_create_slots(opt, var_list)
    elif is_keras_legacy(opt):
        keras_optimizers.legacy_create_all_weights(opt, var_list)
    else:
        opt.build(var_list)


def build_averages(averages, var_list):
    """Creates the shadow variables of `averages` now, each = its variable.

    `ExponentialMovingAverage.apply` creates them and moves each towards
    its variable, which it already equals: only the creation changes
    anything (as TF1's graph construction did). Its update goes through
    the strategy's `update` like an apply's, hence the apply scope.
    """
    with step_context.sync_apply_scope():
        averages.apply(var_list)


def variables(opt):
    """The inner optimizer's variables, whichever graph created them."""
    if is_tf1(opt):
        found = keras_optimizers.tf1_optimizer_variables(opt)
        return sorted(found, key=lambda v: v.name)
    found = opt.variables
    # A tf_keras slot of a sharded variable is one `ShardedVariable`: listed
    # shard by shard, as the model's weights are.
    return sharding.shards(found() if callable(found) else list(found))


def apply(opt, strategy, grads_and_vars, global_step, name):
    """One inner apply of the round's mean gradients; +1 on `global_step`.

    Runs while the core traces its apply (inside `sync_apply_scope`, where
    the strategy lets variable updates through).
    """
    grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
    with strategy.scope(), step_context.sync_apply_scope():
        if is_tf1(opt):
            # Each apply appends to this graph's TRAIN_OP collection and
            # compares with `==`, which fails on a previous member's
            # variable-valued update: start each one empty.
            key = tf.compat.v1.GraphKeys.TRAIN_OP
            del tf.compat.v1.get_collection_ref(key)[:]
            return keras_optimizers.tf1_optimizer_apply(
                opt, strategy, grads_and_vars, global_step
            )
        var_list = [v for _, v in grads_and_vars]
        if is_multi(opt):  # each group's share; its `iterations` +1
            update = opt.apply_aggregated(grads_and_vars)
        elif is_keras_legacy(opt):
            update = keras_optimizers.legacy_distributed_apply(
                opt,
                strategy,
                grads_and_vars,
                keras_optimizers.legacy_prepare(opt, var_list),
                name,
            )
        else:
            update = keras_optimizers.new_distributed_apply(
                opt, strategy, grads_and_vars
            )
        iterations = getattr(opt, "iterations", None)
        if global_step is None or iterations is global_step:
            return update
        deps = [update] if update is not None else []
        with tf.control_dependencies(deps):
            return global_step.assign_add(1, read_value=False)
