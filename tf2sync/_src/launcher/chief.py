"""The chief's training job: build, fit, checkpoint, survive a ps restart."""

from __future__ import annotations

import dataclasses
import logging as logging_lib
import re
import time

import tensorflow as tf
from absl import logging

from tf2sync._src import config as config_lib
from tf2sync._src import liveness
from tf2sync._src import sharding
from tf2sync._src import trainer_sync
from tf2sync._src import watchdog
from tf2sync._src.launcher import chief_report
from tf2sync._src.launcher import job_contract
from tf2sync._src.launcher import local_tasks


@dataclasses.dataclass(frozen=True)
class ChiefConfig:
    """What the launcher's flags ask of the chief (see `flags.py`)."""

    replicas_to_aggregate: int | None = None
    total_num_replicas: int | None = None
    batch_size: int = 32
    epochs: int = 10
    steps_per_epoch: int | None = None
    steps_per_execution: int | None = None
    unroll_steps: bool = True
    learning_rate: float = 0.01
    momentum: float = 0.9
    mixed_precision: str = "float32"
    sync_optimizer: str = "tf2sync"
    token_timeout: float | None = 60.0
    worker_timeout: float | None = 60.0
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int | None = None
    checkpoint_every_s: float | None = None
    checkpoint_in_background: bool = False
    model_log_dir: str | None = None
    verbose_sync_metrics: bool = False
    ps_restart_timeout: float = 300.0
    min_shard_bytes: int | None = None
    max_shards: int | None = None
    # The tf.data service dispatcher (grpc://host:port) whose passes `fit`
    # reads (`tf2sync.ServicePassPerEpoch`); None: static sharding.
    data_service: str | None = None


# MinSizePartitioner's own default shard size, used with max_shards alone.
_DEFAULT_MIN_SHARD_BYTES = 256 << 10


def variable_partitioner(config: ChiefConfig, num_ps: int):
    """The partitioner `config` asks for, or None.

    `MinSizePartitioner(min_shard_bytes, max_shards)`: `min_shard_bytes`
    defaults to 256 KiB, `max_shards` to `num_ps`. Neither set: None.
    """
    args = _partitioner_args(config, num_ps)
    if args is None:
        return None
    return tf.distribute.experimental.partitioners.MinSizePartitioner(**args)


def _partitioner_args(config: ChiefConfig, num_ps: int):
    if config.min_shard_bytes is None and config.max_shards is None:
        return None
    return {
        "min_shard_bytes": config.min_shard_bytes or _DEFAULT_MIN_SHARD_BYTES,
        "max_shards": config.max_shards or num_ps,
    }


def inner_optimizer(job, config: ChiefConfig):
    """The job's `build_optimizer(learning_rate, momentum)` if it has one,
    else momentum SGD, one per variable group if the job defines groups."""

    def sgd(rate):
        return tf.keras.optimizers.SGD(rate, momentum=config.momentum)

    if hasattr(job, "build_optimizer"):
        optimizer = job_contract.call(
            job, "build_optimizer", config.learning_rate, config.momentum
        )
        print(
            f"tf2sync: the job's optimizer {type(optimizer).__name__} "
            f"learning_rate={config.learning_rate:g}"
        )
        return optimizer
    if not hasattr(job, "optimizer_groups"):
        return sgd(config.learning_rate)
    return _groups_optimizer(job, config, sgd)


def _groups_optimizer(job, config: ChiefConfig, optimizer_of_rate):
    """A `tf2sync.MultiOptimizer` of the job's `optimizer_groups`, each
    group's optimizer `optimizer_of_rate(its rate)`; prints the rates."""
    import tf2sync

    groups = job_contract.call(job, "optimizer_groups", config.learning_rate)
    for description, _, rate in groups:
        print(f"tf2sync: group {description!r} learning_rate={rate:g}")
    return tf2sync.MultiOptimizer(
        groups={p: optimizer_of_rate(rate) for _, p, rate in groups}
    )


