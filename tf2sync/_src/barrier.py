"""The token barrier beside the global step: both of its halves.

A replica step may start once it holds a token; an update releases the
tokens of the next step. In the core's order a step takes its token first
and then reads the global step as its tag (`acquire`); in TF1's order (the
`compat_v1` shim) it pushes first and then takes a token carrying the
global step it may use next (`take`). Tokens come back from the update
(`release`, inside the aggregator's critical section), from a step that
pushed nothing (`give_back`), from dropped pushes, and from the chief and
its watchdog (`seed`).
"""

from __future__ import annotations

import tensorflow as tf

from tf2sync._src import wire as wire_lib

# The token `retire` enqueues, and what a step that takes it fails with.
RETIRED = -1
RETIRED_MESSAGE = (
    "tf2sync: this step's SyncOptimizer was replaced by a later one on its "
    "strategy. Compile the model with the new one (or trace the step again)."
)


class TokenBarrier:
    """The token queue on the global step's ps, and the time spent at it.

    Tokens are int64 global steps. The queue is unbounded and never
    closed, so a restarted chief or a watchdog can always add tokens. A
    negative token (`retire`) fails the step that takes it in the core's
    order.
    """

    def __init__(self, global_step, name):
        self.global_step = global_step
        self.device = global_step.device
        with tf.init_scope(), tf.device(self.device):
            self.queue = tf.queue.FIFOQueue(
                capacity=-1, dtypes=[tf.int64], shapes=[[]], name=name + "_q"
            )
        # Seconds replicas waited for a token (core order), summed on the ps.
        self.wait_seconds = wire_lib.ps_variable(
            tf.constant(0.0, tf.float64), self.device, name + "_wait"
        )

    def step(self):
        """The global step as int64 (a TF1 global step may be int32)."""
        return tf.cast(self.global_step.read_value(), tf.int64)

    # Coordinator side (eager) -----------------------------------------------

    def seed(self, num_tokens: int) -> None:
        """Enqueues `num_tokens` tokens of the current global step now.

        The core reads the step after its token anyway; in TF1's order the
        value is the taker's next tag.
        """
        if num_tokens > 0:
            with tf.init_scope(), tf.device(self.device):
                self.queue.enqueue_many(tf.fill([num_tokens], self.step()))

    def retire(self, num_tokens: int) -> None:
        """Replaces the tokens left with `num_tokens` negative ones, now
        (no step may be running): each step of the core's order that takes
        one fails (`acquire`, `RETIRED_MESSAGE`)."""
        with tf.init_scope(), tf.device(self.device):
            left = int(self.queue.size())
            if left:
                self.queue.dequeue_many(left)
            self.queue.enqueue_many(
                tf.fill([num_tokens], tf.constant(RETIRED, tf.int64))
            )

    def available(self) -> int:
        """Tokens in the queue now."""
        with tf.init_scope(), tf.device(self.device):
            return int(self.queue.size())

    # Step side (traced) ---------------------------------------------------

    def acquire(self):
        """Dequeues one token; returns the tag (global step read after it).

        The wait is timed and added to `wait_seconds`, on the ps: no
        worker<->ps edge but the tag's.
        """
        with tf.device(self.device):
            start = tf.timestamp()
            with tf.control_dependencies([start]):
                token = self.queue.dequeue()
            # Only string data: a plain Assert op, no cond guarding it.
            valid = tf.debugging.Assert(token >= 0, [RETIRED_MESSAGE])
            with tf.control_dependencies([token, valid]):
                tag = tf.identity(self.step())
                waited = tf.timestamp() - start
            count = self.wait_seconds.assign_add(waited, read_value=False)
            with tf.control_dependencies([count]):
                return tf.identity(tag)

    def take(self, after):
        """TF1's order: dequeues one token once `after` ran; returns it.

        The token carries the global step of the update that released it
        (or of the seeding), which becomes the worker's next tag.
        """
        with tf.control_dependencies(after), tf.device(self.device):
            return self.queue.dequeue()

    def give_back(self, after):
        """Returns one token once `after` ran (a step that pushed nothing)."""
        with tf.control_dependencies(after), tf.device(self.device):
            return self.queue.enqueue(tf.constant(0, tf.int64))

    def release(self, count, step=None):
        """Enqueues `count` tokens carrying `step` (0 if None), traced.

        Called inside the aggregator's critical section, on this ps: by an
        update (the next step's tokens), and for pushes that were dropped
        after taking a token.
        """
        value = tf.constant(0, tf.int64) if step is None else step
        if isinstance(count, int):
            shape = [count]
        else:
            shape = tf.reshape(tf.cast(count, tf.int32), [1])
        return self.queue.enqueue_many([tf.fill(shape, value)])
