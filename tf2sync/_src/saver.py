"""`OneTraceSaver`: a checkpoint written through one traced function, at
once or from a copy of every variable while training goes on."""

from __future__ import annotations

import os
import threading
import time

import tensorflow as tf
from absl import logging

from tf2sync._src import checkpointing
from tf2sync._src import keras_compat
from tf2sync._src.internals import checkpoints as checkpoints_internals


class OneTraceSaver:
    """`tf.train.CheckpointManager.save`, through one traced function.

    TensorFlow writes a checkpoint whose variables live on several tasks
    (the parameter servers and the chief) through a `tf.function` it traces
    anew at every save, and the chief registers every new function with
    every task of the cluster, waiting for each to answer: while a worker is
    frozen, each save would wait for it (and so would the epoch). This
    saver traces `tf.train.Checkpoint.write` once, with the path as an
    argument, and again only when the checkpoint's variables change; a
    function already registered runs on the parameter servers and the chief
    only. It keeps the files as a `tf.train.CheckpointManager` with the same
    arguments does: `<name>-<number>` in `directory`, the `checkpoint` state
    file (relative paths; `tf.train.latest_checkpoint` and a new manager
    read it) and the `max_to_keep` newest.

    With `background=True` a save copies every variable it writes into a
    snapshot variable beside it (on the same task: one traced function,
    each parameter server copying its own), then writes the snapshot in a
    thread of its own while training goes on, through the same traced
    write reading the snapshots in place of the variables. What is saved is
    the state at the copy (a whole number of updates, when the caller
    joined before the save); training waits only for the copy. One write is
    under way at a time: a save, or `wait`, first waits for the one before,
    and raises its error if it failed. Its cost: a second copy of every
    saved variable's memory on each task, for the whole training.
    """

    def __init__(
        self,
        checkpoint,
        directory,
        max_to_keep,
        name="ckpt",
        *,
        background=False,
    ):
        self._checkpoint = checkpoint
        self._directory = directory
        self._max_to_keep = max_to_keep
        self._name = name
        self._background = background
        self._write = None  # checkpoint.write, as a tf.function
        self._concrete = None  # its one trace
        self._variables = None
        self._copy = None  # traced: every snapshot takes its variable's value
        self._captures = None  # the write's inputs, snapshots for variables
        self._thread = None
        self._error = None

    def prepare(self) -> None:
        """Traces the save now, for the variables that exist now.

        Call it before training (with every optimizer variable built), while
        every task answers: the first save then registers nothing new.
        """
        self._function()

    def _function(self):
        checkpoint = self._checkpoint
        variables = _variable_ids(checkpoint)  # save_counter included
        if self._write is None or variables != self._variables:
            self._write = tf.function(checkpoint.write, autograph=False)
            self._concrete = self._write.get_concrete_function(
                tf.TensorSpec([], tf.string)
            )
            self._variables = variables
            if self._background:
                self._snapshot(self._concrete)
        return self._concrete

    def _snapshot(self, write) -> None:
        """Snapshot variables for what `write` reads, and their copy."""
        pairs = [(v, _snapshot_of(v)) for v in write.graph.variables]
        by_handle = {id(v.handle): s.handle for v, s in pairs}
        captured = write.captured_inputs
        unknown = [
            c
            for c in captured
            if c.dtype == tf.resource and id(c) not in by_handle
        ]
        if unknown:  # a resource the write reads that is not a variable
            raise RuntimeError(
                f"tf2sync: a background save cannot copy {len(unknown)} "
                "of the resources the checkpoint reads: save with "
                "background=False."
            )
        self._captures = [by_handle.get(id(c), c) for c in captured]

        def copy():
            for variable, snapshot in pairs:
                snapshot.assign(variable.read_value())

        self._copy = tf.function(copy, autograph=False)
        self._copy.get_concrete_function()  # traced now, while all answer

    def save(self, checkpoint_number) -> str:
        """Writes checkpoint `<name>-<checkpoint_number>` (an int, or a
        string such as `SyncCheckpoint`'s `3_120`); returns its path (in
        the background: once the copy is made; `wait` for the files)."""
        self.wait()
        # Counted as the manager counts saves (restores expect it saved).
        self._checkpoint.save_counter.assign_add(1)
        write = self._function()
        directory = self._directory
        tf.io.gfile.makedirs(directory)
        path = os.path.join(directory, f"{self._name}-{checkpoint_number}")
        if not self._background:
            write(tf.constant(path))
            checkpointing.save_sync_totals(self._checkpoint, path)
            self._record(directory, path)
            return path
        self._copy()
        totals = checkpointing.sync_totals(self._checkpoint)
        self._thread = threading.Thread(
            target=self._write_copy,
            args=(write, path, totals),
            name="tf2sync-checkpoint-write",
            daemon=True,
        )
        self._thread.start()
        return path

    def _write_copy(self, write, path, totals) -> None:
        try:
            checkpoints_internals.call_with_captures(
                write, [tf.constant(path)], self._captures
            )
            checkpointing.save_sync_totals(self._checkpoint, path, totals)
            self._record(self._directory, path)
        except Exception as error:  # noqa: BLE001 - raised by `wait`
            self._error = error

    def wait(self) -> None:
        """Returns once the background write under way (if any) is done.

        Raises:
          The error of that write, if it failed (its checkpoint is then not
          listed: the one before stays the newest).
        """
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            logging.error("tf2sync: a background checkpoint write failed.")
            raise error

    def settle(self) -> None:
        """`wait`, logging a failed write rather than raising it: before a
        new run, whose restore takes the save before it."""
        try:
            self.wait()
        except Exception as error:  # noqa: BLE001 - the save before stays
            logging.warning("tf2sync: the last save failed: %s", error)

    def _record(self, directory, path):
        """The state file lists `path` last, with the manager's timestamps;
        checkpoints past `max_to_keep` are deleted."""
        now = time.time()
        state = tf.train.get_checkpoint_state(directory)
        name = os.path.basename(path)
        kept = []  # (basename, timestamp)
        preserved = now - 1.0  # as a manager creating the directory
        if state is not None:
            preserved = state.last_preserved_timestamp
            stamps = list(state.all_model_checkpoint_timestamps)
            stamps += [preserved] * (
                len(state.all_model_checkpoint_paths) - len(stamps)
            )
            kept = [
                (os.path.basename(p), t)
                for p, t in zip(state.all_model_checkpoint_paths, stamps)
                if os.path.basename(p) != name
            ]
        kept.append((name, now))
        keep = self._max_to_keep
        dropped = []
        if keep is not None and keep > 0:
            dropped, kept = kept[:-keep], kept[-keep:]
        lines = [f'model_checkpoint_path: "{name}"']
        lines += [f'all_model_checkpoint_paths: "{p}"' for p, _ in kept]
        lines += [f"all_model_checkpoint_timestamps: {t!r}" for _, t in kept]
        lines.append(f"last_preserved_timestamp: {preserved!r}")
        temporary = os.path.join(directory, "checkpoint.tmp")
        with tf.io.gfile.GFile(temporary, "w") as f:
            f.write("\n".join(lines) + "\n")
        tf.io.gfile.rename(
            temporary, os.path.join(directory, "checkpoint"), True
        )
        for old, _ in dropped:  # after the state file no longer names them
            pattern = os.path.join(directory, old) + ".*"
            for file in tf.io.gfile.glob(pattern):
                tf.io.gfile.remove(file)