def sync_optimizer(job, config: ChiefConfig, rta: int, total: int):
    """The optimizer to compile with, as `config.sync_optimizer` says.

    The TF1 shim wraps the job's `build_optimizer()` if it has one, else a
    `tf2sync.MultiOptimizer` of momentum SGDs for its variable groups, else
    TF1's `MomentumOptimizer`.

    Raises:
      ValueError: If the TF1 shim is asked for with a mixed precision
        policy, which it does not support.
    """
    import tf2sync

    check_sync_optimizer(job, config)
    if config.sync_optimizer == "tf2sync":
        return tf2sync.SyncOptimizer(inner_optimizer(job, config))
    if hasattr(job, "build_optimizer"):
        # The job's own: a TF1 optimizer (examples/tf1_port/job.py's Adam)
        # or a tf_keras one, both of which the shim takes as `inner`.
        inner = inner_optimizer(job, config)
    elif hasattr(job, "optimizer_groups"):
        # TF1's momentum per group: tf_keras's legacy momentum SGD makes
        # the same updates at a constant rate, and MultiOptimizer takes
        # tf_keras optimizers only.
        inner = _groups_optimizer(
            job,
            config,
            lambda rate: tf.keras.optimizers.legacy.SGD(
                rate, momentum=config.momentum
            ),
        )
    else:
        inner = tf.compat.v1.train.MomentumOptimizer(
            config.learning_rate, config.momentum
        )
    return tf2sync.compat.v1.SyncReplicasOptimizer(
        inner, replicas_to_aggregate=rta, total_num_replicas=total
    )


def check_sync_optimizer(job, config: ChiefConfig) -> None:
    """Raises `ValueError` if `config.sync_optimizer` cannot train `job`."""
    del job  # the shim takes any optimizer a job builds
    if config.sync_optimizer != "tf1_shim":
        return
    if config.mixed_precision != "float32":
        raise ValueError(
            "--sync_optimizer=tf1_shim supports float32 only. Received: "
            f"--mixed_precision={config.mixed_precision}"
        )


# Errors a peer's restart can cause (a worker's gRPC stream cut mid-request:
# "Unable to parse request"; a function aborted or cancelled with it): the
# chief retries them from the last checkpoint, at most this many times.
TRANSIENT_ERRORS = (
    tf.errors.InternalError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
)
MAX_TRANSIENT_RETRIES = 3
_TASK = re.compile(r"/job:\w+/replica:\d+/task:\d+")


def train(resolver, job, config: ChiefConfig):
    """Trains as chief; after a ps failure, waits, restores and goes on.

    A parameter server that dies surfaces as `tf.errors.UnavailableError`.
    With `checkpoint_dir`, the chief waits up to `ps_restart_timeout`
    seconds for every ps to answer again, rebuilds strategy, model and
    optimizer on the restarted ps, restores the newest checkpoint and
    continues from it: at most the training since that save is redone (an
    epoch, or less with `checkpoint_every_steps` / `checkpoint_every_s`).
    Errors a peer's restart causes (`TRANSIENT_ERRORS`) resume the same
    way, at most `MAX_TRANSIENT_RETRIES` times in a run, each logged in
    one line.
    Without `checkpoint_dir`, when no ps comes back in time, or past the
    retries, it raises a `RuntimeError` naming the task in the error.

    Returns:
      A dict: the job's metrics (`final_metrics`), sync_steps_applied,
      stale_gradients_dropped, seconds, and `eval`: every value
      `evaluate` returned.
    """
    ps_hosts = resolver.cluster_spec().as_dict()["ps"]
    retries = 0
    _quiet_coordinator_errors()
    while True:
        try:
            return _train_once(resolver, job, config)
        except (tf.errors.UnavailableError, *TRANSIENT_ERRORS) as error:
            lost = isinstance(error, tf.errors.UnavailableError)
            cause = _one_line(error)
            # The old strategy's threads would poll and alarm the new one's.
            watchdog.stop_all()
            liveness.stop_all()
            if not config.checkpoint_dir and not lost:
                raise  # nothing to resume from: the error as it came
            if not config.checkpoint_dir:
                raise RuntimeError(
                    f"{cause}. Parameter servers: {ps_hosts}. Without "
                    "--checkpoint_dir the chief cannot resume: rerun with "
                    "it to survive a ps restart."
                ) from None
            if not lost:
                retries += 1
                if retries > MAX_TRANSIENT_RETRIES:
                    raise RuntimeError(
                        f"{cause} (after {MAX_TRANSIENT_RETRIES} retries)."
                    ) from error
            logging.warning(
                "tf2sync: %s; %s, then resuming from the last checkpoint.",
                cause,
                f"waiting up to {config.ps_restart_timeout:.0f} s for the "
                f"parameter servers {ps_hosts}"
                if lost
                else f"retry {retries} of {MAX_TRANSIENT_RETRIES}",
            )
            time.sleep(1.0)
            try:
                for address in ps_hosts:
                    local_tasks.wait_for_port(
                        address, config.ps_restart_timeout
                    )
            except TimeoutError as timeout:
                raise RuntimeError(
                    f"The parameter server did not come back: {timeout}"
                ) from None


