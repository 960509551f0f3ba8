"""What `fit` and `evaluate` do with the input tf_keras's
coordinator data handler builds, under `SyncParameterServerStrategy`.

`per_worker_dataset` is the coordinator's input hook (`install`): when a
`_ClusterCoordinatorDataHandler` builds its per-worker dataset (the
handler `keras_calls` records, for the call it records), it refuses what
the call's first step or first validation would fail on, in one line
(`jit_compile=True`; `validation_data` that cannot be read; a
`ServicePassPerEpoch` outside `fit`'s training data), repeats `fit`'s
training arrays, moves `steps_per_execution` onto the coordinator, makes
`fit` repeat its steps (`unrolled_fit`), and has a `OnePassPerEpoch` or a
`ServicePassPerEpoch` start a pass at each epoch. A dataset built outside
a data handler (a user's own loop, `tf2sync.Trainer`) is left to the
coordinator.
"""

from __future__ import annotations

import tensorflow as tf

from tf2sync._src import coordinator as coordinator_lib
from tf2sync._src import data_service
from tf2sync._src import fit_inputs
from tf2sync._src import keras_calls
from tf2sync._src import unrolled_fit
from tf2sync._src.internals import keras_fit
from tf2sync._src.internals import patches


def install() -> None:
    """Installs `fit_inputs` and this module's hook on the coordinator's
    per-worker datasets (idempotent)."""
    fit_inputs.install()
    coordinator_lib.add_input_hook(per_worker_dataset)


def per_worker_dataset(coordinator, dataset_fn):
    """The per-worker dataset of the data handler being built, or None.

    Called by `coordinator` (a `SyncCoordinator`) for `dataset_fn` (as
    its `create_per_worker_dataset` will build it); None leaves the
    building to the coordinator. Only a `_ClusterCoordinatorDataHandler`
    of `fit` or `evaluate` (exact evaluation's subclass aside)
    is acted on, before `fit` makes its train function: otherwise `fit`
    keeps tf_keras's loop (slower, not wrong).
    """
    handler = keras_calls.handler_being_built()
    model = keras_fit.data_handler_model(handler)
    creator = keras_fit.data_handler_dataset_creator(handler)
    if isinstance(creator, OnePassPerEpoch):
        patches.new_iterator_each_epoch.install(handler)
    if model is not None:
        _check_not_jit_compiled(model)
        _check_validation_input(model)
        _repeat_training_arrays(model, handler)
        unrolled_fit.steps_per_execution_on_coordinator(model, handler)
        # fit makes its train function next: repeat its steps.
        unrolled_fit.repeat_by_default(model)
    if isinstance(
        creator, data_service.ServicePassPerEpoch
    ) and not data_service.is_pass_dataset_fn(dataset_fn):
        _check_pass_reader(model, coordinator.strategy)
        return data_service.for_fit(
            creator,
            handler,
            model,
            coordinator,
            coordinator_lib.core_aggregator(coordinator.strategy),
        )
    return None


class OnePassPerEpoch(tf.keras.utils.experimental.DatasetCreator):
    """A `DatasetCreator` whose every `fit` epoch starts a new pass.

    `fit` keeps one iterator per worker for all epochs of a
    `DatasetCreator`, so once a worker has pushed more or fewer batches
    than its shard holds in one epoch, its passes straddle every later
    epoch. With this one, each worker's iterator is made again at the
    start of every epoch (a fresh pass over its shard, reshuffled): an
    epoch in which each worker pushes its shard's batches is exactly one
    pass over the data, whatever earlier epochs did. Use it with a dataset
    function that shards by its input context and an epoch of one pass
    (`docs/data.md`); with an epoch shorter than a pass, every epoch would
    read the same first part of each shard.

    Under stock PSS (no tf2sync coordinator) it is a plain
    `DatasetCreator`.
    """


# The argument that bounds the steps of each input `keras_calls.input_role`
# names.
_STEPS_ARGUMENT = {
    "fit": "pass `steps_per_epoch`",
    "validation": "pass `validation_steps` to `fit`",
    "evaluate": "pass `steps`",
    "predict": "pass `steps`",
}


def finite_dataset_message(role, cardinality) -> str:
    """The refusal of a finite dataset: for `role` (`keras_calls.input_role`),
    what to add; `cardinality`: its elements."""
    which = "`validation_data`" if role == "validation" else "The dataset"
    fix = "Add `.repeat()` and " + _STEPS_ARGUMENT.get(
        role, "run a fixed number of steps"
    )
    if role in ("validation", "evaluate"):
        fix += (
            " (or compile with `pss_evaluation_shards` to read a finite one "
            "once, exactly)"
        )
    return (
        f"{which} must repeat: under ParameterServerStrategy each worker "
        "iterates its own copy, and a step fails with an error when any copy "
        f"runs out. {fix}. Received: a dataset of {cardinality} elements."
    )


