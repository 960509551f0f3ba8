"""The `tf2sync` binary: ps / worker / chief roles, or a whole local cluster.

Modes, in order of precedence:

* `--job_name=ps|worker --task_index=i --ps_hosts=... --worker_hosts=...`
  (TF1 style): serve as that task until killed.
* `--job_name=chief ...` with the same host flags: run the training job.
* `TF_CONFIG` set (Kubeflow TFJob, Slurm): the role it names.
* a JobSet pod's `TF2SYNC_JOBSET_*` environment (Kubernetes JobSet, which
  sets no TF_CONFIG; see `jobset.py` and examples/deploy/jobset.yaml): the
  cluster and role TF_CONFIG would give.
* otherwise `--local_cluster=WORKERS,PS` (default `2,1`; `--num_ps=N`
  alone: `2,N`): start each ps and worker as a subprocess on 127.0.0.1 and
  run the chief here; every process is ended by PID at the end or on Ctrl-C.

`--cluster_from=flags|tf_config|jobset|local` picks one of these sources
and refuses to start without it (default `auto`: the first that is given).

`--max_shards` / `--min_shard_bytes` shard large variables over the ps
(`MinSizePartitioner`); the chief prints each sharded variable's shards and
the ps holding them.

TF's gRPC servers listen on all interfaces without authentication: keep the
cluster's ports on a private network. The launcher warns when a host list
names a public address.
"""

from __future__ import annotations

import importlib
import ipaddress
import json
import os
import sys

from absl import app
from absl import flags
from absl import logging

from tf2sync._src import console

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

