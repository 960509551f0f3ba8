"""Checkpoints: the save cadence, checks before a restore, the sync
counters beside each save, and an evaluator that follows the saves (the
saver itself: `saver.OneTraceSaver`).

`fit`'s callback (`fit_checkpoint.SyncCheckpoint`) and `Trainer` save
`tf.train.Checkpoint(model=..., optimizer=...)` as `<dir>/ckpt-<epochs>`
(weights, the global step, every slot and group state), and inside an
epoch as `<dir>/ckpt-<epochs>_<steps>`, keeping the last few. Files are
written first and the `checkpoint` index last, so a process killed while
saving leaves the previous checkpoint usable.
"""

from __future__ import annotations

import collections
import json
import math
import os
import time

import tensorflow as tf
from absl import logging

from tf2sync._src import callbacks as callbacks_lib
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


def check_flag(name: str, value) -> None:
    """Refuses a checkpoint option (`name`) that is not a bool."""
    if not isinstance(value, bool):
        raise ValueError(
            f"`{name}` must be True or False. Received: {name}={value!r}"
        )


def check_every(name: str, value, kind) -> None:
    """Refuses a save cadence (`every_steps`: `kind` int; seconds: a
    number) that is not None nor a positive finite number."""
    if value is None:
        return
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if ok and kind is not int:
        ok = math.isfinite(value)
    if not ok or value <= 0:
        what = "an int" if kind is int else "a number of seconds"
        raise ValueError(
            f"`{name}` must be None or {what} > 0. Received: {name}={value!r}"
        )


class Cadence:
    """When a save inside an epoch is due: `every_steps` steps of the
    epoch, or `every_seconds`, since the last save (either None: not by
    it)."""

    def __init__(self, every_steps=None, every_seconds=None):
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self._scheduled = collections.deque()
        self.saved(0)

    def scheduled(self, result, lookahead: int) -> None:
        """A function was scheduled (`result`: its `RemoteValue`, or
        `fit`'s logs of it). With `every_seconds`, waits for the one
        scheduled `lookahead` functions before (2 per worker keep every
        worker busy): under PSS the loop schedules up to hundreds of
        functions ahead, and a clock read at scheduling time would run
        ahead of the training it measures (a whole epoch scheduled
        within `every_seconds` was never saved inside)."""
        if self.every_seconds is None:
            return
        self._scheduled.append(result)
        while len(self._scheduled) > lookahead:
            callbacks_lib.wait_for_function(self._scheduled.popleft())

    def __bool__(self):
        return bool(self.every_steps or self.every_seconds)

    def saved(self, step: int) -> None:
        """A save was made at `step` of its epoch (0: at an epoch's start
        or end), after a join."""
        self._scheduled.clear()
        self._step = step
        self._at = time.monotonic()

    def epoch_begins(self, step: int) -> None:
        """An epoch begins at `step` (0, or where a resumed one starts):
        steps count from there, seconds from the last save."""
        self._step = step

    def due(self, step: int) -> bool:
        """Whether `step` steps of the epoch done call for a save."""
        return (
            self.every_steps is not None
            and step - self._step >= self.every_steps
        ) or (
            self.every_seconds is not None
            and time.monotonic() - self._at >= self.every_seconds
        )


def position_of(path: str) -> tuple[int, int]:
    """`(epochs done, steps of the next epoch done)` of a checkpoint's
    prefix: `<dir>/ckpt-3` at an epoch's end, `<dir>/ckpt-3_120` inside
    one (`SyncCheckpoint`)."""
    epoch, _, step = os.path.basename(path).rsplit("-", 1)[1].partition("_")
    return int(epoch), int(step or 0)


def _epoch_of(path: str) -> int:
    return position_of(path)[0]


def latest_epoch(directory: str):
    """The newest checkpoint in `directory` and the epochs it completed.

    Returns:
      `(prefix, epoch)`, e.g. `("<dir>/ckpt-3", 3)`; `(None, 0)` where
      `directory` holds none (or does not exist).
    """
    latest = tf.train.latest_checkpoint(directory)
    if latest is None:
        return None, 0
    return latest, _epoch_of(latest)


_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"


