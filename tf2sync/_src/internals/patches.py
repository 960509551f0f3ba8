"""Every runtime patch tf2sync installs into TensorFlow or tf_keras.

A patch replaces what TF or tf_keras code looks up: a function of a
module, a method of a class, a method of one object (an instance attribute
shadowing its class's, or replacing the object's own), or the class of an
object. Only this module makes such a replacement (`tests/patches_test.py`
scans tf2sync's source for one elsewhere). Each patch has an idempotent
`install` (twice is once) and an `uninstall` that puts back the very
objects it replaced, and says what it replaces (`replaces`), why (`why`),
the versions it was checked on (`versions`, tagged as in the package's
docstring) and where tf2sync installs it (`where`). `REGISTRY` names them
all.

Not patches, and left to the modules that read the same state: writes of
TF's or tf_keras's own private data as they write it themselves (a read
cache emptied, the variable behind `steps_per_execution`,
`_being_scheduled` around a trace, a loss copy's
`_allow_sum_over_batch_size`, a remote value's type spec, a
`tf.function`'s retracing-warning flag), and tf2sync's own `_tf2sync_*`
marks on TF objects.
"""

from __future__ import annotations

import weakref

import tf_keras
from tensorflow.python.autograph.core import config as autograph_config
from tf_keras.src.engine import base_layer as keras_base_layer
from tf_keras.src.mixed_precision import autocast_variable
from tf_keras.src.mixed_precision import loss_scale_optimizer as lso

from tf2sync._src.internals import checkpoints
from tf2sync._src.internals import closures
from tf2sync._src.internals import cluster_coordinator
from tf2sync._src.internals import keras_fit
from tf2sync._src.internals import keras_saving
from tf2sync._src.internals import mixed_precision
from tf2sync._src.internals import patch_kinds
from tf2sync._src.internals import ps_variables

# When a SyncParameterServerStrategy is made ------------------------------


def _with_tf2sync_rule(current):
    rule = autograph_config.DoNotConvert("tf2sync")
    (rules,) = current
    if any(isinstance(r, type(rule)) and r._prefix == "tf2sync" for r in rules):
        return [rules]
    return [(rule,) + tuple(rules)]


autograph_skips_tf2sync = patch_kinds.GlobalPatch(
    "autograph_skips_tf2sync",
    [(autograph_config, "CONVERSION_RULES")],
    _with_tf2sync_rule,
    replaces="tensorflow.python.autograph.core.config.CONVERSION_RULES",
    why="""Puts the `tf2sync` package on AutoGraph's do-not-convert list
    (`config.CONVERSION_RULES`, read at each call), once (see
    `internals.autograph`). As for TensorFlow's own code, a function of
    tf2sync called from converted code then runs as written, and the
    user's functions it calls are converted only where tf2sync converts
    them explicitly (`convert_as_caller`), as `tf.distribute.Strategy.run`
    does.""",
    versions="[2.21] [2.15]",
    where="first_use.install(), from SyncParameterServerStrategy.__init__",
)

loss_scaling_predicate = patch_kinds.GlobalPatch(
    "loss_scaling_predicate",
    [(lso, "strategy_supports_loss_scaling")],
    lambda current, predicate: [predicate],
    replaces="tf_keras.src.mixed_precision.loss_scale_optimizer."
    "strategy_supports_loss_scaling",
    why="""Makes tf_keras ask `predicate()` whether the strategy in scope
    supports loss scaling, before it builds a mixed_float16 layer or a
    loss-scale optimizer (it looks the function up at each call): tf_keras
    refuses loss scaling under PSS, with no hook (`loss_scale`).""",
    versions="[2.21] [2.15: kept]",
    where="first_use.install(), from SyncParameterServerStrategy.__init__",
)


# When a SyncParameterServerStrategy is made with a variable_partitioner ----

