"""The checks of `Trainer`'s arguments: each refuses a value in one line
naming the argument and the value, before anything trains."""

from __future__ import annotations

import inspect
import numbers
import os

import tensorflow as tf
import tf_keras
from absl import logging

from tf2sync._src import callbacks as callbacks_lib
from tf2sync._src import checkpointing
from tf2sync._src import compat_v1
from tf2sync._src import directories
from tf2sync._src import options as options_lib
from tf2sync._src.internals import keras_training


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
    try:  # a subclassed model may create its weights in `__init__`
        weights = model.weights
    except ValueError:  # tf_keras: "Weights ... have not yet been created"
        weights = []
    if weights:
        return
    raise ValueError(
        f"Trainer's `model` has no weights yet: {model.name!r} is built at "
        "its first call, and the trainer builds its optimizer before any "
        "step. Give its first layer an `input_shape` (or call "
        "`model.build(input_shape)`) under `strategy.scope()`. Received: "
        f"model={model.name!r} (built=False)"
    )


def loss_fn(loss_fn, default_step: bool):
    """`loss_fn` checked, a loss name resolved as `compile` resolves it.

    Args:
      loss_fn: The `Trainer`'s `loss_fn`.
      default_step: Whether the trainer's `train_step` is `Trainer`'s own
        (which needs a loss); an overridden one may compute its own.

    Returns:
      `loss_fn`, or for a name (`"mse"`) the mean over the batch of
      tf_keras's loss function of that name.
    """
    if loss_fn is None:
        if default_step:
            raise ValueError(
                "Trainer's default `train_step` needs `loss_fn`, "
                "`loss_fn(y_true, y_pred) -> scalar` (or a tf.keras loss, or "
                "its name); override `train_step` to compute the loss "
                "yourself. Received: loss_fn=None"
            )
        return None
    if isinstance(loss_fn, str):
        try:
            function = tf_keras.losses.get(loss_fn)
        except ValueError:
            raise ValueError(
                f"`loss_fn`: tf.keras has no loss named {loss_fn!r}. "
                f"Received: loss_fn={loss_fn!r}"
            ) from None
        if isinstance(function, tf_keras.losses.Loss):
            return function

        def mean_loss(y_true, y_pred):
            return tf.reduce_mean(function(y_true, y_pred))

        mean_loss.__name__ = f"mean_{getattr(function, '__name__', 'loss')}"
        return mean_loss
    if not callable(loss_fn):
        raise TypeError(
            "`loss_fn` must be a function `loss_fn(y_true, y_pred) -> "
            "scalar`, a tf.keras loss or its name. Received: "
            f"loss_fn={loss_fn!r}"
        )
    return loss_fn


def callbacks(callbacks) -> list:
    """`callbacks` as a list (one callback alone, as `fit` takes it);
    refuses anything but tf.keras callbacks."""
    if isinstance(callbacks, tf_keras.callbacks.Callback):
        return [callbacks]
    if callbacks is None:
        return []
    callbacks = list(callbacks)
    for i, callback in enumerate(callbacks):
        # tf_keras's CallbackList takes any object with the hooks.
        if not hasattr(callback, "on_epoch_end"):
            raise TypeError(
                "`callbacks` must be tf.keras.callbacks.Callback objects. "
                f"Received: callbacks[{i}]={callback!r}"
            )
    return callbacks


def verbose(verbose) -> None:
    """Refuses a `verbose` other than "auto", 0, 1 or 2, as `fit` reads it."""
    if verbose == "auto" or (
        isinstance(verbose, numbers.Integral) and verbose in (0, 1, 2)
    ):
        return
    raise ValueError(
        '`verbose` must be "auto", 0 (silent), 1 (progress bar) or 2 (one '
        f"line per epoch). Received: verbose={verbose!r}"
    )


def epochs(epochs) -> None:
    """Refuses `epochs` that is not an int >= 0."""
    if not _is_int(epochs) or epochs < 0:
        raise ValueError(
            "`epochs` must be an int >= 0 (the total, resumed epochs "
            f"included). Received: epochs={epochs!r}"
        )


def batch(batch) -> None:
    """Refuses, while tracing, a batch the default `train_step` cannot
    split into `(x, y)`."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return
    if isinstance(batch, (tuple, list)):
        shape = f"a {type(batch).__name__} of {len(batch)}"
    elif isinstance(batch, dict):
        shape = f"a dict of keys {sorted(batch)}"
    elif isinstance(batch, tf.Tensor):
        shape = f"a tensor of shape {tuple(batch.shape.as_list())}"
    else:
        shape = f"a {type(batch).__name__}"
    raise ValueError(
        "Trainer's default `train_step` takes `(x, y)` batches: make "
        "`dataset_fn`'s dataset yield pairs, or override `train_step`. "
        f"Received: a batch of {shape}"
    )


def checkpoint_cadence(checkpoint_dir, every_steps, every_seconds):
    """The `checkpointing.Cadence` of `Trainer`'s `checkpoint_every_*`;
    raises `ValueError` for a bad one, or one without `checkpoint_dir`."""
    checkpointing.check_every("checkpoint_every_steps", every_steps, int)
    checkpointing.check_every(
        "checkpoint_every_seconds", every_seconds, (int, float)
    )
    cadence = checkpointing.Cadence(every_steps, every_seconds)
    if cadence and not checkpoint_dir:
        name, value = (
            ("checkpoint_every_steps", every_steps)
            if every_steps
            else ("checkpoint_every_seconds", every_seconds)
        )
        raise ValueError(
            f"`{name}` needs `checkpoint_dir` (where to save). Received: "
            f"{name}={value!r}, checkpoint_dir={checkpoint_dir!r}"
        )
    return cadence


def checkpoint_dir(checkpoint_dir) -> None:
    """Refuses a `checkpoint_dir` the first save could not write (a file,
    a directory it cannot write or create), before anything trains."""
    if checkpoint_dir is None:
        return
    path = os.fspath(checkpoint_dir)
    problem = directories.directory_problem(path, writable=True)
    if problem:
        raise ValueError(
            f"`checkpoint_dir`: {problem}. Received: "
            f"checkpoint_dir={checkpoint_dir!r}"
        )


def dataset_fn(dataset_fn):
    """Refuses a `dataset_fn` that is not callable (a dataset, arrays), or
    that cannot take the input context."""
    if callable(dataset_fn):
        try:
            signature = inspect.signature(dataset_fn)
        except (TypeError, ValueError):  # a builtin: not inspectable
            return
        try:
            signature.bind(None)
        except TypeError:
            raise TypeError(
                "`dataset_fn` must take one argument, the "
                "tf.distribute.InputContext (its `input_pipeline_id` is the "
                "worker, to shard the data by); write `lambda input_context: "
                f"...` to ignore it. Received: dataset_fn{signature}"
            ) from None
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
    if not _is_int(steps_per_epoch) or steps_per_epoch <= 0:
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
        and keras_training.implements_train_batch_hooks(c)
    ]
    if names:
        logging.warning(
            "tf2sync.Trainer calls the callbacks' epoch hooks only: the batch "
            "hooks of %s will not be called (save or log per epoch, e.g. "
            "ModelCheckpoint(save_freq='epoch'), or train with model.fit).",
            ", ".join(names),
        )


def _is_int(value) -> bool:
    """An integral value that is not a bool (NumPy's ints too)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
