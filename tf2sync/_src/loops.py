"""Repeating a training step inside one scheduled function.

A function that runs several steps in a `tf.while_loop` pays for the loop on
every iteration: the loop's body has ops on the worker and on the ps, and TF
sends the loop's control from one to the other each time round. Repeating
the step in the traced graph (a Python loop, unrolled when traced) removes
those transfers, but traces the step once per copy. `repeat` does both: it
repeats the step in groups of at most `group` copies, and loops over the
groups when there are more steps than one group holds. The group size
callers use when the user does not choose is
`tf2sync.SyncOptions.max_unrolled_steps`.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

_TRACING = threading.local()


def repeating() -> bool:
    """Whether the step being traced is one of several copies in a graph.

    True inside `repeat` with at least 2 copies per group. The aggregator
    then makes every push a call of one ps function, so that the ps
    instantiates it once per worker rather than once per copy.
    """
    return getattr(_TRACING, "repeating", False)


@contextlib.contextmanager
def _copies():
    previous = repeating()
    _TRACING.repeating = True
    try:
        yield
    finally:
        _TRACING.repeating = previous


def repeat(step, steps: int, group: int, carry=None):
    """Runs `carry = step(carry)` `steps` times in the function being traced.

    The steps run in order. Up to `group` consecutive steps are copies in
    the graph; with more steps than that, a `tf.while_loop` runs the whole
    groups and the remainder follows, unrolled. `group=1` is a plain
    `tf.while_loop` of single steps; `group >= steps` repeats every step in
    the graph (no loop).

    Args:
      step: `step(carry) -> carry`, tracing one step.
      steps: Steps to run, >= 1.
      group: Most copies of the step per loop iteration, >= 1.
      carry: The initial carry (tensors, fixed shapes). None: the first
        group runs before the loop and its result gives the carry (as
        tf_keras's loop runs its first step before looping).

    Returns:
      The carry after the last step.
    """
    group = max(1, min(group, steps))
    with _copies() if group > 1 else contextlib.nullcontext():
        return _repeat(step, steps, group, carry)


def _repeat(step, steps, group, carry):
    groups, rest = divmod(steps, group)

    def run_group(value):
        for _ in range(group):
            value = step(value)
        return value

    if carry is None:
        carry = run_group(carry)
        groups -= 1
    if groups == 1:
        carry = run_group(carry)
    elif groups > 1:
        _, carry = tf.while_loop(
            lambda i, _: i < groups,
            lambda i, value: (i + 1, run_group(value)),
            (tf.constant(0), carry),
        )
    for _ in range(rest):
        carry = step(carry)
    return carry