sharded_autocast = patch_kinds.GlobalPatch(
    "sharded_autocast",
    [(autocast_variable, "create_autocast_variable")],
    lambda current: [mixed_precision.create_autocast_sharded],
    replaces="tf_keras.src.mixed_precision.autocast_variable."
    "create_autocast_variable",
    why="""Lets a mixed_float16 layer create a sharded weight. tf_keras
    wraps each float weight of such a layer in an `AutoCastVariable`
    (`autocast_variable.create_autocast_variable`, looked up at each call
    by `Layer.add_weight`), which refuses a `ShardedVariable` (tf_keras
    2.21 fails so under stock PSS too). Once installed, a
    `ShardedVariable` becomes a `ShardedVariable` of autocast shards: each
    shard reads as float16 in the layer's compute, stays float32 on its
    ps, and is a variable of its own to the optimizer and to tf2sync.
    Other variables are wrapped as before.""",
    versions="[2.21] [2.15: kept]",
    where="strategy.SyncParameterServerStrategy.__init__, given a "
    "variable_partitioner",
)

h5_refuses_sharded = patch_kinds.GlobalPatch(
    "h5_refuses_sharded",
    [(tf_keras.Model, "save"), (tf_keras.Model, "save_weights")],
    lambda current, wrap: [
        wrap(current[0], "save"),
        wrap(current[1], "save_weights"),
    ],
    replaces="tf_keras.Model.save and tf_keras.Model.save_weights",
    why="""Refuses HDF5 for a model with sharded variables, in one line
    naming the formats that work (`sharding.refusing_h5`): tf_keras's h5
    writer stores each shard as a weight of its own, so the file saved
    without a word and failed to load into any other sharding ("Weight
    count mismatch"). Other models and formats save as before.""",
    versions="[2.21]",
    where="strategy.SyncParameterServerStrategy.__init__, given a "
    "variable_partitioner",
)

nested_array_inputs = patch_kinds.GlobalPatch(
    "nested_array_inputs",
    [(keras_fit.coordinator_handler_class(), "_convert_to_dataset_creator")],
    lambda current: [keras_fit.nested_arrays_converter(current[0])],
    replaces="tf_keras.src.engine.data_adapter."
    "_ClusterCoordinatorDataHandler._convert_to_dataset_creator",
    why="""Lets `fit`, `evaluate` and `predict` under a ParameterServerStrategy
    take dicts, lists and tuples of arrays, as they take one array: tf_keras
    turns one array into a `DatasetCreator` of its one-machine adapter and
    refuses the others with a `NotImplementedError`, though its adapters
    read them (`keras_fit.nested_arrays_converter`).""",
    versions="[2.21]",
    where="fit_inputs.install(), from fit_hooks.install() (a "
    "SyncParameterServerStrategy's __init__)",
)

keras_calls = patch_kinds.GlobalPatch(
    "keras_calls",
    [(tf_keras.Model, name) for name in ("fit", "evaluate", "predict")],
    lambda current, wrap: [
        wrap(name, method)
        for name, method in zip(("fit", "evaluate", "predict"), current)
    ],
    replaces="tf_keras.Model.fit, tf_keras.Model.evaluate and "
    "tf_keras.Model.predict",
    why="""`install(wrap)`: each of them becomes `wrap(name, method)`
    (`keras_calls.method`), which records the call it runs (which one,
    the model, its arguments) for as long as it runs, for every model:
    tf_keras's data handlers call the coordinator without saying for
    which call. Under a `SyncParameterServerStrategy` the input hooks
    `fit_inputs` registers rewrite the arguments of `fit` and `evaluate`
    first (`steps_per_epoch` derived from arrays, finite evaluation data
    read by tf_keras's exact evaluation); other models call tf_keras's
    methods with their own arguments.""",
    versions="[2.21]",
    where="keras_calls.install(), from fit_inputs.install() (fit_hooks's, "
    "from a SyncParameterServerStrategy's __init__) and "
    "unrolled_fit.unroll_fit_steps",
)

data_handler_context = patch_kinds.GlobalPatch(
    "data_handler_context",
    [(keras_fit.coordinator_handler_class(), "__init__")],
    lambda current, wrap: [wrap(current[0])],
    replaces="tf_keras.src.engine.data_adapter."
    "_ClusterCoordinatorDataHandler.__init__",
    why="""`install(wrap)`: the handler's `__init__` becomes `wrap(it)`
    (`keras_calls.handler_init`), which records the handler being built
    (its exact evaluation subclass's too, whose `__init__` calls it) for
    as long as it builds, and marks the first one a `fit` builds as its
    training data handler. The handler builds its per-worker dataset in
    `__init__` through the coordinator, which reads the record rather than
    the call stack.""",
    versions="[2.21]",
    where="keras_calls.install(), from fit_inputs.install() (fit_hooks's, "
    "from a SyncParameterServerStrategy's __init__) and "
    "unrolled_fit.unroll_fit_steps",
)

