"""`unroll_fit_steps`: `model.fit` without tf_keras's per-function loop."""

from __future__ import annotations

import weakref

import tensorflow as tf
import tf_keras

from tf2sync._src import callbacks
from tf2sync._src import data_service
from tf2sync._src import keras_calls
from tf2sync._src import loops
from tf2sync._src import options as options_lib
from tf2sync._src.internals import cluster_coordinator
from tf2sync._src.internals import keras_training
from tf2sync._src.internals import patches
from tf2sync._src.internals import ps_strategy
from tf2sync._src.internals import ps_variables


def unroll_fit_steps(model, enabled: bool = True):
    """Sets whether `model.fit` repeats its steps in each function or loops.

    Under a ParameterServerStrategy, `fit` schedules one function per
    `steps_per_execution` steps, and tf_keras runs them in a `tf.range`
    loop. The loop's body runs on the worker and on the ps, so every
    iteration sends the loop's control to the ps on top of the step's own
    transfers. Repeating the step instead, each scheduled function runs
    tf_keras's own `train_step` in its graph (`jit_compile=True` is refused:
    XLA cannot read variables on the parameter servers),
    as `tf2sync.Trainer` does by default: up to 10 copies, and with a
    larger `steps_per_execution` a `tf.while_loop` runs groups of 10 and
    the rest follows unrolled. The same steps run in the same order. Two
    per-step costs go too: `_train_counter` (a ps variable) counts a
    function's steps once they all succeeded, and the sync counters
    (`sync_steps`, `stale_dropped`, ...) are read from the ps when the logs
    are fetched (at the end of an epoch, after its `join`: exact) rather
    than returned by every push. How much faster than tf_keras's loop:
    docs/performance.md, "Which option to pick".

    Under `tf2sync.SyncParameterServerStrategy`, `fit` does this by
    default (from its first call on the model), unless the model's class
    overrides `make_train_function` or this was called with
    `enabled=False`. Call it to choose: `enabled=False` keeps tf_keras's
    loop, for large models, where tracing time counts and the loop's cost
    does not. The cost of repeating: a larger function to set up (up to
    10 copies of the step), and the ps holds more of the step for each
    worker (the repeated pushes call one function, the rest is copied per
    step; docs/performance.md, "Memory").

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
    _check_arguments(model, enabled)
    keras_calls.install()  # fit's calls read their data handler there
    unrolled = getattr(model, "_tf2sync_unrolled", None)
    if not enabled:
        if unrolled:
            _restore_keras_loop(model)
        model._tf2sync_unrolled = False
        return model
    if unrolled:
        return model
    patches.unrolled_train_function.install(
        model,
        _repeating_make_train_function(model, model.make_train_function),
    )
    patches.exact_epoch_logs.install(model, _exact_epoch_logs(model))
    model.train_function = None  # made again, repeating its steps
    model._tf2sync_unrolled = True
    return model


def _check_arguments(model, enabled) -> None:
    """Raises `TypeError` for the arguments `unroll_fit_steps` refuses."""
    if not isinstance(model, tf_keras.Model):
        raise TypeError(
            "`model` must be a tf.keras.Model (tf_keras). Received: "
            f"model={model!r}"
        )
    if not isinstance(enabled, bool):
        raise TypeError(
            f"`enabled` must be True or False. Received: enabled={enabled!r}"
        )


def _restore_keras_loop(model) -> None:
    """Undoes `unroll_fit_steps(model)`: tf_keras's loop and log check."""
    patches.unrolled_train_function.uninstall(model)  # the class's methods
    patches.exact_epoch_logs.uninstall(model)  # again
    model.train_function = None


def _repeating_make_train_function(model, keras_make):
    """`model.make_train_function`, its functions repeating their steps.

    Args:
      model: The tf_keras model.
      keras_make: The model's own `make_train_function`, for `fit` without
        a `ClusterCoordinator`.

    Returns:
      `make_train_function(force=False)`, as tf_keras's.
    """

    def make_train_function(force=False):
        if model.train_function is not None and not force:
            return model.train_function
        coordinator = keras_training.model_coordinator(model)
        if coordinator is None:
            return keras_make(force=force)
        sync = _sync_optimizer(model)  # compile makes a new train function
        if sync is not None and model.built and model.trainable_variables:
            # Its slots now, eagerly: created by the first trace, they would
            # make tf.function trace the whole train function again.
            sync.build(model.trainable_variables)
        schedule = _scheduler(model, coordinator, sync)
        model.train_function = schedule
        return schedule

    return make_train_function


