"""SyncParameterServerStrategy: ParameterServerStrategy with a step barrier."""

from __future__ import annotations

import sys
import threading
import weakref

import tensorflow as tf
from absl import logging
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import input_lib
from tensorflow.python.distribute import parameter_server_strategy_v2
from tensorflow.python.distribute import ps_values
from tensorflow.python.distribute.coordinator import (
    cluster_coordinator as coordinator_lib,
)
from tensorflow.python.distribute.coordinator import (
    values as coordinator_values,
)

from tf2sync._src import aggregation
from tf2sync._src import config as config_lib
from tf2sync._src import unrolled_fit
from tf2sync._src import watchdog

_STEP = threading.local()
_CONNECTED = {}  # the cluster spec this process last connected to


class StepContext:
    """What one traced replica step knows: its tag, and whether it pushed."""

    def __init__(self, tag, worker=None, want_stats=True, first_op=None):
        self.tag = tag
        self.worker = worker
        # Where the step's ops start: its graph, and its first op's index.
        self._graph = tf.compat.v1.get_default_graph()
        self._first_op = first_op
        self.pushed = False
        self.want_stats = want_stats  # whether the push reads the counters
        self.stats = None  # set by the push: counters read on the ps

    def first_op_here(self):
        """The index of the step's first op if the current graph is the
        step's own (not a function nested in it), else None."""
        if tf.compat.v1.get_default_graph() is self._graph:
            return self._first_op
        return None


def current_step():
    """The `StepContext` of the replica step being traced, or None."""
    return getattr(_STEP, "context", None)


class _StepScope:
    def __init__(self, context):
        self._context = context

    def __enter__(self):
        self._previous = current_step()
        _STEP.context = self._context

    def __exit__(self, *exc):
        _STEP.context = self._previous


def _is_keras_train_step(fn) -> bool:
    """True for the `run_step` of tf_keras's `make_train_function`.

    Its `__qualname__` names `make_train_function`, or (tf_keras 2.15, whose
    `step_function` AutoGraph converts) `tf__step_function.<locals>.run_step`.
    The test function's step matches the second form too; it pushes
    nothing, so the counters it would get are never read.
    """
    qualname = getattr(fn, "__qualname__", "")
    return "make_train_function" in qualname or qualname.endswith(
        "step_function.<locals>.run_step"
    )


def current_worker():
    """The int64 index of the worker running the traced step, or None."""
    return getattr(_STEP, "worker", None)


class _WorkerScope:
    def __init__(self, worker):
        self._worker = worker

    def __enter__(self):
        self._previous = current_worker()
        _STEP.worker = self._worker

    def __exit__(self, *exc):
        _STEP.worker = self._previous


