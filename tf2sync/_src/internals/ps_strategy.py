"""The ParameterServerStrategy object [2.21] [2.15: kept]: its extended
class, its workers and resolver, its distributed datasets.

PSS's extended object and datasets have no public handles beyond
`tf.distribute.Strategy`'s. `strategy.extended` is made a tf2sync class by
`patches.extended_class`.
"""

from __future__ import annotations

from tensorflow.python.distribute import input_lib
from tensorflow.python.distribute import parameter_server_strategy_v2

# The class of `strategy.extended` under PSS, for subclassing: no public
# name (tf2sync overrides its `_create_variable`, `_update` and
# `_experimental_distribute_dataset` hooks).
ParameterServerExtended = (
    parameter_server_strategy_v2.ParameterServerStrategyV2Extended
)


def num_workers(strategy) -> int:
    """A PSS's worker tasks (`extended._num_workers`), 1 for another
    strategy; public only through its cluster resolver's spec."""
    return int(getattr(strategy.extended, "_num_workers", 1))


def cluster_resolver(strategy):
    """The strategy's `ClusterResolver`, or None. PSS keeps the one it was
    given in `_cluster_resolver`; its public `cluster_resolver` property
    answers None. [2.21] [2.15]: `fit_test` reaches it on both."""
    return strategy.cluster_resolver or getattr(
        strategy, "_cluster_resolver", None
    )


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
