"""`unroll_fit_steps`: `model.fit` without tf_keras's per-function loop."""

from __future__ import annotations

import tensorflow as tf
import tf_keras
from tf_keras.src.engine import training as keras_training

from tf2sync._src import loops


def unroll_fit_steps(model, enabled: bool = True):
    """Sets whether `model.fit` repeats its steps in each function or loops.

    Under a ParameterServerStrategy, `fit` schedules one function per
    `steps_per_execution` steps, and tf_keras runs them in a `tf.range`
    loop. The loop's body runs on the worker and on the ps, so every
    iteration sends the loop's control to the ps on top of the step's own
    transfers. Repeating the step instead, each scheduled function runs
    tf_keras's own step (`train_step`, the `_train_counter` increment,
    `jit_compile`) in its graph, as `tf2sync.Trainer` does by default: up
    to 10 copies, and with a larger `steps_per_execution` a
    `tf.while_loop` runs groups of 10 and the rest follows unrolled. The
    same steps run in the same order, with the same logs. On the w1 MLP
    (2 workers + 1 ps, 2 cores) `fit` measured ~1.7 x the examples per
    second (`docs/performance.md`).

    Under `tf2sync.SyncParameterServerStrategy`, `fit` does this by
    default (from its first call on the model), unless the model's class
    overrides `make_train_function` or this was called with
    `enabled=False`. Call it to choose: `enabled=False` keeps tf_keras's
    loop, for large models, where tracing time counts and the loop's cost
    does not. The cost of repeating: tracing takes up to 10 times longer (a
    ResNet-50 step: ~10 s instead of ~2 s to the first call), and the ps
    holds more of the step for each worker (the repeated pushes call one
    function, the rest is copied per step: on the w3 embedding, ~7.6 MB
    more per worker than stock PSS at 10 steps, ~3 MB in a loop).

    Only `fit` through a `ClusterCoordinator` changes: without one (no
    ParameterServerStrategy), `fit` runs tf_keras's own function. Call it
    before or after `compile`; it lasts for the model's lifetime.

    Args:
      model: A `tf.keras.Model` (tf_keras).
      enabled: True repeats the steps; False restores tf_keras's loop.

    Returns:
      `model`.

    Raises:
      TypeError: If `model` is not a tf_keras `Model`, or `enabled` not a
        bool.
    """
    if not isinstance(model, tf_keras.Model):
        raise TypeError(
            "`model` must be a tf.keras.Model (tf_keras). Received: "
            f"model={model!r}"
        )
    if not isinstance(enabled, bool):
        raise TypeError(
            f"`enabled` must be True or False. Received: enabled={enabled!r}"
        )
    unrolled = getattr(model, "_tf2sync_unrolled", None)
    if not enabled:
        if unrolled:
            del model.make_train_function  # the class's method again
            model.train_function = None
        model._tf2sync_unrolled = False
        return model
    if unrolled:
        return model
    keras_make = model.make_train_function

    def make_train_function(force=False):
        if model.train_function is not None and not force:
            return model.train_function
        coordinator = model._cluster_coordinator
        if coordinator is None:
            return keras_make(force=force)
        functions = {}

        def schedule(iterator):
            # Read when scheduled, as tf_keras does (autotuning may change
            # it between calls); one function per value.
            steps = int(model._steps_per_execution.numpy())
            function = functions.get(steps)
            if function is None:
                function = tf.function(_unrolled(model, steps))
                functions[steps] = function
                model.train_tf_function = function  # TensorBoard's graph
            return coordinator.schedule(function, args=(iterator,))

        schedule.functions = functions  # by steps (not tracked by Keras)
        model.train_function = schedule
        return schedule

    model.make_train_function = make_train_function
    model.train_function = None  # made again, repeating its steps
    model._tf2sync_unrolled = True
    return model


def repeat_by_default(model) -> None:
    """`unroll_fit_steps(model)`, unless the user chose or customised.

    Called when `fit` under `tf2sync.SyncParameterServerStrategy` builds its
    input, before it makes its train function.
    """
    if (
        isinstance(model, tf_keras.Model)
        and getattr(model, "_tf2sync_unrolled", None) is None
        and type(model).make_train_function
        is tf_keras.Model.make_train_function
        and "make_train_function" not in vars(model)
    ):
        unroll_fit_steps(model)


def _unrolled(model, steps):
    """tf_keras's multi-step train function, its loop unrolled."""

    def run_step(data):
        outputs = model.train_step(data)
        # As tf_keras: count the step only if `train_step` succeeded.
        with tf.control_dependencies(
            keras_training._minimum_control_deps(outputs)
        ):
            model._train_counter.assign_add(1)
        return outputs

    if model.jit_compile:
        run_step = tf.function(
            run_step, jit_compile=True, reduce_retracing=True
        )
    # The strategy adds the sync counters to the logs of fit's steps only.
    run_step._tf2sync_keras_train_step = True

    def train_function(iterator):
        def step(_):
            data = next(iterator)
            outputs = model.distribute_strategy.run(run_step, args=(data,))
            return keras_training.reduce_per_replica(
                outputs,
                model.distribute_strategy,
                reduction=model.distribute_reduction_method,
            )

        return loops.repeat(step, steps, loops.MAX_UNROLLED_STEPS)

    return train_function