class _PackedReads:
    """One tensor per parameter server carries a step's variable reads.

    Each variable a replica step reads densely is otherwise its own transfer
    from the ps to the worker, and on a small model those transfers are
    most of the step. Inside this scope TF's own read cache for
    ParameterServerStrategy variables (`cache_variable_reads`) gives each
    variable one read per step. On exit the cached reads are regrouped:
    per (ps, dtype), the reads are concatenated on the ps, and the cached
    tensors on the worker are rewired to slices of that one tensor. The
    values are those of the individual reads (all after the tag). A step
    that wrote a variable and read it again would see the first read,
    which tf2sync rules out for trainable variables, the only ones packed:
    they only change in the ps's critical section. The push (and with it
    the apply and its moving averages) is traced by `merge_call` in the
    caller's thread, outside this replica thread's cache: it reads the ps.
    The step's forward lookups (an embedding's gather, ordered after the tag
    like every read) stay on the ps too, and their rows join the same
    tensor, so that on w3 a step brings its weights in one transfer, not
    two (in-process: 6-18 % more examples per second in the loop, 9 % in
    `fit`). A lookup whose rows are also used on a ps keeps its own.
    """

    def __init__(self, variables, first_op):
        self._variables = variables
        self._first_op = first_op  # where the step's ops start in the graph
        self._scope = None

    def __enter__(self):
        local = distribute_utils.caching_scope_local
        if local.in_caching_scope():
            return self  # already caching (nesting is not supported)
        self._scope = distribute_utils.cache_variable_reads()
        self._scope.__enter__()
        self._candidates = list(self._variables.values())
        for var in self._candidates:
            var._cache = None
            var._current_new_cache_scope_count = local.new_cache_scope_count
        return self

    def __exit__(self, *exc):
        if self._scope is None:
            return False
        try:
            if exc[0] is None:
                self._pack()
        finally:
            for var in self._candidates:
                var._cache = None
            self._scope.__exit__(*exc)
        return False

    def _pack(self):
        graph = tf.compat.v1.get_default_graph()
        groups = {}
        for var in self._candidates:
            cached = var._cache
            if (
                cached is None
                or not var.trainable  # may be written, then read, in a step
                or cached.graph is not graph
                or cached.op.type != "Identity"
                or not var.shape.is_fully_defined()
            ):
                continue
            key = (var._v.device, var.dtype.base_dtype)
            groups.setdefault(key, []).append(var)
        gathers = {}
        for var, gather in self._gathers(graph):
            key = (var._v.device, var.dtype.base_dtype)
            gathers.setdefault(key, []).append((var, gather))
        for key in list(groups) + [k for k in gathers if k not in groups]:
            group = groups.get(key, [])
            lookups = gathers.get(key, [])
            if len(group) + len(lookups) < 2:
                continue  # nothing to save
            # The reads themselves stay where they were traced (ordered
            # after the tag, and before the step's push by automatic control
            # dependencies); only their transfer to the worker is packed.
            with tf.device(key[0]):
                flat_rows = [tf.reshape(g.outputs[0], [-1]) for _, g in lookups]
                packed = tf.concat(
                    [tf.reshape(v._cache.op.inputs[0], [-1]) for v in group]
                    + flat_rows,
                    axis=0,
                )
            ours = tuple(t.op for t in flat_rows)
            # A gather's rows: as many as its ids, which the worker has.
            shapes = [
                tf.concat(
                    [
                        tf.shape(g.inputs[1]),
                        tf.constant(v.shape[1:].as_list(), tf.int32),
                    ],
                    axis=0,
                )
                for v, g in lookups
            ]
            sizes = [v.shape.num_elements() for v in group]
            if lookups:
                sizes = tf.stack(
                    [tf.constant(n) for n in sizes]
                    + [tf.reduce_prod(shape) for shape in shapes]
                )
            pieces = tf.split(packed, sizes, num=len(group) + len(lookups))
            for var, piece in zip(group, pieces):
                piece = tf.reshape(piece, var.shape)
                var._cache.op._update_input(0, piece)
            for (_, gather), piece, shape in zip(
                lookups, pieces[len(group) :], shapes
            ):
                rows = gather.outputs[0]
                piece = tf.reshape(piece, shape)
                piece.set_shape(rows.shape)
                for consumer, index in self._worker_uses(rows, ours):
                    consumer._update_input(index, piece)

    def _gathers(self, graph):
        """The step's lookups of packable variables: (variable, gather op).

        Only forward lookups, whose rows go to the worker: a gather of a
        trainable variable with a static shape, not placed on a ps by the
        caller (ops of the push are), with batch_dims 0, whose rows are
        used by ops not placed on a ps.
        """
        handles = {}
        for var in self._candidates:
            if var.trainable and var.shape.is_fully_defined():
                handles[id(var._v.handle)] = var
        captured = {id(inner): outer for outer, inner in graph.captures}
        found = []
        for op in graph.get_operations()[self._first_op :]:
            if op.type != "ResourceGather" or "/job:" in op.device:
                continue
            outer = captured.get(id(op.inputs[0]))
            var = handles.get(id(outer)) if outer is not None else None
            if var is None or op.get_attr("batch_dims") != 0:
                continue
            if self._worker_uses(op.outputs[0], ()):
                found.append((var, op))
        return found

    @staticmethod
    def _worker_uses(tensor, exclude):
        """(consumer, input index) of `tensor`, for consumers off the ps."""
        uses = []
        for consumer in tensor.consumers():
            if consumer in exclude:
                continue
            if "/job:ps" in consumer.device or any(
                not group.endswith(consumer.name.encode())
                for group in consumer.colocation_groups()
            ):
                return []  # used on a ps too: leave this lookup alone
            for index, t in enumerate(consumer.inputs):
                if t is tensor:
                    uses.append((consumer, index))
        return uses


