"""ParameterServerStrategy's variables [2.21] [2.15: kept]: plain
resource variables, the read cache and sharded variables.

PSS's variables and read cache have no public handles beyond
`tf.distribute.Strategy`'s. The read cache made graph-aware
(`PerGraphCachingVariable`) is installed by `patches.per_graph_read_cache`.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import ps_values
from tensorflow.python.distribute import sharded_variable
from tensorflow.python.ops import resource_variable_ops

# The classes `patches.per_graph_read_cache` swaps between, and the one it
# looks through (what PSS wraps around a variable on workers with several
# GPUs).
CachingVariable = ps_values.CachingVariable
AggregatingVariable = ps_values.AggregatingVariable

# What PSS's creator returns for a partitioned variable (exported only as
# `tf.__internal__.distribute.ShardedVariable`).
ShardedVariable = sharded_variable.ShardedVariable


def plain_resource_variable(
    initial_value, name, dtype=None, *, device=None, trainable=False
):
    """A resource variable outside any strategy, made under `init_scope`.

    No public form: `tf.Variable` goes through the creator of the strategy
    in scope (under PSS: a ps variable, placed round-robin).
    """
    place = tf.device(device) if device else contextlib.nullcontext()
    with tf.init_scope(), place:
        return resource_variable_ops.ResourceVariable(
            initial_value, trainable=trainable, name=name, dtype=dtype
        )


def is_caching_variable(var) -> bool:
    """Whether `var` is PSS's variable with a read cache (no public class:
    `ps_values.CachingVariable`, what PSS's creator returns or wraps)."""
    return isinstance(var, ps_values.CachingVariable)


class PerGraphCachingVariable(ps_values.CachingVariable):
    """A `CachingVariable` whose cached read is only reused where reachable.

    PSS's cache (`cached_read_value`) returns one tensor per variable per
    caching scope, whatever graph asks. A step that first reads a variable
    inside a nested graph (a `tf.cond` branch, a `Sequential` inferring its
    shapes in a scratch graph on its first call) then got that graph's
    tensor outside it: `InaccessibleTensorError`. Here a cached read is
    reused in its own graph and in graphs nested in it (which capture it);
    elsewhere the variable is read again and that read becomes the cache.
    """

    __slots__ = ()

    def cached_read_value(self):
        cached = super().cached_read_value()
        cached_graph = getattr(cached, "graph", None)  # None: eager
        if tf.executing_eagerly():  # under `init_scope` in a step
            return cached if cached_graph is None else self._v.read_value()
        graph = tf.compat.v1.get_default_graph()
        while graph is not None:
            if graph is cached_graph:
                return cached
            graph = getattr(graph, "outer_graph", None)
        self._cache = None
        return super().cached_read_value()


def is_sharded_variable(var) -> bool:
    """Whether `var` is a `ShardedVariable` (what PSS's creator returns for
    a partitioned variable; exported only as
    `tf.__internal__.distribute.ShardedVariable`)."""
    return isinstance(var, sharded_variable.ShardedVariable)


def shards(variables) -> list:
    """`variables` with each `ShardedVariable` replaced by its shards, in
    order (a shard is a variable of its own on one ps)."""
    flat = []
    for var in variables:
        if is_sharded_variable(var):
            flat.extend(var.variables)
        else:
            flat.append(var)
    return flat


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


def in_read_caching_scope() -> bool:
    """Whether `read_caching_scope()` is active (it cannot nest)."""
    return distribute_utils.caching_scope_local.in_caching_scope()


def read_caching_scope():
    """PSS's `cache_variable_reads()` scope: one read per variable.

    Internal to PSS (tf_keras's coordinator evaluation used it).
    """
    return distribute_utils.cache_variable_reads()


def start_read_cache(var) -> None:
    """Empties `var`'s read cache and ties it to the current caching scope
    (`_cache`, `_current_new_cache_scope_count`)."""
    var._cache = None
    count = distribute_utils.caching_scope_local.new_cache_scope_count
    var._current_new_cache_scope_count = count


def clear_read_cache(var) -> None:
    """Empties `var`'s read cache (`_cache`)."""
    var._cache = None


def cached_read(var):
    """The tensor `var`'s read cache holds, or None (`_cache`)."""
    return var._cache


def inner_variable(var):
    """The variable a `CachingVariable` wraps (`_v`): its `device` is the
    ps task's; its `handle` is what the step's reads capture."""
    return var._v