_JOB_NAME = flags.DEFINE_enum(
    "job_name",
    None,
    ["ps", "worker", "chief", "evaluator"],
    "This task's role (TF1 style). Unset: TF_CONFIG, else a JobSet pod's "
    "environment, else --local_cluster (see --cluster_from).",
)
_CLUSTER_FROM = flags.DEFINE_enum(
    "cluster_from",
    "auto",
    ["auto", "flags", "tf_config", "jobset", "local"],
    "Where the cluster and this task's role come from. auto: --job_name "
    "and the host flags if --job_name is given, else TF_CONFIG if set, "
    "else a JobSet pod's TF2SYNC_JOBSET_* environment (examples/deploy/"
    "jobset.yaml) if set, else --local_cluster. The others use that source "
    "only and refuse to start without it (and with --job_name, but for "
    "flags).",
)
_TASK_INDEX = flags.DEFINE_integer("task_index", 0, "This task's index.")
_PS_HOSTS = flags.DEFINE_list("ps_hosts", [], "ps tasks, host:port,...")
_WORKER_HOSTS = flags.DEFINE_list(
    "worker_hosts", [], "worker tasks, host:port,..."
)
_CHIEF_HOST = flags.DEFINE_string(
    "chief_host", None, "The chief (coordinator) task, host:port."
)
_LOCAL_CLUSTER = flags.DEFINE_string(
    "local_cluster",
    "2,1",
    "WORKERS,PS: start this cluster as local subprocesses on 127.0.0.1 "
    "(used when neither --job_name, TF_CONFIG nor a JobSet's environment "
    "is set; see --cluster_from).",
)
_NUM_PS = flags.DEFINE_integer(
    "num_ps",
    None,
    "Number of ps tasks. Local mode: the PS of --local_cluster (given "
    "alone, the workers stay at --local_cluster's default, 2; given with "
    "--local_cluster, the two must agree). With --ps_hosts or TF_CONFIG: "
    "checked against the ps tasks they name.",
)
_MIN_SHARD_BYTES = flags.DEFINE_integer(
    "min_shard_bytes",
    None,
    "Shard variables of rank >= 1 along axis 0 with tf.distribute."
    "experimental.partitioners.MinSizePartitioner(min_shard_bytes, "
    "max_shards): as many shards as keep each at least this many bytes, at "
    "most --max_shards (default: the number of ps), placed round robin "
    "over the ps. Unset, and --max_shards unset: no partitioner (each "
    "variable whole on one ps).",
)
_MAX_SHARDS = flags.DEFINE_integer(
    "max_shards",
    None,
    "Shard variables into at most this many shards (see --min_shard_bytes; "
    "given alone, shards are at least 256 KiB, MinSizePartitioner's "
    "default: a large table splits into --max_shards, small kernels and "
    "biases stay whole).",
)
_REPLICAS_TO_AGGREGATE = flags.DEFINE_integer(
    "replicas_to_aggregate",
    None,
    "Gradients averaged per update (default: the number of workers).",
)
_TOTAL_NUM_REPLICAS = flags.DEFINE_integer(
    "total_num_replicas",
    None,
    "Replicas pushing gradients (default: the number of workers).",
)
_JOB_MODULE = flags.DEFINE_string(
    "job_module",
    "tf2sync._src.jobs.digits",
    "Module with build_model, train_dataset, eval_arrays, "
    "num_train_examples (unless --steps_per_epoch), LOSS, METRICS "
    "(see jobs/digits.py); it may define flags of its own and "
    "FLAG_DEFAULTS for the launcher's (jobs/clicks.py).",
)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Batch per replica.")
_EPOCHS = flags.DEFINE_integer("epochs", 10, "Epochs to train.")
_STEPS_PER_EPOCH = flags.DEFINE_integer(
    "steps_per_epoch",
    None,
    "Replica steps (pushes) per epoch, over all workers. Default: one pass "
    "over the data, each worker reading its shard once "
    "(workers x ceil(num_train_examples / workers / batch_size)).",
)
_STEPS_PER_EXECUTION = flags.DEFINE_integer(
    "steps_per_execution",
    None,
    "Replica steps per scheduled function. Default: the largest divisor "
    "of a worker's steps of an epoch up to 10 (if at least 5, else 10), so "
    "that the epoch's functions are the same size (docs/data.md).",
)
_UNROLL_STEPS = flags.DEFINE_boolean(
    "unroll_steps",
    True,
    "Repeat the step in each scheduled function, up to 10 copies per "
    "loop iteration (fit's default under tf2sync), instead of tf_keras's "
    "tf.range loop, whose control crosses to the ps every step. "
    "--nounroll_steps: tf_keras's loop (tracing is then faster, for large "
    "models).",
)
_LEARNING_RATE = flags.DEFINE_float(
    "learning_rate",
    0.01,
    "Base SGD rate (the default job scales it per variable group).",
)
_MOMENTUM = flags.DEFINE_float(
    "momentum",
    0.9,
    "SGD momentum, in [0, 1] (a job's build_optimizer gets it too).",
)
_NUM_GPUS = flags.DEFINE_integer(
    "num_gpus",
    None,
    "GPUs each worker uses (default: all it sees; 0: CPU only). The ps "
    "always runs on CPU. In local mode each worker gets its own GPUs.",
)
_MIXED_PRECISION = flags.DEFINE_enum(
    "mixed_precision",
    "float32",
    ["float32", "mixed_float16", "mixed_bfloat16"],
    "Keras dtype policy of the model; mixed_float16 turns on tf2sync's "
    "dynamic loss scaling.",
)
_SYNC_OPTIMIZER = flags.DEFINE_enum(
    "sync_optimizer",
    "tf2sync",
    ["tf2sync", "tf1_shim"],
    "tf2sync: tf2sync.SyncOptimizer (per-step barrier, packed pushes). "
    "tf1_shim: tf2sync.compat.v1.SyncReplicasOptimizer around TF1's "
    "MomentumOptimizer (a MultiOptimizer of momentum SGDs for a job's "
    "optimizer_groups()), with TF1's token and global-step behaviour "
    "(float32; not for a job with its own build_optimizer()).",
)
_TOKEN_TIMEOUT = flags.DEFINE_float(
    "token_timeout",
    60.0,
    "Seconds without a synchronous step and without tokens after which the "
    "chief releases the tokens a dead worker took (0: never).",
)
_WORKER_TIMEOUT = flags.DEFINE_float(
    "worker_timeout",
    60.0,
    "Chief: seconds a worker may leave the chief's pings unanswered "
    "(frozen, partitioned) before it is treated as failed: its function "
    "runs again on another worker and its token is released (0: never).",
)
_PS_RESTART_TIMEOUT = flags.DEFINE_float(
    "ps_restart_timeout",
    300.0,
    "Chief: seconds to wait for a failed parameter server to come back "
    "before giving up (resuming needs --checkpoint_dir).",
)
_CONNECT_TIMEOUT = flags.DEFINE_float(
    "connect_timeout", 60.0, "Seconds to wait for each task to answer."
)
_CHECKPOINT_DIR = flags.DEFINE_string(
    "checkpoint_dir",
    None,
    "Chief: save model and optimizer after every epoch and resume from the "
    "latest on restart (created if missing). Refused at once (exit code 2) "
    "if it is a file or not writable, if its latest checkpoint is of "
    "another model, or if that checkpoint finished more epochs than "
    "--epochs (nothing to train); one that finished exactly --epochs "
    "trains nothing and evaluates the model. Evaluator: the checkpoints to "
    "evaluate.",
)
_MODEL_LOG_DIR = flags.DEFINE_string(
    "model_log_dir",
    None,
    "TensorBoard logs (chief: training and sync metrics; evaluator: eval).",
)
_MAX_EVALUATIONS = flags.DEFINE_integer(
    "max_evaluations",
    None,
    "Evaluator: stop after this many checkpoints (default: --epochs).",
)
_EVAL_TIMEOUT = flags.DEFINE_float(
    "eval_timeout",
    600.0,
    "Evaluator: stop when no new checkpoint comes for this many seconds.",
)
_VERBOSE_SYNC_METRICS = flags.DEFINE_boolean(
    "verbose_sync_metrics",
    False,
    "Show every sync figure on the epoch line (accepted_w0, stale_w0, "
    "barrier_wait_s_epoch, ...), not only sync_steps, stale_dropped and "
    "examples_per_s. They are in the logs (History, TensorBoard) either way.",
)
_INPUT_SHARDING = flags.DEFINE_enum(
    "input_sharding",
    "static",
    ["static", "service"],
    "How the workers share the training data. static: each worker reads its "
    "own shard (by worker index), an epoch is one pass when the workers keep "
    "pace. service: tf.data service's dynamic sharding: a dispatcher on the "
    "chief, a tf.data worker beside each worker, each element of a pass to "
    "whichever worker asks first, and an epoch that ends with the pass (the "
    "job needs train_pass(); docs/data.md).",
)
_DATA_SERVICE_PORT = flags.DEFINE_integer(
    "data_service_port",
    None,
    "With --input_sharding=service: the dispatcher's port on the chief's "
    "host; worker i's tf.data worker listens on this port + 1 + i on its "
    "host. Default: free ports in the local mode; required otherwise (the "
    "same value for every task).",
)
_DATA_SERVICE_WORKER_PORT = flags.DEFINE_integer(
    "data_service_worker_port",
    None,
    "A worker's tf.data worker port (default: --data_service_port + 1 + "
    "--task_index; the local mode sets it).",
)
_TASK_LOG_DIR = flags.DEFINE_string(
    "task_log_dir",
    None,
    "Where the logs of the local cluster's tasks (ps0.log, worker0.log, ...) "
    "and TensorFlow's C++ log of the chief (chief.log) go. Default: a new "
    "temporary directory, printed once (older ones beyond the newest "
    f"{console.KEPT_LOG_DIRS} are removed once nothing in them was written "
    f"for {console.STALE_LOG_DIR_S // 3600} hours).",
)