def _order_only_reads_after(tag, operations):
    """Orders the step's reads and stateful ops, and only them, after its tag.

    The step is traced under a control dependency on its tag, but TF adds
    it only to ops none of whose inputs were made in the same scope: an
    embedding's gather, say, follows the tag only through the cast of its
    ids. Here every op of the step that takes a resource (a variable read,
    a gather, a call) or is stateful gets the tag as a control input of its
    own, and every pure op (stateless, no resource input) loses it: a pure
    op computes the same value whenever it runs, so that dependency only
    delayed it, and for ops on the worker it cost a transfer from the ps
    per step (w1 and w3, in-process: 7-18 % more examples per second
    without it).
    """
    for op in operations:
        control = op.control_inputs
        if op._is_stateful or any(t.dtype == tf.resource for t in op.inputs):
            if tag.op not in control:
                op._add_control_inputs([tag.op])
        elif tag.op in control:
            op._remove_all_control_inputs()
            op._add_control_inputs([c for c in control if c is not tag.op])


class _SyncCoordinator(coordinator_lib.ClusterCoordinator):
    """Passes each scheduled function the index of the worker running it.

    A scheduled function cannot tell which worker runs it; the coordinator
    can. Every `tf.function` scheduled while a SyncOptimizer is attached is
    wrapped to take a per-worker value (each worker's own index, built as a
    per-worker resource, rebuilt when a worker restarts) and traced under it,
    so that pushes are counted per worker. `ClusterCoordinator(strategy)`
    returns this instance: tf_keras and user loops get it unchanged.

    On workers without GPUs, per-worker datasets are iterated directly (see
    `create_per_worker_dataset`).
    """

    def __init__(self, strategy):
        first = not getattr(self, "_has_initialized", False)
        super().__init__(strategy)
        if first:
            self._worker_ids = None
            self._wrapped = weakref.WeakKeyDictionary()

    def create_per_worker_dataset(self, dataset_fn):
        """See base class. On CPU workers, without the per-device iterator.

        A distributed dataset (what `model.fit` builds from a
        `tf.data.Dataset`, and what `distribute_datasets_from_function`
        returns) is iterated on each worker through a multi-device iterator,
        which prefetches every element to the replica's device. A worker
        without GPUs has one replica on its own CPU: the copy is to the
        device the element is already on, and skipping it took a small
        model's `fit` from 15.8k to 18.8k examples/s. There the worker
        iterates the dataset that the distributed dataset wraps, which
        yields the same elements in the same order (one input pipeline and
        one replica per worker: PSS neither shards nor rebatches it).
        Workers with GPUs keep the prefetch.
        """
        if self.strategy.extended._num_gpus_per_worker == 0:
            dataset_fn = _single_pipeline(dataset_fn)
        # The data handler of a `fit` or `evaluate` building its input
        # (exact evaluation's subclass aside), before `fit` makes its train
        # function: otherwise `fit` keeps tf_keras's loop (slower, not wrong).
        handler = _caller_of_type("_ClusterCoordinatorDataHandler")
        model = getattr(handler, "_model", None)
        if model is not None:
            _check_not_jit_compiled(model)
            unrolled_fit.steps_per_execution_on_coordinator(model, handler)
            # fit makes its train function next: repeat its steps.
            unrolled_fit.repeat_by_default(model)
        return super().create_per_worker_dataset(dataset_fn)

    def _ids(self):
        if self._worker_ids is None:
            ids = []
            for i, worker in enumerate(self._cluster.workers):
                index = tf.function(lambda i=i: tf.constant(i, tf.int64))
                ids.append(worker.create_resource(index))
            self._worker_ids = coordinator_values.PerWorkerValues(tuple(ids))
        return self._worker_ids

    def schedule(self, fn, args=None, kwargs=None):
        wants_ids = (
            self.strategy._aggregator is not None
            or self.strategy._tf2sync_worker_ids
        )
        if not wants_ids or not isinstance(
            fn, tf.types.experimental.GenericFunction
        ):
            return super().schedule(fn, args=args, kwargs=kwargs)
        wrapped = self._wrapped.get(fn)
        if wrapped is None:

            def with_worker(worker, *a, **k):
                with _WorkerScope(worker):
                    return fn(*a, **k)

            wrapped = tf.function(with_worker)
            self._wrapped[fn] = wrapped
        args = (self._ids(), *(args or ()))
        if self.strategy._tf2sync_worker_ids:  # a TF1 shim exists
            # Trace now (as `schedule` would), so that what the trace built
            # (the shim's round, even on the very first schedule) starts
            # before any worker runs it.
            wrapped.get_concrete_function(
                *_as_specs(args), **_as_specs(kwargs or {})
            )
            for callback in list(self.strategy._tf2sync_before_dispatch):
                callback()
        return super().schedule(wrapped, args=args, kwargs=kwargs)