def _variable_ids(checkpoint) -> frozenset:
    """The ids of every variable `checkpoint` saves.

    An optimizer's slots are saved beside their variables, not as its
    children, so each optimizer's own list of variables is added.
    """
    checkpoint.save_counter  # noqa: B018 - created on first read
    ids = set()
    for t in tf.train.TrackableView(checkpoint).descendants():
        if isinstance(t, tf.Variable):
            ids.add(id(t))
        elif isinstance(t, _OPTIMIZERS):
            variables = t.variables
            for v in variables() if callable(variables) else variables:
                ids.add(id(v))
    return frozenset(ids)


_OPTIMIZERS = (tf.compat.v1.train.Optimizer, *keras_compat.KERAS_OPTIMIZERS)


def _snapshot_of(variable) -> tf.Variable:
    """A variable of `variable`'s dtype and shape on its device, not
    trainable and tracked by no model."""

    def make():
        return tf.Variable(
            lambda: tf.zeros(variable.shape, variable.dtype),
            trainable=False,
            name=variable.name.split(":")[0] + "_snapshot",
        )

    if tf.distribute.has_strategy():  # ParameterServerStrategy's placement
        extended = tf.distribute.get_strategy().extended
        with extended.colocate_vars_with(variable):
            return make()
    with tf.device(variable.device):
        return make()
