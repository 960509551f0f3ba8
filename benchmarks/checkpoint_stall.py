"""What a save inside an epoch costs `fit` (issue 56: at most one step).

One in-process cluster (127.0.0.1, 1 ps, `--workers` workers), a workload
of `workloads.py` under `model.fit` with `steps_per_execution=10` (the
launcher's default), epochs run side by side: without saves inside the
epoch, with `tf2sync.SyncCheckpoint(every_steps=...)`, and with it
writing in the background, in turn, the first epoch of each kind dropped
(set-up). The stall per save is the extra epoch time over the saves it
made; it is reported beside a synchronous step's time (an epoch without
saves over its updates).

  python benchmarks/checkpoint_stall.py --workload=w3 --rounds=5
"""

from __future__ import annotations

import statistics
import tempfile
import time

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


class _EpochSeconds(tf.keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._began = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._began)


def _fit(model, data, saver):
    timer = _EpochSeconds()
    callbacks = [timer] + ([saver] if saver else [])  # timer first
    model.fit(
        data,
        epochs=1,
        steps_per_epoch=_STEPS.value,
        callbacks=callbacks,
        verbose=0,
    )
    return timer.seconds[0]


def main(argv):
    del argv
    workload, workers = _WORKLOAD.value, _WORKERS.value
    resolver = tf2sync.testing.local_cluster(workers, 1)
    strategy = tf2sync.SyncParameterServerStrategy(
        resolver, replicas_to_aggregate=workers
    )
    with strategy.scope():
        model = workloads.build_model(workload)
        model.compile(
            optimizer=tf2sync.SyncOptimizer(workloads.optimizer()),
            loss=workloads.keras_loss(workload),
            steps_per_execution=10,
        )
    batch = workloads.batch(workload)
    data = tf.keras.utils.experimental.DatasetCreator(
        lambda ctx: workloads.dataset(workload, batch)
    )
    saves = (_STEPS.value - 1) // _EVERY.value  # the epoch's end aside
    kinds = {"no saves": None, "saves": False, "background saves": True}
    seconds = {kind: [] for kind in kinds}
    for i in range(_ROUNDS.value + 1):
        for kind, background in kinds.items():
            # A new directory each time: a saver resumes from its newest.
            saver = background is not None and tf2sync.SyncCheckpoint(
                tempfile.mkdtemp(),
                every_steps=_EVERY.value,
                background=background,
            )
            took = _fit(model, data, saver)
            if i:  # the first of each kind sets up
                seconds[kind].append(took)
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
        print(
            f"{kind}: epoch {median[kind]:.3f} s, stall per save "
            f"{stall * 1000:.1f} ms = {stall / step_s:.2f} steps"
        )


if __name__ == "__main__":
    app.run(main)