def _caller_of_type(type_name):
    """The nearest caller's `self` whose class is named `type_name`, or None.

    tf_keras's data handlers call the strategy without saying who they are;
    the stack does. (If tf_keras renamed a class, the lookup finds nothing,
    and each use below falls to its safe side.)
    """
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if type(owner).__name__ == type_name:
            return owner
        frame = frame.f_back
    return None


def _for_exact_evaluation() -> bool:
    """Whether tf_keras's exact evaluation is distributing a dataset.

    `model.evaluate` after `compile(pss_evaluation_shards=...)` gives its
    finite dataset through `_ClusterCoordinatorExactEvalDataHandler`
    (otherwise finite datasets are refused, as elsewhere).
    """
    handler = _caller_of_type("_ClusterCoordinatorExactEvalDataHandler")
    return handler is not None


def _check_not_jit_compiled(model):
    """Refuses `jit_compile=True` before `fit` or `evaluate` runs a step.

    XLA cannot read variables that live on another device, and under a
    ParameterServerStrategy every variable lives on a ps: stock PSS fails
    inside its first step ("Trying to access resource ... located in device
    /job:ps"), and tf2sync's push would fail earlier with an error about
    `merge_call`. Neither names the setting to change.
    """
    if getattr(model, "jit_compile", None):
        raise ValueError(
            "`jit_compile=True` cannot run under "
            "tf2sync.SyncParameterServerStrategy: XLA cannot read variables "
            "on the parameter servers, where all of them live. Compile the "
            "model with jit_compile=False. Received: "
            f"jit_compile={model.jit_compile!r}"
        )


def _single_pipeline(dataset_or_fn):
    """The dataset a PSS distributed dataset wraps (see the coordinator)."""
    if isinstance(dataset_or_fn, input_lib.DistributedDataset):
        if dataset_or_fn._built:  # built eagerly elsewhere: leave it
            return dataset_or_fn
        return dataset_or_fn._original_dataset
    if not callable(dataset_or_fn) or isinstance(
        dataset_or_fn, tf.types.experimental.ConcreteFunction
    ):
        return dataset_or_fn

    def dataset_fn():  # traced on each worker
        dataset = dataset_or_fn()
        if isinstance(dataset, input_lib.DistributedDatasetsFromFunction):
            return dataset._datasets[0]
        if isinstance(dataset, input_lib.DistributedDataset):
            return dataset._cloned_datasets[0]
        return dataset

    return dataset_fn


def _as_specs(structure):
    """Worker 0's slice of scheduled arguments, as `schedule` traces them."""
    return tf.nest.map_structure(
        coordinator_lib._maybe_as_type_spec,
        coordinator_lib._select_worker_slice(0, structure),
    )


_UNWRAPPED_MESSAGE = (
    "A plain optimizer is updating variables under "
    "SyncParameterServerStrategy, which would train asynchronously. Wrap it: "
    "`optimizer=tf2sync.SyncOptimizer(<your optimizer>)` under "
    "`strategy.scope()`."
)