def _scheduler(model, coordinator, sync):
    """The train function `fit` calls: schedules a repeating function.

    Args:
      model: The tf_keras model.
      coordinator: The `ClusterCoordinator` that schedules the functions.
      sync: The model's `SyncOptimizer`, or None.

    Returns:
      `schedule(iterator)`, returning the scheduled function's logs (with
      the sync totals when `sync` is not None); its `functions` attribute
      holds the traced functions by steps.
    """
    functions = {}
    # One trace of the step for the functions of one kind (fit's of
    # several lengths: single steps, the full call, a split call's pieces).
    traces = {}
    # `(data handler, RemoteValue)`: the first call's first single step,
    # kept (where `loops.waits_for_first_step`) for the next call, which
    # waits for it if it traces a function in the same `fit`.
    first_step = []

    def key_of(steps, service):
        # One function per value, as fit's data handler counts them.
        # One function per pass object: its steps mark that one's passes.
        return steps if service is None else (steps, "pass", id(service))

    def function_of(steps, service):
        key = key_of(steps, service)
        function = functions.get(key)
        if function is None:
            shared = traces.setdefault(
                None if service is None else id(service), loops.StepTraces()
            )
            # As tf_keras's, it does not convert `train_step` (tf_keras's
            # code is not converted, nor tf2sync's: internals/autograph.py).
            function = tf.function(
                _unrolled(model, steps, service, shared), autograph=False
            )
            functions[key] = function
            model.train_tf_function = function  # TensorBoard's graph
        return function

    def schedule(iterator):
        handler = keras_calls.fit_data_handler(model)
        steps = _steps_of_call(model, handler)
        service = data_service.pass_of(handler)
        first = not functions
        pieces = [steps]
        if service is None and not _traces_before_dispatch(model):
            options = options_lib.of_strategy(model.distribute_strategy)
            pieces = _pieces(
                steps,
                handler,
                coordinator,
                first=first,
                group=options.max_unrolled_steps,
            )
        of_fit, waiting = first_step.pop() if first_step else (None, None)
        if (
            waiting is not None
            and of_fit is handler
            and any(key_of(p, service) not in functions for p in pieces)
        ):
            loops.wait_for_first_step(waiting)
        functions_of_call = [function_of(piece, service) for piece in pieces]
        _plan(coordinator, functions_of_call, handler)
        scheduled = [
            coordinator.schedule(function, args=(iterator,))
            for function in functions_of_call
        ]
        if first and loops.waits_for_first_step(
            ps_strategy.cluster_resolver(model.distribute_strategy),
            len(scheduled),
        ):
            first_step.append((handler, scheduled[0]))
        logs = scheduled[-1]
        if not getattr(model, "_tf2sync_epoch_end_warm", False):
            _warm_epoch_end(model)
        return (
            logs if sync is None else callbacks.LogsWithSyncTotals(logs, sync)
        )

    schedule.functions = functions  # by steps (not tracked by Keras)
    return schedule