def _validate_host_list(name, hosts):
    for host in hosts:
        if ":" not in host or not host.rsplit(":", 1)[1].isdigit():
            raise flags.ValidationError(
                f"--{name} must be host:port entries. Received: "
                f"--{name}={','.join(hosts)}"
            )
    return True


flags.register_validator(
    "ps_hosts", lambda v: _validate_host_list("ps_hosts", v)
)
flags.register_validator(
    "worker_hosts", lambda v: _validate_host_list("worker_hosts", v)
)
flags.register_validator(
    "num_gpus",
    lambda v: v is None or v >= 0,
    message="--num_gpus must be >= 0.",
)
flags.register_validator(
    "task_index",
    lambda v: v >= 0,
    message="--task_index must be >= 0.",
)


def _check_sharding_flags():
    """Refuses a non-positive --num_ps, --min_shard_bytes or --max_shards.

    absl's usage error, exit code 2, before any task starts.
    """
    for holder in (_NUM_PS, _MIN_SHARD_BYTES, _MAX_SHARDS):
        if holder.value is not None and holder.value <= 0:
            raise app.UsageError(
                f"--{holder.name} must be a positive int. Received: "
                f"--{holder.name}={holder.value}",
                exitcode=2,
            )


def _check_num_ps(num_ps):
    """Refuses --num_ps if it disagrees with the cluster's `num_ps`."""
    if _NUM_PS.value is not None and _NUM_PS.value != num_ps:
        raise app.UsageError(
            f"--num_ps={_NUM_PS.value} but the cluster names {num_ps} ps "
            "task(s).",
            exitcode=2,
        )


def _cluster_source():
    """Where the cluster comes from: flags, tf_config, jobset or local.

    --cluster_from=auto: the first of the module docstring's modes that is
    given. Another value is that source, refused (usage error) if it is
    missing or if --job_name is given with anything but `flags`; a JobSet
    environment that lacks a variable is refused by `_jobset_task`.
    """
    source = _CLUSTER_FROM.value
    job_name = _JOB_NAME.value
    if source == "auto":
        return console.auto_cluster_source(job_name, os.environ)
    if source == "flags" and job_name is None:
        raise app.UsageError(
            "--cluster_from=flags needs --job_name (and the host flags).",
            exitcode=2,
        )
    if source != "flags" and job_name is not None:
        raise app.UsageError(
            f"--job_name={job_name} conflicts with --cluster_from={source}: "
            "role flags are --cluster_from=flags (or auto).",
            exitcode=2,
        )
    if source == "tf_config" and not os.environ.get("TF_CONFIG"):
        raise app.UsageError(
            "--cluster_from=tf_config but TF_CONFIG is not set.", exitcode=2
        )
    return source


