"""Epoch checkpoints for the chief, resume, and an evaluator that follows them.

The chief saves `tf.train.Checkpoint(model=..., optimizer=...)` after each
epoch as `<dir>/ckpt-<epoch>` (weights, the global step, every slot and
group state), keeping the last few. `tf.train.CheckpointManager` writes the
files first and the `checkpoint` index last, so a chief killed while saving
leaves the previous checkpoint usable. A restarted chief restores the latest
one and continues from the next epoch.
"""

from __future__ import annotations

import collections
import os

import tensorflow as tf
import tf_keras
from absl import logging

from tf2sync._src import sharding


def check_shapes(checkpoint, path: str) -> None:
    """Refuses a checkpoint whose variables have other shapes than ours.

    A sharded table is saved whole (its shards are slices of one saved
    variable), so a checkpoint restores into another number of shards;
    but a table of another vocabulary size fails deep inside the restore
    with a multi-page graph error, or (partly restored) not at all. This
    compares every variable the checkpoint and `checkpoint`'s objects have
    in common, by their path in the object graph, before anything is
    restored.

    Args:
      checkpoint: The `tf.train.Checkpoint` about to restore `path`.
      path: The checkpoint's prefix, e.g. `<dir>/ckpt-3`.

    Raises:
      ValueError: Naming the checkpoint, the first variable whose shape
        differs, and both shapes.
    """
    saved = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    for key, variable in _variables_by_key(checkpoint):
        if key not in saved:
            continue
        ours = variable.shape.as_list()
        if list(saved[key]) != ours:
            name = variable.name
            if sharding.is_sharded(variable):  # named "ShardedVariable"
                name = variable.variables[0].name.rsplit("/part_", 1)[0]
            raise ValueError(
                f"The checkpoint {path} does not fit this model: it saved "
                f"{key.split('/.ATTRIBUTES')[0]} (variable "
                f"{name.split(':')[0]}) with shape "
                f"{list(saved[key])}, the model's has shape {ours}. Build "
                "the model it was saved from (e.g. the same vocabulary "
                "size), or use another checkpoint directory."
            )


def _variables_by_key(root):
    """`(checkpoint key, variable)` of every variable under `root`.

    Walks the object graph as `tf.train.Checkpoint` saves it (public
    `tf.train.TrackableView`); a `ShardedVariable` is one variable there.
    """
    # Breadth first, as the checkpoint names an object by its first path.
    seen = {id(root)}
    queue = collections.deque([("", root)])
    while queue:
        prefix, obj = queue.popleft()
        if isinstance(obj, tf.Variable) or sharding.is_sharded(obj):
            yield prefix + "/.ATTRIBUTES/VARIABLE_VALUE", obj
            if not sharding.is_sharded(obj):
                continue
        for name, child in tf.train.TrackableView.children(obj).items():
            if id(child) in seen:
                continue
            seen.add(id(child))
            escaped = name.replace(".", "..").replace("/", "./")
            queue.append((f"{prefix}/{escaped}" if prefix else escaped, child))


def _epoch_of(path: str) -> int:
    return int(os.path.basename(path).rsplit("-", 1)[1])


class EpochCheckpoint(tf_keras.callbacks.Callback):
    """Saves model and optimizer after every epoch; restores on request."""

    def __init__(self, directory: str, model, optimizer, max_to_keep=3):
        super().__init__()
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
        self._manager = tf.train.CheckpointManager(
            self._checkpoint,
            directory,
            max_to_keep=max_to_keep,
            checkpoint_name="ckpt",
        )

    def restore_latest(self) -> int:
        """Restores the newest checkpoint; returns the epochs it completed."""
        latest = self._manager.latest_checkpoint
        if latest is None:
            return 0
        check_shapes(self._checkpoint, latest)
        self._checkpoint.restore(latest).assert_existing_objects_matched()
        logging.warning("Resumed from %s", latest)
        return _epoch_of(latest)

    def on_epoch_end(self, epoch, logs=None):
        self._manager.save(checkpoint_number=epoch + 1)


def evaluate_checkpoints(
    build_model,
    eval_arrays,
    loss,
    metrics,
    directory: str,
    *,
    log_dir: str | None = None,
    max_evaluations: int | None = None,
    timeout: float = 600.0,
):
    """Evaluates each new checkpoint in `directory` until told to stop.

    Args:
      build_model: Builds the model (no strategy needed).
      eval_arrays: `(x, y)` held-out data.
      loss: Passed to `compile`.
      metrics: Passed to `compile`.
      directory: Where the chief writes `ckpt-<epoch>`.
      log_dir: If set, writes `eval_*` scalars per epoch for TensorBoard.
      max_evaluations: Stop after this many evaluations.
      timeout: Stop when no new checkpoint comes for this many seconds.

    Returns:
      A list of `(epoch, {metric: value})`, one per evaluation.
    """
    model = build_model()
    model.compile(loss=loss, metrics=list(metrics))
    checkpoint = tf.train.Checkpoint(model=model)
    writer = tf.summary.create_file_writer(log_dir) if log_dir else None
    x, y = eval_arrays
    results = []
    for path in tf.train.checkpoints_iterator(directory, timeout=timeout):
        checkpoint.restore(path).expect_partial()
        values = model.evaluate(x, y, verbose=0, return_dict=True)
        epoch = _epoch_of(path)
        results.append((epoch, values))
        print(
            f"eval epoch={epoch} "
            + " ".join(f"{k}={v:.4f}" for k, v in values.items()),
            flush=True,
        )
        if writer:
            with writer.as_default(step=epoch):
                for name, value in values.items():
                    tf.summary.scalar("eval_" + name, value)
            writer.flush()
        if max_evaluations and len(results) >= max_evaluations:
            break
    return results
