"""ParameterServerStrategy: its variables, read cache, extended class
and datasets.

Part of `tf2sync._src.tf_internals`, the one door to private TensorFlow
and tf_keras API: see its docstring for the version tags.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import input_lib
from tensorflow.python.distribute import parameter_server_strategy_v2
from tensorflow.python.distribute import ps_values
from tensorflow.python.distribute import sharded_variable
from tensorflow.python.ops import resource_variable_ops

# Distribute / ParameterServerStrategy [2.21] [2.15: kept] --------------------
# PSS's variables, read cache and datasets have no public handles beyond
# `tf.distribute.Strategy`'s.


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


# The class of `strategy.extended` under PSS, for subclassing: no public
# name (tf2sync overrides its `_create_variable`, `_update` and
# `_experimental_distribute_dataset` hooks).
ParameterServerExtended = (
    parameter_server_strategy_v2.ParameterServerStrategyV2Extended
)


def replace_extended_class(strategy, cls) -> None:
    """Makes `strategy.extended` a `cls`, a subclass of its class: PSS's
    `__init__` builds it with no way to choose the class."""
    if not issubclass(cls, type(strategy.extended)):
        raise TypeError(f"{cls!r} does not subclass {type(strategy.extended)}")
    strategy.extended.__class__ = cls


def num_workers(strategy) -> int:
    """A PSS's worker tasks (`extended._num_workers`), 1 for another
    strategy; public only through its cluster resolver's spec."""
    return int(getattr(strategy.extended, "_num_workers", 1))


def num_gpus_per_worker(strategy) -> int:
    """A PSS's GPUs per worker (`extended._num_gpus_per_worker`)."""
    return int(strategy.extended._num_gpus_per_worker)


def is_distributed_dataset(obj) -> bool:
    """Whether `obj` is what `experimental_distribute_dataset` returns
    (`input_lib.DistributedDataset`; `tf.distribute.DistributedDataset` is
    an interface that `distribute_datasets_from_function`'s shares)."""
    return isinstance(obj, input_lib.DistributedDataset)


def distributed_dataset_is_built(dataset) -> bool:
    """Whether a `DistributedDataset` built its iterators (`_built`)."""
    return bool(dataset._built)


def distributed_dataset_source(dataset):
    """The dataset a `DistributedDataset` wraps (`_original_dataset`)."""
    return dataset._original_dataset


def worker_local_dataset(dataset):
    """The one `tf.data.Dataset` of a distributed dataset built inside a
    per-worker dataset function (`_datasets[0]`, `_cloned_datasets[0]`);
    any other `dataset` unchanged."""
    if isinstance(dataset, input_lib.DistributedDatasetsFromFunction):
        return dataset._datasets[0]
    if isinstance(dataset, input_lib.DistributedDataset):
        return dataset._cloned_datasets[0]
    return dataset
