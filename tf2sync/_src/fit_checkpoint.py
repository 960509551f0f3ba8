"""`SyncCheckpoint`: `fit`'s checkpoints at epoch ends, every few steps or
seconds, and its resume from the newest, inside an epoch too."""

from __future__ import annotations

import tensorflow as tf
import tf_keras
from absl import logging

from tf2sync._src import callbacks as callbacks_lib
from tf2sync._src import checkpointing
from tf2sync._src import saver as saver_lib
from tf2sync._src.internals import cluster_coordinator
from tf2sync._src.internals import keras_training


class SyncCheckpoint(tf_keras.callbacks.Callback):
    """Saves model and optimizer during `fit`, and resumes from the newest.

    tf_keras's `BackupAndRestore` saves only at epoch ends under
    ParameterServerStrategy; this callback also saves inside an epoch, so
    a restart (a lost parameter server, a killed chief) redoes at most
    `every_steps` steps or `every_seconds` of training, not an epoch.

    Protocol:
      1. `on_train_begin`: every optimizer variable is built, the newest
         checkpoint in `directory` (if any) is restored into model and
         optimizer (weights, global step, slots, the sync counters), and
         the save function is traced (once: a frozen worker cannot delay
         a save, see `saver.OneTraceSaver`).
      2. `fit` then starts at the saved position: the epoch the checkpoint
         was in, at the step after the last one it holds (tf_keras's own
         resume hook, the one `BackupAndRestore` sets). An epoch resumed
         so reads its remaining steps from its input's start (each
         worker's pipeline is new), and its plan of updates is those
         steps' (no update over the plan). A directory holding a finished
         run's saves resumes at its end: a new run needs a new directory.
      3. After a scheduled function, when `every_steps` steps (as `fit`
         counts them: `steps_per_epoch`) or `every_seconds` seconds have
         passed since the last save (seconds of training: with a time
         cadence each function waits for the one scheduled two per worker
         before it, as `fit` schedules far ahead), the coordinator joins (every
         scheduled step ends; no apply is under way on any ps) and the
         checkpoint is written `<directory>/ckpt-<epoch>_<step>`: `epoch`
         epochs done and `step` steps of the next.
      4. At each epoch's end (after `fit`'s own join) it is written
         `<directory>/ckpt-<epochs done>`.

    Guarantees: a save holds the state after a whole number of applied
    updates, the same on every ps (it follows a join); files are written
    data first and the `checkpoint` index last, so a process killed while
    saving leaves the previous save usable; the `max_to_keep` newest saves
    are kept, inside epochs or at their ends. Gradients accumulated toward
    an update not yet applied when the save is made are not in it (as at
    an epoch's end). What a save inside an epoch costs is a join: workers
    idle from their last step until the write ends (docs/performance.md).

    With `background=True` the write leaves the training path: after the
    join each task copies the variables it holds into a snapshot beside
    them, training goes on, and a thread writes the snapshot (one write at
    a time; `fit` returns once the last is written). The guarantees above
    hold; every task holds a second copy of its saved variables.

    Args:
      directory: Where checkpoints are written and resumed from.
      every_steps: Also save after this many steps of an epoch; None:
        not by steps.
      every_seconds: Also save when this many seconds passed since the
        last save (checked after each scheduled function); None: not by
        time.
      max_to_keep: Saves kept (the oldest are deleted).
      background: Write each save from a snapshot while training goes on
        (see above), at the cost of a second copy of the variables.

    Raises:
      ValueError: If `every_steps` is not None or a positive int,
        `every_seconds` not None or a positive finite number, or
        `max_to_keep` not a positive int, or `background` not a bool.
    """

    def __init__(
        self,
        directory: str,
        *,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        max_to_keep: int = 3,
        background: bool = False,
    ):
        super().__init__()
        # Its batch hook reads no logs: fit under PSS allows it (it
        # refuses batch hooks that would fetch every function's logs).
        self._supports_tf_logs = True
        checkpointing.check_every("every_steps", every_steps, int)
        checkpointing.check_every("every_seconds", every_seconds, (int, float))
        if (
            not isinstance(max_to_keep, int)
            or isinstance(max_to_keep, bool)
            or max_to_keep < 1
        ):
            raise ValueError(
                "`max_to_keep` must be an int > 0. Received: "
                f"max_to_keep={max_to_keep!r}"
            )
        checkpointing.check_flag("background", background)
        self.directory = str(directory)
        self.background = background
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self._cadence = checkpointing.Cadence(every_steps, every_seconds)
        self.max_to_keep = max_to_keep
        self._checkpoint = None
        self._saver = None
        self._position = None  # (epoch, step) restored, or None
        self._epoch = 0
        self._start = (0, 0)  # where fit starts: (epoch, step)

    def _implements_train_batch_hooks(self):
        return bool(self._cadence)

    def _prepare_checkpoint(self):
        model = self.model
        if (
            self._checkpoint is None
            or self._checkpoint.model is not model
            or self._checkpoint.optimizer is not model.optimizer
        ):  # a new model, or compiled again with another optimizer
            self._checkpoint = tf.train.Checkpoint(
                model=model, optimizer=model.optimizer
            )
            self._saver = saver_lib.OneTraceSaver(
                self._checkpoint,
                self.directory,
                self.max_to_keep,
                background=self.background,
            )
        return self._checkpoint

    def restore_latest(self):
        """Restores the newest save into the model (set by `fit` or
        `set_model`); returns its `(epochs done, steps of the next)`, or
        `(0, 0)` where `directory` holds none."""
        checkpoint = self._prepare_checkpoint()
        latest = tf.train.latest_checkpoint(self.directory)
        if latest is None:
            return 0, 0
        checkpointing.check_shapes(checkpoint, latest)
        checkpoint.restore(latest).assert_existing_objects_matched()
        checkpointing.restore_sync_totals(checkpoint, latest)
        logging.warning("Resumed from %s", latest)
        return checkpointing.position_of(latest)

    def on_train_begin(self, logs=None):
        model = self.model
        if self._saver is not None:  # a write an interrupted fit left
            self._saver.settle()
        self._prepare_checkpoint()
        try:
            sync = callbacks_lib.find_sync_optimizer(model.optimizer)
        except ValueError:
            sync = None
        if (
            sync is not None
            and getattr(model, "built", False)
            and model.trainable_variables
        ):  # an unbuilt model's optimizer builds at its first step
            sync.build(model.trainable_variables)
        self._position = self.restore_latest()
        self._saver.prepare()  # traced while every task answers
        keras_training.set_fit_resume(model, self)
        self._start = (0, 0)
        self._cadence.saved(0)

    def maybe_load_initial_counters_from_ckpt(
        self, steps_per_epoch, initial_epoch, mode=None
    ):
        """Where `fit` starts: the restored position, or `initial_epoch`
        (tf_keras's resume hook, read once after `on_train_begin`)."""
        del mode
        # Read once, by this fit: a fit that raised before its end leaves
        # no position for the next one.
        keras_training.set_fit_resume(self.model, None)
        position, self._position = self._position, None
        if position is None or position == (0, 0):
            return initial_epoch, 0
        epoch, step = position
        if steps_per_epoch is not None and step >= steps_per_epoch:
            epoch, step = epoch + 1, 0
        self._start = (epoch, step)
        return epoch, step

    def on_train_end(self, logs=None):
        keras_training.set_fit_resume(self.model, None)
        self._saver.wait()  # the last background write, if any

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        start_epoch, start_step = self._start
        self._cadence.epoch_begins(start_step if epoch == start_epoch else 0)

    def on_train_batch_end(self, batch, logs=None):
        coordinator = keras_training.model_coordinator(self.model)
        if self.every_seconds and coordinator is not None and logs is not None:
            workers = cluster_coordinator.coordinator_workers(coordinator)
            self._cadence.scheduled(logs, 2 * len(workers))
        done = int(batch) + 1  # steps of this epoch run (fit's count)
        steps = (self.params or {}).get("steps")
        if steps is not None and done >= steps:
            return  # the epoch's end saves
        if not self._cadence.due(done):
            return
        if coordinator is not None:
            coordinator.join()
        self._save(f"{self._epoch}_{done}")
        self._cadence.saved(done)

    def on_epoch_end(self, epoch, logs=None):
        self._save(str(epoch + 1))
        self._cadence.saved(0)

    def _save(self, suffix: str) -> str:
        self._prepare_checkpoint()
        return self._saver.save(suffix)
