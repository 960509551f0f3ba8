"""What `Trainer` and the launcher's chief need of their synchronous
optimizer, for either kind.

They train with a `tf2sync.SyncOptimizer` or with the TF1 shim
(`tf2sync.compat.v1.SyncReplicasOptimizer`). The two differ in where the
global step lives, how a step applies its gradients, what is counted and
how the step's copies are traced; `of(optimizer)` returns the one adapter
that says it, so neither has a branch on the kind.
"""

from __future__ import annotations

import tensorflow as tf

from tf2sync._src import callbacks as callbacks_lib
from tf2sync._src import compat_v1


class KerasSync:
    """A `tf2sync.SyncOptimizer` (or its loss-scale wrapper).

    Its global step is its `iterations`; a step's replicas (a worker's
    GPUs) are summed by the optimizer, so each replica's loss counts 1/n;
    its copies of a step are traced once (`loops.repeat`); the counters
    are read from the ps (`callbacks.sync_totals`).
    """

    tf1_order = False
    trace_once = True
    counts = True  # stale, accepted per worker, over the plan (`totals`)

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.global_step = None

    def build(self, strategy, model) -> None:
        """Every optimizer variable, eagerly under `strategy.scope()`."""
        with strategy.scope():
            self.optimizer.build(model.trainable_variables)

    def checkpointed(self) -> dict:
        """What a checkpoint holds besides model, optimizer and epoch."""
        return {}

    def replicas(self) -> int:
        """The replicas whose mean losses a worker's gradient sums."""
        return tf.distribute.get_replica_context().num_replicas_in_sync

    def apply(self, grads_and_vars) -> None:
        self.optimizer.apply_gradients(grads_and_vars)

    def begin(self) -> None:
        """Refuses a trainer whose optimizer a later one replaced, before
        anything (a checkpoint restore included) changes the model."""
        callbacks_lib.find_sync_optimizer(self.optimizer)._check_current()

    def step(self) -> int:
        """The global step (one variable read)."""
        return int(self._sync().iterations.numpy())

    def totals(self) -> dict:
        return callbacks_lib.sync_totals(self._sync())

    def end(self) -> None:
        """After a `train` call."""

    def _sync(self):
        return callbacks_lib.find_sync_optimizer(self.optimizer)


class Tf1Shim(KerasSync):
    """The TF1 shim: TF1's order (push, then token).

    Its global step is a variable the trainer creates (and checkpoints), as
    a TF1 program did; a step is one push of the worker whatever its
    replicas; its copies are traced one by one (each ordered by the token
    of the one before); TF1 counts nothing but steps; its token watchdog
    stops after each `train` (the next one starts it).
    """

    tf1_order = True
    trace_once = False
    counts = False  # TF1 counts its global step only

    def __init__(self, optimizer, global_step=None):
        super().__init__(optimizer)
        self.global_step = global_step

    def build(self, strategy, model) -> None:
        with strategy.scope():
            self.global_step = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="global_step"
            )

    def checkpointed(self) -> dict:
        return {"global_step": self.global_step}

    def replicas(self) -> int:
        return 1

    def apply(self, grads_and_vars) -> None:
        self.optimizer.apply_gradients(grads_and_vars, self.global_step)

    def begin(self) -> None:
        """Nothing to refuse: every shim optimizer of a strategy shares its
        one protocol (`engine.PushFirstStep.of`), so none replaces another."""

    def step(self) -> int:
        return int(self.global_step.numpy())

    def totals(self) -> dict:
        return {"sync_steps": self.step()}  # TF1 drops stale gradients

    def end(self) -> None:
        self.optimizer.make_session_run_hook(is_chief=True).end()


def of(optimizer, global_step=None):
    """The adapter of `optimizer` (checked by `trainer_checks` before).

    `global_step`: the TF1 shim's where it exists already (under `fit`,
    the compiled model's `optimizer.iterations`, which `fit` passes the
    shim); `Tf1Shim.build` makes one otherwise. A `SyncOptimizer`'s is
    its own `iterations`."""
    if isinstance(optimizer, compat_v1.SyncReplicasOptimizer):
        return Tf1Shim(optimizer, global_step)
    return KerasSync(optimizer)
