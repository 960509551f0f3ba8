"""The shim's round: what the SyncReplicasOptimizers of one step share.

TF1 gave every `SyncReplicasOptimizer` its own token queue, so three of them
in one `train_op` released three sets of tokens per step and the barrier
broke. Here every shim optimizer applied in the same traced step joins one
`Round`: one token queue, one local step per worker, one chief round that
applies each member once and releases the tokens once.

The chief's part starts by itself: the strategy's coordinator traces each
scheduled function before dispatching it and then calls `ensure_started`
on every round (seed the steps, enqueue the initial tokens, start the round
thread), so `model.fit` and custom loops need no hook. TF1's hook still
works and does the same when called first.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref

import tensorflow as tf
from absl import logging
from tensorflow.python.ops import resource_variable_ops

from tf2sync._src import strategy as strategy_lib
from tf2sync._src import watchdog
from tf2sync._src.compat_v1_accumulators import plain_variable

# Tokens and local steps are int64 whatever the global step's dtype: the
# round may start before a later member names its global step.
TOKEN_DTYPE = tf.int64
# Per traced graph: the `Round` started there, and each round's step context.
_OPEN_ROUNDS = weakref.WeakKeyDictionary()
_STEP_CONTEXTS = weakref.WeakKeyDictionary()
_LAST_TOKENS = weakref.WeakKeyDictionary()  # graph -> its last step's token
_STARTED = weakref.WeakSet()  # rounds whose thread stops at exit
_GLOBAL_STEP_REQUIRED = "Global step is required to check staleness"
_AUTO = "started by the coordinator"
# TF1's order (push, then token) can leave a finite run's last steps
# waiting for a round that needs more pushes than will come (each stale
# push costs the barrier a token for good). Once every scheduled step was
# dispatched and nothing moved for this long, the watchdog releases the
# tokens the round needs; they carry the current global step, so they can
# cost a wasted or dropped gradient, never a wrong one.
DRAIN_TIMEOUT = 1.0


class ChiefRunner:
    """The TF2 counterpart of TF1's chief `QueueRunner`.

    A daemon thread on the coordinator runs the sync round (take every
    accumulator, apply once, release tokens, moving averages) back to back.
    """

    def __init__(self, sync_round):
        self._round = sync_round
        self._thread = None
        self._stopping = False
        self.error = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self):
        """Starts the round thread (no-op if it already runs)."""
        if self.running:
            return self
        self._stopping = False
        self._round._stop_flag.assign(False)
        self._thread = threading.Thread(
            target=self._loop, name="sync_replicas_chief", daemon=True
        )
        self._thread.start()
        return self

    def _loop(self):
        try:
            while not self._stopping:
                self._round._round_fn()
        except Exception as e:  # noqa: BLE001 - reported through .error
            if not self._stopping:
                self.error = e
                logging.exception(
                    "SyncReplicasOptimizer chief round failed: %s", e
                )

    def stop(self, timeout: float = 30.0):
        """Stops the thread: unblocks its takes and skips that round's apply.

        The accumulators are left with their steps bumped; a new start
        reseeds them.
        """
        if not self.running:
            return
        self._stopping = True
        self._round._stop_flag.assign(True)
        for acc, rta in self._round._accumulators_and_rta():
            acc.unblock(rta)
        self._thread.join(timeout)
        self._thread = None


class SessionRunHook:
    """TF1's `SyncReplicasOptimizer` hook, for code that still calls it.

    Not needed in TF2: the coordinator starts the chief's part before the
    first scheduled step runs (`Round.ensure_started`). Called by hand,
    `begin()` then `after_create_session()` do it first (after the step was
    traced), with this hook's `num_tokens`; `end()` stops the round thread.
    """

    def __init__(self, sync_optimizer, is_chief, num_tokens):
        self._sync_optimizer = sync_optimizer
        self._is_chief = is_chief
        self._num_tokens = num_tokens
        self._begun = False

    def begin(self):
        """Checks `apply_gradients` was called; builds the init tokens."""
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
        """Chief: seeds steps, enqueues init tokens, starts the round thread.

        Non-chief: resets the local steps to the global step. `session` and
        `coord` are accepted for TF1 signature compatibility and ignored.
        """
        del session, coord
        if not self._begun:
            self.begin()
        sync_round = self._sync_optimizer._round
        if self._is_chief:
            if sync_round.claim(self):
                sync_round.start(self._init_tokens)
        else:
            sync_round.local_step_init()

    def end(self, session=None):
        """Stops the chief's round thread (whoever started it)."""
        del session
        sync_round = self._sync_optimizer._round
        if self._is_chief and sync_round is not None:
            sync_round.stop()