def _jobset_task():
    """This JobSet pod's `jobset.JobSetTask`; bad environment: usage error."""
    from tf2sync._src import jobset

    try:
        return jobset.cluster_from_environ(os.environ)
    except ValueError as e:
        raise app.UsageError(str(e), exitcode=2) from None


def _check_input():
    """Refuses bad flags, TF_CONFIG, job module or checkpoint directory.

    One line naming the flag (or TF_CONFIG) and the value, absl's usage
    error (exit code 2), from `main` before any task starts and before the
    chief connects (see `flag_checks`). ps and worker tasks check the
    flags and TF_CONFIG (or the JobSet environment) only.
    """
    from tf2sync._src import flag_checks

    if _cluster_source() == "local":  # where the local tasks' logs go
        flag_checks.check_checkpoint_dir(
            _TASK_LOG_DIR.value, writable=True, name="task_log_dir"
        )
        _check_local_gpus()
    flag_checks.check_positive_ints(
        {
            h.name: h.value
            for h in (
                _REPLICAS_TO_AGGREGATE,
                _TOTAL_NUM_REPLICAS,
                _BATCH_SIZE,
                _EPOCHS,
                _STEPS_PER_EPOCH,
                _STEPS_PER_EXECUTION,
                _MAX_EVALUATIONS,
            )
        }
    )
    flag_checks.check_non_negative(
        {
            h.name: h.value
            for h in (_TOKEN_TIMEOUT, _WORKER_TIMEOUT, _PS_RESTART_TIMEOUT)
        }
    )
    flag_checks.check_positive(
        {h.name: h.value for h in (_CONNECT_TIMEOUT, _EVAL_TIMEOUT)}
    )
    flag_checks.check_optimizer_flags(_LEARNING_RATE.value, _MOMENTUM.value)
    _check_input_sharding()
    role = _JOB_NAME.value
    source = _cluster_source()
    if source == "tf_config":
        config = flag_checks.parse_tf_config(os.environ["TF_CONFIG"])
        role = config["task"]["type"]
    elif source == "jobset":
        role = _jobset_task().task_type
    elif source == "local":
        _local_workers_and_ps()  # this process is the chief
        role = "chief"
    elif source == "flags" and role in ("ps", "worker", "chief"):
        _check_num_ps(len(_spec_from_flags(warn=False)["ps"]))
    if role in ("ps", "worker"):
        return
    evaluator = role == "evaluator"
    directory = _CHECKPOINT_DIR.value
    flag_checks.check_checkpoint_dir(directory, writable=not evaluator)
    job = _load_job()
    flag_checks.check_job_api(
        job,
        _JOB_MODULE.value,
        evaluator=evaluator,
        steps_per_epoch=_STEPS_PER_EPOCH.value,
    )
    if _INPUT_SHARDING.value == "service" and not callable(
        getattr(job, "train_pass", None)
    ):
        raise app.UsageError(
            f"--input_sharding=service: --job_module={_JOB_MODULE.value} "
            "lacks train_pass(batch_size) (the finite, batched dataset of one "
            "pass; see tf2sync/_src/jobs/digits.py).",
            exitcode=2,
        )
    if not directory:
        return
    from tf2sync._src import checkpointing

    try:
        checkpointing.check_model_fits(job.build_model, directory)
    except ValueError as e:
        raise app.UsageError(
            f"--checkpoint_dir={directory}: {e}", exitcode=2
        ) from None
    if not evaluator:
        latest, done = checkpointing.latest_epoch(directory)
        flag_checks.check_epochs_left(directory, latest, done, _EPOCHS.value)


def _check_local_gpus():
    """--num_gpus=N > 0 in the local mode needs a GPU on this machine (the
    workers share them when there are fewer than N per worker)."""
    wanted = _NUM_GPUS.value
    if not wanted:
        return
    from tf2sync._src import processes

    available = processes.machine_gpus()
    if available == 0:
        raise app.UsageError(
            f"--num_gpus={wanted}: this machine shows TensorFlow no GPU "
            f"(--num_gpus=0 trains on CPU; {_cuda_hint()}).",
            exitcode=2,
        )
    if wanted > available:
        raise app.UsageError(
            f"--num_gpus={wanted}: this machine shows TensorFlow "
            f"{available} GPU(s); a worker takes at most that many.",
            exitcode=2,
        )


def _cuda_hint() -> str:
    """What to install where an NVIDIA GPU machine shows TensorFlow no GPU:
    pip's `tensorflow` brings no CUDA libraries; its `and-cuda` extra
    does, for this interpreter."""
    from importlib import metadata

    try:
        major, minor = metadata.version("tensorflow").split(".")[:2]
        wanted = f"tensorflow[and-cuda]=={major}.{minor}.*"
    except (metadata.PackageNotFoundError, ValueError):
        wanted = "tensorflow[and-cuda]"
    return (
        "on an NVIDIA GPU machine TensorFlow needs its CUDA libraries: "
        f"{sys.executable} -m pip install '{wanted}'"
    )


