"""SyncParameterServerStrategy: ParameterServerStrategy with a step barrier."""

from __future__ import annotations

import weakref

import tensorflow as tf
from absl import logging

from tf2sync._src import config as config_lib
from tf2sync._src import coordinator as coordinator_lib
from tf2sync._src import first_use
from tf2sync._src import fit_hooks
from tf2sync._src import graph_rewrites
from tf2sync._src import keras_calls
from tf2sync._src import liveness
from tf2sync._src import options as options_lib
from tf2sync._src import sharding
from tf2sync._src import step_context
from tf2sync._src import watchdog
from tf2sync._src.internals import autograph
from tf2sync._src.internals import cluster_coordinator
from tf2sync._src.internals import keras_training
from tf2sync._src.internals import patches
from tf2sync._src.internals import ps_strategy
from tf2sync._src.internals import ps_variables

# Re-exported for callers that trace steps with an explicit worker index.
current_step = step_context.current_step
current_worker = step_context.current_worker
_WorkerScope = step_context.WorkerScope

_CONNECTED = {}  # the cluster spec this process last connected to


_UNWRAPPED_MESSAGE = (
    "A plain optimizer is updating variables under "
    "SyncParameterServerStrategy, which would train asynchronously. Wrap it: "
    "`optimizer=tf2sync.SyncOptimizer(<your optimizer>)` under "
    "`strategy.scope()`."
)


_MIXED_KINDS_MESSAGE = (
    "This SyncParameterServerStrategy already has a synchronous optimizer of "
    "the other kind (a tf2sync.SyncOptimizer and a "
    "tf2sync.compat.v1.SyncReplicasOptimizer do not mix on one strategy). "
    "Use tf2sync.MultiOptimizer for several variable groups."
)


class _SyncExtended(ps_strategy.ParameterServerExtended):
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
        if cardinality >= 0 and not keras_calls.building_exact_evaluation():
            raise ValueError(
                fit_hooks.finite_dataset_message(
                    keras_calls.input_role(), cardinality
                )
            )
        return super()._experimental_distribute_dataset(dataset, options)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        # Traced for each worker by the coordinator (its index set): the
        # input context names the worker's pipeline, as under MWMS.
        worker = step_context.dataset_worker()
        if worker is None:
            return super()._distribute_datasets_from_function(
                dataset_fn, options
            )
        num_workers = self._num_workers

        def per_worker_fn(context):
            return dataset_fn(
                tf.distribute.InputContext(
                    num_input_pipelines=num_workers,
                    input_pipeline_id=worker,
                    num_replicas_in_sync=context.num_replicas_in_sync,
                )
            )

        return super()._distribute_datasets_from_function(
            per_worker_fn, options
        )

    def _create_variable(self, next_creator, **kwargs):
        var = super()._create_variable(next_creator, **kwargs)
        for part in ps_variables.shards([var]):  # each shard on its ps
            patches.per_graph_read_cache.install(part)
            if ps_variables.is_caching_variable(part):
                self._tf2sync_variables[id(part)] = part  # for packed reads
        return var

    def _update(self, var, fn, args, kwargs, group):
        if tf.inside_function() and not step_context.in_sync_apply():
            raise TypeError(_UNWRAPPED_MESSAGE)
        return super()._update(var, fn, args, kwargs, group)