class StepContext:
    """One traced replica step's shared worker side for one `Round`."""

    def __init__(self, local_step, worker):
        self.local_step = local_step
        self.worker = worker
        self.dequeue = None
        self.result = None


class Round:
    """What the shim optimizers used in one training step share.

    One token queue, one local step per worker (both on the ps of the first
    member's global step, or of its first variable), one chief round that
    takes every member's accumulators, applies each inner optimizer once,
    increments each distinct global step once and releases
    `tokens_per_step` tokens once. Some member must name a global step.
    """

    def __init__(self, leader, device, global_step=None):
        strategy = leader._strategy
        num_workers = max(
            leader._total_num_replicas,
            getattr(strategy.extended, "_num_workers", 1),
        )
        name = leader._name
        self.leader = leader
        self.members = []  # (optimizer, its global_step or None)
        self.global_step = None
        self.strategy = strategy
        self.tokens_per_step = leader._tokens_per_step
        with tf.init_scope():
            current = tf.constant(0, TOKEN_DTYPE)
            if global_step is not None:
                current = tf.cast(global_step.read_value(), TOKEN_DTYPE)
            self.local_steps = plain_variable(
                tf.fill([num_workers], current),
                device,
                f"{name}_sync_rep_local_step",
            )
            with tf.device(device):
                self.token_queue = tf.queue.FIFOQueue(
                    capacity=-1,
                    dtypes=[TOKEN_DTYPE],
                    shapes=[()],
                    name=f"{name}_sync_token_q",
                )
            self._stop_flag = resource_variable_ops.ResourceVariable(
                False, trainable=False, name=f"{name}_stop"
            )
            self.rounds = plain_variable(
                tf.constant(0, tf.int64), device, f"{name}_rounds"
            )
        self.runner = ChiefRunner(self)
        self.started = False
        self.watchdog = None
        self._round_fn = None
        self._claimed_by = set()
        if isinstance(strategy, strategy_lib.SyncParameterServerStrategy):
            strategy._tf2sync_before_dispatch.append(self.ensure_started)

    def add_member(self, opt, global_step):
        if global_step is not None and self.global_step is None:
            self.global_step = global_step
        self.members.append((opt, global_step))

    def check(self):
        """Raises TF1's error if no member named a global step."""
        if self.global_step is None:
            raise ValueError(_GLOBAL_STEP_REQUIRED)

    def _accumulators_and_rta(self):
        return [
            (acc, opt._replicas_to_aggregate)
            for opt, _ in self.members
            for acc in opt._accumulators()
        ]

    # Chief side ----------------------------------------------------------

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

    def ensure_started(self):
        """Starts the chief's part unless a hook or an earlier call did.

        Called by the coordinator after tracing a scheduled function and
        before dispatching it, so no worker waits on a token that nobody
        will enqueue.
        """
        if self.started or not self.members:
            return
        self.start(self.leader.get_init_tokens_op(-1))
        self._claimed_by = {_AUTO}

    def start(self, init_tokens):
        """Seeds local and accumulator steps, enqueues tokens, starts."""
        self.check()
        self._halt()
        step = tf.cast(self.global_step.read_value(), TOKEN_DTYPE)
        self.local_steps.assign(tf.fill(tf.shape(self.local_steps), step))
        for acc, _ in self._accumulators_and_rta():
            acc.set_global_step(step)
        init_tokens()
        self.runner.start()
        self.started = True
        _STARTED.add(self)
        timeout = getattr(self.strategy, "_token_timeout", None)
        if timeout is not None:
            self.watchdog = watchdog.TokenWatchdog(
                self, timeout, drain_timeout=DRAIN_TIMEOUT
            )

    def stop(self):
        """Stops the round thread and the watchdog (`hook.end()`).

        The next scheduled step starts the round again (`ensure_started`).
        """
        self._halt()
        self.started = False
        self._claimed_by = set()

    def _halt(self):
        if self.watchdog is not None:
            self.watchdog.stop()
        self.runner.stop()

    def watch_state(self) -> watchdog.WatchState:
        """What `watchdog.TokenWatchdog` needs, read eagerly on the ps."""
        step = int(self.global_step.numpy())
        pending = [
            int(a.num_accumulated()) for a, _ in self._accumulators_and_rta()
        ]
        tokens = int(self.token_queue.size())
        drained = False
        coordinator = getattr(self.strategy, "_cluster_coordinator", None)
        if coordinator is not None:
            queue = coordinator._cluster.closure_queue
            inflight = queue._inflight_closure_count
            if not inflight and queue._queue.empty():
                # No step is in flight, so none waits for a token: TF1 order
                # (push, then token) leaves the queue empty between steps.
                tokens = max(tokens, 1)
            drained = inflight > 0 and queue._queue.empty()
        return watchdog.WatchState(
            progress=(step, int(self.rounds.numpy()), *pending),
            step=step,
            tokens=tokens,
            pending=min(pending, default=0),
            required=self.leader._replicas_to_aggregate,
            drained=drained,
        )

    def seed_tokens(self, num):
        """Releases `num` tokens of the current global step (watchdog)."""
        self.enqueue_tokens(num)

    def local_step_init(self):
        step = tf.cast(self.global_step.read_value(), TOKEN_DTYPE)
        self.local_steps.assign(tf.fill(tf.shape(self.local_steps), step))

    def enqueue_tokens(self, num):
        """Enqueues `num` tokens carrying the current global step."""
        step = tf.cast(self.global_step.read_value(), TOKEN_DTYPE)
        with tf.device(self.token_queue.queue_ref.device):
            return self.token_queue.enqueue_many([tf.fill([num], step)])

    def rebuild(self):
        self._round_fn = self._make_round_fn()

    def _make_round_fn(self):
        members = [(opt, gs, list(opt._states)) for opt, gs in self.members]

        @tf.function(autograph=False)
        def sync_round():
            applies = []  # (optimizer, grads_and_vars, global_step)
            incremented = set()
            for opt, gs, states in members:
                grads_and_vars = []
                for state in states:
                    for var, acc in zip(state.variables, state.accumulators):
                        grad = None
                        if acc is not None:
                            grad = acc.take(opt._replicas_to_aggregate)
                        grads_and_vars.append((grad, var))
                if gs is not None and id(gs) in incremented:
                    gs = None
                if gs is not None:
                    incremented.add(id(gs))
                applies.append((opt, grads_and_vars, gs))
            taken = [
                t
                for _, gvs, _ in applies
                for g, _ in gvs
                if g is not None
                for t in tf.nest.flatten(g, expand_composites=True)
            ]

            def apply():
                updates = []
                for opt, gvs, gs in applies:
                    update = opt._inner_apply(gvs, gs)
                    if update is not None:
                        updates.append(update)
                with tf.control_dependencies(updates):
                    release = self.enqueue_tokens(self.tokens_per_step)
                ops = [release]
                for opt, _ in self.members:
                    if opt._variable_averages is not None:
                        with tf.control_dependencies([release]):
                            ops.append(
                                opt._variable_averages.apply(
                                    opt._variables_to_average
                                )
                            )
                with tf.control_dependencies(ops):
                    return self.rounds.assign_add(1, read_value=False)

            with tf.control_dependencies(taken):
                stop = self._stop_flag.read_value()
            with tf.control_dependencies(taken):
                tf.cond(stop, tf.no_op, apply)

        return sync_round

    # Worker side ---------------------------------------------------------

    def step_context(self):
        """The current traced step's `StepContext` (a new one eagerly)."""
        worker = strategy_lib.current_worker()
        if worker is None:
            worker = tf.constant(0, tf.int64)
        if tf.executing_eagerly():
            ctx = None
        else:
            graph = tf.compat.v1.get_default_graph()
            contexts = _STEP_CONTEXTS.setdefault(graph, {})
            ctx = contexts.get(id(self))
        if ctx is None:
            ctx = StepContext(tf.gather(self.local_steps, worker), worker)
            if not tf.executing_eagerly():
                contexts[id(self)] = ctx
        return ctx

    def finish_step(self, ctx, pushes):
        """Makes the step's one token dequeue wait for `pushes` too."""
        push_ops = [p if isinstance(p, tf.Operation) else p.op for p in pushes]
        if ctx.dequeue is not None:
            ctx.dequeue.op._add_control_inputs(push_ops)
            return ctx.result
        with tf.control_dependencies(push_ops):
            with tf.device(self.token_queue.queue_ref.device):
                ctx.dequeue = self.token_queue.dequeue()
        update = self.local_steps.scatter_update(
            tf.IndexedSlices(
                tf.reshape(ctx.dequeue, [1]), tf.reshape(ctx.worker, [1])
            )
        )
        with tf.control_dependencies([update]):
            ctx.result = tf.identity(ctx.dequeue)
        if not tf.executing_eagerly():
            _LAST_TOKENS[tf.compat.v1.get_default_graph()] = ctx.result
        return ctx.result