def _check_pass_reader(model, strategy) -> None:
    """Refuses a `ServicePassPerEpoch` outside `fit` with tf2sync's own
    repeating train function and a `tf2sync.SyncOptimizer` (one line)."""
    entry = keras_calls.entry_point(model)
    if entry != "fit":
        raise ValueError(
            "A tf2sync.ServicePassPerEpoch is read only by model.fit and "
            f"tf2sync.Trainer; received it in model.{entry or '?'}() (give "
            "evaluate and validation_data a dataset of their own)"
        )
    if coordinator_lib.core_aggregator(strategy) is None:
        raise ValueError(
            "A tf2sync.ServicePassPerEpoch needs a tf2sync.SyncOptimizer (its "
            "epoch ends with a flush of the last step); received "
            f"optimizer={type(model.optimizer).__name__}"
        )
    if not unrolled_fit.is_unrolled(model):
        raise ValueError(
            "A tf2sync.ServicePassPerEpoch needs tf2sync's train function "
            "(its steps stop at the end of the pass); received a model with "
            "tf_keras's loop (tf2sync.unroll_fit_steps(model, False), or a "
            "make_train_function of its own)"
        )


def _check_validation_input(model):
    """Refuses, while `fit` builds its training input, `validation_data`
    that its first validation would refuse once the first epoch trained:

    - a `ServicePassPerEpoch` (only fit's training steps end its pass);
    - a tf.data.Dataset that is finite (see `finite_dataset_message`),
      unless tf_keras's exact evaluation reads it, or infinite without
      `validation_steps`;
    - other data without `validation_steps` (tf_keras needs them under
      PSS; exact evaluation aside for a `DatasetCreator`), or of types
      tf_keras's coordinator cannot read (not tensors, arrays or pandas).

    Nothing is refused for a `fit` whose epochs do not validate
    (`validation_freq`)."""
    validation = keras_calls.fit_validation(model)
    if validation is None or not validation.validates:
        return
    data, steps = validation.data, validation.steps
    exact = keras_fit.exact_evaluation_shards(model) > 0
    received = f"Received: validation_data={type(data).__name__}"
    if validation.split:  # as given: fit uses it only without the data
        received += f", validation_split={validation.split!r}"
    if isinstance(data, data_service.ServicePassPerEpoch):
        raise ValueError(
            "A tf2sync.ServicePassPerEpoch is read only as fit's training "
            "data and by tf2sync.Trainer: give validation_data a dataset of "
            f"its own. {received}"
        )
    if isinstance(data, tf.data.Dataset):
        cardinality = int(data.cardinality())
        if cardinality == tf.data.INFINITE_CARDINALITY and steps is None:
            raise ValueError(
                "`validation_data` repeats forever: pass `validation_steps` "
                "to `fit`, the steps of each validation. Received: "
                "validation_steps=None"
            )
        if cardinality >= 0 and not exact:
            raise ValueError(finite_dataset_message("validation", cardinality))
        return
    if isinstance(
        data,
        (
            tf.keras.utils.experimental.DatasetCreator,
            tf.distribute.DistributedDataset,
        ),
    ):
        if steps is None and not exact:
            raise ValueError(
                "`validation_data` needs `validation_steps` under "
                "ParameterServerStrategy (or compile with "
                f"`pss_evaluation_shards`). {received}, validation_steps=None"
            )
        return
    if not keras_fit.keras_converts_for_coordinator(validation.x, validation.y):
        raise ValueError(
            "`validation_data` under ParameterServerStrategy must be a "
            "tf.data.Dataset, a DatasetCreator, or (x, y) of tensors, NumPy "
            f"arrays or pandas objects. {received} (x: "
            f"{type(validation.x).__name__}, y: {type(validation.y).__name__})"
        )
    if steps is None:
        raise ValueError(
            "`validation_data` of arrays needs `validation_steps` under "
            "ParameterServerStrategy, at most the batches it makes: each "
            f"worker reads its own copy, once. {received}, "
            "validation_steps=None"
        )


def _repeat_training_arrays(model, handler) -> None:
    """Lets `fit(x, y, steps_per_epoch=...)` of arrays train its steps.

    tf_keras turns arrays into a dataset of `epochs` passes, which each
    worker iterates as its own copy: once a worker had run more batches
    than that (more steps than one pass per epoch, shared among the
    workers as they come), its step failed with `End of sequence` and
    `fit` with an opaque CancelledError, stock PSS's too. Under tf2sync
    each worker starts another pass of its copy instead. The data a
    validation or `evaluate` reads is left as it is: reading more than
    one pass there would count batches twice.
    """
    creator = keras_fit.data_handler_dataset_creator(handler)
    if keras_calls.input_role(
        model
    ) == "fit" and keras_fit.is_keras_arrays_creator(creator):
        patches.repeat_keras_arrays.install(creator)


def _check_not_jit_compiled(model):
    """Refuses `jit_compile=True` before `fit` or `evaluate` runs a step.

    XLA cannot read variables that live on another device, and under a
    ParameterServerStrategy every variable lives on a ps: stock PSS fails
    inside its first step ("Trying to access resource ... located in device
    /job:ps"), and tf2sync's push would fail earlier with an error about
    `merge_call`. Neither names the setting to change.
    """
    if getattr(model, "jit_compile", None):
        raise ValueError(
            "`jit_compile=True` cannot run under "
            "tf2sync.SyncParameterServerStrategy: XLA cannot read variables "
            "on the parameter servers, where all of them live. Compile the "
            "model with jit_compile=False. Received: "
            f"jit_compile={model.jit_compile!r}"
        )