whole_weights_in_keras_files = patch_kinds.GlobalPatch(
    "whole_weights_in_keras_files",
    [
        (keras_base_layer.Layer, "save_own_variables"),
        (keras_base_layer.Layer, "load_own_variables"),
    ],
    lambda current: [
        keras_saving.save_own_variables,
        keras_saving.load_own_variables,
    ],
    replaces="tf_keras.src.engine.base_layer.Layer.save_own_variables and "
    ".load_own_variables",
    why="""Makes the `.keras` format save a sharded weight whole. tf_keras's
    `Layer.save_own_variables` (and `load_own_variables`) store
    `layer.weights` one entry each, and a layer lists a sharded weight as
    its shards: a `.keras` file of a model with 3 shards would load only
    into a model with 3 shards (no other file of tf_keras splits a
    weight). Once installed, a layer with sharded weights stores each
    whole (its shards concatenated) and loads it into however many shards
    it has, 1 included; other layers are saved as before.""",
    versions="[2.21] [2.15: kept]",
    where="strategy.SyncParameterServerStrategy.__init__, given a "
    "variable_partitioner",
)


# Class swaps ----------------------------------------------------------------


class _ReadCacheSwap(patch_kinds.Patch):
    """`install(var)`, `uninstall(var)`: `var` is a `CachingVariable`, or
    the `AggregatingVariable` PSS wraps around one on workers with several
    GPUs (its reads go through the cache it wraps); any other variable is
    left alone."""

    kind = "class swap"

    @staticmethod
    def _cache(var):
        if isinstance(var, ps_variables.AggregatingVariable):
            return var.get()
        return var

    def is_installed(self, var) -> bool:
        return type(self._cache(var)) is ps_variables.PerGraphCachingVariable

    def install(self, var) -> None:
        var = self._cache(var)
        if type(var) is ps_variables.CachingVariable:
            var.__class__ = ps_variables.PerGraphCachingVariable

    def uninstall(self, var) -> None:
        var = self._cache(var)
        if type(var) is ps_variables.PerGraphCachingVariable:
            var.__class__ = ps_variables.CachingVariable


per_graph_read_cache = _ReadCacheSwap(
    "per_graph_read_cache",
    replaces="the class of a variable PSS's creator makes "
    "(tensorflow.python.distribute.ps_values.CachingVariable)",
    why="""Makes PSS's read cache of a variable graph-aware: see
    `ps_variables.PerGraphCachingVariable` (a class swap: PSS's creator
    builds the wrapper with no way to choose its class).""",
    versions="[2.21] [2.15: kept]",
    where="strategy._SyncExtended._create_variable, each variable (each "
    "shard) the strategy creates",
)


class _ExtendedClassSwap(patch_kinds.Patch):
    """`install(strategy, cls)`: makes `strategy.extended` a `cls`, a
    subclass of its class (else `TypeError`); `uninstall(strategy)` gives
    it back the class it had."""

    kind = "class swap"

    def __init__(self, name, **info):
        super().__init__(name, **info)
        self._before = weakref.WeakKeyDictionary()  # extended -> its class

    def is_installed(self, strategy) -> bool:
        return strategy.extended in self._before

    def install(self, strategy, cls) -> None:
        extended = strategy.extended
        if not issubclass(cls, type(extended)):
            raise TypeError(f"{cls!r} does not subclass {type(extended)}")
        if type(extended) is not cls:
            self._before.setdefault(extended, type(extended))
            extended.__class__ = cls

    def uninstall(self, strategy) -> None:
        extended = strategy.extended
        before = self._before.pop(extended, None)
        if before is not None:
            extended.__class__ = before


extended_class = _ExtendedClassSwap(
    "extended_class",
    replaces="the class of a PSS's `strategy.extended` "
    "(ps_strategy.ParameterServerExtended)",
    why="""PSS's `__init__` builds `strategy.extended` with no way to choose
    its class; tf2sync's subclass overrides its `_create_variable`,
    `_update` and `_experimental_distribute_dataset` hooks.""",
    versions="[2.21] [2.15: kept]",
    where="strategy.SyncParameterServerStrategy.__init__",
)