def _check_input_sharding():
    """--input_sharding=service's flags: one line each, exit 2."""
    if _INPUT_SHARDING.value != "service":
        return
    port = _DATA_SERVICE_PORT.value
    if port is not None and not 0 < port < 65536:
        raise app.UsageError(
            f"--data_service_port={port}: a port is 1-65535.", exitcode=2
        )
    worker_port = _DATA_SERVICE_WORKER_PORT.value
    if worker_port is not None and not 0 < worker_port < 65536:
        raise app.UsageError(
            f"--data_service_worker_port={worker_port}: a port is 1-65535.",
            exitcode=2,
        )
    if port is None and _cluster_source() != "local":
        raise app.UsageError(
            "--input_sharding=service needs --data_service_port outside the "
            "local mode (the dispatcher's port on the chief's host, the same "
            "for every task).",
            exitcode=2,
        )
    if _SYNC_OPTIMIZER.value == "tf1_shim":
        raise app.UsageError(
            "--input_sharding=service needs --sync_optimizer=tf2sync (an "
            "epoch that ends with its data applies its last, incomplete "
            "step; the TF1 shim has no such step). Received: "
            "--sync_optimizer=tf1_shim",
            exitcode=2,
        )


def _local_workers_and_ps():
    """--local_cluster's WORKERS,PS, with --num_ps's PS (see its help)."""
    workers, ps = _parse_local_cluster(_LOCAL_CLUSTER.value)
    num_ps = _NUM_PS.value
    if num_ps is None or num_ps == ps:
        return workers, ps
    if flags.FLAGS["local_cluster"].present:
        raise app.UsageError(
            f"--num_ps={num_ps} conflicts with --local_cluster="
            f"{_LOCAL_CLUSTER.value} ({ps} ps): give one of them, or make "
            "them agree.",
            exitcode=2,
        )
    return workers, num_ps


def _parse_local_cluster(value):
    parts = value.split(",")
    try:
        workers, ps = (int(p) for p in parts)
    except ValueError:
        workers = ps = 0
    if len(parts) != 2 or workers <= 0 or ps <= 0:
        raise app.UsageError(
            "--local_cluster must be WORKERS,PS with positive ints. "
            f"Received: --local_cluster={value}",
            exitcode=2,
        )
    return workers, ps


def _warn_public(hosts):
    for host in hosts:
        name = host.rsplit(":", 1)[0]
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            continue
        if address.is_global:
            logging.warning(
                "%s is a public address: TF's gRPC servers accept any "
                "connection without authentication. Keep cluster ports on a "
                "private network.",
                host,
            )


def _spec_from_flags(warn=True):
    """The cluster the role flags name, refused (usage error) where a task
    could not serve it; `warn`: log each public address."""
    if not _PS_HOSTS.value or not _WORKER_HOSTS.value:
        raise app.UsageError(
            "--job_name needs --ps_hosts and --worker_hosts. Received: "
            f"--ps_hosts={','.join(_PS_HOSTS.value)} "
            f"--worker_hosts={','.join(_WORKER_HOSTS.value)}",
            exitcode=2,
        )
    spec = {"ps": _PS_HOSTS.value, "worker": _WORKER_HOSTS.value}
    if _CHIEF_HOST.value:
        spec["chief"] = [_CHIEF_HOST.value]
    from tf2sync._src import flag_checks

    flag_checks.check_distinct_addresses(
        spec,
        lambda role, hosts: (
            f"--chief_host={hosts[0]}"
            if role == "chief"
            else f"--{role}_hosts={','.join(hosts)}"
        ),
    )
    job = _JOB_NAME.value
    if job in spec and _TASK_INDEX.value >= len(spec[job]):
        raise app.UsageError(
            f"--task_index={_TASK_INDEX.value} but --{job}_hosts names "
            f"{len(spec[job])} task(s).",
            exitcode=2,
        )
    if job == "chief" and "chief" not in spec:
        raise app.UsageError("--job_name=chief needs --chief_host.", exitcode=2)
    if warn:
        _warn_public([h for hosts in spec.values() for h in hosts])
    return spec


