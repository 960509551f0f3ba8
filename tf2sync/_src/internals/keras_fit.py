"""What tf_keras's `fit`, `evaluate` and `predict` and their data handlers
are doing now [2.21] [2.15: kept], for the coordinator.

tf_keras's data handlers call the strategy's coordinator without saying
who they are, nor for which call: `keras_calls` records both (the
patches `keras_calls` and `data_handler_context`), and this module reads
the handlers' and adapters' private attributes. The hooks tf2sync puts on
a handler, its adapter or its dataset creator are in `patches`
(`epoch_end_hook`, `repeat_keras_arrays`, `new_iterator_each_epoch`).
"""

from __future__ import annotations

import copy

import tensorflow as tf
import tf_keras
from tf_keras.src.engine import data_adapter as keras_data_adapter


def coordinator_handler_class():
    """tf_keras's `_ClusterCoordinatorDataHandler`, the data handler `fit`
    and `evaluate` build under a coordinator (for `patches`) [2.21]."""
    return keras_data_adapter._ClusterCoordinatorDataHandler


def exact_evaluation_handler_class():
    """Its subclass for exact evaluation,
    `_ClusterCoordinatorExactEvalDataHandler` [2.21]."""
    return keras_data_adapter._ClusterCoordinatorExactEvalDataHandler


def should_validate(model, epoch, validation_freq) -> bool:
    """Whether `fit` of `model` validates after `epoch` (0-based) for its
    `validation_freq` (`_should_eval`; a bad `validation_freq` raises
    ValueError) [2.21] [2.15]."""
    return model._should_eval(epoch, validation_freq)


def split_off_validation(x, y, sample_weight, validation_split):
    """The `validation_data` that `fit` splits off its arrays for
    `validation_split` (the last examples, unshuffled:
    `train_validation_split`) [2.21]."""
    _, validation = keras_data_adapter.train_validation_split(
        (x, y, sample_weight), validation_split=validation_split
    )
    return validation


def is_keras_tensor_like(value) -> bool:
    """Whether `value` is what tf_keras's coordinator handler converts: a
    tensor, NumPy array or pandas object (`_get_tensor_types`) [2.21]."""
    return isinstance(value, keras_data_adapter._get_tensor_types())


def keras_converts_for_coordinator(x, y) -> bool:
    """Whether tf_keras's coordinator data handler turns `x` and `y` into a
    dataset: tensors, NumPy arrays or pandas objects, or dicts, lists and
    tuples of them (`patches.nested_array_inputs`; otherwise it raises
    NotImplementedError) [2.21] [2.15]."""
    leaves = tf.nest.flatten(x) + tf.nest.flatten(y)
    return all(is_keras_tensor_like(leaf) for leaf in leaves)


# The name of the dataset function `nested_arrays_converter` makes.
_NESTED_ARRAYS_CREATOR = "tf2sync_nested_arrays"


def nested_arrays_converter(convert):
    """tf_keras's `_convert_to_dataset_creator` (`convert`) taking dicts,
    lists and tuples of arrays as its one-machine adapters take them
    (`select_data_adapter`), each worker reading its own copy as of one
    array; anything else goes to `convert` [2.21]."""

    def convert_nested(handler, x, y, **kwargs):
        leaves = tf.nest.flatten(x) + tf.nest.flatten(y)
        if not all(is_keras_tensor_like(leaf) for leaf in leaves):
            return convert(handler, x, y, **kwargs)
        # tf_keras passes `sample_weight`, its adapters take
        # `sample_weights`: its own conversion dropped the weights.
        weights = kwargs.pop("sample_weight", None)

        def dataset_fn(input_context):
            del input_context  # each worker reads its own copy
            adapter = keras_data_adapter.select_data_adapter(x, y)
            return adapter(
                x=x, y=y, sample_weights=weights, **kwargs
            ).get_dataset()

        dataset_fn.__qualname__ = _NESTED_ARRAYS_CREATOR
        return tf.keras.utils.experimental.DatasetCreator(dataset_fn)

    return convert_nested