# The coordinator's workers and queue ----------------------------------------


worker_failure_hook = patch_kinds.ObjectPatch(
    "worker_failure_hook",
    "_on_closure_failure",
    cluster_coordinator.hooked_closure_failure,
    objects=cluster_coordinator.coordinator_workers,
    replaces="cluster_coordinator.Worker._on_closure_failure, per worker",
    why="""`install(coordinator, callback)`: calls `callback(worker_index,
    error)` when a worker fails a closure. PSS tells nobody: its
    `Worker._on_closure_failure` (run once the failure handler has
    classified the error as a worker failure, before it waits for the
    worker to come back) puts the closure back. Wrapped per worker
    instance, after the closure is back in the queue.""",
    versions="[2.21] [2.15: kept]",
    where="coordinator.SyncCoordinator.__init__",
)


function_error_hook = patch_kinds.ObjectPatch(
    "function_error_hook",
    "mark_failed",
    cluster_coordinator.hooked_mark_failed,
    objects=lambda coordinator: [
        cluster_coordinator.closure_queue(coordinator)
    ],
    replaces="cluster_coordinator._CoordinatedClosureQueue.mark_failed, "
    "per coordinator",
    why="""`install(coordinator, callback)`: calls `callback(error)` when a
    scheduled function fails with an error of its own (not a worker
    failure: see `worker_failure_hook`). PSS records it with its closure
    queue's `mark_failed`, wrapped here once per queue, after the error
    is recorded.""",
    versions="[2.21] [2.15: kept]",
    where="coordinator.SyncCoordinator.__init__",
)


closure_tracking = patch_kinds.ObjectPatch(
    "closure_tracking",
    "_process_closure",
    closures.tracked_process_closure,
    objects=cluster_coordinator.coordinator_workers,
    forget=closures.untrack,
    replaces="cluster_coordinator.Worker._process_closure, per worker",
    why="""`install(coordinator)`: lets `closures.take_over_closure` move a
    worker's in-flight closure. Replaces each worker's `_process_closure`
    (per instance; its thread looks the method up for every closure) with
    `closures.process_tracked`: TF's own [2.21] [2.15: the same], plus the
    record of the closure running and the check, when it returns or
    fails, that nobody took it over.""",
    versions="[2.21] [2.15: the same]",
    where="liveness.WorkerMonitor.__init__ (a strategy's worker_timeout)",
)


# tf_keras's data handlers ---------------------------------------------------


epoch_end_hook = patch_kinds.ObjectPatch(
    "epoch_end_hook",
    "sync",
    keras_fit.sync_then,
    replaces="tf_keras's _ClusterCoordinatorDataHandler.sync, per handler",
    why="""`install(handler, fn)`: makes a `_ClusterCoordinatorDataHandler`
    call `fn(join)` after each join that ends an epoch's steps: its
    `sync`, which `catch_stop_iteration` calls once the epoch's functions
    are scheduled.""",
    versions="[2.21] [2.15]",
    where="data_service.for_fit (fit of a ServicePassPerEpoch)",
)


repeat_keras_arrays = patch_kinds.ObjectPatch(
    "repeat_keras_arrays",
    "dataset_fn",
    keras_fit.repeating_dataset_fn,
    replaces="the dataset_fn of the DatasetCreator tf_keras's coordinator "
    "data handler makes of arrays",
    why="""`install(creator)`: makes `creator`
    (`keras_fit.is_keras_arrays_creator`) repeat its dataset. tf_keras's
    adapter makes `epochs` passes over the arrays, each shuffled as
    `fit`'s `shuffle` says; under PSS each worker iterates its own copy
    with one iterator for the whole `fit`, so a worker that runs more
    batches than those passes hold fails its step. Repeated, each worker
    starts another pass instead. Its `dataset_fn` is replaced (by one
    `is_keras_arrays_creator` no longer recognises: never twice).""",
    versions="[2.21] [2.15]",
    where="fit_hooks._repeat_training_arrays (fit of arrays)",
)