def open_round():
    """The `Round` a shim optimizer started in the current traced step."""
    if tf.executing_eagerly():
        return None
    return _OPEN_ROUNDS.get(tf.compat.v1.get_default_graph())


def set_open_round(sync_round):
    if not tf.executing_eagerly():
        _OPEN_ROUNDS[tf.compat.v1.get_default_graph()] = sync_round


def previous_token():
    """`[token]` of the step traced before this one in the same function.

    Steps repeated in one function's graph (instead of a loop) have no order
    but their data's: the next step would read the weights while this one
    still waits for its token. TF1 runs one step per `session.run`, so the
    strategy makes each step's ops follow the previous step's token.
    """
    if tf.executing_eagerly():
        return []
    token = _LAST_TOKENS.get(tf.compat.v1.get_default_graph())
    return [] if token is None else [token]


def end_traced_step():
    """After a traced `strategy.run`: checks and closes its step.

    Its round must have a global step. Then the graph's open round and step
    contexts are dropped, so that a further `strategy.run` in the same
    function (steps repeated in the graph instead of looped) is a step of
    its own: its own local-step read, pushes and token.
    """
    sync_round = open_round()
    if sync_round is not None:
        sync_round.check()
    if not tf.executing_eagerly():
        graph = tf.compat.v1.get_default_graph()
        _OPEN_ROUNDS.pop(graph, None)
        _STEP_CONTEXTS.pop(graph, None)


@atexit.register
def _stop_started_rounds():
    # A round thread blocked in a take may hold the interpreter's exit;
    # unblocking needs the ps, which may be gone: bound the wait.
    rounds = [r for r in list(_STARTED) if r.runner.running]
    if not rounds:
        return

    def stop_all():
        for sync_round in rounds:
            # The cluster may be gone already: nothing left to unblock.
            with contextlib.suppress(Exception):
                sync_round.stop()

    stopper = threading.Thread(target=stop_all, daemon=True)
    stopper.start()
    stopper.join(10.0)