def _one_line(error) -> str:
    """`error` in one line: its type, the task it names, its first line."""
    text = str(getattr(error, "message", "") or error)
    first = next((line for line in text.splitlines() if line.strip()), "")
    task = _TASK.search(text)
    where = f" from {task.group(0)}" if task else ""
    return f"{type(error).__name__}{where}: {first.strip()[:160]}"


class _FirstLineOnly(logging_lib.Filter):
    """Cuts PSS's closure-error records to their first line.

    When a task dies, every in-flight function logs its whole error
    (hundreds of lines of remote tracebacks); tf2sync logs the cause once.
    """

    def filter(self, record):
        if record.levelno >= logging_lib.ERROR and record.pathname.endswith(
            "cluster_coordinator.py"
        ):
            message = record.getMessage()
            record.msg = message.splitlines()[0][:300] if message else ""
            record.args = ()
        return True


def _quiet_coordinator_errors():
    for name in ("tensorflow", "absl"):
        logger = logging_lib.getLogger(name)
        if not any(isinstance(f, _FirstLineOnly) for f in logger.filters):
            logger.addFilter(_FirstLineOnly())


def _train_once(resolver, job, config: ChiefConfig):
    """Builds on the cluster, fits, evaluates and prints the totals.

    Returns:
      The dict `train` returns.
    """
    tf.config.set_visible_devices([], "GPU")  # the chief only coordinates
    tf.keras.mixed_precision.set_global_policy(config.mixed_precision)
    spec = resolver.cluster_spec().as_dict()
    num_workers = len(spec["worker"])
    rta = config.replicas_to_aggregate or num_workers
    total = config.total_num_replicas or max(num_workers, rta)
    steps, per_function = epoch_plan(job, config, num_workers)
    config = dataclasses.replace(config, steps_per_execution=per_function)
    began = time.monotonic()
    strategy = _strategy(resolver, config, rta, total)
    connected = time.monotonic()
    model, optimizer = _compiled_model(strategy, job, config, rta, total)
    logging.info(
        "tf2sync: connected to the cluster in %.1f s; model built in %.1f s.",
        connected - began,
        time.monotonic() - connected,
    )
    _print_plan(config, num_workers, len(spec["ps"]), rta, total, steps)
    _print_shards(model)
    sync = trainer_sync.of(optimizer, model.optimizer.iterations)
    seconds = _fit(model, job, config, steps, sync)
    sync.end()  # the shim's token watchdog stops before the cluster goes
    metrics = chief_report.evaluate(job, model)
    totals = chief_report.sync_totals(sync, metrics, seconds, num_workers)
    totals["eval"] = metrics
    return totals


# Steps per function the default looks for: each is a copy of the step in
# the function's graph, traced before the first call (see unroll_fit_steps).
_MAX_STEPS_PER_FUNCTION = 10


