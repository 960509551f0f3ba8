"""Releases tokens lost with a dead worker, so the job does not hang.

A worker that dies after taking its step's token and before pushing takes
the token with it. Without backup workers the step then never completes and
every replica waits for a token forever (TF1's known hang, tensorflow#5022).

The watchdog is a daemon thread on the coordinator. Every `poll` seconds it
reads the global step, the pending count and the tokens left, on the ps.
When no update has been applied for `timeout` seconds, nothing has been
pushed meanwhile and no token is left, it logs a warning and releases the
tokens the step still needs. Releasing a token is safe even when no token
was lost (a slow step, say): a step's tag is read after its token, so a
surplus token costs at most a wasted or dropped gradient, never a wrong one.

The coordinator sees a worker fail long before `timeout`: it then calls
`alarm_all`, and for the next `ALARM_WINDOW` seconds every watchdog
releases a stalled step's tokens once `ALARM_TIMEOUT` seconds pass without
progress (polling every `ALARM_POLL` s), so the job goes on within about a
second of the failure instead of after `timeout`. The failed worker held at
most one token per synchronous optimizer (a step takes its next token only
after its push); releasing on a stall rather than per failed worker also
covers a dequeue the dead worker left waiting on the ps, which takes the
next token released.

With variables on several ps (`sync.scale_out`), the worker whose push
sealed a step applies it; one that dies before it is done leaves the step
sealed. Stalled so, the watchdog calls the barrier's `recover()`, which
applies the step where it was not yet applied and ends it (each ps applies
it once, whoever else is still applying it). Once steps have been applied
the watchdog runs `recover`'s function once with nothing sealed
(`prepare_recover`): a function first run while a worker is frozen would
wait for that worker (`liveness`), and a frozen sealer is the case
`recover` is for.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import NamedTuple

import tensorflow as tf
from absl import logging

# Polls hold this lock; `stop_all` takes it, so that no poll is reading the
# ps when the process connects to another cluster (a read through a handle
# of the old cluster then crashes the process, not just the thread).
_POLL_LOCK = threading.Lock()
_LIVE = weakref.WeakSet()

# After `alarm_all`: seconds without progress before tokens are released,
# the poll period meanwhile, and how long the alarm lasts.
ALARM_TIMEOUT = 0.5
ALARM_POLL = 0.1
ALARM_WINDOW = 30.0


def alarm_all(reason: str) -> None:
    """A worker failed (`reason` says which): see the module docstring."""
    for dog in list(_LIVE):
        dog.alarm(reason)


def stop_all() -> None:
    """Stops every watchdog of this process, waiting out a poll under way."""
    with _POLL_LOCK:
        for dog in list(_LIVE):
            dog.stop()


class WatchState(NamedTuple):
    """What the watchdog reads on the ps, each poll."""

    progress: tuple  # changes whenever a gradient arrives or a step applies
    step: int  # the global step
    tokens: int  # tokens left in the queue
    pending: int  # gradients waiting for the next update
    required: int  # gradients an update needs
    # Every scheduled step was dispatched and some are still running: with
    # TF1's order (push, then token) the last ones may wait for a round
    # that needs more pushes than will come.
    drained: bool = False
    # Scale-out (`sync.scale_out`): a step was sealed and not yet ended;
    # stalled so, the push that sealed it died: `recover()` ends it.
    sealed: bool = False


class TokenWatchdog:
    """Watches one token barrier; see the module docstring.

    The watched object (tf2sync's `Aggregator`, or the TF1 shim's
    `PushFirstStep`, which reads the same `Aggregator` with TF1's order)
    has `watch_state() -> WatchState` and `seed_tokens(n)`. With
    `drain_timeout`, a drained barrier (see `WatchState.drained`) gets its
    tokens after that many seconds instead of `timeout`.
    """

    def __init__(
        self,
        barrier,
        timeout: float,
        poll: float | None = None,
        drain_timeout: float | None = None,
    ):
        self.timeout = float(timeout)
        self.drain_timeout = drain_timeout
        self.poll = poll or max(0.2, min(5.0, self.timeout / 4))
        if drain_timeout:
            self.poll = min(self.poll, max(0.1, drain_timeout / 4))
        self.released = 0
        self._barrier = weakref.ref(barrier)
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by `stop` and `alarm`
        self._alarm_until = 0.0
        self._alarm_reason = None
        self._thread = threading.Thread(
            target=self._run, name="tf2sync-token-watchdog", daemon=True
        )
        _LIVE.add(self)
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._wake.set()

    def alarm(self, reason: str) -> None:
        """Releases a stalled step's tokens fast for `ALARM_WINDOW` s."""
        self._alarm_reason = reason
        self._alarm_until = time.monotonic() + ALARM_WINDOW
        self._wake.set()

    def _alarmed(self) -> bool:
        return time.monotonic() < self._alarm_until

    def _run(self):
        last, since = None, time.monotonic()
        first, prepared = None, False
        while True:
            self._wake.wait(ALARM_POLL if self._alarmed() else self.poll)
            self._wake.clear()
            if self._stop.is_set():
                return
            barrier = self._barrier()
            if barrier is None:
                return
            with _POLL_LOCK:
                if self._stop.is_set():
                    return
                try:
                    with tf.init_scope():
                        state = barrier.watch_state()
                except Exception:  # The cluster is gone: nothing to watch.
                    return
            if first is None:
                first = state.step
            if not prepared and state.step != first and not state.sealed:
                # Steps were applied: the pushes are traced and every
                # worker answered. (Off the training thread.)
                prepared = self._prepare_recover(barrier)
            if state.progress != last:
                last, since = state.progress, time.monotonic()
                continue
            limit = self.timeout
            if state.drained and self.drain_timeout:
                limit = min(limit, self.drain_timeout)
            alarmed = self._alarmed()
            if alarmed:
                limit = min(limit, ALARM_TIMEOUT)
            if state.sealed and time.monotonic() - since >= limit:
                logging.warning(
                    "tf2sync: step %d was sealed and not applied for %.1f s "
                    "(the worker that sealed it probably died): applying it.",
                    state.step,
                    time.monotonic() - since,
                )
                with _POLL_LOCK:
                    if self._stop.is_set():
                        return
                    barrier.recover()
                since = time.monotonic()
                continue
            if state.tokens > 0 or time.monotonic() - since < limit:
                continue
            needed = max(1, state.required - state.pending)
            if alarmed:
                logging.warning(
                    "tf2sync: %s; step %d stalled at %d of %d gradients: "
                    "releasing %d token(s).",
                    self._alarm_reason,
                    state.step,
                    state.pending,
                    state.required,
                    needed,
                )
            else:
                self._log_timeout(state, since, needed)
            with _POLL_LOCK:
                if self._stop.is_set():
                    return
                barrier.seed_tokens(needed)
            self.released += needed
            since = time.monotonic()

    def _prepare_recover(self, barrier) -> bool:
        """`barrier.prepare_recover()` where it has one (scale-out)."""
        prepare = getattr(barrier, "prepare_recover", None)
        if prepare is None:
            return True
        with _POLL_LOCK:
            if self._stop.is_set():
                return True
            try:
                return prepare()
            except Exception:  # noqa: BLE001 - the cluster is going away
                logging.exception("tf2sync: preparing the recovery failed.")
                return True

    def _log_timeout(self, state, since, needed):
        logging.log(
            logging.INFO if state.drained else logging.WARNING,
            "tf2sync: no synchronous step for %.0f s and no token left "
            "(step %d, %d of %d gradients): %s Releasing %d token(s).",
            time.monotonic() - since,
            state.step,
            state.pending,
            state.required,
            "the last scheduled steps wait for a round no step will complete."
            if state.drained
            else "a worker probably died holding a token.",
            needed,
        )
