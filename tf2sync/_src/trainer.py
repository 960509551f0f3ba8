"""Trainer: a small custom training loop on ClusterCoordinator."""

from __future__ import annotations

import contextlib
import inspect
import sys

import tensorflow as tf
import tf_keras

from tf2sync._src import callbacks as callbacks_lib
from tf2sync._src import checkpointing
from tf2sync._src import data_service
from tf2sync._src import loops
from tf2sync._src import options as options_lib
from tf2sync._src import saver as saver_lib
from tf2sync._src import trainer_checks as checks
from tf2sync._src import trainer_epochs
from tf2sync._src import trainer_sync
from tf2sync._src.internals import keras_fit


class Trainer(trainer_epochs.EpochsMixin):
    """Synchronous custom-loop training with Keras callbacks and checkpoints.

    Protocol, per epoch:

    1. `train_loop_begin()` (override to reset state), then the callbacks'
       `on_epoch_begin`.
    2. `steps // steps_per_loop` functions are scheduled on the workers
       (then the rest of the epoch's steps as functions of one step); each
       runs `steps_per_loop` synchronous replica steps, and each replica
       step calls `train_step(batch)` (override it; the default computes
       `loss_fn(y, model(x))` and applies through the `SyncOptimizer`, or
       through a `tf2sync.compat.v1.SyncReplicasOptimizer` with the
       trainer's `global_step`, TF1's protocol; the coordinator starts its
       chief part, no hook is needed). By default the function repeats
       the step in its graph, up to `max_unrolled_steps` (10) copies per
       `tf.while_loop` iteration (see `use_tf_while_loop` and `options`
       in `__init__`). The first loop of a `train` call whose steps are
       all copies runs as `steps_per_loop` functions of one step: the
       workers set that function up sooner, so the first update comes
       sooner. The steps and their order are the same either way.
    3. The loop joins: when `train` returns or raises, no step is running.
    4. `train_loop_end(logs)` may add entries; the sync totals (exact, read
       after the join) are added; then `on_epoch_end`, and with
       `checkpoint_dir` a checkpoint of model, optimizer and epoch.

    With `checkpoint_dir`, `train` first restores the latest checkpoint and
    continues where it was saved: weights, global step, every slot and
    the moving averages resume as they were, so the next steps equal an
    uninterrupted run's (given the same data). With `checkpoint_every_*`
    the loop also joins and saves inside an epoch (`ckpt-<epochs>_<steps>`,
    a whole number of applied updates on every ps); a resumed epoch runs
    the steps left, reading them from its input's start.

    A progress bar is shown per epoch when stdout is a terminal, one line
    per epoch otherwise (`verbose=0` silences both).
    """

    def __init__(
        self,
        *,
        strategy,
        model,
        optimizer,
        loss_fn=None,
        steps_per_loop: int = 10,
        use_tf_while_loop: bool | None = None,
        checkpoint_dir: str | None = None,
        max_to_keep: int = 3,
        checkpoint_every_steps: int | None = None,
        checkpoint_every_seconds: float | None = None,
        checkpoint_in_background: bool = False,
        callbacks=(),
        verbose: int | str = "auto",
        options: options_lib.SyncOptions | None = None,
    ):
        """Creates the coordinator and the checkpoint; see the class doc.

        Args:
          strategy: A `tf2sync.SyncParameterServerStrategy`.
          model: A tf_keras model built under `strategy.scope()`.
          optimizer: The `tf2sync.SyncOptimizer` for `model`, or a
            `tf2sync.compat.v1.SyncReplicasOptimizer` (then the trainer
            creates, checkpoints and passes `self.global_step`).
          loss_fn: `loss_fn(y_true, y_pred) -> scalar`, the mean over the
            replica's batch, for the default `train_step`: a function, or
            a tf.keras loss with its default reduction (which tf_keras
            refuses under a strategy outside `compile`; here it means the
            replica's mean, as the loss `fit` compiles). A loss of another
            shape is refused when the step is traced. With several GPUs
            on a worker, each replica's mean counts 1/n of the worker's
            gradient, as in `fit`. The model's own losses
            (`model.losses`: regularizers, `add_loss`) are added to it,
            as `fit` adds them. A loss's name (`"mse"`) means the batch
            mean of that tf.keras loss function, as in `compile`; None
            only with an overridden `train_step`.
          steps_per_loop: Synchronous steps per scheduled function.
          use_tf_while_loop: How a scheduled function runs its
            `steps_per_loop` steps. A `tf.while_loop` whose body runs on
            the worker and on the ps sends the loop's control to the ps
            every iteration; repeating the step in the traced graph
            instead is faster for small and medium models, at the cost of
            a larger function to set up and of ps memory per copy
            (docs/performance.md, "Which option to pick").
            None (the default): the step is repeated in groups of up to
            `options.max_unrolled_steps` (10 by default) copies, and a
            `tf.while_loop` runs the groups when
            `steps_per_loop` is larger (the rest follows unrolled). True:
            a `tf.while_loop` of single steps, as Orbit's `StandardTrainer`
            (for large models, where tracing time counts and the loop's
            cost does not). False: all `steps_per_loop` steps repeated in
            the graph.
          checkpoint_dir: Where to save and resume; None: no checkpoints.
          max_to_keep: Checkpoints kept.
          checkpoint_every_steps: Also save after this many steps of an
            epoch (after the function that reaches them: the loop joins,
            then saves), so that a restart redoes at most about that many;
            `train` resumes inside the epoch. None: at epoch ends only.
          checkpoint_every_seconds: Also save when this many seconds
            passed since the last save (checked as each function is
            scheduled). Neither is used for a `ServicePassPerEpoch`'s
            epochs, which end with their pass.
          checkpoint_in_background: Write each save from a copy of the
            variables made on their own tasks, while training goes on (a
            second copy of every saved variable; `train` returns once the
            last save is written). See `tf2sync.SyncCheckpoint`.
          callbacks: `tf.keras.callbacks.Callback`s (or one).
          verbose: "auto", 0, 1 (progress bar) or 2 (one line per epoch).
          options: A `tf2sync.SyncOptions` for this trainer's loop; None
            (the default): the strategy's (`strategy.options`).

        Raises:
          TypeError: If `options` is not a `tf2sync.SyncOptions` or None,
            or `optimizer` is neither optimizer above, or `loss_fn` is not
            callable nor a loss's name, or a callback is not a
            `tf.keras.callbacks.Callback`.
          ValueError: If `steps_per_loop` is not a positive int, or
            `use_tf_while_loop` not None or a bool, or `verbose` not one of
            its values, or `loss_fn` is None with the default `train_step`
            or names no tf.keras loss, or `model` has no weights yet, or a
            later `SyncOptimizer` replaced `optimizer`, or `checkpoint_dir`
            is a file or cannot be written or created, or a
            `checkpoint_every_*` is not None nor > 0, or is given without
            `checkpoint_dir`, or `checkpoint_in_background` is not a bool.
        """
        checks.loop_arguments(steps_per_loop, use_tf_while_loop)
        self.options = checks.checked_options(strategy, options)
        checks.optimizer(optimizer)
        checks.model(model)
        checks.verbose(verbose)
        default_step = type(self).train_step is Trainer.train_step
        loss_fn = checks.loss_fn(loss_fn, default_step)
        callbacks = checks.callbacks(callbacks)
        checks.checkpoint_dir(checkpoint_dir)
        self._cadence = checks.checkpoint_cadence(
            checkpoint_dir, checkpoint_every_steps, checkpoint_every_seconds
        )
        checkpointing.check_flag(
            "checkpoint_in_background", checkpoint_in_background
        )
        self.strategy = strategy
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.steps_per_loop = steps_per_loop
        self.use_tf_while_loop = use_tf_while_loop
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(
            strategy
        )
        self._callbacks = list(callbacks)
        self._verbose = _resolved_verbose(verbose)
        self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._sync = trainer_sync.of(optimizer)
        self._sync.build(strategy, model)
        # The TF1 shim's global step, created here; None for a SyncOptimizer
        # (its `iterations`).
        self.global_step = self._sync.global_step
        self._manager = self._checkpoint_manager(checkpoint_dir, max_to_keep)
        self._saver = None
        if self._manager:  # one traced save (see `OneTraceSaver`)
            self._saver = saver_lib.OneTraceSaver(
                self._manager.checkpoint,
                checkpoint_dir,
                max_to_keep,
                background=checkpoint_in_background,
            )

    def _checkpoint_manager(self, checkpoint_dir, max_to_keep):
        """The `tf.train.CheckpointManager` of `checkpoint_dir`, or None.

        The checkpoint holds model, optimizer and epoch, and the shim's
        `global_step`.
        """
        if not checkpoint_dir:
            return None
        checkpoint = tf.train.Checkpoint(
            model=self.model,
            optimizer=self.optimizer,
            epoch=self._epoch,
            **self._sync.checkpointed(),
        )
        return tf.train.CheckpointManager(
            checkpoint, checkpoint_dir, max_to_keep=max_to_keep
        )

    # Template hooks -------------------------------------------------------

    def train_loop_begin(self):
        """Called before each epoch's steps are scheduled."""

    def train_step(self, batch):
        """One replica step: returns the loss (with `model.losses`, as
        `fit` logs it). Runs inside `strategy.run`."""
        checks.batch(batch)
        x, y = batch
        loss_fn = _converted(keras_fit.replica_mean_loss(self.loss_fn))
        replicas = self._sync.replicas()
        with tf.GradientTape() as tape:
            loss = loss_fn(y, self.model(x, training=True))
            checks.scalar_loss(loss, self.loss_fn)
            if self.model.losses:  # regularizers, add_loss: as fit adds
                loss += tf.add_n(self.model.losses)
            # The SyncOptimizer sums a worker's local replicas (GPUs): each
            # replica's mean counts 1/n of the worker's, as in fit's
            # compiled loss.
            scaled = loss if replicas == 1 else loss / replicas
        variables = self.model.trainable_variables
        grads = tape.gradient(scaled, variables)
        self._sync.apply(zip(grads, variables))
        return loss

    def train_loop_end(self, logs):
        """Called after each epoch's join; returns the epoch's logs."""
        return logs

    # Driver ---------------------------------------------------------------

    def train(
        self, dataset_fn, *, epochs: int, steps_per_epoch: int | None = None
    ):
        """Trains, resuming from the latest checkpoint if there is one.

        Args:
          dataset_fn: `dataset_fn(input_context) -> tf.data.Dataset`,
            called on each worker; must repeat. Or a
            `tf2sync.ServicePassPerEpoch`: each epoch is then one pass of
            a tf.data service job shared by the workers, and ends with it.
          epochs: Total epochs (resumed ones included).
          steps_per_epoch: Replica steps per epoch: loops of
            `steps_per_loop` steps, then the rest (fewer) as functions of
            one step each. None (only) with a `ServicePassPerEpoch`.

        Returns:
          The `tf.keras.callbacks.History` of the epochs run.

        Raises:
          TypeError: If `dataset_fn` is not callable (a dataset itself) or
            cannot take the input context.
          ValueError: If `epochs` is not an int >= 0, or the default
            `train_step`'s batches are not `(x, y)` (when the step is
            traced, before any update), or `steps_per_epoch` is not a
            positive int, or is
            given with a `ServicePassPerEpoch`
            (or missing without one); or a `ServicePassPerEpoch` is given
            with the TF1 shim; or a later `SyncOptimizer` replaced this
            trainer's (then neither the model nor a checkpoint changes).
        """
        self._sync.begin()  # before the restore below changes the model
        service = isinstance(dataset_fn, data_service.ServicePassPerEpoch)
        if not service:
            checks.dataset_fn(dataset_fn)
        checks.steps_per_epoch(steps_per_epoch, service, self._sync.tf1_order)
        checks.epochs(epochs)
        if self._saver:  # a write an interrupted `train` left
            self._saver.settle()
        first_step = self._restore_latest_checkpoint()
        if self._saver:  # traced while every task answers
            self._saver.prepare()
        start_epoch = int(self._epoch.numpy())
        if steps_per_epoch and first_step >= steps_per_epoch:
            # Saved inside an epoch now shorter: its steps all ran.
            start_epoch, first_step = start_epoch + 1, 0
        rest = (steps_per_epoch or 0) % self.steps_per_loop
        history = tf_keras.callbacks.History()
        callback_list = tf_keras.callbacks.CallbackList(
            self._callbacks + [history],
            model=self.model,
            epochs=epochs,
            steps=steps_per_epoch,
            verbose=0,
        )
        self._run = _Run()  # this call's plan (see `_run_epoch`)
        if service:
            per_worker, next_pass = dataset_fn.per_worker_dataset(
                self.strategy, self.coordinator
            )
            loop = self._loop = self._pass_loop_function()
        else:
            iterator = self._per_worker_iterator(dataset_fn)
            # The first loop's single steps and the loop share one trace;
            # a loop with no single-step function keeps a lone push inline
            # (loops.repeating).
            traces = loops.StepTraces()
            single = self._single_step_loop(traces)
            loop = self._loop = self._loop_function(
                traces=traces if single is not None else None
            )
            # An epoch's last steps short of a loop run as single steps:
            # the first loop's function where there is one (set up by
            # then), rather than a function of their own for each worker
            # to set up.
            rest_fn = None
            if rest:
                rest_fn = single or self._loop_function(steps=1)
        self._cadence.saved(0)  # seconds count from here
        checks.warn_batch_hooks_uncalled(self._callbacks)
        callbacks_lib.use_optimizer(self._callbacks, self.optimizer)
        callback_list.on_train_begin()
        for epoch in range(start_epoch, epochs):
            self.train_loop_begin()
            callback_list.on_epoch_begin(epoch)
            with _no_error_left_behind(self.coordinator):
                if service:
                    next_pass()
                    logs = self._run_pass(loop, iter(per_worker))
                else:
                    # A resumed epoch runs the steps its save left.
                    logs = self._run_epoch(
                        loop,
                        iterator,
                        (epoch, first_step, steps_per_epoch),
                        single,
                        rest_fn,
                    )
                    single, first_step = None, 0  # the first epoch only
            logs = self.train_loop_end(logs)
            callback_list.on_epoch_end(epoch, logs)
            self._end_epoch(epoch, epochs, logs)
            if self.model.stop_training:
                break
        if self._saver:
            self._saver.wait()  # the last background write, if any
        callback_list.on_train_end()
        self._sync.end()
        return history

    def _restore_latest_checkpoint(self) -> int:
        """Restores the latest checkpoint of `checkpoint_dir`, if any;
        returns the steps of its epoch it holds (0: an epoch's end)."""
        if not self._manager:
            return 0
        latest = tf.train.latest_checkpoint(self._manager.directory)
        if not latest:
            return 0
        checkpointing.check_shapes(self._manager.checkpoint, latest)
        self._manager.checkpoint.restore(
            latest
        ).assert_existing_objects_matched()
        checkpointing.restore_sync_totals(self._manager.checkpoint, latest)
        return checkpointing.position_of(latest)[1]

    def _per_worker_iterator(self, dataset_fn):
        """An iterator of `dataset_fn`'s distributed dataset on each worker."""
        per_worker = self.coordinator.create_per_worker_dataset(
            lambda: self.strategy.distribute_datasets_from_function(dataset_fn)
        )
        return iter(per_worker)


