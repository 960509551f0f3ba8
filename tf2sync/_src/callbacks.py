"""What the synchronous machinery did, for Keras: callbacks and fit's logs."""

from __future__ import annotations

import re
import time

import numpy as np
import tensorflow as tf
import tf_keras

from tf2sync._src import keras_calls


def _is_sync_optimizer(optimizer) -> bool:
    # `SyncOptimizer`'s marker: optimizer.py imports what imports this.
    return getattr(type(optimizer), "_tf2sync_synchronous", False)


def find_sync_optimizer(optimizer):
    """The `SyncOptimizer` in `optimizer` (itself, or under loss scaling)."""
    if _is_sync_optimizer(optimizer):
        return optimizer
    inner = getattr(optimizer, "sync_optimizer", None)
    if _is_sync_optimizer(inner):
        return inner
    raise ValueError(
        "SyncMetrics needs a model compiled with tf2sync.SyncOptimizer. "
        f"Received optimizer: {optimizer!r}"
    )


def use_optimizer(callbacks, optimizer) -> None:
    """Makes the `SyncMetrics` among `callbacks` read `optimizer`'s totals
    (a `tf2sync.Trainer`'s: its model is not compiled with it).

    Raises:
      ValueError: If there is one and `optimizer` holds no `SyncOptimizer`.
    """
    for callback in callbacks:
        if isinstance(callback, SyncMetrics):
            callback._optimizer = find_sync_optimizer(optimizer)


def sync_totals(optimizer) -> dict:
    """Exact totals of a `SyncOptimizer` (or its loss-scale wrapper), read
    on the ps in one call (`Aggregator.totals`)."""
    return find_sync_optimizer(optimizer)._aggregator.totals()


def is_sync_total(key: str) -> bool:
    """Whether `key` is one of `sync_totals`' keys (`accepted` aside)."""
    return key in (
        "sync_steps",
        "stale_dropped",
        "nonfinite_dropped",
        "barrier_wait_s",
    ) or bool(re.fullmatch(r"(accepted|stale)_w\d+", key))


# The sync figures an epoch line shows; the others stay in the logs
# (History, CSVLogger, TensorBoard). `nonfinite_dropped` shows when not 0.
EPOCH_LINE_KEYS = ("sync_steps", "stale_dropped", "examples_per_s")
_EPOCH_KEYS = (
    "stale_dropped_epoch",
    "nonfinite_dropped_epoch",
    "barrier_wait_s_epoch",
    "sync_steps_per_s",
    "examples_per_s",
)


def epoch_line(logs: dict) -> dict:
    """`logs` less the sync figures an epoch line leaves out.

    Kept: the loss, the model's metrics, `sync_steps`, `stale_dropped`,
    `examples_per_s`, and `nonfinite_dropped` when it is not 0.
    """

    def shown(key, value):
        if key == "nonfinite_dropped":
            return bool(value)
        if key in EPOCH_LINE_KEYS:
            return True
        return not (is_sync_total(key) or key in _EPOCH_KEYS)

    return {k: v for k, v in logs.items() if shown(k, v)}


def epoch_value_text(value) -> str:
    """A value of the epoch line: a count as an integer, a float as
    tf_keras's line shows it (4 decimals, or 4 significant digits below
    1e-3)."""
    if np.ndim(value):  # a metric of several values: tf_keras's mean
        value = float(np.mean(value))
    value = getattr(value, "item", lambda: value)()  # NumPy scalars
    if isinstance(value, (int, bool)):
        return str(int(value))
    value = float(value)
    return f"{value:.4f}" if abs(value) > 1e-3 else f"{value:.4e}"


def _duration_text(seconds: float, unit: str) -> str:
    """tf_keras's `Progbar` time format (`566ms/epoch`, `12ms/step`)."""
    if seconds >= 1 or seconds == 0:
        return f"{seconds:.0f}s/{unit}"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.0f}ms/{unit}"
    return f"{seconds * 1e6:.0f}us/{unit}"


