"""The checks of `Trainer`'s arguments: each refuses a value in one line
naming the argument and the value, before anything trains."""

from __future__ import annotations

import numbers
import os

import tensorflow as tf
import tf_keras
from absl import logging

from tf2sync._src import callbacks as callbacks_lib
from tf2sync._src import compat_v1
from tf2sync._src import flag_checks
from tf2sync._src import options as options_lib
from tf2sync._src import tf_internals


def loop_arguments(steps_per_loop, use_tf_while_loop) -> None:
    """Raises `ValueError` for the loop arguments `Trainer` refuses."""
    if not isinstance(steps_per_loop, int) or steps_per_loop <= 0:
        raise ValueError(
            "`steps_per_loop` must be a positive int. Received: "
            f"steps_per_loop={steps_per_loop!r}"
        )
    if use_tf_while_loop is not None and not isinstance(
        use_tf_while_loop, bool
    ):
        raise ValueError(
            "`use_tf_while_loop` must be None, True or False. Received: "
            f"use_tf_while_loop={use_tf_while_loop!r}"
        )


def checked_options(strategy, options):
    """`options` checked; the strategy's when None."""
    if options is None:
        options = options_lib.of_strategy(strategy)
    return options_lib.check(options)


def optimizer(optimizer):
    """Raises `TypeError` unless the trainer can step through `optimizer`."""
    if isinstance(optimizer, compat_v1.SyncReplicasOptimizer):
        return
    try:
        callbacks_lib.find_sync_optimizer(optimizer)
    except ValueError:
        raise TypeError(
            "Trainer's `optimizer` must be a tf2sync.SyncOptimizer (or a "
            "tf2sync.compat.v1.SyncReplicasOptimizer): another optimizer "
            "would train asynchronously. Received: "
            f"optimizer={optimizer!r}"
        ) from None


def model(model) -> None:
    """Refuses a model without weights: the trainer builds the optimizer's
    state on them, eagerly, before any step is traced."""
    if model.built:
        return
    raise ValueError(
        f"Trainer's `model` has no weights yet: {model.name!r} is built at "
        "its first call, and the trainer builds its optimizer before any "
        "step. Give its first layer an `input_shape` (or call "
        "`model.build(input_shape)`) under `strategy.scope()`. Received: "
        f"model={model.name!r} (built=False)"
    )


def checkpoint_dir(checkpoint_dir) -> None:
    """Refuses a `checkpoint_dir` the first save could not write (a file,
    a directory it cannot write or create), before anything trains."""
    if checkpoint_dir is None:
        return
    path = os.fspath(checkpoint_dir)
    problem = flag_checks.directory_problem(path, writable=True)
    if problem:
        raise ValueError(
            f"`checkpoint_dir`: {problem}. Received: "
            f"checkpoint_dir={checkpoint_dir!r}"
        )


def dataset_fn(dataset_fn):
    """Refuses a `dataset_fn` that is not callable (a dataset, arrays)."""
    if callable(dataset_fn):
        return
    hint = ""
    if isinstance(dataset_fn, tf.data.Dataset):
        hint = (
            " (a tf.data.Dataset: build it inside the function, or pass "
            "`lambda input_context: dataset` for each worker to read its "
            "own copy)"
        )
    raise TypeError(
        "`dataset_fn` must be a function `dataset_fn(input_context) -> "
        "tf.data.Dataset`, called on each worker, or a "
        f"tf2sync.ServicePassPerEpoch{hint}. Received: "
        f"dataset_fn={type(dataset_fn).__name__}"
    )


def steps_per_epoch(steps_per_epoch, service, shim) -> None:
    """Raises `ValueError` unless `steps_per_epoch` is a positive int (None
    with a `ServicePassPerEpoch` (`service`), which the shim cannot read)."""
    if service:
        if shim:
            raise ValueError(
                "A `tf2sync.ServicePassPerEpoch` needs a "
                "`tf2sync.SyncOptimizer` (an epoch ending with its data "
                "applies its last, incomplete step); received the TF1 "
                "shim: optimizer=SyncReplicasOptimizer"
            )
        if steps_per_epoch is not None:
            raise ValueError(
                "With a `tf2sync.ServicePassPerEpoch` an epoch is one pass "
                "of its data: leave `steps_per_epoch` None. Received: "
                f"steps_per_epoch={steps_per_epoch!r}"
            )
        return
    if (
        not isinstance(steps_per_epoch, numbers.Integral)
        or isinstance(steps_per_epoch, bool)
        or steps_per_epoch <= 0
    ):
        raise ValueError(
            "`steps_per_epoch` must be a positive int. Received: "
            f"steps_per_epoch={steps_per_epoch!r}"
        )


def scalar_loss(loss, loss_fn):
    """Refuses, while tracing, a loss that is not a scalar (a `Loss` of
    `NONE` reduction, as tf_keras's error under a strategy advises): its
    gradient would be the batch's sum, `batch size` times the mean's,
    which `fit` takes."""
    rank = tf.TensorShape(getattr(loss, "shape", None)).rank
    if rank is not None and rank > 0:
        raise ValueError(
            "`loss_fn` must return a scalar, the mean over the replica's "
            f"batch; it returned shape {loss.shape.as_list()}. Use a "
            "tf.keras loss with its default reduction, or tf.reduce_mean. "
            "Received: "
            f"loss_fn={loss_fn!r}"
        )


def warn_batch_hooks_uncalled(callbacks) -> None:
    """Says which callbacks act on batches, hooks a `Trainer` never calls.

    It calls the epoch and train hooks only: its functions run loops of
    steps on the workers, with no batch in between for a hook (a
    `ModelCheckpoint(save_freq=N)` would never save). Progress bars are
    its own business (`verbose`, `SyncMetrics`).
    """
    names = [
        type(c).__name__
        for c in callbacks
        if not isinstance(c, tf_keras.callbacks.ProgbarLogger)
        and tf_internals.implements_train_batch_hooks(c)
    ]
    if names:
        logging.warning(
            "tf2sync.Trainer calls the callbacks' epoch hooks only: the batch "
            "hooks of %s will not be called (save or log per epoch, e.g. "
            "ModelCheckpoint(save_freq='epoch'), or train with model.fit).",
            ", ".join(names),
        )
