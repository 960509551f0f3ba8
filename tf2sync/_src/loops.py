"""Repeating a training step inside one scheduled function.

A function that runs several steps in a `tf.while_loop` pays for the loop on
every iteration: the loop's body has ops on the worker and on the ps, and TF
sends the loop's control from one to the other each time round. Repeating
the step in the graph removes those transfers. `repeat` does both: it
repeats the step in groups of at most `group` copies, and loops over the
groups when there are more steps than one group holds. The group size
callers use when the user does not choose is
`tf2sync.SyncOptions.max_unrolled_steps`.

The step's Python runs once: it is traced as a function of its own, and
each copy in the graph is a copy of that function's ops
(`tf_internals.inline_copy`), the same ops a new trace would make. A call
of the function instead would run slower (TF calls it at every step rather
than inlining it: 0.70-0.76 x the examples/s on w1 and w3), and tracing
the step again per copy costs a step's trace per copy
(docs/performance.md, "Time to the first update").
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from tf2sync._src import tf_internals

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


def repeat(step, steps: int, group: int, carry=None, trace_once=True):
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
      carry: The initial carry (tensors, fixed shapes). None: the step
        ignores its carry (it is given None each time) and the result is
        the last step's; the first group runs before the loop, whose carry
        is that group's result (as tf_keras's loop runs its first step
        before looping).
      trace_once: Whether copies copy one trace of the step's graph
        (see the module docstring) rather than tracing its Python again.
        The TF1 shim's steps are traced per copy: each copy's ops follow
        the previous copy's token, which the shim wires while tracing. A
        step whose graph copies would differ from new traces
        (`tf_internals.copies_like_traces`: per-worker resources, seeded
        random ops) is traced per copy too.

    Returns:
      The carry after the last step.
    """
    group = max(1, min(group, steps))
    if group == 1:  # the loop's body is traced once anyway
        return _repeat(step, steps, group, carry)
    with _copies():
        if trace_once:
            once = _TracedOnce(step, carry)
            if once.copies_like_traces:
                step = once
        return _repeat(step, steps, group, carry)


class _TracedOnce:
    """`step`, traced once (now, in the current graph); each call copies
    the traced graph into the graph being built."""

    def __init__(self, step, carry):
        self._ignores_carry = carry is None
        # Traced with AutoGraph as the enclosing function is (a function
        # traced without it would turn it off for the step's callees).
        step = tf_internals.convert_as_caller(step)
        if self._ignores_carry:
            function = tf.function(lambda: step(None), autograph=False)
            self._concrete = function.get_concrete_function()
        else:
            function = tf.function(step, autograph=False)
            self._concrete = function.get_concrete_function(carry)
        self._copies = 0
        # Else each copy traces the step again (see `tf_internals`).
        self.copies_like_traces = tf_internals.copies_like_traces(
            self._concrete
        )

    def __call__(self, carry):
        self._copies += 1
        args = () if self._ignores_carry else (carry,)
        return tf_internals.inline_copy(
            self._concrete, args, f"step_{self._copies}"
        )


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