def has_added_metrics(model) -> bool:
    """Whether a layer of `model` has metrics of `add_metric` that are not
    compiled ones: tf_keras's exact evaluation refuses them
    (`_disallow_exact_eval_with_add_metrics`) [2.21]."""
    compiled = model.compiled_metrics.metrics if model.compiled_metrics else []
    return any(
        metric not in compiled
        for layer in model._flatten_layers()
        for metric in layer._metrics
    )


def set_exact_evaluation_shards(model, shards: int) -> None:
    """`compile(pss_evaluation_shards=shards)` after the fact (tf_keras
    reads `_pss_evaluation_shards` at each `evaluate`), and the test
    function made for the other kind forgotten: tf_keras keeps either kind
    in `test_function`, and `make_test_function` returns the one it has
    [2.21]."""
    if int(getattr(model, "_pss_evaluation_shards", 0) or 0) != int(shards):
        model.test_function = None
    # Its exact function (cached apart, never cleared by `compile`) holds
    # the metrics and loss of the compile that traced it.
    compiled = model.compiled_metrics
    if getattr(model, "_tf2sync_exact_compile", None) is not compiled:
        model._shard_test_function = None
        model._tf2sync_exact_compile = compiled
    model._pss_evaluation_shards = int(shards)


def forget_validation_data(model) -> None:
    """Drops the validation data handler a `fit` caches
    (`_eval_data_handler`): tf_keras deletes it only when `fit` ends
    normally, so the next `fit` after a failed one validated on the old
    data [2.21]."""
    if getattr(model, "_eval_data_handler", None) is not None:
        model._eval_data_handler = None


def replica_mean_loss(loss_fn):
    """`loss_fn` allowed to reduce to the mean over a replica's batch
    under a strategy, where it is a tf_keras `Loss` of `AUTO` or
    `SUM_OVER_BATCH_SIZE` reduction (tf_keras refuses those under a
    strategy but in `compile`, which allows its own losses through
    `_allow_sum_over_batch_size` [2.21] [2.15]): a copy, the user's object
    left as it is. Any other `loss_fn` is returned as it is."""
    reduction = tf_keras.losses.Reduction
    if not isinstance(loss_fn, tf_keras.losses.Loss) or getattr(
        loss_fn, "reduction", None
    ) not in (reduction.AUTO, reduction.SUM_OVER_BATCH_SIZE):
        return loss_fn
    allowed = copy.copy(loss_fn)
    allowed._allow_sum_over_batch_size = True
    return allowed


def exact_evaluation_shards(model) -> int:
    """`compile(pss_evaluation_shards=...)` as tf_keras inferred it
    (`_pss_evaluation_shards`; 0 without exact evaluation) [2.21] [2.15]."""
    return int(getattr(model, "_pss_evaluation_shards", 0) or 0)


def data_handler_model(handler):
    """The model a tf_keras data handler serves (`_model`), or None."""
    return getattr(handler, "_model", None)


def data_handler_dataset_creator(handler):
    """The `DatasetCreator` a data handler reads (its adapter's), or None."""
    adapter = getattr(handler, "_adapter", None)
    return getattr(adapter, "dataset_creator", None)


def is_keras_arrays_creator(creator) -> bool:
    """Whether `creator` is the `DatasetCreator` tf_keras's coordinator data
    handler made of tensors, NumPy arrays or pandas objects
    (`_convert_to_dataset_creator`'s `_dataset_fn`) [2.21] [2.15]."""
    fn = getattr(creator, "dataset_fn", None)
    name = getattr(fn, "__qualname__", "")
    return name == _NESTED_ARRAYS_CREATOR or name.startswith(
        "_ClusterCoordinatorDataHandler._convert_to_dataset_creator."
    )


def sync_then(handler, fn):
    """`handler.sync`, then `fn(join)` with it (for
    `patches.epoch_end_hook`)."""
    join = handler.sync

    def sync():
        join()
        fn(join)

    return sync


def repeating_dataset_fn(creator):
    """`creator.dataset_fn` with its dataset repeated (for
    `patches.repeat_keras_arrays`)."""
    make = creator.dataset_fn
    return lambda input_context: make(input_context).repeat()


def data_handler_adapter(handler):
    """A data handler's data adapter (`_adapter`)."""
    return handler._adapter