def _pieces(steps, handler, coordinator, first, group) -> list:
    """The steps of the functions that run a call of `steps`.

    The first call of the model's train function (`first`: no function
    traced yet; the first `fit` after `compile`) runs as single-step
    functions where `loops.starts_on_single_steps` says so (`group`:
    `SyncOptions.max_unrolled_steps`); the first epoch then ends about
    when it did.

    A call of fewer steps than `steps_per_execution` is an epoch's last, or
    every call when an epoch is shorter than `steps_per_execution` (which
    tf_keras then lowers for the whole `fit`):

    - An epoch's last call, its steps within one group, runs as single-step
      functions: the workers set up the one-step function once (the first
      call's, where it ran on single steps) and no function of the last
      call's length, which the first epoch would wait for. It trades a
      one-off set-up, which grows with the model, for a few dispatches per
      epoch (docs/benchmarks.md, "Measurements behind the code").
    - Otherwise the call is split over the workers: its steps run side by
      side rather than on one worker while the others wait for the epoch's
      end. E.g. 6 steps on 2 workers: 3 + 3; 7: 4 + 3.

    The same steps run, each once.
    """
    full = getattr(handler, "_tf2sync_steps_per_execution", None)
    short = full is not None and steps < full
    position = keras_training.fit_epoch_position(handler)
    epochs_last = short and position is not None and position[1] > steps
    if (first or epochs_last) and loops.starts_on_single_steps(steps, group):
        return [1] * steps
    workers = len(cluster_coordinator.coordinator_workers(coordinator))
    if not short or steps < 2 or workers < 2:
        return [steps]
    size = -(-steps // min(workers, steps))
    pieces = [size] * (steps // size)
    if steps % size:
        pieces.append(steps % size)
    return pieces


def _traces_before_dispatch(model) -> bool:
    """Whether the strategy's protocol is the TF1 shim's (its copies are
    ordered while traced: loops.repeat)."""
    protocol = getattr(model.distribute_strategy, "_protocol", None)
    return bool(getattr(protocol, "traces_before_dispatch", False))


def is_unrolled(model) -> bool:
    """Whether `fit` of `model` runs tf2sync's repeating train function."""
    return bool(getattr(model, "_tf2sync_unrolled", None))


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


def steps_per_execution_on_coordinator(model, handler) -> None:
    """Moves `model`'s `steps_per_execution` variable onto the coordinator.

    tf_keras makes it in `compile`, under the strategy scope: on a ps. Its
    data handler then reads it before every function `fit` schedules, a
    round trip from the coordinator to the ps each time, while no function
    on a worker reads it: tf2sync's repeat their steps a number of times
    fixed when traced, and tf_keras's loop takes the value as an argument,
    read when the function is scheduled. The same value in a variable of the
    coordinator takes those round trips off the ps and the coordinator
    (docs/benchmarks.md, "Measurements behind the code").
    `handler` is the data handler being built: it holds the variable too.
    With `steps_per_execution="auto"` the tuner holds it as well, and
    nothing moves.
    """
    variable = keras_training.steps_per_execution_variable(model)
    if variable is None or getattr(
        model, "autotune_steps_per_execution", False
    ):
        return
    # The value fit's calls have, but for an epoch's last (see `_pieces`):
    # the data handler sets the variable to fewer steps for that call.
    if handler is not None:
        handler._tf2sync_steps_per_execution = int(variable.numpy())
    if "/job:ps" not in (getattr(variable, "device", "") or ""):
        return
    here = ps_variables.plain_resource_variable(  # outside the strategy
        variable.numpy(), name="spe", dtype=tf.int64
    )
    # Not tracked: as tf_keras's own (see `_configure_steps_per_execution`).
    keras_training.set_steps_per_execution_variable(model, here)
    if keras_training.data_handler_steps_per_execution(handler) is variable:
        keras_training.set_data_handler_steps_per_execution(handler, here)


def _unrolled(model, steps, service=None, traces=None):
    """tf_keras's multi-step train function, its loop unrolled.

    `traces` (a `loops.StepTraces`) holds the step's trace for every
    function of the model's `fit` that shares it. With `service` (a
    `ServicePassPerEpoch`), a step runs only if its worker's iterator
    gives an element, and otherwise marks its pass ended and returns zeros
    of the step's outputs (`data_service`, 3.; `fit` takes an epoch's logs
    from the metrics after the join).
    """

    def run_step(data):
        return model.train_step(data)

    if model.jit_compile:
        run_step = tf.function(
            run_step, jit_compile=True, reduce_retracing=True
        )
    # Not a tf_keras `run_step` to the strategy (see
    # `keras_training.is_keras_train_step`): the sync counters join the logs
    # when they are fetched (`callbacks.LogsWithSyncTotals`), not from the
    # pushes.

    def train_function(iterator):
        def run(data):
            outputs = model.distribute_strategy.run(run_step, args=(data,))
            return keras_training.reduce_per_replica(
                outputs,
                model.distribute_strategy,
                model.distribute_reduction_method,
            )

        def step(_, iterator):
            if service is None:
                return run(next(iterator))
            element = iterator.get_next_as_optional()
            traced = []

            def run_element():
                traced.append(run(element.get_value()))
                return traced[0]

            def skip():  # traced after run_element: its outputs' structure
                if not traced:  # tf.cond traces the true branch first
                    raise RuntimeError("tf2sync: the step was not traced")
                with tf.control_dependencies([service.mark_ended()]):
                    return tf.nest.map_structure(_zeros_like_spec, traced[0])

            return tf.cond(element.has_value(), run_element, skip)

        options = options_lib.of_strategy(model.distribute_strategy)
        outputs = loops.repeat(
            step,
            steps,
            options.max_unrolled_steps,
            trace_once=not _traces_before_dispatch(model),
            inputs=(iterator,),
            traces=traces,
        )
        # As tf_keras, the steps count once they succeeded; one write to
        # the ps per function rather than per step (the counter is read
        # from the coordinator, between functions).
        with tf.control_dependencies(
            keras_training.minimum_control_deps(outputs)
        ):
            keras_training.train_counter(model).assign_add(steps)
        return outputs

    return train_function


def _zeros_like_spec(tensor):
    """Zeros of `tensor`'s static shape (an unknown dimension as 0)."""
    shape = tensor.shape
    dims = [] if shape.rank is None else [d or 0 for d in shape.as_list()]
    return tf.identity(tf.zeros(dims, tensor.dtype))


def _warm_epoch_end(model):
    """Reads the model's metrics once now, as `fit`'s first epoch end will.

    The first run of an op on another task can register a function with
    every task, which waits for a frozen worker (see liveness.py): run
    them while every worker answers, just after the first function is
    scheduled (its trace built the metrics).
    """
    model._tf2sync_epoch_end_warm = True
    try:
        model.get_metrics_result()
    except Exception:  # noqa: BLE001 - only a warm-up: the epoch end reports
        pass


_CALLED = weakref.WeakSet()  # fit data handlers that made a call


def _plan(coordinator, functions, handler):
    """Caps the run's updates at what its epochs planned
    (`SyncCoordinator.plan_epoch`), at each epoch's first call: a function
    re-run after a worker fault then adds no update. `functions` are the
    call's (more than one when it runs as single steps or is split over
    the workers: `_pieces`), all under the cap. A run resumed inside an
    epoch plans its steps left; a call whose epoch has no known length
    lifts the cap (nothing to plan from)."""
    if not hasattr(coordinator, "plan_epoch"):
        return
    if data_service.pass_of(handler) is not None:
        # Epochs of a data service pass have no known length, and a
        # re-run function reads new elements.
        coordinator.lift_plan()
        return
    position = keras_training.fit_epoch_position(handler)
    if handler is not None and position is not None and position[1]:
        first, steps = position
        resumed = first and handler not in _CALLED  # nothing in flight
        if first == 0 or resumed:
            coordinator.plan_epoch(functions[0], steps - first, handler)
        _CALLED.add(handler)
        if coordinator.in_plan(handler):
            for function in functions:
                coordinator.planned(function)
            return
    # Also after plan_epoch without a SyncOptimizer: nothing was planned.
    coordinator.lift_plan()


def _steps_of_call(model, handler=None):
    """The steps of the train function `fit` is calling now.

    `fit`'s data handler sets them (`step_increment + 1`: the
    `steps_per_execution` it read, or fewer for an epoch's last call) just
    before the call. Reading them there saves a round trip to the ps per
    function; outside `fit` (or if tf_keras renamed them) the model's
    `steps_per_execution` variable is read, as tf_keras's function does.
    """
    if handler is None:
        handler = keras_calls.fit_data_handler(model)
    increment = getattr(handler, "step_increment", None)
    if isinstance(increment, int) and increment >= 0:
        return increment + 1
    return int(keras_training.steps_per_execution_variable(model).numpy())


def _exact_epoch_logs(model):
    """tf_keras's end-of-epoch check of the logs, blind to the sync counters.

    Under a ClusterCoordinator, tf_keras replaces an epoch's logs with the
    model's metrics read after the epoch's `join` (exact) only when the logs
    hold exactly the metrics' keys; otherwise it warns ("Could not get Model
    metric results") and keeps the last function's logs. The sync counters
    are exact already, so they are set aside for the check and put back.
    """
    keras_validate = keras_training.epoch_logs_validator(model)

    def validate(logs):
        if not isinstance(logs, dict):
            return keras_validate(logs)
        sync = {k: v for k, v in logs.items() if callbacks.is_sync_total(k)}
        result = keras_validate(
            {k: v for k, v in logs.items() if k not in sync}
        )
        return dict(result, **sync) if isinstance(result, dict) else result

    return validate


def _sync_optimizer(model):
    """The model's `SyncOptimizer` (under loss scaling too), or None."""
    try:
        return callbacks.find_sync_optimizer(model.optimizer)
    except ValueError:
        return None
