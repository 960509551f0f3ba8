"""AutoGraph: what it converts of tf2sync's code and the user's.

Part of `tf2sync._src.tf_internals`, the one door to private TensorFlow
and tf_keras API: see its docstring for the version tags.
"""

from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.python.autograph.core import ag_ctx as autograph_ctx
from tensorflow.python.autograph.core import config as autograph_config
from tensorflow.python.autograph.core import converter as autograph_converter

# AutoGraph [2.21] [2.15] ---------------------------------------------------
# AutoGraph converts every function a converted function calls, except those
# of modules on its list (tensorflow, tf_keras, numpy, ...). tf2sync's code
# runs inside the user's traced step (its `strategy.run`, its optimizer's
# `apply_gradients`), so without a place on that list AutoGraph rewrote
# tf2sync's Python, and ran its loops over a step's ops through its
# operators, on every first trace: most of a small model's trace
# (docs/performance.md, "Time to the first update"). There is no public API
# to add a module to the list (`tf.autograph.experimental.do_not_convert`
# marks one function, and turns conversion off for whatever it calls).


def skip_autograph_for_tf2sync() -> None:
    """Puts the `tf2sync` package on AutoGraph's do-not-convert list
    (`config.CONVERSION_RULES`, read at each call), once.

    As for TensorFlow's own code, a function of tf2sync called from
    converted code then runs as written, and the user's functions it calls
    are converted only where tf2sync converts them explicitly
    (`convert_as_caller`), as `tf.distribute.Strategy.run` does.
    """
    rule = autograph_config.DoNotConvert("tf2sync")
    rules = autograph_config.CONVERSION_RULES
    if not any(
        isinstance(r, type(rule)) and r._prefix == "tf2sync" for r in rules
    ):
        autograph_config.CONVERSION_RULES = (rule,) + tuple(rules)


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