def _serve(spec, job, index):
    """Runs a ps or worker server until SIGTERM/SIGINT (or its parent ends).

    SIGTERM and SIGINT exit 0 at once, whatever disposition the task
    inherited. A local task (started with `processes.child_kwargs`) also
    exits when its launcher is gone (`processes.exit_with_parent`, from
    `main`).
    """
    import tensorflow as tf

    from tf2sync._src import cluster as cluster_lib
    from tf2sync._src import processes

    _place_devices(job)
    num_workers = len(spec.get("worker", []))
    server = tf.distribute.Server(
        tf.train.ClusterSpec(spec),
        job_name=job,
        task_index=index,
        protocol="grpc",
        config=cluster_lib.server_config(num_workers),
        start=True,
    )
    logging.info("Serving %s:%d at %s", job, index, server.target)
    tf_data_worker = None  # referenced while the task serves
    if job == "worker" and _INPUT_SHARDING.value == "service":
        from tf2sync._src import data_service

        dispatcher, address = data_service.addresses(
            spec,
            index,
            _DATA_SERVICE_PORT.value,
            _DATA_SERVICE_WORKER_PORT.value,
        )
        if int(address.rsplit(":", 1)[1]) > 65535:
            raise app.UsageError(
                f"--data_service_port={_DATA_SERVICE_PORT.value}: worker "
                f"{index}'s tf.data worker port ({address}) is past 65535.",
                exitcode=2,
            )
        tf_data_worker = data_service.start_worker(dispatcher, address)
        logging.info(
            "tf.data worker at %s (dispatcher %s)", address, dispatcher
        )
    processes.serve_forever(server)  # exits the process on a signal
    del tf_data_worker


def _forks_local_tasks() -> bool:
    """Whether the local mode will start its tasks as forks: no GPUs
    planned (see `processes.LocalProcessCluster`) nor found, and TensorFlow
    has run nothing yet (a job module may at import: see
    `processes.TaskForker`)."""
    if _JOB_NAME.value is not None or _NUM_GPUS.value is not None:
        return False
    from tf2sync._src import tf_internals

    if tf_internals.runtime_started():  # a job module ran TF, or a GPU
        return False
    try:
        return _cluster_source() == "local"
    except app.UsageError:
        return False  # said again, in its place, by `_main`


def _serve_forked(spec, job, index, args):
    """A local task forked from the launcher (`processes.LocalProcessCluster`)
    : its flags `args` on top of the launcher's, then `_serve`."""
    from tf2sync._src import processes

    processes.exit_with_parent()
    if args:
        flags.FLAGS(["tf2sync", *args], known_only=True)
    if not flags.FLAGS["verbosity"].present:  # as `main` sets a task's
        logging.set_verbosity(logging.WARNING)
    _serve(spec, job, index)


