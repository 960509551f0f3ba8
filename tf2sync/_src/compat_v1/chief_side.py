"""The chief's side of the shim's step protocol (`engine.PushFirstStep`).

What TF1's chief did at session start, and its hook's queue runner: seed
every local step with the global step and enqueue the initial tokens once
per round (`start`, `init_tokens`), started by the coordinator before
the first dispatch unless a hook or TF1's init-tokens op did it first
(`claim`, `before_dispatch`), and the core's token watchdog, which reads
the barrier with TF1's order in mind (`watch_state`).
"""

from __future__ import annotations

import tensorflow as tf
from absl import logging

from tf2sync._src import watchdog
from tf2sync._src.internals import cluster_coordinator

_AUTO = "started by the coordinator"
_MANUAL = "started by TF1's init-tokens op"
# TF1's order (push, then token) can leave a finite run's last steps
# waiting for a round that needs more pushes than will come (each stale
# push costs the barrier a token for good). Once every scheduled step was
# dispatched, every running one has pushed and waits for its token, and
# nothing moved for this long, the watchdog releases the tokens the round
# needs; they carry the current global step, so they can cost a wasted or
# dropped gradient, never a wrong one.
DRAIN_TIMEOUT = 1.0


class ChiefSideMixin:
    """The chief's side of `engine.PushFirstStep` (see the module
    docstring); the protocol's state (`aggregator`, `global_step`,
    `local_steps`, `parked`, `members`, `started`, `watchdog`) is the
    engine's."""

    def claim(self, hook):
        """True if `hook` should (re)start the round now.

        Of several members' hooks, the first one called starts the round;
        the same hook called again restarts it. Hooks called after the
        coordinator started the round change nothing.
        """
        if _AUTO in self._claimed_by:
            self._claimed_by.add(hook)
            return False
        if not self._claimed_by or hook in self._claimed_by:
            self._claimed_by = {hook}
            return True
        self._claimed_by.add(hook)
        return False

    def before_dispatch(self):
        """Starts the chief's side unless a hook or an earlier call did.

        The coordinator calls this after tracing a scheduled function and
        before dispatching it, so no worker waits on a token that nobody
        will enqueue.
        """
        if self.started or self.aggregator is None:
            return
        self.start(self.members[0][0]._replicas_to_aggregate)
        self._claimed_by = {_AUTO}

    def start(self, num_tokens):
        """Seeds the local steps, enqueues `num_tokens`, starts the watchdog."""
        self._halt()
        self.local_step_init()
        # No step runs at a start: a count left by a step killed between
        # its push and its token would drain rounds early from now on.
        self.parked.assign(0)
        self.aggregator.seed_tokens(num_tokens)
        self.started = True
        self.start_watchdog()

    def stop(self):
        """Stops the watchdog; the next dispatch starts the chief again."""
        self._halt()
        self.started = False
        self._claimed_by = set()

    def _halt(self):
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def local_step_init(self):
        """Every worker's local step := the global step (TF1's init op)."""
        step = tf.cast(self.global_step.read_value(), self.local_steps.dtype)
        self.local_steps.assign(tf.fill(tf.shape(self.local_steps), step))

    def watch_state(self) -> watchdog.WatchState:
        """The core barrier's state, read with TF1's order in mind."""
        state = self.aggregator.watch_state()
        tokens, drained = state.tokens, False
        coordinator = cluster_coordinator.strategy_coordinator(self.strategy)
        if coordinator is not None:
            inflight, queue_empty = cluster_coordinator.inflight_closures(
                coordinator
            )
            if not inflight and queue_empty:
                # No step is in flight, so none waits for a token: TF1's
                # order leaves the queue empty between steps.
                tokens = max(tokens, 1)
            # Drained only once every running step has pushed: one still
            # computing will push, and with TF1's order a token released
            # before it does would cost a worker a wasted step (a step
            # slower than `DRAIN_TIMEOUT` did, before this count).
            drained = (
                inflight > 0
                and queue_empty
                and int(self.parked.numpy()) >= inflight
            )
        return state._replace(tokens=tokens, drained=drained)

    def seed_tokens(self, num):
        """Releases `num` tokens of the current global step (watchdog)."""
        self.aggregator.seed_tokens(num)

    def init_tokens(self, num):
        """TF1's init-tokens op run by hand: the chief's start, no watchdog.

        TF1's chief ran it once, at session start. Here it enqueues `num`
        tokens only if nothing started the round yet: after the coordinator
        (its first dispatch), a hook or an earlier call, the round already
        has its initial tokens, and more would cost every worker one more
        wasted step; such a call adds nothing and logs why. `ChiefRunner.
        start()` (TF1's queue runner) adds the watchdog; no dispatch seeds
        tokens again.
        """
        if self.started:
            logging.warning(
                "SyncReplicasOptimizer: the init-tokens op was called after "
                "the round started (%s): it enqueued nothing (TF1's chief "
                "ran it once; another %d tokens would waste a step).",
                _describe_claim(self._claimed_by),
                num,
            )
            return
        if num > 0:
            self.aggregator.seed_tokens(num)
        self.started = True
        self._claimed_by = {_MANUAL}

    def start_watchdog(self):
        """Starts the token watchdog if the chief's side has none yet."""
        timeout = self.strategy._token_timeout
        if self.aggregator is None:
            return  # nothing traced yet: nothing to watch
        if timeout is not None and self.watchdog is None:
            self.watchdog = watchdog.TokenWatchdog(
                self, timeout, drain_timeout=DRAIN_TIMEOUT
            )


def _describe_claim(claimed_by):
    """Who started the round, for the log: the coordinator, TF1's
    init-tokens op, or a hook."""
    for who in (_AUTO, _MANUAL):
        if who in claimed_by:
            return who
    return "started by a hook's after_create_session()"
