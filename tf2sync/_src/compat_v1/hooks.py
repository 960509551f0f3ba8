"""TF1's chief objects for code that still calls them.

TF2 needs neither: the coordinator starts the chief's side before the first
scheduled step runs (`PushFirstStep.before_dispatch`), and the rounds are
applied on the ps by the push that completes them. Called by hand, they do
what TF1's did at the same moments.
"""

from __future__ import annotations

import tensorflow as tf


class ChiefRunner:
    """TF2's counterpart of TF1's chief `QueueRunner`.

    TF1's queue runner was a thread taking every accumulator and applying
    each round. Here the push that completes a round applies it, on the ps,
    so there is no round thread: `start()` and `stop()` start and stop what
    is left of the chief's loop, the token watchdog (which releases tokens
    lost with a dead worker). `error` is kept for TF1 code that reads it;
    a failed round fails the step that completed it instead.
    """

    error = None

    def __init__(self, protocol):
        self._protocol = protocol

    @property
    def running(self) -> bool:
        return self._protocol.started

    def start(self):
        """Starts the token watchdog; enqueues no tokens.

        TF1's queue runner enqueued none before its first round: the
        initial tokens are the init-tokens op's (`get_init_tokens_op()()`,
        before or after this call), else the coordinator's, which seeds
        TF1's default count before the first dispatch if nothing did.
        """
        self._protocol.start_watchdog()
        return self

    def stop(self, timeout: float = 30.0):
        """Stops the token watchdog (`timeout` kept for TF1's signature)."""
        del timeout
        self._protocol.stop()


class SessionRunHook:
    """TF1's `SyncReplicasOptimizer` hook, for code that still calls it.

    Called by hand, `begin()` then `after_create_session()` do the chief's
    start first (after the step was traced), with this hook's `num_tokens`;
    `end()` stops the chief's watchdog.
    """

    def __init__(self, sync_optimizer, is_chief, num_tokens):
        self._sync_optimizer = sync_optimizer
        self._is_chief = is_chief
        self._num_tokens = num_tokens
        self._begun = False

    def begin(self):
        """Checks `apply_gradients` was called; checks the init tokens."""
        if not self._sync_optimizer._gradients_applied:
            raise ValueError(
                "SyncReplicasOptimizer.apply_gradient should be called before "
                "using the hook."
            )
        if self._is_chief:
            self._init_tokens = self._sync_optimizer.get_init_tokens_op(
                self._num_tokens
            )
        self._begun = True

    def after_create_session(self, session=None, coord=None):
        """Chief: seeds local steps, enqueues init tokens, starts the watchdog.

        Non-chief: resets the local steps to the global step. `session` and
        `coord` are accepted for TF1 signature compatibility and ignored.
        """
        del session, coord
        if not self._begun:
            self.begin()
        protocol = self._sync_optimizer._protocol
        if self._is_chief:
            if protocol.claim(self):
                protocol.start(self._init_tokens.num_tokens)
        else:
            protocol.local_step_init()

    def end(self, session=None):
        """Stops the chief's watchdog (whoever started it)."""
        del session
        protocol = self._sync_optimizer._protocol
        if self._is_chief and protocol is not None:
            protocol.stop()


class InitTokens:
    """TF2's counterpart of TF1's init-tokens op: call it to enqueue."""

    def __init__(self, protocol, num_tokens):
        self._protocol = protocol
        self.num_tokens = num_tokens

    @property
    def dtype(self):
        """The tokens' dtype: the global step's, as TF1's op enqueued."""
        return self._protocol.token_dtype()

    def __call__(self):
        """Enqueues the tokens: the chief's start, as TF1's op was.

        Once per start of the round, as TF1's chief ran it: a call after
        the round started (by the coordinator, a hook or an earlier call)
        enqueues nothing and logs it.
        """
        self._protocol.init_tokens(self.num_tokens)


class TokenQueue:
    """TF1's `_sync_token_queue`, typed as TF1's: the global step's dtype.

    The core barrier's queue (shared with `tf2sync.SyncOptimizer`'s order,
    whose negative retire token and given-back tokens are int64) holds
    int64 tokens; this view of it gives and takes the global step's dtype,
    as TF1's queue did (int32 tokens for an int32 global step).
    """

    def __init__(self, queue, dtype):
        self._queue = queue
        self.dtypes = [dtype]

    @property
    def dtype(self):
        """The tokens' dtype (TF1's queue had one component)."""
        return self.dtypes[0]

    @property
    def shapes(self):
        return self._queue.shapes

    @property
    def name(self):
        return self._queue.name

    def size(self, name=None):
        """The tokens in the queue now."""
        return self._queue.size(name=name)

    def dequeue(self, name=None):
        """Takes one token (blocks until there is one)."""
        return self._cast(self._queue.dequeue(name=name), self.dtype)

    def dequeue_many(self, n, name=None):
        """Takes `n` tokens (blocks until there are `n`)."""
        return self._cast(self._queue.dequeue_many(n, name=name), self.dtype)

    def enqueue(self, vals, name=None):
        """Adds one token carrying `vals`."""
        return self._queue.enqueue(self._cast(vals, tf.int64), name=name)

    def enqueue_many(self, vals, name=None):
        """Adds one token per element of `vals`."""
        return self._queue.enqueue_many(self._cast(vals, tf.int64), name=name)

    @staticmethod
    def _cast(value, dtype):
        return tf.nest.map_structure(lambda v: tf.cast(v, dtype), value)