def _place_devices(job):
    """ps: CPU only. worker: its first --num_gpus GPUs (all by default)."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if job != "worker":
        tf.config.set_visible_devices([], "GPU")
        return
    wanted = _NUM_GPUS.value
    if wanted is None:
        wanted = len(gpus)
    if wanted > len(gpus):
        hint = f" ({_cuda_hint()})" if not gpus else ""
        raise app.UsageError(
            f"--num_gpus={wanted} but this worker sees {len(gpus)} GPU(s)"
            f"{hint}.",
            exitcode=2,
        )
    tf.config.set_visible_devices(gpus[:wanted], "GPU")
    logging.info("worker uses %d GPU(s)", wanted)


def _chief_config():
    from tf2sync._src import chief

    return chief.ChiefConfig(
        replicas_to_aggregate=_REPLICAS_TO_AGGREGATE.value,
        total_num_replicas=_TOTAL_NUM_REPLICAS.value,
        batch_size=_BATCH_SIZE.value,
        epochs=_EPOCHS.value,
        steps_per_epoch=_STEPS_PER_EPOCH.value,
        steps_per_execution=_STEPS_PER_EXECUTION.value,
        unroll_steps=_UNROLL_STEPS.value,
        learning_rate=_LEARNING_RATE.value,
        momentum=_MOMENTUM.value,
        mixed_precision=_MIXED_PRECISION.value,
        sync_optimizer=_SYNC_OPTIMIZER.value,
        token_timeout=_TOKEN_TIMEOUT.value or None,
        worker_timeout=_WORKER_TIMEOUT.value or None,
        checkpoint_dir=_CHECKPOINT_DIR.value,
        model_log_dir=_MODEL_LOG_DIR.value,
        verbose_sync_metrics=_VERBOSE_SYNC_METRICS.value,
        ps_restart_timeout=_PS_RESTART_TIMEOUT.value,
        min_shard_bytes=_MIN_SHARD_BYTES.value,
        max_shards=_MAX_SHARDS.value,
    )


def _dispatcher_target(spec) -> str | None:
    """The tf.data service the chief's `fit` reads (`grpc://host:port`),
    or None (static sharding)."""
    if _INPUT_SHARDING.value != "service":
        return None
    host = spec["chief"][0].rsplit(":", 1)[0]
    return f"grpc://{host}:{_DATA_SERVICE_PORT.value}"


def train(resolver, job):
    """Runs the training job as chief (see `chief.train`); with
    --input_sharding=service, serves the tf.data dispatcher meanwhile."""
    import dataclasses

    from tf2sync._src import chief

    config = _chief_config()
    target = _dispatcher_target(resolver.cluster_spec().as_dict())
    dispatcher = None  # referenced while the chief trains
    if target is not None:
        from tf2sync._src import data_service

        dispatcher = data_service.start_dispatcher(_DATA_SERVICE_PORT.value)
        spec = resolver.cluster_spec().as_dict()
        workers = len(spec["worker"])
        data_service.wait_for_workers(
            dispatcher,
            workers,
            _CONNECT_TIMEOUT.value,
            [
                data_service.addresses(
                    spec, i, _DATA_SERVICE_PORT.value, _worker_port_flag(i)
                )[1]
                for i in range(workers)
            ],
        )
        config = dataclasses.replace(config, data_service=target)
    try:
        return chief.train(resolver, job, config)
    finally:
        del dispatcher


_FORKER = []  # the local mode's processes.TaskForker, made in `main`


def main(argv):
    from tf2sync._src import processes

    if _forks_local_tasks():
        # Before any thread or TensorFlow op: see processes.TaskForker.
        _FORKER.append(processes.TaskForker(_serve_forked))
    # First of all: a local task ends with its launcher, and SIGINT /
    # SIGTERM end this process (one line, exit 130 / 143), whatever
    # disposition it inherited. `_serve` makes them exit 0 in a task.
    processes.exit_with_parent()
    processes.exit_on_signals()
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
        import tensorflow as tf

        tf.get_logger().setLevel("WARNING")
    _check_sharding_flags()
    _check_input()  # bad input: one line, exit 2, before any task starts
    try:
        code = _main()
    except app.UsageError:
        raise  # absl prints it with the usage hint, exit 2 (its exitcode)
    except Exception as error:  # noqa: BLE001 - the error, then no teardown
        code = _report_error(error)
    # Remote resources cannot be deleted once the tasks are gone; skip the
    # interpreter's teardown, which would try (and log every failure).
    processes.end_process(code)


def _report_error(error):
    """Ends stderr with `error` on one line (`--verbosity=1`: traceback too).

    Returns the exit code, 1.
    """
    import traceback

    hint = " (--verbosity=1 prints the traceback)"
    if logging.get_verbosity() >= logging.DEBUG:
        traceback.print_exception(error)
        hint = ""
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    more = " ..." if first != text else ""
    print(
        f"tf2sync: {type(error).__name__}: {first}{more}{hint}",
        file=sys.stderr,
    )
    return 1


def _main():
    # `_check_input` has refused bad flags, the role flags' cluster and
    # --num_ps against it, before this runs.
    job_name = _JOB_NAME.value
    if job_name in ("ps", "worker"):
        _serve(_spec_from_flags(), job_name, _TASK_INDEX.value)
        return 0
    job = _load_job()
    if job_name == "chief":
        import tensorflow as tf

        spec = _spec_from_flags()
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(spec),
            task_type="chief",
            task_id=0,
            rpc_layer="grpc",
        )
        _wait_all(spec)
        train(resolver, job)
        return 0
    if job_name == "evaluator":
        return _evaluate(job)
    source = _cluster_source()
    if source == "tf_config":
        return _main_tf_config(job)
    if source == "jobset":
        return _main_jobset(job)
    from tf2sync._src import processes

    workers, ps = _local_workers_and_ps()
    log_dir = console.launcher_log_dir() or console.task_log_dir(
        _TASK_LOG_DIR.value
    )
    cluster = processes.LocalProcessCluster(
        workers,
        ps,
        log_dir=log_dir,
        num_gpus=_NUM_GPUS.value,
        worker_args=_service_worker_args(workers),
        forker=_FORKER[0] if _FORKER else None,
    )
    try:  # a signal meanwhile stops the cluster: processes.exit_on_signals
        resolver = cluster.start(timeout=_CONNECT_TIMEOUT.value)
        print(
            f"tf2sync: local task pids={cluster.pids}, logs in {log_dir}",
            flush=True,
        )
        train(resolver, job)
    finally:
        cluster.stop()
    return 0


def _worker_port_flag(index):
    """Worker `index`'s --data_service_worker_port as the chief knows it:
    the local mode's own pick, else the default (None)."""
    return _LOCAL_WORKER_PORTS[index] if _LOCAL_WORKER_PORTS else None


_LOCAL_WORKER_PORTS = []  # the local mode's tf.data worker ports


def _service_worker_args(num_workers):
    """Worker i's flags for --input_sharding=service in the local mode
    (free ports for the tf.data workers), or None."""
    if _INPUT_SHARDING.value != "service":
        return None
    from tf2sync._src import cluster as cluster_lib

    # One pick for all (separate picks could return the same port).
    ports = cluster_lib.pick_free_ports(
        num_workers + (_DATA_SERVICE_PORT.value is None)
    )
    if _DATA_SERVICE_PORT.value is None:
        flags.FLAGS.data_service_port = ports.pop()
    _LOCAL_WORKER_PORTS[:] = ports
    return [
        [
            "--input_sharding=service",
            f"--data_service_port={_DATA_SERVICE_PORT.value}",
            f"--data_service_worker_port={port}",
        ]
        for port in ports
    ]


