"""What `fit` and `evaluate` take under `SyncParameterServerStrategy`.

Under a ParameterServerStrategy tf_keras refuses, or reads wrongly, input
it takes on one machine. Installed when the first strategy is created,
`fit` and `evaluate` of a model under one (other models are untouched):

* take dicts, lists and tuples of NumPy arrays (tensors, pandas objects)
  as they take one array: each worker reads its own shuffled copy, as
  tf_keras does for one array under PSS;
* derive `steps_per_epoch` from such arrays when it is not given: one
  pass of the examples at `batch_size`, shared by the workers (logged);
* evaluate finite data exactly, once: arrays (`validation_data=(x, y)`,
  `evaluate(x, y)`) and finite `tf.data` datasets are read through
  tf_keras's exact evaluation (`compile(pss_evaluation_shards=...)`), which
  splits them into shards, each read by one worker, each element once,
  so `val_*` and `evaluate` are the metrics of the whole set. Without it,
  each worker read its own copy from its start: the first batches counted
  once per worker and the rest never. Not where tf_keras's exact
  evaluation cannot run (a model with its own `test_step`, or metrics of
  `add_metric`): there a finite input keeps needing `validation_steps` /
  `steps` (refused in one line otherwise, `fit_hooks.py`).
"""

from __future__ import annotations

import functools
import inspect
import logging as logging_lib
import math

import tensorflow as tf
import tf_keras
from absl import logging

from tf2sync._src import keras_calls
from tf2sync._src.internals import keras_fit
from tf2sync._src.internals import patches
from tf2sync._src.internals import ps_strategy

# tf_keras's `pss_evaluation_shards="auto"`: shards per worker.
SHARDS_PER_WORKER = 5
_DEFAULT_BATCH_SIZE = 32  # tf_keras's, for arrays without `batch_size`


def install() -> None:
    """Installs the patch `nested_array_inputs` and `keras_calls`'s, with
    this module's input hooks of `fit` and `evaluate` (idempotent)."""
    patches.nested_array_inputs.install()
    keras_calls.install()
    keras_calls.set_input_hooks(fit=_wrap_fit, evaluate=_wrap_evaluate)


def _under_sync(model) -> bool:
    return getattr(model.distribute_strategy, "_tf2sync_synchronous", False)


def is_arrays(value) -> bool:
    """Whether `value` is an array or a dict, list or tuple of them (what
    tf_keras's one-machine adapters read as arrays)."""
    if value is None:
        return False
    leaves = tf.nest.flatten(value)
    return bool(leaves) and all(
        keras_fit.is_keras_tensor_like(leaf) for leaf in leaves
    )


def _num_examples(x) -> int:
    return len(tf.nest.flatten(x)[0])


def exact_allowed(model) -> bool:
    """Whether tf_keras's exact evaluation scores `model` as `evaluate`
    would. It skips a model's own `test_step`, `compute_loss` and
    `compute_metrics`, leaves out `model.losses` (regularizers,
    `add_loss`), refuses metrics of `add_metric`, and updates each metric
    with the whole `(y, y_pred)` structure (several outputs fail)."""
    own = any(
        getattr(type(model), name) is not getattr(tf_keras.Model, name)
        for name in ("test_step", "compute_loss", "compute_metrics")
    )
    outputs = getattr(model, "outputs", None)
    return (
        not own
        and not model.losses
        and not keras_fit.has_added_metrics(model)
        and (outputs is None or len(outputs) == 1)
    )


def _finite(dataset) -> bool:
    return int(dataset.cardinality()) >= 0


def _arrays_dataset(x, y, sample_weight, batch_size):
    """Arrays as a finite batched dataset."""
    parts = tuple(p for p in (x, y, sample_weight) if p is not None)
    parts = tf.nest.map_structure(
        lambda v: v.to_numpy() if hasattr(v, "to_numpy") else v, parts
    )
    # A list of inputs is several tensors, as tf_keras reads it (tf.data
    # would stack a list into one).
    parts = tf.__internal__.nest.list_to_tuple(parts)
    return tf.data.Dataset.from_tensor_slices(parts).batch(
        batch_size or _DEFAULT_BATCH_SIZE
    )


