"""AutoGraph and `tf.function` of tf2sync's own code [2.21] [2.15].

AutoGraph converts every function a converted function calls, except those
of modules on its list (tensorflow, tf_keras, numpy, ...). tf2sync's code
runs inside the user's traced step (its `strategy.run`, its optimizer's
`apply_gradients`), so without a place on that list AutoGraph rewrote
tf2sync's Python, and ran its loops over a step's ops through its
operators, on every first trace: most of a small model's trace
(docs/performance.md, "Time to the first update"). There is no public API
to add a module to the list (`tf.autograph.experimental.do_not_convert`
marks one function, and turns conversion off for whatever it calls):
`patches.autograph_skips_tf2sync` adds `tf2sync` to it.
"""

from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.python.autograph.core import ag_ctx as autograph_ctx
from tensorflow.python.autograph.core import converter as autograph_converter


def function_of_tf2sync(fn):
    """`tf.function(fn)` for a function of tf2sync's own code.

    A top-level `tf.function` converts its function with AutoGraph even
    from a module on the do-not-convert list (0.12-0.17 s of the Trainer's
    first trace on w1). This one does not rewrite `fn`, but traces it under
    an ENABLED AutoGraph status (`ag_ctx.ControlStatusCtx`), as inside a
    converted function: the user's functions `fn` calls through
    `convert_as_caller` (or `Strategy.run`) are still converted.
    """

    def traced(*args):
        with autograph_ctx.ControlStatusCtx(
            status=autograph_ctx.Status.ENABLED,
            options=autograph_converter.ConversionOptions(
                recursive=True, user_requested=True
            ),
        ):
            return fn(*args)

    return tf.function(functools.wraps(fn)(traced), autograph=False)


def without_retracing_warning(function):
    """`function` (a `tf.function`) that never logs TF's "triggered
    tf.function retracing" warning (`_omit_frequent_tracing_warning`). TF
    counts traces per Python code object, so a closure made once per
    instance (each optimizer's counter read) would warn after five
    instances in a process, although each traces once [2.21] [2.15]."""
    function._omit_frequent_tracing_warning = True
    return function


def untraced_copy(function):
    """A copy of the `tf.function` `function` without its traces.

    `Function._clone(None)`: the same Python function and options
    (input signature, AutoGraph, XLA), an empty cache. There is no public
    way to trace a function anew: a call reuses any trace made in the same
    context (the same outermost graph, device and strategy scope), even
    one made while `tf2sync` state read at trace time (the scheduled
    worker's index) was different. Returns `function` itself if it has no
    such method [2.21]."""
    clone = getattr(function, "_clone", None)
    return function if clone is None else clone(None)


def convert_as_caller(fn):
    """`fn`, converted by AutoGraph iff the code calling tf2sync is.

    `tf.__internal__.autograph.tf_convert` with the caller's control
    status, as `tf.distribute.Strategy.run` converts the replica function
    it is given (a function of an unconverted module runs as written).
    """
    return tf.__internal__.autograph.tf_convert(
        fn,
        tf.__internal__.autograph.control_status_ctx(),
        convert_by_default=False,
    )
