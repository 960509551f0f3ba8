"""What a save inside an epoch costs `fit` (issue 56: at most one step);
the method: docs/benchmarks.md#checkpoint-stall.

  python benchmarks/checkpoint_stall.py --workload=w3 --rounds=5
"""

from __future__ import annotations

import statistics
import tempfile
import time

import systems
import tensorflow as tf
import workloads  # sets TF_USE_LEGACY_KERAS before tf.keras is read
from absl import app
from absl import flags

import tf2sync

_WORKLOAD = flags.DEFINE_string("workload", "w3", "A workloads.py model.")
_WORKERS = flags.DEFINE_integer("workers", 2, "Workers (1 ps).")
_STEPS = flags.DEFINE_integer("steps", 400, "Steps per epoch (all workers).")
_EVERY = flags.DEFINE_integer("every_steps", 100, "Steps between saves.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Epochs of each kind measured.")


class _TimedCheckpoint(tf2sync.SyncCheckpoint):
    """Adds up the seconds its saves inside the epoch take after their
    join (the join drains steps already scheduled, which still run):
    workers idle meanwhile. Apart from the CPU a background write takes
    from the steps on shared cores."""

    paused = 0.0

    def _save(self, suffix):
        began = time.perf_counter()
        path = super()._save(suffix)
        if "_" in suffix:  # inside the epoch
            self.paused += time.perf_counter() - began
        return path


def _fit(model, data, saver):
    """The seconds of one epoch of `fit`, with `saver` if not None."""
    timer = systems.EpochTimer(0)
    callbacks = [timer] + ([saver] if saver else [])
    model.fit(
        data, steps_per_epoch=_STEPS.value, callbacks=callbacks, verbose=0
    )
    return timer.seconds


def main(argv):
    del argv
    workload, workers = _WORKLOAD.value, _WORKERS.value
    resolver = tf2sync.testing.local_cluster(workers, 1)
    strategy = tf2sync.SyncParameterServerStrategy(
        resolver, replicas_to_aggregate=workers
    )
    with strategy.scope():
        model = workloads.build_model(workload)
        opt = tf2sync.SyncOptimizer(workloads.optimizer())
        loss = workloads.keras_loss(workload)
        model.compile(opt, loss, steps_per_execution=10)
    batch = workloads.batch(workload)
    data = tf.keras.utils.experimental.DatasetCreator(
        lambda ctx: workloads.dataset(workload, batch)
    )
    saves = (_STEPS.value - 1) // _EVERY.value  # the epoch's end aside
    kinds = {"no saves": None, "saves": False, "background saves": True}
    seconds = {kind: [] for kind in kinds}
    paused = {kind: [] for kind in kinds}
    for i in range(_ROUNDS.value + 1):
        for kind, background in kinds.items():
            # A new directory each time: a saver resumes from its newest.
            saver = background is not None and _TimedCheckpoint(
                tempfile.mkdtemp(),
                every_steps=_EVERY.value,
                background=background,
            )
            took = _fit(model, data, saver)
            if i:  # the first of each kind sets up
                seconds[kind].append(took)
                paused[kind].append(saver.paused / saves if saver else 0.0)
    median = {kind: statistics.median(s) for kind, s in seconds.items()}
    plain_s = median["no saves"]
    step_s = plain_s / (_STEPS.value / workers)  # rta = workers
    print(
        f"{workload}, {workers} workers, {_STEPS.value} steps/epoch, a save "
        f"every {_EVERY.value} ({saves} an epoch); medians of "
        f"{_ROUNDS.value} epochs; synchronous step {step_s * 1000:.1f} ms"
    )
    for kind in kinds:
        stall = (median[kind] - plain_s) / saves
        pause = statistics.median(paused[kind])
        print(
            f"{kind}: epoch {median[kind]:.3f} s, stall per save "
            f"{stall * 1000:.1f} ms = {stall / step_s:.2f} steps; idle after "
            f"the join {pause * 1000:.1f} ms a save = "
            f"{pause / step_s:.2f} steps"
        )


if __name__ == "__main__":
    app.run(main)
