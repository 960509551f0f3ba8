"""The aggregator's counters, its plan limit and what the watchdog reads.

`CountersMixin` is part of `aggregation.Aggregator` (see that module for
the protocol): the counters live on the global step's ps and are read in
one function (`totals`), or by each push for the logs (`_counters`).
"""

from __future__ import annotations

import tensorflow as tf

from tf2sync._src import watchdog
from tf2sync._src.internals import autograph

# The step limit when nothing is planned: never reached.
NO_LIMIT = 2**62


class CountersMixin:
    """Counters, plan and barrier state of `aggregation.Aggregator`."""

    def seed_tokens(self, num_tokens: int) -> None:
        """Enqueues `num_tokens` tokens of the current step now (eagerly)."""
        self.barrier.seed(num_tokens)

    def retire(self) -> None:
        """A later SyncOptimizer replaced this one (`strategy._attach`):
        steps traced for it fail at their token from now on. One token per
        worker suffices: the first failure cancels the others' functions,
        and the extra ones cover steps already waiting."""
        self.retired = True
        self.barrier.retire(self.num_workers + self.config.tokens_per_step)

    def _step(self):
        return self.barrier.step()

    def totals(self) -> dict:
        """The counters, read on the ps by one function: one round trip.

        Read one by one they took ten or more round trips, two or three
        times per `fit` epoch. Keys: `sync_steps`, `stale_dropped`,
        `nonfinite_dropped`, `barrier_wait_s`, `accepted`,
        `over_plan_dropped`, and per worker i `accepted_w<i>`, `stale_w<i>`.
        Counts are exact below 2**53 (they cross as one float64 vector).
        """
        if self._totals_function is None:

            def read():
                with tf.device(self.device):
                    extra = tf.stack(
                        [
                            self.accepted.read_value(),
                            self.over_plan.read_value(),
                        ]
                    )
                    return tf.concat(
                        [self._counters(), tf.cast(extra, tf.float64)], axis=0
                    )

            # One per aggregator, each traced once: no retracing to warn of.
            self._totals_function = autograph.without_retracing_warning(
                tf.function(read, autograph=False)
            )
        values = self._totals_function().numpy()
        n = self.num_workers
        totals = {
            "sync_steps": int(values[0]),
            "stale_dropped": int(values[1]),
            "nonfinite_dropped": int(values[2]),
            "barrier_wait_s": float(values[3 + 2 * n]),
            "accepted": int(values[4 + 2 * n]),
            "over_plan_dropped": int(values[5 + 2 * n]),
        }
        for i in range(n):
            totals[f"accepted_w{i}"] = int(values[3 + i])
            totals[f"stale_w{i}"] = int(values[3 + n + i])
        return totals

    def restore_totals(self, totals: dict) -> None:
        """Sets the counters to `totals` (a `totals()` a checkpoint kept
        beside it), eagerly: per-worker ones for this cluster's workers,
        0 for a worker the saved run did not have. The global step is the
        checkpoint's own."""
        n = self.num_workers
        with tf.init_scope():
            for name, variable in (
                ("stale_dropped", self.stale_dropped),
                ("nonfinite_dropped", self.nonfinite_dropped),
                ("accepted", self.accepted),
                ("over_plan_dropped", self.over_plan),
            ):
                variable.assign(int(totals.get(name, 0)))
            self.wait_seconds.assign(float(totals.get("barrier_wait_s", 0.0)))
            for prefix, variable in (
                ("accepted_w", self.accepted_per_worker),
                ("stale_w", self.stale_per_worker),
            ):
                variable.assign(
                    [int(totals.get(f"{prefix}{i}", 0)) for i in range(n)]
                )

    def _counters(self):
        """`[global step, stale, non-finite, accepted per worker...,
        stale per worker..., total barrier wait]` as one float64 vector
        (counts exact below 2**53): what a push returns for the logs, and
        the head of `totals`."""
        counts = tf.concat(
            [
                tf.stack(
                    [
                        self._step(),
                        self.stale_dropped.read_value(),
                        self.nonfinite_dropped.read_value(),
                    ]
                ),
                self.accepted_per_worker.read_value(),
                self.stale_per_worker.read_value(),
            ],
            axis=0,
        )
        wait = tf.cast(self.wait_seconds.read_value(), tf.float64)
        return tf.concat(
            [tf.cast(counts, tf.float64), tf.reshape(wait, [1])], axis=0
        )

    def plan_run(self) -> tuple:
        """`(global step, gradients pending)` now: the base of a run's plan
        (read eagerly, between epochs)."""
        with tf.init_scope():
            step = int(self.global_step.numpy())
            pending = int(self.count.numpy())
            if int(self.acc_step.numpy()) != step:
                pending = 0  # of another step: discarded by the next push
        return step, pending

    def plan_updates(self, base, pushes: int) -> int:
        """Caps the global step at `base`'s step plus
        `(pending + pushes) // replicas_to_aggregate` (eagerly, between
        epochs); returns the limit.

        `base` is `plan_run()` at the run's start and `pushes` the pushes
        planned since, so the plan holds over the run whatever the epochs
        left in the accumulators. A push past the limit that would complete
        an update is dropped (see the module docstring, 5.); one that would
        not is accumulated as usual (an epoch's leftovers, which the next
        epoch completes).
        """
        step, pending = base
        limit = step + max(0, (pending + int(pushes))) // (
            self.config.replicas_to_aggregate
        )
        with tf.init_scope():
            self.step_limit.assign(limit)
        return limit

    def clear_plan(self) -> None:
        """Removes the cap of `plan_updates` (eagerly)."""
        with tf.init_scope():
            self.step_limit.assign(NO_LIMIT)

    @property
    def token_queue(self) -> tf.queue.FIFOQueue:
        """The barrier's queue of tokens, on the global step's ps."""
        return self.barrier.queue

    def tokens_available(self) -> int:
        return self.barrier.available()

    def watch_state(self) -> watchdog.WatchState:
        """The `watchdog.WatchState` of this barrier, read eagerly."""
        step = int(self.global_step.numpy())
        return watchdog.WatchState(
            progress=(
                step,
                int(self.accepted.numpy()),
                int(self.stale_dropped.numpy()),
            ),
            step=step,
            tokens=self.tokens_available(),
            pending=int(self.count.numpy()),
            required=self.config.replicas_to_aggregate,
            sealed=self._scale_out is not None
            and int(self._scale_out.sealed.numpy()) != 0,
        )

    def _stats_after(self, applied):
        """The counters (`_counters`), read on the ps once `applied` ran
        (see `push`): one transfer back to the worker when the logs use
        them."""
        with tf.control_dependencies([applied]):
            return self._counters()