def _single_output_of_one(model, dataset) -> bool:
    """Whether `model` has one output of shape `(batch, 1)`; a model
    without a known output shape (subclassed) is called on one batch."""
    try:
        shape = tuple(model.output_shape)
    except (AttributeError, RuntimeError, TypeError):
        x, _, _ = tf.keras.utils.unpack_x_y_sample_weight(
            next(iter(dataset.take(1)))
        )
        output = model(x, training=False)
        if not isinstance(output, tf.Tensor):
            return False
        shape = tuple(output.shape)
    return len(shape) == 2 and shape[-1] == 1


def for_exact_evaluation(model, dataset, steps):
    """`dataset` (finite, batched) as tf_keras's exact evaluation reads it
    right: `steps` batches if given; labels of rank 1 given the rank of a
    `(batch, 1)` output (its cloned metrics skip the rank matching of
    `compile`'s metrics, and compared a label vector with a column, a
    partial batch's accuracy came out wrong); shards of batches (tf.data's
    AUTO policy may try files, and fail)."""
    if steps:
        dataset = dataset.take(steps)
    if _single_output_of_one(model, dataset):

        def match(*element):
            x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(
                element if len(element) > 1 else element[0]
            )
            if y is not None and y.shape.rank == 1:
                y = tf.expand_dims(y, -1)
            return tf.keras.utils.pack_x_y_sample_weight(x, y, sample_weight)

        dataset = dataset.map(match)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return dataset.with_options(options)


def _build_metrics(model, dataset, evaluate) -> None:
    """Builds the compiled metrics with one step of tf_keras's own
    `evaluate` (exact evaluation clones them, and a model's first step
    builds them): before the model ever trained or evaluated."""
    if model.compiled_metrics is None or model.compiled_metrics.built:
        return
    shards = keras_fit.exact_evaluation_shards(model)
    keras_fit.set_exact_evaluation_shards(model, 0)  # one step, not exact
    try:
        evaluate(model, dataset.take(1).repeat(), steps=1, verbose=0)
    finally:
        keras_fit.set_exact_evaluation_shards(model, shards)


class _NotShardableNote(logging_lib.Filter):
    """Drops tf_keras's note that exact evaluation of a dataset of slices
    "may be slower than inexact evaluation": tf2sync chose it, and the
    inexact one scores the wrong examples."""

    def filter(self, record):
        return not record.getMessage().startswith("Found source dataset")


class _ExactEvaluation:
    """Turns tf_keras's exact evaluation on for one call, if it was off:
    `SHARDS_PER_WORKER` shards per worker, at most one per batch of
    `dataset` (tf.data cannot cut a dataset into more shards than it has
    elements)."""

    def __init__(self, model, dataset=None):
        self._model = model
        self._enabled = (
            dataset is not None
            and keras_fit.exact_evaluation_shards(model) == 0
        )
        if self._enabled:
            workers = ps_strategy.num_workers(model.distribute_strategy)
            self._shards = max(
                1, min(SHARDS_PER_WORKER * workers, int(dataset.cardinality()))
            )
        self._filter = _NotShardableNote()

    def __enter__(self):
        if self._enabled:
            keras_fit.set_exact_evaluation_shards(self._model, self._shards)
            logging_lib.getLogger("tensorflow").addFilter(self._filter)

    def __exit__(self, *exc):
        if self._enabled:
            keras_fit.set_exact_evaluation_shards(self._model, 0)
            logging_lib.getLogger("tensorflow").removeFilter(self._filter)


def _as_python(result):
    """tf_keras's exact `evaluate` returns tensors; one machine's, floats."""
    if isinstance(result, dict):
        return {k: _as_python(v) for k, v in result.items()}
    if isinstance(result, (list, tuple)):
        return [_as_python(v) for v in result]
    return float(result) if hasattr(result, "numpy") else result