class SyncMetrics(tf_keras.callbacks.ProgbarLogger):
    """Exact synchronous-training metrics in the epoch logs.

    `model.fit` under `SyncParameterServerStrategy` already adds the totals
    `sync_steps`, `stale_dropped`, `nonfinite_dropped` and `barrier_wait_s`
    to its logs. By default (`fit` repeating its steps) they are read from
    the parameter servers when the logs are fetched, after the epoch's
    `join`: exact (and the epoch's metrics are tf_keras's exact ones).
    With tf_keras's loop (`unroll_fit_steps(model, False)`) they are as the
    last scheduled step read them; pushes of other workers still in flight
    then may be missing. This callback reads the parameter servers after
    the epoch's `join` and overwrites them with exact values either way,
    and adds per-epoch figures:

    * `stale_dropped_epoch`, `nonfinite_dropped_epoch`: dropped this epoch;
    * `sync_steps_per_s`: synchronous updates per second of the epoch;
    * `examples_per_s`: accepted gradients x `batch_size` per second (only
      with `batch_size`);
    * `barrier_wait_s_epoch`: seconds replicas waited for tokens;
    * `accepted_w<i>`, `stale_w<i>`: gradients of worker i accepted and
      dropped as stale, in total.

    Put it before `History`-reading callbacks (`CSVLogger`, `TensorBoard`)
    in the callback list so that they record the exact values.

    It is also `fit`'s progress bar (a `ProgbarLogger`, which `fit` then
    uses instead of its own; `verbose` of `fit` still applies): the epoch
    line shows the loss, the metrics, `sync_steps`, `stale_dropped`,
    `examples_per_s` and `nonfinite_dropped` when not 0; every figure stays
    in the logs. Given another `ProgbarLogger` too, `fit` prints that one's
    lines (every figure) and `SyncMetrics` only adds its figures to the
    logs. The line shows what the logs hold when `SyncMetrics` runs:
    list it after callbacks that add to the logs (`ReduceLROnPlateau`'s
    `lr`) and before those that record them (`CSVLogger`, `TensorBoard`).
    """

    def __init__(self, batch_size: int | None = None, verbose: bool = False):
        """Args:
        batch_size: Examples per replica step, for `examples_per_s`.
        verbose: Whether the epoch line shows every figure of the logs
          (`accepted_w0`, `barrier_wait_s_epoch`, ...), not only those
          above.

        Raises:
          ValueError: If `batch_size` is not None or a positive int, or
            `verbose` not a bool.
        """
        if batch_size is not None and (
            not isinstance(batch_size, int)
            or isinstance(batch_size, bool)
            or batch_size <= 0
        ):
            raise ValueError(
                "`batch_size` must be None or a positive int. Received: "
                f"batch_size={batch_size!r}"
            )
        if not isinstance(verbose, bool):
            raise ValueError(
                f"`verbose` must be a bool. Received: verbose={verbose!r}"
            )
        super().__init__(count_mode="steps")
        self._batch_size = batch_size
        self.show_all = verbose
        self._start = None
        self._optimizer = None  # a Trainer's (`use_optimizer`), or the model's

    def on_train_begin(self, logs=None):
        # Another progress bar in fit's callbacks prints instead: one line
        # per epoch, not two.
        if any(
            isinstance(c, tf_keras.callbacks.ProgbarLogger) and c is not self
            for c in keras_calls.fit_callbacks(self.model)
        ):
            self.verbose = 0
        super().on_train_begin(logs)

    def _shown(self, logs):
        # Not a dict: a function's logs not fetched (a batch hook of
        # another callback has fit call every callback's; verbose=2 reads
        # none of them).
        if not isinstance(logs, dict) or self.show_all:
            return logs
        return epoch_line(logs)

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, self._shown(logs))

    def _totals(self):
        return sync_totals(self._optimizer or self.model.optimizer)

    def on_epoch_begin(self, epoch, logs=None):
        totals = self._totals()
        self._start = (time.perf_counter(), totals)
        # Totals, not averaged over the bar's updates.
        self.stateful_metrics = (
            set(self.stateful_metrics) | set(totals) | set(_EPOCH_KEYS)
        )
        super().on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._add_figures(logs)
        if self.verbose == 2 and logs is not None and self._start is not None:
            # tf_keras's line would print every count as a float
            # (`sync_steps: 48.0000 - stale_dropped: 0.0000e+00`).
            print(self._epoch_text(self._shown(logs)), flush=True)
            return
        super().on_epoch_end(epoch, self._shown(logs))

    def _epoch_text(self, logs) -> str:
        """tf_keras's verbose-2 epoch line, with counts as integers."""
        seconds = time.perf_counter() - self._start[0]
        steps = self.target or self.seen or 1
        parts = [f"{steps}/{steps}", f"{seconds:.0f}s"]
        parts += [f"{k}: {epoch_value_text(v)}" for k, v in logs.items()]
        parts += [
            _duration_text(seconds, "epoch"),
            _duration_text(seconds / steps, "step"),
        ]
        return " - ".join(parts)

    def _add_figures(self, logs):
        if logs is None or self._start is None:
            return
        started, before = self._start
        seconds = max(time.perf_counter() - started, 1e-9)
        now = self._totals()
        logs.update({k: v for k, v in now.items() if is_sync_total(k)})
        logs["stale_dropped_epoch"] = (
            now["stale_dropped"] - before["stale_dropped"]
        )
        logs["nonfinite_dropped_epoch"] = (
            now["nonfinite_dropped"] - before["nonfinite_dropped"]
        )
        logs["barrier_wait_s_epoch"] = (
            now["barrier_wait_s"] - before["barrier_wait_s"]
        )
        logs["sync_steps_per_s"] = (
            now["sync_steps"] - before["sync_steps"]
        ) / seconds
        if self._batch_size:
            logs["examples_per_s"] = (
                (now["accepted"] - before["accepted"])
                * self._batch_size
                / seconds
            )