def epoch_plan(job, config: ChiefConfig, num_workers: int):
    """`(steps per epoch, steps per function)` for `config` and `job`.

    Unset, an epoch is one pass: each worker reads its shard of
    `ceil(job.num_train_examples() / num_workers)` examples once, in
    `ceil(shard / batch_size)` steps (a shard one example smaller can have
    one batch fewer: then an epoch is not exactly one pass). Unset, a
    function holds the largest divisor of a worker's steps of an epoch up
    to 10 (if it is at least 5 or all of them; else 10): every function
    of an epoch is then the same size, so workers that keep pace run as
    many of them and each pushes its shard's batches, no more, in every
    epoch (see `docs/data.md`).
    """
    steps = config.steps_per_epoch
    if not steps:  # the job's `num_train_examples` is only needed here
        shard = -(-job_contract.call(job, "num_train_examples") // num_workers)
        steps = num_workers * max(1, -(-shard // config.batch_size))
    per_function = config.steps_per_execution
    if per_function is None:
        per_worker = -(-steps // num_workers)
        per_function = max(
            d
            for d in range(1, _MAX_STEPS_PER_FUNCTION + 1)
            if per_worker % d == 0
        )
        if per_function < min(5, per_worker):
            per_function = _MAX_STEPS_PER_FUNCTION
    return steps, per_function


def _strategy(resolver, config: ChiefConfig, rta: int, total: int):
    """The `tf2sync.SyncParameterServerStrategy` of the cluster."""
    import tf2sync

    num_ps = len(resolver.cluster_spec().as_dict()["ps"])
    return tf2sync.SyncParameterServerStrategy(
        resolver,
        replicas_to_aggregate=rta,
        total_num_replicas=total,
        token_timeout=config.token_timeout,
        worker_timeout=config.worker_timeout,
        variable_partitioner=variable_partitioner(config, num_ps),
    )


def _compiled_model(strategy, job, config: ChiefConfig, rta: int, total: int):
    """The job's model, compiled under `strategy`, and its optimizer.

    Returns:
      `(model, optimizer)`: `optimizer` as `sync_optimizer` made it.
    """
    import tf2sync

    with strategy.scope():
        model = job_contract.call(job, "build_model")
        optimizer = sync_optimizer(job, config, rta, total)
        model.compile(
            optimizer=optimizer,
            loss=job.LOSS,
            metrics=list(job.METRICS),
            steps_per_execution=config.steps_per_execution,
        )
    tf2sync.unroll_fit_steps(model, config.unroll_steps)
    return model, optimizer


def _print_plan(config: ChiefConfig, num_workers, num_ps, rta, total, steps):
    """Prints the cluster and the run's settings, one line."""
    print(
        f"tf2sync: {num_workers} workers, {num_ps} ps, "
        f"replicas_to_aggregate={rta}, total_num_replicas={total}, "
        f"{steps} steps/epoch, {config.steps_per_execution} per function"
        f"{' (unrolled)' if config.unroll_steps else ' (tf_keras loop)'}, "
        f"{config.mixed_precision}" + _partitioner_text(config, num_ps),
        flush=True,
    )
    note = config_lib.SyncConfig.create(rta, total).backup_note()
    if note:
        print(f"tf2sync: {note}", flush=True)


def _partitioner_text(config: ChiefConfig, num_ps: int) -> str:
    args = _partitioner_args(config, num_ps)
    if args is None:
        return ""
    return (
        ", MinSizePartitioner("
        + ", ".join(f"{k}={v}" for k, v in args.items())
        + ")"
    )


def _print_shards(model):
    """Prints each sharded variable: one line, its shards and their ps."""
    for sharded, parts in sharding.sharded_groups(model.variables):
        # A ShardedVariable is named "ShardedVariable"; its shards
        # "<name>/part_<i>".
        name = parts[0].name.split(":")[0].rsplit("/part_", 1)[0]
        where = ", ".join(
            f"part_{i} {v.shape.as_list()} on {_task_of(v.device)}"
            for i, v in enumerate(parts)
        )
        print(
            f"tf2sync: {name} {sharded.shape.as_list()} in {len(parts)} "
            f"shards: {where}",
            flush=True,
        )


def _task_of(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.job}:{spec.task}"


def _fit(model, job, config: ChiefConfig, steps: int, sync) -> float:
    """Fits `model`, resuming from `config.checkpoint_dir` if it has one.

    Returns:
      The seconds `fit` took.
    """
    import tf2sync

    batch = config.batch_size
    # An epoch of one pass (the default) starts each worker's pass anew.
    creator = (
        tf.keras.utils.experimental.DatasetCreator
        if config.steps_per_epoch
        else tf2sync.OnePassPerEpoch
    )
    data = creator(
        lambda ctx: job_contract.call(job, "train_dataset", ctx, batch)
    )
    if config.data_service:  # an epoch ends with its pass (docs/data.md)
        data = tf2sync.ServicePassPerEpoch(
            job_contract.call(job, "train_pass", batch), config.data_service
        )
    callbacks = _callbacks(config, sync)
    if hasattr(job, "callbacks"):  # the job's own (benchmarks/chaos.py)
        callbacks += job_contract.call(job, "callbacks")
    start = time.monotonic()
    model.fit(
        data,
        epochs=config.epochs,
        steps_per_epoch=steps,
        # One line per epoch, in a terminal too: tf_keras refuses a
        # progress bar (verbose=1) under ParameterServerStrategy.
        verbose=2,
        callbacks=callbacks,
    )
    return time.monotonic() - start


def _callbacks(config: ChiefConfig, sync):
    """`fit`'s callbacks. With `config.checkpoint_dir`, a
    `tf2sync.SyncCheckpoint`: `fit` restores its newest save and starts
    where that save was, inside an epoch too."""
    import tf2sync

    batch = config.batch_size
    callbacks = []
    if sync.counts:  # the TF1 shim's totals are its global step only
        callbacks.append(
            tf2sync.SyncMetrics(
                batch_size=batch, verbose=config.verbose_sync_metrics
            )
        )
    if config.checkpoint_dir:
        callbacks.append(
            tf2sync.SyncCheckpoint(
                config.checkpoint_dir,
                every_steps=config.checkpoint_every_steps,
                every_seconds=config.checkpoint_every_s,
                background=config.checkpoint_in_background,
            )
        )
    if config.model_log_dir:
        callbacks.append(tf.keras.callbacks.TensorBoard(config.model_log_dir))
    return callbacks