class SyncParameterServerStrategy(
    tf.distribute.experimental.ParameterServerStrategy
):
    """A `ParameterServerStrategy` whose training steps are synchronous.

    Protocol (per step of each replica, with the `SyncOptimizer` created
    under this strategy's scope; a later one replaces it between runs and
    the replaced one's steps fail):

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

    # Read by modules that cannot import this one (`fit_inputs`).
    _tf2sync_synchronous = True

    def __init__(
        self,
        cluster_resolver,
        *,
        replicas_to_aggregate: int,
        total_num_replicas: int | None = None,
        variable_partitioner=None,
        token_timeout: float | None = 60.0,
        worker_timeout: float | None = None,
        options: options_lib.SyncOptions | None = None,
    ):
        """Connects to the cluster and records the synchronous settings.

        Args:
          cluster_resolver: A `tf.distribute.cluster_resolver.ClusterResolver`
            naming `ps` and `worker` tasks (and the `chief`, this process).
          replicas_to_aggregate: Gradients averaged into each update.
          total_num_replicas: Replicas pushing gradients; `None` means
            `replicas_to_aggregate`. More than `replicas_to_aggregate` gives
            backup replicas; fewer means gradient accumulation.
          variable_partitioner: `None` (each variable whole on one ps, round
            robin), or a partitioner as stock PSS takes it: one of
            `tf.distribute.experimental.partitioners` (`FixedShardsPartitioner`,
            `MinSizePartitioner`, `MaxSizePartitioner`), TF1's
            `tf.compat.v1.fixed_size_partitioner`, or any callable
            `(shape, dtype) -> [num_shards, 1, ...]`. Variables of rank >= 1
            become `ShardedVariable`s, each shard on its own ps, and each
            shard's gradients are aggregated on its ps (see
            `tf2sync/_src/sharding.py`).
          token_timeout: Seconds without progress and without tokens after
            which the tokens a dead worker took are released (see
            `tf2sync/_src/watchdog.py`); `None` turns that off. A worker
            whose closure fails (killed, restarted) has its step's tokens
            released within about a second, whatever this is.
          worker_timeout: Seconds a worker may leave the coordinator's pings
            unanswered (frozen, partitioned) before it is treated as failed:
            its in-flight function runs again on another worker and its
            step's token is released (see `tf2sync/_src/liveness.py`).
            `None` (the default) never declares a worker frozen.
          options: A `tf2sync.SyncOptions` (tunables, read as
            `strategy.options`); `None` means `SyncOptions()`.

        Raises:
          TypeError: If `cluster_resolver` is not a `ClusterResolver`, a
            count is not an int, or `options` not a `tf2sync.SyncOptions`.
          ValueError: If a count is not positive, or the partitioner is not
            callable or returns something other than `[n >= 1, 1, ...]`.
        """
        if not isinstance(
            cluster_resolver, tf.distribute.cluster_resolver.ClusterResolver
        ):
            raise TypeError(
                "`cluster_resolver` must be a tf.distribute.cluster_resolver."
                "ClusterResolver (TFConfigClusterResolver(), or "
                "tf2sync.testing.local_cluster(...) for a local cluster). "
                f"Received: cluster_resolver={cluster_resolver!r}"
            )
        self._sync_config = config_lib.SyncConfig.create(
            replicas_to_aggregate, total_num_replicas
        )
        fit_hooks.install()
        first_use.install(SyncParameterServerStrategy)
        if note := self._sync_config.backup_note():
            logging.info("tf2sync: %s", note)
        variable_partitioner = sharding.checked(variable_partitioner)
        if variable_partitioner is not None:
            patches.sharded_autocast.install()  # mixed_float16 layers
            patches.whole_weights_in_keras_files.install()
            patches.h5_refuses_sharded.install(sharding.refusing_h5)
        if token_timeout is not None and not float(token_timeout) > 0:
            raise ValueError(
                "`token_timeout` must be a positive number of seconds or "
                f"None. Received: token_timeout={token_timeout!r}"
            )
        self._token_timeout = token_timeout
        if worker_timeout is not None and not (
            isinstance(worker_timeout, (int, float))
            and not isinstance(worker_timeout, bool)
            and worker_timeout > 0
        ):
            raise ValueError(
                "`worker_timeout` must be a positive number of seconds or "
                f"None. Received: worker_timeout={worker_timeout!r}"
            )
        self._options = options_lib.check(options)  # None: SyncOptions()
        self._watchdog = None
        # The step protocol of the synchronous optimizer attached (one per
        # strategy): `TokenFirstStep` for a SyncOptimizer, the TF1 order
        # for the compat_v1 shim. None: `run` is stock PSS's.
        self._protocol = None
        spec = cluster_resolver.cluster_spec().as_dict()
        if _CONNECTED.get("spec") not in (None, spec):
            # Another cluster: the watchdogs of strategies on the previous
            # one would read through handles the connection invalidates.
            watchdog.stop_all()
            liveness.stop_all()
        _CONNECTED["spec"] = spec
        super().__init__(cluster_resolver, variable_partitioner)
        patches.extended_class.install(self, _SyncExtended)
        self._extended._tf2sync_variables = weakref.WeakValueDictionary()
        # Installed now, so that ClusterCoordinator(strategy) returns it.
        coordinator = coordinator_lib.SyncCoordinator(self)
        self.worker_monitor = None
        if worker_timeout is not None:
            self.worker_monitor = liveness.WorkerMonitor(
                coordinator, worker_timeout
            )
        num_workers = ps_strategy.num_workers(self)
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

    @property
    def options(self) -> options_lib.SyncOptions:
        """The `tf2sync.SyncOptions` this strategy was created with."""
        return self._options

    def _check_can_attach(self) -> None:
        """Refuses a new SyncOptimizer now, before it builds anything: the
        TF1 shim's protocol is attached, or steps of the SyncOptimizer it
        would replace (see `_attach`) are running."""
        protocol = self._protocol
        if protocol is None:
            return
        if not isinstance(protocol, TokenFirstStep):
            raise ValueError(_MIXED_KINDS_MESSAGE)
        coordinator = cluster_coordinator.strategy_coordinator(self)
        if coordinator is None:
            return
        running, none_waiting = cluster_coordinator.inflight_closures(
            coordinator
        )
        if running or not none_waiting:
            raise ValueError(
                "A new tf2sync.SyncOptimizer would replace this strategy's "
                "while functions scheduled for the current one are still "
                f"running ({running} on workers): create it after they end "
                "(after fit returns, or coordinator.join())."
            )

    def _attach(self, aggregator) -> None:
        """Attaches a SyncOptimizer's barrier: the core step protocol.

        A later SyncOptimizer replaces an earlier one, as compiling a model
        again replaces its optimizer (say, after changing which layers
        train): the earlier one's steps fail from then on, when traced
        (`SyncOptimizer.apply_gradients`) or at their first token if
        traced before (`Aggregator.retire`), so that no step ever updates
        the weights through two optimizers' accumulators at once.
        """
        # The SyncOptimizer's constructor ran `_check_can_attach`.
        previous = self._protocol
        if previous is not None:
            if self._watchdog is not None:
                self._watchdog.stop()
                self._watchdog = None
            previous.aggregator.retire()
            self._protocol = None
            logging.info(
                "SyncParameterServerStrategy: a new SyncOptimizer replaces "
                "the previous one (global step %d); steps traced for the "
                "previous one fail from now on.",
                int(previous.aggregator.global_step.numpy()),
            )
        self._attach_protocol(
            TokenFirstStep(aggregator, self._extended._tf2sync_variables)
        )
        if self._token_timeout is not None:
            self._watchdog = watchdog.TokenWatchdog(
                aggregator, self._token_timeout
            )

    def _attach_protocol(self, protocol) -> None:
        if self._protocol is not None:
            raise ValueError(_MIXED_KINDS_MESSAGE)
        self._protocol = protocol

    def run(self, fn, args=(), kwargs=None, options=None):
        """See base class. Adds the step barrier described above."""
        protocol = self._protocol
        base_run = super().run
        if tf.inside_function():
            # Converted iff the caller is, as the base class does: tf2sync's
            # own code is not converted (see internals/autograph.py).
            fn = autograph.convert_as_caller(fn)
        if protocol is None or not tf.inside_function():
            worker = step_context.current_worker()
            if worker is not None:
                inner = fn

                def fn(*a, **k):  # carries the worker into the replica
                    with step_context.WorkerScope(worker):
                        return inner(*a, **k)

            return base_run(fn, args=args, kwargs=kwargs, options=options)
        return protocol.run_step(
            lambda step_fn: base_run(
                step_fn, args=args, kwargs=kwargs, options=options
            ),
            fn,
        )


class TokenFirstStep:
    """The core's replica step (see `aggregation`): token, tag, push.

    `run_step` dequeues a token and reads the tag before the step, orders
    the step's reads after it, packs its reads, and gives the token back if
    the step pushed nothing. The TF1 shim has its own protocol with the
    same two methods (`compat_v1.engine.PushFirstStep`).

    Guarantees, per traced step: one token taken, one tag read after it,
    every read and stateful op of the step after the tag; the token comes
    back with the update the step's push completes, or at once (after the
    step's outputs) when the step pushed nothing.
    """

    # Whether the coordinator must trace a function before dispatching it
    # and call `before_dispatch` (a protocol whose chief side is built by
    # the first trace).
    traces_before_dispatch = False

    def __init__(self, aggregator, variables):
        self.aggregator = aggregator
        self._variables = variables

    def before_dispatch(self) -> None:
        """Nothing to start: the barrier was seeded when it was built."""

    def run_step(self, run, fn):
        """Traces one replica step of `fn` with `run(step_fn)`."""
        aggregator = self.aggregator
        tag = aggregator.acquire()
        variables = self._variables
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        # Only model.fit's train step puts the counters in its logs.
        step = step_context.StepContext(
            tag,
            step_context.current_worker(),
            keras_training.is_keras_train_step(fn),
            first,
        )

        def step_fn(*a, **k):
            with tf.control_dependencies([tag]), step_context.StepScope(step):
                with graph_rewrites.PackedReads(variables, first):
                    return fn(*a, **k)

        result = run(step_fn)
        graph_rewrites.order_only_reads_after(
            tag, graph.get_operations()[first:]
        )
        if (
            step.pushed
            and step.want_stats
            and isinstance(result, dict)
            and step.stats is not None
        ):
            # model.fit: the sync totals join the logs (History, progress
            # line, TensorBoard), as the push read them on the ps.
            result = dict(
                result, **_fit_metrics(step.stats, aggregator.num_workers)
            )
        if not step.pushed:
            outputs = [
                t
                for t in tf.nest.flatten(result, expand_composites=True)
                if isinstance(t, tf.Tensor)
            ]
            aggregator.give_back(outputs)
        return result


def _fit_metrics(stats, num_workers):
    """The sync metrics of `fit`'s logs, from the counters a push returned.

    `stats` is `Aggregator.push`'s float64 vector: global step, stale,
    non-finite, accepted per worker, stale per worker, barrier wait.
    """
    values = tf.unstack(stats)
    counts = [tf.cast(v, tf.int64) for v in values[:-1]]
    metrics = {
        "sync_steps": counts[0],
        "stale_dropped": counts[1],
        "nonfinite_dropped": counts[2],
        "barrier_wait_s": values[-1],
    }
    for i in range(num_workers):
        metrics[f"accepted_w{i}"] = counts[3 + i]
        metrics[f"stale_w{i}"] = counts[3 + num_workers + i]
    return metrics


def outside_parameter_servers() -> bool:
    """True where no `ParameterServerStrategy` (sync or not) is current."""
    return not isinstance(
        tf.distribute.get_strategy(),
        tf.distribute.experimental.ParameterServerStrategy,
    )


def warn_loaded_alone(name, optimizer) -> None:
    """Says a saved `SyncOptimizer` loaded as its inner `optimizer` alone."""
    logging.warning(
        "Loaded %s outside a SyncParameterServerStrategy scope as its inner "
        "%s, which is not synchronous. Load under `strategy.scope()` to train "
        "on the cluster.",
        name or "SyncOptimizer",
        type(optimizer).__name__,
    )


def warn_loaded_fresh(name) -> None:
    """Says a `SyncOptimizer` rebuilt from its config under the strategy
    (what `load_model` does) starts with a fresh state: tf_keras's `.keras`
    files hold no state of a legacy-style optimizer such as this one, and
    its h5 loading skips it (with a warning of its own)."""
    logging.warning(
        "Built %s from its config with a fresh state: the global step starts "
        "at 0 and the slots anew (a model file loaded with load_model holds "
        "no SyncOptimizer state). To resume training, restore a checkpoint "
        "(save_weights, ModelCheckpoint(save_weights_only=True), Trainer's "
        "checkpoint_dir).",
        name or "SyncOptimizer",
    )
