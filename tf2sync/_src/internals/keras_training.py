"""tf_keras training [2.21] [2.15: kept]: the pieces of `fit`'s train
function.

tf2sync makes `fit`'s train function itself, from tf_keras's own pieces,
which `tf.keras.Model` does not export. tf2sync replaces the model's
end-of-epoch check of its logs (`epoch_logs_validator`) through
`patches.exact_epoch_logs`.
"""

from __future__ import annotations

from tensorflow.python.trackable import base as trackable
from tf_keras.src.engine import training as keras_training


def is_keras_train_step(fn) -> bool:
    """True for the `run_step` of tf_keras's `make_train_function`.

    Version gate: its `__qualname__` names `make_train_function`, or is
    `tf__step_function.<locals>.run_step` where AutoGraph converted
    `step_function` (tf_keras 2.15) [2.15: kept]. The test function's
    step matches the second form too.
    """
    qualname = getattr(fn, "__qualname__", "")
    return "make_train_function" in qualname or qualname.endswith(
        "step_function.<locals>.run_step"
    )


def reduce_per_replica(values, strategy, reduction):
    """tf_keras's reduction of a step's per-replica outputs."""
    return keras_training.reduce_per_replica(
        values, strategy, reduction=reduction
    )


def minimum_control_deps(outputs) -> list:
    """What tf_keras's train function waits on before counting a step."""
    return keras_training._minimum_control_deps(outputs)


def model_coordinator(model):
    """The coordinator `fit` runs `model` on (`_cluster_coordinator`)."""
    return getattr(model, "_cluster_coordinator", None)


def train_counter(model):
    """`model`'s count of train steps run (`_train_counter`)."""
    return model._train_counter


def steps_per_execution_variable(model):
    """The variable behind `model.steps_per_execution`, or None."""
    return getattr(model, "_steps_per_execution", None)


def set_steps_per_execution_variable(model, variable) -> None:
    """Makes `variable` the one behind `model.steps_per_execution`,
    untracked (as tf_keras's own, see `_configure_steps_per_execution`)."""
    with trackable.no_automatic_dependency_tracking_scope(model):
        model._steps_per_execution = variable


def data_handler_steps_per_execution(handler):
    """The `steps_per_execution` variable a data handler reads, or None."""
    return getattr(handler, "_steps_per_execution", None)


def set_data_handler_steps_per_execution(handler, variable) -> None:
    """Makes a data handler read `variable` as its `steps_per_execution`."""
    handler._steps_per_execution = variable


def fit_epoch_position(handler):
    """`(first step of the call being made, steps of the epoch)` of a fit
    data handler (its `_current_step` and `inferred_steps`), or None."""
    current = getattr(handler, "_current_step", None)
    total = getattr(handler, "inferred_steps", None)
    if not isinstance(current, int) or not isinstance(total, int):
        return None
    return current, total


def epoch_logs_validator(model):
    """`model`'s end-of-epoch check of its logs, which swaps in the exact
    metrics after a coordinator's join (`_validate_and_get_metrics_result`)."""
    return model._validate_and_get_metrics_result


def implements_train_batch_hooks(callback) -> bool:
    """Whether a tf_keras callback acts on training batches
    (`_implements_train_batch_hooks`: an overridden batch hook, a
    `ModelCheckpoint` or `BackupAndRestore` saving every N batches, a
    `TensorBoard` tracing) [2.21] [2.15]."""
    implements = getattr(callback, "_implements_train_batch_hooks", None)
    return bool(implements()) if implements is not None else False


def set_fit_resume(model, resume) -> None:
    """Makes `model`'s next `fit` start at the `(epoch, step)` that
    `resume.maybe_load_initial_counters_from_ckpt(steps_per_epoch,
    initial_epoch, mode)` returns (tf_keras's `_training_state`, which its
    `BackupAndRestore` sets, and which `fit` reads after `on_train_begin`);
    None: as `fit` is called [2.21] [2.15]."""
    with trackable.no_automatic_dependency_tracking_scope(model):
        model._training_state = resume