def wait_for_function(result) -> None:
    """Waits until the scheduled function of `result` (its `RemoteValue`,
    or `fit`'s logs of it) has run. Its error is not raised here: the
    next `schedule` or `join` raises it."""
    if isinstance(result, LogsWithSyncTotals):
        result = result._logs  # not the totals: no read on the ps
    try:
        result.fetch()
    except Exception:  # noqa: BLE001 - see the docstring
        pass


class LogsWithSyncTotals(tf.distribute.experimental.coordinator.RemoteValue):
    """The logs of one scheduled `fit` function, plus the sync totals.

    The totals (`sync_steps`, `stale_dropped`, `nonfinite_dropped`,
    `barrier_wait_s`, `accepted_w<i>`, `stale_w<i>`) are read from the ps
    when the logs are fetched: at the end of an epoch that is after `fit`'s
    `join`, so they are exact, and a progress bar (`verbose=1`) reads them
    once it has waited for the function. The function itself does not
    return them, so its pushes read nothing for the logs.
    """

    def __init__(self, logs, optimizer):
        self._logs = logs
        self._optimizer = optimizer

    def _with_totals(self, logs, convert):
        if not isinstance(logs, dict):
            return logs
        totals = sync_totals(self._optimizer)
        del totals["accepted"]  # not fit's keys
        del totals["over_plan_dropped"]
        return dict(logs, **{k: convert(v) for k, v in totals.items()})

    def fetch(self):
        """The logs as NumPy values, once the function has run."""
        return self._with_totals(self._logs.fetch(), lambda v: v)

    def get(self, *key_and_default):
        """The logs as tensors, once the function has run.

        Given a key (and a default), that entry of the fetched logs, as a
        dict's `get`: callbacks that take fit's logs unconverted call
        `logs.get("loss")` on them (`TerminateOnNaN`, which fails so under
        stock PSS: its `RemoteValue.get` takes no key). A sync total is
        read from the ps only when its key is asked for.
        """
        if not key_and_default:
            return self._with_totals(self._logs.get(), tf.constant)
        key, *default = key_and_default
        logs = self._logs.fetch()
        if not isinstance(logs, dict):
            return default[0] if default else None
        if key in logs:
            return logs[key]
        return self.fetch().get(key, *default)
