"""The push's side of the scale-out protocol (stage, commit, apply).

`SealedMixin` is part of `aggregation.Aggregator`: with variables on
several ps, a push stages its shares (`_stage`) before its commit, and the
push that sealed a step applies it on every ps and ends it
(`_apply_sealed`); `recover` ends a step whose sealer died. See
`sync.scale_out` for the protocol and its guarantees.
"""

from __future__ import annotations

import tensorflow as tf

from tf2sync._src import step_context
from tf2sync._src.sync import local_apply
from tf2sync._src.sync import scale_out as scale_out_lib


class SealedMixin:
    """Scale-out pushes of `aggregation.Aggregator`."""

    def _stage(self, inputs, check_finite):
        """Scale-out: stages every share on its ps (`sync.staging`);
        returns the commit's inputs: no gradient (all are staged), the
        push id and the stages' acknowledgement."""
        push_id = scale_out_lib.ScaleOut.new_push_id()
        ack = self._scale_out.stage(push_id, inputs, check_finite)
        with tf.device(self.device):
            push_id = tf.identity(push_id)
        return {
            **inputs,
            "packed": [None] * len(inputs["packed"]),
            "sparse": [None] * len(inputs["sparse"]),
            "id": push_id,
            "ack": ack,
        }

    def _apply_sealed(self, committed, stats):
        """Scale-out: the push that sealed a step applies it on the other
        ps, then ends it on this one (`sync.scale_out`). Returns
        `(applied, stats)` as `push`."""
        seal, admitted, count, read = committed
        with tf.device(self.device):
            ticket = tf.concat(
                [tf.reshape(seal, [1]), tf.reshape(count, [1]), admitted], 0
            )
        staged = self._scale_out.apply_staged(ticket, self._sparse_mean)
        finalizer = self._finalizer(stats)
        args = (seal, admitted, count)
        call = finalizer.prepare(*args)
        values = finalizer.reads() if call else []
        # Each cond sits on its ps with what it reads received first: a
        # push that did not seal sends no dead branch's tensors across.
        with tf.device(self.device), tf.control_dependencies(staged):
            values = [tf.identity(v) for v in values]
            return tf.cond(
                seal > 0,
                lambda: (
                    finalizer.call(args, values)
                    if call
                    else finalizer.inline(*args)
                ),
                lambda: (tf.constant(False), read),
            )

    def _finalizer(self, stats):
        """The finalize as one function of this ps where it can be (it
        holds nothing of another ps: no EMA or group optimizer there)."""
        if stats not in self._finalizers:
            self._finalizers[stats] = local_apply.LocalApply(
                self.device,
                lambda seal, admitted, count: self._in_section(
                    "finalize",
                    lambda: self._finalize(seal, admitted, count, stats),
                    # The other ps' sections read the step too: the seal
                    # orders them before this.
                    exclusive_resource_access=False,
                ),
                self.optimizer_variables,
            )
        return self._finalizers[stats]

    def _finalize(self, seal, admitted, count, stats):
        """Scale-out, in the critical section: ends the step sealed as
        `seal` (see `ScaleOut.finalize`); returns `(ended, stats)`."""
        ended = self._scale_out.finalize(
            seal,
            admitted,
            count,
            self._sparse_mean,
            lambda: self._end_step(self._increment(), False),
        )
        if not stats:
            return ended, tf.zeros([0], tf.float64)
        return ended, self._stats_after(ended)

    def _increment(self):
        with step_context.sync_apply_scope():
            return self._increment_fn(self._scale_out.all_variables)

    def recover(self) -> bool:
        """Applies and ends a step sealed but not ended (eagerly).

        Scale-out only: the push that sealed a step may die before it
        applied it on every ps. Safe while that push still runs: each ps
        applies a seal once, and the step ends once. Returns whether a
        sealed step was found.
        """
        scale_out = self._scale_out
        if scale_out is None:
            return False
        with tf.init_scope():
            seal = int(scale_out.sealed.numpy())
            if not seal:
                return False
            self._recover_function()(tf.constant(seal, tf.int64))
            return True

    def prepare_recover(self) -> bool:
        """Runs `recover`'s function once with no seal: it changes nothing.

        A function's first run registers it with every task of the cluster
        and waits for each to answer, a frozen worker too (`liveness`):
        prepared while every worker answers, `recover` runs at once when a
        frozen sealer leaves its step sealed. The watchdog calls this once
        steps have been applied. Returns False until a push has built the
        protocol (nothing to prepare before).
        """
        if self._scale_out is None:
            return False
        with tf.init_scope():
            self._recover_function()(tf.constant(0, tf.int64))
        return True

    def _recover_function(self):
        function = getattr(self, "_recover_fn", None)
        if function is None:
            scale_out = self._scale_out

            def run(seal):
                # Seal 0 (`prepare_recover`): every apply and the finalize
                # are skipped by their conditions.
                return self._apply_sealed(
                    (
                        seal,
                        scale_out.admitted.read_value(),
                        self.count.read_value(),
                        tf.zeros([0], tf.float64),
                    ),
                    stats=False,
                )

            function = tf.function(
                run,
                input_signature=[tf.TensorSpec([], tf.int64)],
                autograph=False,
            )
            self._recover_fn = function
        return function