def check_model_fits(build_model, directory: str) -> None:
    """Refuses the newest checkpoint in `directory` if another model saved it.

    Builds `build_model()` in a graph of its own: nothing is initialized or
    run, and TensorFlow's eager runtime is left as it was (the chief's
    devices and cluster connection are set later). Then compares, in the
    order `tf.train.Checkpoint(model=...)` names them, the model's
    variables with the checkpoint's: a variable the checkpoint lacks, one
    of another shape, or (for a model that is built) one the checkpoint has
    and the model lacks. The optimizer's variables are not compared (they
    are created at the first step); `SyncCheckpoint.restore_latest` checks
    those it can. Does nothing where `directory` holds no checkpoint, or
    where the model cannot be built outside the chief's strategy.

    Args:
      build_model: The job's `build_model`.
      directory: The chief's checkpoint directory.

    Raises:
      ValueError: One line naming the checkpoint and the first variable
        that does not fit.
    """
    latest, _ = latest_epoch(directory)
    if latest is None:
        return
    saved = tf.train.load_checkpoint(latest).get_variable_to_shape_map()
    saved = {
        key: list(shape)
        for key, shape in saved.items()
        if key.startswith("model/")
        and key.endswith(_VALUE)
        and ".OPTIMIZER_SLOT" not in key
    }
    try:
        with tf.Graph().as_default():
            model = build_model()
            ours = [
                (key, variable.name.split(":")[0], variable.shape.as_list())
                for key, variable in _variables_by_key(
                    tf.train.Checkpoint(model=model)
                )
            ]
            built = bool(getattr(model, "built", True))
    except Exception:  # noqa: BLE001 - left to restore_latest on the chief
        return
    hint = "Build the model it was saved from, or use another directory."
    for key, name, shape in ours:
        short = key[: -len(_VALUE)]
        if key not in saved:
            raise ValueError(
                f"the checkpoint {latest} is of another model: it has no "
                f"{short} (variable {name}, shape {shape}). {hint}"
            )
        if saved[key] != shape:
            raise ValueError(
                f"the checkpoint {latest} is of another model: it saved "
                f"{short} with shape {saved[key]}, the model's (variable "
                f"{name}) has shape {shape}. {hint}"
            )
    if not built or not ours:
        return  # variables come at the first call: extra ones cannot tell
    extra = sorted(set(saved) - {key for key, _, _ in ours})
    if extra:
        raise ValueError(
            f"the checkpoint {latest} is of another model: it saved "
            f"{extra[0][: -len(_VALUE)]} (shape {saved[extra[0]]}), which "
            f"the model lacks. {hint}"
        )


# Beside each checkpoint `<prefix>`: its SyncOptimizer's counters (JSON).
_TOTALS = ".sync_totals.json"


def _aggregator_of(checkpoint):
    """The `Aggregator` of the `SyncOptimizer` `checkpoint` saves, or None
    (no optimizer, or another kind: the TF1 shim counts nothing)."""
    optimizer = getattr(checkpoint, "optimizer", None)
    try:
        return callbacks_lib.find_sync_optimizer(optimizer)._aggregator
    except (ValueError, AttributeError):
        return None


def sync_totals(checkpoint):
    """The counters of `checkpoint`'s SyncOptimizer now (a dict), or None."""
    aggregator = _aggregator_of(checkpoint)
    return None if aggregator is None else aggregator.totals()


def save_sync_totals(checkpoint, path: str, totals=None) -> None:
    """Writes the counters of `checkpoint`'s SyncOptimizer (or `totals`,
    read earlier by `sync_totals`) beside `path`, so that a resume goes on
    counting (`restore_sync_totals`)."""
    if totals is None:
        totals = sync_totals(checkpoint)
    if totals is None:
        return
    temporary = path + _TOTALS + ".tmp"  # a reader never sees half a file
    with tf.io.gfile.GFile(temporary, "w") as f:
        f.write(json.dumps(totals))
    tf.io.gfile.rename(temporary, path + _TOTALS, True)


def restore_sync_totals(checkpoint, path: str) -> None:
    """Sets the counters saved beside checkpoint `path`, if any: the
    stale, accepted and per-worker counts and the barrier wait go on from
    the saved run's (as the global step does), for this run's workers."""
    aggregator = _aggregator_of(checkpoint)
    if aggregator is None or not tf.io.gfile.exists(path + _TOTALS):
        return
    with tf.io.gfile.GFile(path + _TOTALS) as f:
        try:
            totals = json.loads(f.read())
        except ValueError:  # not ours, or damaged: count from 0
            logging.warning(
                "tf2sync: unreadable %s: counters start at 0.", path + _TOTALS
            )
            return
    aggregator.restore_totals(totals)


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
    done = set()
    for path in _epoch_ends(directory, timeout, done):
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


def _epoch_ends(directory, timeout, done):
    """The newest epoch's-end save each time saves come, when newer than
    every one yielded (each added to `done`): an evaluator that falls
    behind goes to the newest, as `checkpoints_iterator` does, and a save
    inside an epoch (`checkpoints_iterator`'s newest) does not hide the
    epoch's end before it."""
    for newest in tf.train.checkpoints_iterator(directory, timeout=timeout):
        state = tf.train.get_checkpoint_state(directory)
        paths = list(state.all_model_checkpoint_paths) if state else []
        ends = [
            os.path.join(directory, os.path.basename(path))
            for path in paths + [newest]
            if position_of(path)[1] == 0
        ]
        if not ends:
            continue
        path = max(ends, key=_epoch_of)
        if all(_epoch_of(path) > _epoch_of(old) for old in done):
            done.add(path)
            yield path
