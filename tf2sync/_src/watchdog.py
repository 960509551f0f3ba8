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

import tensorflow as tf
from absl import logging


class TokenWatchdog:
    """Watches one `Aggregator`; see the module docstring."""

    def __init__(self, aggregator, timeout: float, poll: float | None = None):
        self.timeout = float(timeout)
        self.poll = poll or max(0.2, min(5.0, self.timeout / 4))
        self.released = 0
        self._aggregator = weakref.ref(aggregator)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="tf2sync-token-watchdog", daemon=True
        )
        self._thread.start()

    def stop(self):
        self._stop.set()

    def _state(self, aggregator):
        with tf.init_scope():
            return (
                int(aggregator.global_step.numpy()),
                int(aggregator.accepted.numpy()),
                int(aggregator.stale_dropped.numpy()),
                int(aggregator.count.numpy()),
                aggregator.tokens_available(),
            )

    def _run(self):
        last, since = None, time.monotonic()
        while not self._stop.wait(self.poll):
            aggregator = self._aggregator()
            if aggregator is None:
                return
            try:
                step, accepted, stale, count, tokens = self._state(aggregator)
            except Exception:  # The cluster is gone: nothing to watch.
                return
            progress = (step, accepted, stale)
            if progress != last:
                last, since = progress, time.monotonic()
                continue
            if tokens > 0 or time.monotonic() - since < self.timeout:
                continue
            needed = max(1, aggregator.config.replicas_to_aggregate - count)
            logging.warning(
                "tf2sync: no synchronous step for %.0f s and no token left "
                "(step %d, %d of %d gradients): a worker probably died "
                "holding a token. Releasing %d token(s).",
                time.monotonic() - since,
                step,
                count,
                aggregator.config.replicas_to_aggregate,
                needed,
            )
            aggregator.seed_tokens(needed)
            self.released += needed
            since = time.monotonic()