class _SyncExtended(
    parameter_server_strategy_v2.ParameterServerStrategyV2Extended
):
    """Refuses variable updates that do not come from a SyncOptimizer.

    Every stock Keras optimizer applies through `extended.update`; tf2sync
    applies inside its critical section and marks that region. An update
    traced outside it would be an asynchronous apply, so it fails at trace
    time, before the first step runs. Eager updates from the coordinator
    (`model.set_weights`, restoring weights) are not training steps and
    pass.
    """

    def _experimental_distribute_dataset(self, dataset, options):
        # Each worker iterates its own copy; a copy that runs out cancels
        # every in-flight step with an opaque CancelledError. Refuse first,
        # except for tf_keras's exact evaluation, which shards a finite
        # dataset into functions that each read one shard to its end.
        cardinality = int(dataset.cardinality())
        if cardinality >= 0 and not _for_exact_evaluation():
            raise ValueError(
                "The dataset must repeat: under ParameterServerStrategy each "
                "worker iterates its own copy, and training stops with an "
                "error when any copy runs out. Add `.repeat()` and pass "
                f"`steps_per_epoch`. Received: a dataset of {cardinality} "
                "elements."
            )
        return super()._experimental_distribute_dataset(dataset, options)

    def _create_variable(self, next_creator, **kwargs):
        var = super()._create_variable(next_creator, **kwargs)
        if isinstance(var, ps_values.CachingVariable):
            self._tf2sync_variables[id(var)] = var  # for packed reads
        return var

    def _update(self, var, fn, args, kwargs, group):
        if tf.inside_function() and not aggregation.in_sync_apply():
            raise TypeError(_UNWRAPPED_MESSAGE)
        return super()._update(var, fn, args, kwargs, group)