@contextlib.contextmanager
def _no_error_left_behind(coordinator):
    """Clears the coordinator's error when an epoch fails.

    A function's error read through a result's `fetch` stays in PSS's
    closure queue, which raises it again at the next `schedule` or `join`:
    the next `train` call (the user's retry, with the cause fixed) failed
    with the old error. `done()` raises and clears it, cancels the
    functions still queued and waits for those in flight; a step waiting
    for the token the failed one took gets it from the token watchdog,
    which the failure alarmed (`coordinator._function_failed`). An error
    already raised by a `schedule` or `join` is not there any more: then
    nothing is cancelled, as before.
    """
    try:
        yield
    except Exception:
        with contextlib.suppress(Exception):  # the error being raised
            coordinator.done()
        raise


class _Run:
    """Identifies one `Trainer.train` call to `SyncCoordinator.plan_epoch`."""


def _resolved_verbose(verbose):
    """`verbose`, with "auto" resolved: 1 in a terminal, 2 otherwise."""
    if verbose == "auto":
        return 1 if sys.stdout.isatty() else 2
    return verbose


def _converted(fn):
    """`fn` converted by AutoGraph if it is a plain function.

    AutoGraph skips tf2sync's code (see internals/autograph.py), and the step's
    AutoGraph status can be off by here (the coordinator's wrapper is
    traced without it), so the user's loss function is converted
    explicitly, as it was when AutoGraph converted Trainer's step; a
    callable object (a Keras `Loss`) converts its own `call`.
    """
    if not inspect.isfunction(fn):
        return fn
    try:
        return tf.autograph.to_graph(fn)
    except Exception:  # noqa: BLE001 - source not available: as written
        return fn
