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
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import NamedTuple

import tensorflow as tf
from absl import logging


class WatchState(NamedTuple):
    """What the watchdog reads on the ps, each poll."""

    progress: tuple  # changes whenever a gradient arrives or a step applies
    step: int  # the global step
    tokens: int  # tokens left in the queue
    pending: int  # gradients waiting for the next update
    required: int  # gradients an update needs


class TokenWatchdog:
    """Watches one token barrier; see the module docstring.

    The watched object (tf2sync's `Aggregator`, the TF1 shim's `Round`)
    has `watch_state() -> WatchState` and `seed_tokens(n)`.
    """

    def __init__(self, barrier, timeout: float, poll: float | None = None):
        self.timeout = float(timeout)
        self.poll = poll or max(0.2, min(5.0, self.timeout / 4))
        self.released = 0
        self._barrier = weakref.ref(barrier)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="tf2sync-token-watchdog", daemon=True
        )
        self._thread.start()

    def stop(self):
        self._stop.set()

    def _run(self):
        last, since = None, time.monotonic()
        while not self._stop.wait(self.poll):
            barrier = self._barrier()
            if barrier is None:
                return
            try:
                with tf.init_scope():
                    state = barrier.watch_state()
            except Exception:  # The cluster is gone: nothing to watch.
                return
            if state.progress != last:
                last, since = state.progress, time.monotonic()
                continue
            if state.tokens > 0 or time.monotonic() - since < self.timeout:
                continue
            needed = max(1, state.required - state.pending)
            logging.warning(
                "tf2sync: no synchronous step for %.0f s and no token left "
                "(step %d, %d of %d gradients): a worker probably died "
                "holding a token. Releasing %d token(s).",
                time.monotonic() - since,
                state.step,
                state.pending,
                state.required,
                needed,
            )
            barrier.seed_tokens(needed)
            self.released += needed
            since = time.monotonic()