class SyncParameterServerStrategy(
    tf.distribute.experimental.ParameterServerStrategy
):
    """A `ParameterServerStrategy` whose training steps are synchronous.

    Protocol (per step of each replica, with the `SyncOptimizer` created
    under this strategy's scope):

    1. `run` dequeues one token from the queue beside the global step and
       reads the global step as the step's tag; every op of the step is
       ordered after that read.
    2. The step computes its gradients; `SyncOptimizer.apply_gradients`
       pushes them to the parameter servers, where they are averaged.
    3. The `replicas_to_aggregate`-th fresh push applies the mean once,
       increments the global step and releases `max(total, aggregate)`
       tokens. Pushes tagged with an older step are dropped as stale.
    4. A step that pushes nothing (evaluation) gives its token back.

    Guarantees: each update is the mean of `replicas_to_aggregate` (or more,
    if they arrived at once) gradients computed from the same weights; it is
    applied exactly once; `optimizer.iterations` rises by exactly 1 per
    update. Training with a plain (unwrapped) optimizer raises a `TypeError`
    when the step is traced, before anything is applied.

    Example::

        resolver = tf2sync.testing.local_cluster(num_workers=2, num_ps=1)
        strategy = tf2sync.SyncParameterServerStrategy(
            resolver, replicas_to_aggregate=2)
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
            model.compile(
                optimizer=tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1)),
                loss="mse")
        model.fit(dataset, epochs=2, steps_per_epoch=10)
    """

    def __init__(
        self,
        cluster_resolver,
        *,
        replicas_to_aggregate: int,
        total_num_replicas: int | None = None,
        variable_partitioner=None,
        token_timeout: float | None = 60.0,
    ):
        """Connects to the cluster and records the synchronous settings.

        Args:
          cluster_resolver: A `tf.distribute.cluster_resolver.ClusterResolver`
            naming `ps` and `worker` tasks (and the `chief`, this process).
          replicas_to_aggregate: Gradients averaged into each update.
          total_num_replicas: Replicas pushing gradients; `None` means
            `replicas_to_aggregate`. More than `replicas_to_aggregate` gives
            backup replicas; fewer means gradient accumulation.
          variable_partitioner: Must be `None`: sharded variables are not
            supported yet.
          token_timeout: Seconds without progress and without tokens after
            which the tokens a dead worker took are released (see
            `tf2sync/_src/watchdog.py`); `None` turns that off.

        Raises:
          TypeError: If a count is not an int.
          ValueError: If a count is not positive, or a partitioner is given.
        """
        self._sync_config = config_lib.SyncConfig.create(
            replicas_to_aggregate, total_num_replicas
        )
        if variable_partitioner is not None:
            raise ValueError(
                "`variable_partitioner`: sharded variables are not supported "
                "by SyncParameterServerStrategy yet. Received: "
                f"variable_partitioner={variable_partitioner!r}"
            )
        if token_timeout is not None and not float(token_timeout) > 0:
            raise ValueError(
                "`token_timeout` must be a positive number of seconds or "
                f"None. Received: token_timeout={token_timeout!r}"
            )
        self._token_timeout = token_timeout
        self._watchdog = None
        # Where the TF1 shim (compat_v1) hooks in: per-worker indices for
        # its local steps, its rounds' starts (after the coordinator traced
        # a scheduled function, before dispatching it), what a traced `run`
        # must follow (the token of the step before it in the same
        # function), and its check after a traced `run`.
        self._tf2sync_worker_ids = False
        self._tf2sync_before_dispatch = []
        self._tf2sync_before_run = []
        self._tf2sync_after_run = []
        spec = cluster_resolver.cluster_spec().as_dict()
        if _CONNECTED.get("spec") not in (None, spec):
            # Another cluster: the watchdogs of strategies on the previous
            # one would read through handles the connection invalidates.
            watchdog.stop_all()
        _CONNECTED["spec"] = spec
        super().__init__(cluster_resolver)
        self._extended.__class__ = _SyncExtended
        self._extended._tf2sync_variables = weakref.WeakValueDictionary()
        # Installed now, so that ClusterCoordinator(strategy) returns it.
        _SyncCoordinator(self)
        self._aggregator = None
        num_workers = self._extended._num_workers
        if self._sync_config.total_num_replicas != num_workers:
            logging.warning(
                "total_num_replicas=%d but the cluster has %d workers.",
                self._sync_config.total_num_replicas,
                num_workers,
            )
        logging.info(
            "SyncParameterServerStrategy: replicas_to_aggregate=%d, "
            "total_num_replicas=%d",
            self._sync_config.replicas_to_aggregate,
            self._sync_config.total_num_replicas,
        )

    @property
    def replicas_to_aggregate(self) -> int:
        """Gradients averaged into each update."""
        return self._sync_config.replicas_to_aggregate

    @property
    def total_num_replicas(self) -> int:
        """Replicas pushing gradients (backups included)."""
        return self._sync_config.total_num_replicas

    def _attach(self, aggregator) -> None:
        if self._aggregator is not None:
            raise ValueError(
                "This SyncParameterServerStrategy already has a SyncOptimizer: "
                "one synchronous optimizer per strategy. Use "
                "tf2sync.MultiOptimizer for several variable groups."
            )
        self._aggregator = aggregator
        if self._token_timeout is not None:
            self._watchdog = watchdog.TokenWatchdog(
                aggregator, self._token_timeout
            )

    def run(self, fn, args=(), kwargs=None, options=None):
        """See base class. Adds the step barrier described above."""
        aggregator = self._aggregator
        if aggregator is None or not tf.inside_function():
            worker = current_worker()
            after = []  # what this step must follow (the TF1 shim's token)
            if tf.inside_function():
                after = [t for hook in self._tf2sync_before_run for t in hook()]
            if worker is not None or after:
                inner = fn

                def fn(*a, **k):
                    # Carries the worker into the replica thread; orders
                    # every op of the step after `after`.
                    with _WorkerScope(worker), tf.control_dependencies(after):
                        return inner(*a, **k)

            result = super().run(fn, args=args, kwargs=kwargs, options=options)
            if tf.inside_function():
                for check in self._tf2sync_after_run:
                    check()
            return result
        tag = aggregator.acquire()
        variables = self._extended._tf2sync_variables
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        # Only model.fit's train step puts the counters in its logs.
        step = StepContext(
            tag, current_worker(), _is_keras_train_step(fn), first
        )

        def step_fn(*a, **k):
            with tf.control_dependencies([tag]), _StepScope(step):
                with _PackedReads(variables, first):
                    return fn(*a, **k)

        result = super().run(step_fn, args=args, kwargs=kwargs, options=options)
        _order_only_reads_after(tag, graph.get_operations()[first:])
        if (
            step.pushed
            and step.want_stats
            and isinstance(result, dict)
            and step.stats is not None
        ):
            # model.fit: the sync totals join the logs (History, progress
            # line, TensorBoard), as the push read them on the ps.
            result = dict(result, **aggregator.metrics_from(step.stats))
        if not step.pushed:
            outputs = [
                t
                for t in tf.nest.flatten(result, expand_composites=True)
                if isinstance(t, tf.Tensor)
            ]
            aggregator.give_back(outputs)
        return result
