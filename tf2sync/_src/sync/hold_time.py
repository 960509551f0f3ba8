"""A probe of how long pushes hold the global step's critical section.

For benchmarks (`benchmarks/ps_scaling.py`), off by default: `enable()`
before a strategy is created makes every `aggregation.Aggregator` created
after it time each body it runs inside its critical section (the one-ps
push, the scale-out commit and the finalize) with two `tf.timestamp` ops
inside the section, and add the seconds and the count to two variables on
its ps. Reading them costs one call; running the probe costs two
timestamps and two adds per hold, inside the section.
"""

from __future__ import annotations

import tensorflow as tf

from tf2sync._src import wire as wire_lib

_ENABLED = [False]


def enable(on: bool = True) -> None:
    """Probes aggregators created from now on (`on=False`: stops)."""
    _ENABLED[0] = bool(on)


def enabled() -> bool:
    return _ENABLED[0]


class HoldProbe:
    """Seconds and count of the holds of one critical section, by kind
    ("push": the one-ps push or the scale-out commit; "finalize")."""

    KINDS = ("push", "finalize")

    def __init__(self, device, name):
        self.seconds = wire_lib.ps_variable(
            tf.zeros([len(self.KINDS)], tf.float64), device, name + "_hold_s"
        )
        self.holds = wire_lib.ps_variable(
            tf.zeros([len(self.KINDS)], tf.int64), device, name + "_holds"
        )

    def timed(self, kind, body):
        """`body` as a function whose run inside the section is timed."""
        index = self.KINDS.index(kind)

        def run():
            start = tf.timestamp()
            out = body()
            with tf.control_dependencies(tf.nest.flatten(out)):
                held = tf.timestamp() - start
            adds = [
                self.seconds.scatter_add(_one(held, index)),
                self.holds.scatter_add(_one(tf.constant(1, tf.int64), index)),
            ]
            with tf.control_dependencies(adds):
                return tf.nest.map_structure(tf.identity, out)

        return run

    def read(self) -> dict:
        """`{kind: (holds, mean seconds per hold)}`, eagerly."""
        seconds = self.seconds.numpy()
        holds = self.holds.numpy()
        return {
            kind: (int(holds[i]), float(seconds[i]) / max(1, int(holds[i])))
            for i, kind in enumerate(self.KINDS)
        }


def _one(value, index):
    return tf.IndexedSlices(tf.reshape(value, [1]), tf.constant([index]))