new_iterator_each_epoch = patch_kinds.ObjectPatch(
    "new_iterator_each_epoch",
    "should_recreate_iterator",
    lambda adapter: lambda: True,
    objects=lambda handler: [keras_fit.data_handler_adapter(handler)],
    replaces="tf_keras's DatasetCreatorAdapter.should_recreate_iterator, "
    "per data handler's adapter",
    why="""`install(handler)`: makes a data handler create its iterator
    again at each epoch. `DatasetCreatorAdapter.should_recreate_iterator`
    is False (tf_keras expects a dataset function's shuffle to run across
    epochs); the handler asks its adapter at every epoch
    (`enumerate_epochs`).""",
    versions="[2.21] [2.15]",
    where="fit_hooks.per_worker_dataset (OnePassPerEpoch) and "
    "data_service.for_fit (ServicePassPerEpoch)",
)


# A model's fit --------------------------------------------------------------

exact_epoch_logs = patch_kinds.ObjectPatch(
    "exact_epoch_logs",
    "_validate_and_get_metrics_result",
    lambda model, validate: validate,
    replaces="tf_keras's Model._validate_and_get_metrics_result, per model",
    why="""`install(model, validate)`: makes `validate(logs)` `model`'s
    end-of-epoch check of its logs (which swaps in the exact metrics
    after a coordinator's join), the instance's; `uninstall(model)`: the
    class's method again.""",
    versions="[2.21] [2.15: kept]",
    where="unrolled_fit.unroll_fit_steps (uninstalled with enabled=False)",
)

unrolled_train_function = patch_kinds.ObjectPatch(
    "unrolled_train_function",
    "make_train_function",
    lambda model, make_train_function: make_train_function,
    replaces="tf_keras's Model.make_train_function, per model",
    why="""`install(model, make_train_function)`: `fit` repeats a step in
    each scheduled function rather than looping over it
    (`unrolled_fit.unroll_fit_steps`); `uninstall(model)`: tf_keras's
    loop again.""",
    versions="[2.21] [2.15: kept]",
    where="unrolled_fit.unroll_fit_steps (uninstalled with enabled=False)",
)


# Optimizers and variables ---------------------------------------------------


sharded_slot_views = patch_kinds.ObjectPatch(
    "sharded_slot_views",
    "get_slot",
    checkpoints.one_view_per_slot,
    replaces="tf_keras's legacy OptimizerV2.get_slot, per optimizer",
    why="""`install(optimizer)`: makes a legacy optimizer's slot of a
    `ShardedVariable` one object. tf_keras's legacy
    `get_slot(sharded_variable, name)` builds a new `ShardedVariable` over
    the shards' slots at every call. A restore binds one such view
    (restoring the shards' slots through it) and
    `assert_existing_objects_matched` then lists another, unbound (stock
    PSS does the same), although every slot was restored. With one view
    per slot, kept here, the check finds the object the restore bound
    (after a restore into a built optimizer; one before the build binds
    the early whole slots, see `checkpoints.early_sharded_slots`, and a
    check after the build still lists the views).""",
    versions="[2.21] [2.15: kept]",
    where="keras_optimizers.legacy_create_all_weights (keras_compat's "
    "build of a legacy optimizer)",
)

variable_reads = patch_kinds.ObjectPatch(
    "variable_reads",
    "_read_variable_op",
    lambda variable, wrap: wrap(variable._read_variable_op),
    # PSS's caching wrapper reads through the variable it wraps.
    objects=lambda variable: [getattr(variable, "_v", variable)],
    replaces="BaseResourceVariable._read_variable_op, per variable",
    why="""`install(variable, wrap)`: a read of `variable` traces as
    `wrap(its own read)` does (`sync.local_apply.reads_as`, which passes a
    ps's values into a function of that ps; uninstalled as it exits).""",
    versions="[2.21] [2.15: kept]",
    where="sync.local_apply.reads_as, for the block it wraps",
)

# Name -> patch: every runtime patch tf2sync installs.
REGISTRY = {
    patch.name: patch
    for patch in (
        autograph_skips_tf2sync,
        loss_scaling_predicate,
        sharded_autocast,
        whole_weights_in_keras_files,
        h5_refuses_sharded,
        nested_array_inputs,
        keras_calls,
        data_handler_context,
        per_graph_read_cache,
        extended_class,
        worker_failure_hook,
        function_error_hook,
        closure_tracking,
        epoch_end_hook,
        repeat_keras_arrays,
        new_iterator_each_epoch,
        exact_epoch_logs,
        unrolled_train_function,
        sharded_slot_views,
        variable_reads,
    )
}