def _split_arrays(model, arguments) -> None:
    """`validation_split` of arrays done as tf_keras does it (the last
    examples, unshuffled), the split off part given as `validation_data`,
    which is then validated exactly; where exact evaluation cannot run,
    left to tf_keras."""
    split = arguments.get("validation_split") or 0.0
    if not split or arguments.get("validation_data") is not None:
        return
    if not exact_allowed(model):
        return
    at = int(_num_examples(arguments["x"]) * (1.0 - split))
    head, tail = {}, []
    for name in ("x", "y", "sample_weight"):
        value = arguments.get(name)
        if value is None:
            tail.append(None)
            continue
        head[name] = tf.nest.map_structure(lambda a: a[:at], value)
        tail.append(tf.nest.map_structure(lambda a: a[at:], value))
    arguments.update(head, validation_split=0.0, validation_data=tuple(tail))


def _exact_dataset(model, x, y, sample_weight, batch_size, steps):
    """The data `x` (arrays with `y` and `sample_weight`, or a dataset)
    ready for exact evaluation (`for_exact_evaluation`), or None where
    exact evaluation does not apply: the model (`exact_allowed`), or data
    that is neither arrays nor a finite dataset."""
    if not exact_allowed(model):
        return None
    if is_arrays(x):
        x = _arrays_dataset(x, y, sample_weight, batch_size)
    elif not (isinstance(x, tf.data.Dataset) and _finite(x)):
        return None
    return for_exact_evaluation(model, x, steps)


def _wrap_fit(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        arguments = bound.arguments
        model = arguments["self"]
        if not _under_sync(model):
            return original(*args, **kwargs)
        if arguments.get("class_weight"):
            raise ValueError(
                "`class_weight` is not applied under ParameterServerStrategy "
                "(tf_keras's coordinator data handler ignores it): weight the "
                "examples with `sample_weight`, or in the dataset's elements. "
                f"Received: class_weight={arguments['class_weight']!r}"
            )
        x, batch = arguments.get("x"), arguments.get("batch_size")
        if is_arrays(x):
            _split_arrays(model, arguments)
            x = arguments["x"]
        if is_arrays(x) and arguments.get("steps_per_epoch") is None:
            n = _num_examples(x)
            steps = max(1, math.ceil(n / (batch or _DEFAULT_BATCH_SIZE)))
            arguments["steps_per_epoch"] = steps
            logging.info(
                "tf2sync: steps_per_epoch=%d (%d examples at batch_size %d, "
                "shared by the workers)",
                steps,
                n,
                batch or _DEFAULT_BATCH_SIZE,
            )
        data = arguments.get("validation_data")
        if isinstance(data, (tuple, list)):
            data = (tuple(data) + (None, None))[:3]
        else:
            data = (data, None, None)
        exact = None
        if data[0] is not None:
            exact = _exact_dataset(
                model,
                *data,
                arguments.get("validation_batch_size") or batch,
                arguments.get("validation_steps"),
            )
        if exact is not None:
            arguments["validation_data"] = exact
            arguments["validation_steps"] = None
        try:
            with _ExactEvaluation(model, exact):
                return original(*bound.args, **bound.kwargs)
        finally:
            keras_fit.forget_validation_data(model)

    return fit


def _wrap_evaluate(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def evaluate(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        arguments = bound.arguments
        model = arguments["self"]
        inner = arguments.get("kwargs", {})
        if not _under_sync(model) or inner.get("_use_cached_eval_dataset"):
            return original(*args, **kwargs)  # fit's validation: as set up
        exact = _exact_dataset(
            model,
            arguments.get("x"),
            arguments.get("y"),
            arguments.get("sample_weight"),
            arguments.get("batch_size"),
            arguments.get("steps"),
        )
        if exact is None:
            return original(*bound.args, **bound.kwargs)
        arguments.update(x=exact, y=None, sample_weight=None, steps=None)
        _build_metrics(model, exact, original)
        with _ExactEvaluation(model, exact):
            return _as_python(original(*bound.args, **bound.kwargs))

    return evaluate