def _load_job():
    """Imports --job_module and checks the chief's flags can train it.

    The working directory is searched too, as `python -m tf2sync` does (the
    `tf2sync` console script alone would not). Runs before any task starts.
    """
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    name = _JOB_MODULE.value
    try:
        job = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or not name.startswith(e.name):
            # The job module imports something that is not installed.
            raise app.UsageError(
                f"--job_module={name}: {e.msg or e}", exitcode=2
            ) from None
        raise app.UsageError(
            f"--job_module={name}: no module named {e.name!r} in the working "
            f"directory ({os.getcwd()}) or the installed packages.",
            exitcode=2,
        ) from None
    from tf2sync._src import chief

    try:
        chief.check_sync_optimizer(job, _chief_config())
    except ValueError as e:
        raise app.UsageError(str(e), exitcode=2) from None
    return job


def _evaluate(job):
    """The evaluator role: evaluates the chief's checkpoints as they come."""
    from tf2sync._src import checkpointing

    if not _CHECKPOINT_DIR.value:
        raise app.UsageError(
            "--job_name=evaluator needs --checkpoint_dir (where the chief "
            "saves its checkpoints).",
            exitcode=2,
        )
    checkpointing.evaluate_checkpoints(
        job.build_model,
        job.eval_arrays(),
        job.LOSS,
        job.METRICS,
        _CHECKPOINT_DIR.value,
        log_dir=_MODEL_LOG_DIR.value,
        max_evaluations=_MAX_EVALUATIONS.value or _EPOCHS.value,
        timeout=_EVAL_TIMEOUT.value,
    )
    return 0


def _wait_all(spec):
    from tf2sync._src import processes

    for address in spec["ps"] + spec["worker"]:
        processes.wait_for_port(address, _CONNECT_TIMEOUT.value)


def _main_tf_config(job):
    import tensorflow as tf

    try:
        config = json.loads(os.environ["TF_CONFIG"])
    except json.JSONDecodeError as e:
        raise app.UsageError(f"TF_CONFIG is not valid JSON: {e}") from None
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = resolver.cluster_spec().as_dict()
    task = config.get("task", {})
    task_type, index = task.get("type"), task.get("index", 0)
    return _run_task(job, spec, task_type, index, resolver, "TF_CONFIG")


def _main_jobset(job):
    """A JobSet pod: the role and cluster of `jobset.cluster_from_environ`."""
    import tensorflow as tf

    spec, task_type, index = _jobset_task()
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec),
        task_type=task_type,
        task_id=index,
        rpc_layer="grpc",
    )
    return _run_task(
        job, spec, task_type, index, resolver, "The JobSet environment"
    )


def _run_task(job, spec, task_type, index, resolver, source):
    """Runs task `task_type`:`index` of cluster `spec` (a dict).

    A ps or worker serves, the chief trains through `resolver`, an evaluator
    evaluates. `source` names where `spec` came from, in errors.
    """
    if not spec.get("ps") or not spec.get("worker"):
        raise app.UsageError(
            f"{source} must name 'ps' and 'worker' tasks. Received cluster: "
            f"{spec}",
            exitcode=2,
        )
    _warn_public([h for hosts in spec.values() for h in hosts])
    _check_num_ps(len(spec["ps"]))
    if task_type in ("ps", "worker"):
        _serve(spec, task_type, index)
        return 0
    if task_type == "chief":
        _wait_all(spec)
        train(resolver, job)
        return 0
    if task_type == "evaluator":
        return _evaluate(job)
    raise app.UsageError(
        f"{source} task.type must be chief, ps, worker or evaluator. "
        f"Received: {task_type!r}"
    )


def _import_job_before_flags(argv):
    """Imports --job_module before absl parses `argv`, if it can.

    A job module may so define absl flags of its own (parsed with the
    launcher's), and `FLAG_DEFAULTS`, a dict of launcher flag name to
    default for that job (the command line still wins). A module that does
    not import is left to `_load_job`, which reports it after parsing.
    """
    name = console.flag_value(argv, "job_module") or _JOB_MODULE.default
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        job = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - reported by _load_job after parsing
        return
    for flag_name, default in getattr(job, "FLAG_DEFAULTS", {}).items():
        flags.FLAGS.set_default(flag_name, default)


def run():
    """Console-script entry point."""
    console.setup_launcher(sys.argv)  # done already by `tf2sync`'s import
    _import_job_before_flags(sys.argv)
    console.flags_in_help(
        __name__,
        console.flag_value(sys.argv, "job_module") or _JOB_MODULE.default,
    )
    app.run(main)
