"""The launcher's input: bad flags refused, and the cluster they name.

`check_input` (with `check_sharding_flags`) runs in `launch.main` before
any task starts and before the chief connects: a bad flag, TF_CONFIG,
JobSet environment, job module or checkpoint directory is one line naming
it and its value, absl's usage error (exit code 2). The pure checks on
values are `flag_checks`'. `launch` then reads the cluster, the job and the
chief's config through the rest (`cluster_source`, `spec_from_flags`,
`local_workers_and_ps`, `load_job`, `chief_config`), which refuse alike.
"""

from __future__ import annotations

import importlib
import ipaddress
import os
import sys

from absl import app
from absl import flags
from absl import logging

from tf2sync._src.launcher import console
from tf2sync._src.launcher import flags as launch_flags


def check_sharding_flags():
    """Refuses a non-positive --num_ps, --min_shard_bytes or --max_shards.

    absl's usage error, exit code 2, before any task starts.
    """
    for holder in (
        launch_flags.NUM_PS,
        launch_flags.MIN_SHARD_BYTES,
        launch_flags.MAX_SHARDS,
    ):
        if holder.value is not None and holder.value <= 0:
            raise app.UsageError(
                f"--{holder.name} must be a positive int. Received: "
                f"--{holder.name}={holder.value}",
                exitcode=2,
            )


def check_num_ps(num_ps):
    """Refuses --num_ps if it disagrees with the cluster's `num_ps`."""
    if (
        launch_flags.NUM_PS.value is not None
        and launch_flags.NUM_PS.value != num_ps
    ):
        raise app.UsageError(
            f"--num_ps={launch_flags.NUM_PS.value} but the cluster names "
            f"{num_ps} ps task(s).",
            exitcode=2,
        )


def cluster_source():
    """Where the cluster comes from: flags, tf_config, jobset or local.

    --cluster_from=auto: the first of the module docstring's modes that is
    given. Another value is that source, refused (usage error) if it is
    missing or if --job_name is given with anything but `flags`; a JobSet
    environment that lacks a variable is refused by `jobset_task`.
    """
    source = launch_flags.CLUSTER_FROM.value
    job_name = launch_flags.JOB_NAME.value
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


def jobset_task():
    """This JobSet pod's `jobset.JobSetTask`; bad environment: usage error."""
    from tf2sync._src.launcher import jobset

    try:
        return jobset.cluster_from_environ(os.environ)
    except ValueError as e:
        raise app.UsageError(str(e), exitcode=2) from None


def check_input():
    """Refuses bad flags, TF_CONFIG, job module or checkpoint directory.

    One line naming the flag (or TF_CONFIG) and the value, absl's usage
    error (exit code 2), from `main` before any task starts and before the
    chief connects (see `flag_checks`). ps and worker tasks check the
    flags and TF_CONFIG (or the JobSet environment) only.
    """
    from tf2sync._src.launcher import flag_checks

    if cluster_source() == "local":  # where the local tasks' logs go
        flag_checks.check_checkpoint_dir(
            launch_flags.TASK_LOG_DIR.value, writable=True, name="task_log_dir"
        )
        _check_local_gpus()
    flag_checks.check_positive_ints(
        {
            h.name: h.value
            for h in (
                launch_flags.REPLICAS_TO_AGGREGATE,
                launch_flags.TOTAL_NUM_REPLICAS,
                launch_flags.BATCH_SIZE,
                launch_flags.EPOCHS,
                launch_flags.STEPS_PER_EPOCH,
                launch_flags.STEPS_PER_EXECUTION,
                launch_flags.MAX_EVALUATIONS,
                launch_flags.CHECKPOINT_EVERY_STEPS,
            )
        }
    )
    flag_checks.check_checkpoint_every(
        launch_flags.CHECKPOINT_EVERY_S.value,
        launch_flags.CHECKPOINT_EVERY_STEPS.value,
        launch_flags.CHECKPOINT_DIR.value,
        launch_flags.CHECKPOINT_IN_BACKGROUND.value,
    )
    flag_checks.check_non_negative(
        {
            h.name: h.value
            for h in (
                launch_flags.TOKEN_TIMEOUT,
                launch_flags.WORKER_TIMEOUT,
                launch_flags.PS_RESTART_TIMEOUT,
            )
        }
    )
    flag_checks.check_positive(
        {
            h.name: h.value
            for h in (launch_flags.CONNECT_TIMEOUT, launch_flags.EVAL_TIMEOUT)
        }
    )
    flag_checks.check_optimizer_flags(
        launch_flags.LEARNING_RATE.value, launch_flags.MOMENTUM.value
    )
    _check_input_sharding()
    role = launch_flags.JOB_NAME.value
    source = cluster_source()
    _check_host_flags_used(source)
    spec, index, workers = None, launch_flags.TASK_INDEX.value, None
    if source == "tf_config":
        config = flag_checks.parse_tf_config(os.environ["TF_CONFIG"])
        role = config["task"]["type"]
        spec, index = config["cluster"], config["task"].get("index", 0)
    elif source == "jobset":
        task = jobset_task()
        role, spec, index = task.task_type, task.cluster, task.task_index
    elif source == "local":
        workers, _ = local_workers_and_ps()  # this process is the chief
        role = "chief"
    elif source == "flags" and role in ("ps", "worker", "chief"):
        spec = spec_from_flags(warn=False)
        check_num_ps(len(spec["ps"]))
    if spec is not None:
        _check_service_addresses(spec, role, index, source)
        workers = len(spec.get("worker", []))
    flag_checks.check_total_num_replicas(
        launch_flags.TOTAL_NUM_REPLICAS.value,
        workers,
        launch_flags.NUM_GPUS.value,
        local=source == "local",
    )
    if role in ("ps", "worker"):
        return
    evaluator = role == "evaluator"
    directory = launch_flags.CHECKPOINT_DIR.value
    flag_checks.check_checkpoint_dir(directory, writable=not evaluator)
    flag_checks.check_checkpoint_dir(
        launch_flags.MODEL_LOG_DIR.value, writable=True, name="model_log_dir"
    )
    job = load_job()
    flag_checks.check_job_api(
        job,
        launch_flags.JOB_MODULE.value,
        evaluator=evaluator,
        steps_per_epoch=launch_flags.STEPS_PER_EPOCH.value,
    )
    if launch_flags.INPUT_SHARDING.value == "service" and not callable(
        getattr(job, "train_pass", None)
    ):
        raise app.UsageError(
            "--input_sharding=service: "
            f"--job_module={launch_flags.JOB_MODULE.value} lacks "
            "train_pass(batch_size) (the finite, batched dataset of one pass; "
            "see tf2sync/_src/jobs/digits.py).",
            exitcode=2,
        )
    flag_checks.check_resume(
        job.build_model, directory, launch_flags.EPOCHS.value, evaluator
    )


def _check_local_gpus():
    """--num_gpus=N > 0 in the local mode needs a GPU on this machine (the
    workers share them when there are fewer than N per worker)."""
    wanted = launch_flags.NUM_GPUS.value
    if not wanted:
        return
    from tf2sync._src.launcher import local_tasks

    available = local_tasks.machine_gpus()
    if available == 0:
        raise app.UsageError(
            f"--num_gpus={wanted}: this machine shows TensorFlow no GPU "
            f"(--num_gpus=0 trains on CPU; {cuda_hint()}).",
            exitcode=2,
        )
    if wanted > available:
        raise app.UsageError(
            f"--num_gpus={wanted}: this machine shows TensorFlow "
            f"{available} GPU(s); a worker takes at most that many.",
            exitcode=2,
        )


def cuda_hint() -> str:
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
    if launch_flags.INPUT_SHARDING.value != "service":
        return
    port = launch_flags.DATA_SERVICE_PORT.value
    if port is not None and not 0 < port < 65536:
        raise app.UsageError(
            f"--data_service_port={port}: a port is 1-65535.", exitcode=2
        )
    worker_port = launch_flags.DATA_SERVICE_WORKER_PORT.value
    if worker_port is not None and not 0 < worker_port < 65536:
        raise app.UsageError(
            f"--data_service_worker_port={worker_port}: a port is 1-65535.",
            exitcode=2,
        )
    if port is None and cluster_source() != "local":
        raise app.UsageError(
            "--input_sharding=service needs --data_service_port outside the "
            "local mode (the dispatcher's port on the chief's host, the same "
            "for every task).",
            exitcode=2,
        )
    if launch_flags.SYNC_OPTIMIZER.value == "tf1_shim":
        raise app.UsageError(
            "--input_sharding=service needs --sync_optimizer=tf2sync (an "
            "epoch that ends with its data applies its last, incomplete "
            "step; the TF1 shim has no such step). Received: "
            "--sync_optimizer=tf1_shim",
            exitcode=2,
        )


def _check_host_flags_used(source):
    """Refuses the role flags' host flags where the cluster comes from
    elsewhere (TF_CONFIG, a JobSet, the local mode): they would be ignored,
    and a task meant to join them would start a cluster of its own."""
    if source == "flags":
        return
    for holder in (
        launch_flags.PS_HOSTS,
        launch_flags.WORKER_HOSTS,
        launch_flags.CHIEF_HOST,
    ):
        value = holder.value
        if value:
            shown = ",".join(value) if isinstance(value, list) else value
            raise app.UsageError(
                f"--{holder.name}={shown} is a role flag: it needs --job_name "
                "(ps, worker, chief or evaluator); without, the cluster "
                f"comes from {_SOURCE_WORDS[source]} and would ignore it.",
                exitcode=2,
            )


_SOURCE_WORDS = {
    "tf_config": "TF_CONFIG",
    "jobset": "the JobSet environment",
    "local": "the local mode (a cluster on this machine)",
}


def _check_service_addresses(spec, role, index, source):
    """--input_sharding=service's addresses in a cluster `spec`, checked
    before any server starts: the dispatcher on the chief's host, and
    worker `index`'s tf.data worker at --data_service_port + 1 + index
    (`data_service.addresses`' default) within 65535."""
    if launch_flags.INPUT_SHARDING.value != "service":
        return
    if not spec.get("chief"):
        where = (
            "--chief_host"
            if source == "flags"
            else f"a chief in {_SOURCE_WORDS[source]}"
        )
        raise app.UsageError(
            f"--input_sharding=service needs {where}: the tf.data "
            "dispatcher runs on the chief's host.",
            exitcode=2,
        )
    port = launch_flags.DATA_SERVICE_PORT.value
    if (
        role == "worker"
        and port is not None
        and launch_flags.DATA_SERVICE_WORKER_PORT.value is None
        and port + 1 + index > 65535
    ):
        raise app.UsageError(
            f"--data_service_port={port}: worker {index}'s tf.data worker "
            f"port ({port + 1 + index}, the port + 1 + its index) is past "
            "65535.",
            exitcode=2,
        )


def local_workers_and_ps():
    """--local_cluster's WORKERS,PS, with --num_ps's PS (see its help)."""
    workers, ps = _parse_local_cluster(launch_flags.LOCAL_CLUSTER.value)
    num_ps = launch_flags.NUM_PS.value
    if num_ps is None or num_ps == ps:
        return workers, ps
    if flags.FLAGS["local_cluster"].present:
        raise app.UsageError(
            f"--num_ps={num_ps} conflicts with --local_cluster="
            f"{launch_flags.LOCAL_CLUSTER.value} ({ps} ps): give one of "
            "them, or make them agree.",
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


def warn_public(hosts):
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


def spec_from_flags(warn=True):
    """The cluster the role flags name, refused (usage error) where a task
    could not serve it; `warn`: log each public address."""
    if not launch_flags.PS_HOSTS.value or not launch_flags.WORKER_HOSTS.value:
        raise app.UsageError(
            "--job_name needs --ps_hosts and --worker_hosts. Received: "
            f"--ps_hosts={','.join(launch_flags.PS_HOSTS.value)} "
            f"--worker_hosts={','.join(launch_flags.WORKER_HOSTS.value)}",
            exitcode=2,
        )
    spec = {
        "ps": launch_flags.PS_HOSTS.value,
        "worker": launch_flags.WORKER_HOSTS.value,
    }
    if launch_flags.CHIEF_HOST.value:
        spec["chief"] = [launch_flags.CHIEF_HOST.value]
    from tf2sync._src.launcher import flag_checks

    flag_checks.check_distinct_addresses(
        spec,
        lambda role, hosts: (
            f"--chief_host={hosts[0]}"
            if role == "chief"
            else f"--{role}_hosts={','.join(hosts)}"
        ),
    )
    job = launch_flags.JOB_NAME.value
    if job in spec and launch_flags.TASK_INDEX.value >= len(spec[job]):
        raise app.UsageError(
            f"--task_index={launch_flags.TASK_INDEX.value} but "
            f"--{'chief_host' if job == 'chief' else job + '_hosts'} names "
            f"{len(spec[job])} task(s).",
            exitcode=2,
        )
    if job == "chief" and "chief" not in spec:
        raise app.UsageError("--job_name=chief needs --chief_host.", exitcode=2)
    if warn:
        warn_public([h for hosts in spec.values() for h in hosts])
    return spec


def chief_config():
    from tf2sync._src.launcher import chief

    return chief.ChiefConfig(
        replicas_to_aggregate=launch_flags.REPLICAS_TO_AGGREGATE.value,
        total_num_replicas=launch_flags.TOTAL_NUM_REPLICAS.value,
        batch_size=launch_flags.BATCH_SIZE.value,
        epochs=launch_flags.EPOCHS.value,
        steps_per_epoch=launch_flags.STEPS_PER_EPOCH.value,
        steps_per_execution=launch_flags.STEPS_PER_EXECUTION.value,
        unroll_steps=launch_flags.UNROLL_STEPS.value,
        learning_rate=launch_flags.LEARNING_RATE.value,
        momentum=launch_flags.MOMENTUM.value,
        mixed_precision=launch_flags.MIXED_PRECISION.value,
        sync_optimizer=launch_flags.SYNC_OPTIMIZER.value,
        token_timeout=launch_flags.TOKEN_TIMEOUT.value or None,
        worker_timeout=launch_flags.WORKER_TIMEOUT.value or None,
        checkpoint_dir=launch_flags.CHECKPOINT_DIR.value,
        checkpoint_every_steps=launch_flags.CHECKPOINT_EVERY_STEPS.value,
        checkpoint_every_s=launch_flags.CHECKPOINT_EVERY_S.value,
        checkpoint_in_background=launch_flags.CHECKPOINT_IN_BACKGROUND.value,
        model_log_dir=launch_flags.MODEL_LOG_DIR.value,
        verbose_sync_metrics=launch_flags.VERBOSE_SYNC_METRICS.value,
        ps_restart_timeout=launch_flags.PS_RESTART_TIMEOUT.value,
        min_shard_bytes=launch_flags.MIN_SHARD_BYTES.value,
        max_shards=launch_flags.MAX_SHARDS.value,
    )


def load_job():
    """Imports --job_module and checks the chief's flags can train it.

    The working directory is searched too, as `python -m tf2sync` does (the
    `tf2sync` console script alone would not). Runs before any task starts.
    """
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    name = launch_flags.JOB_MODULE.value
    if not all(part.isidentifier() for part in (name or "").split(".")):
        raise app.UsageError(
            f"--job_module={name}: not a module name (a dotted import path, "
            "e.g. tf2sync._src.jobs.digits, or my_job for ./my_job.py).",
            exitcode=2,
        )
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
    except ImportError as e:  # the job module imports a name that is not
        raise app.UsageError(f"--job_module={name}: {e}", exitcode=2) from None
    from tf2sync._src.launcher import chief

    try:
        chief.check_sync_optimizer(job, chief_config())
    except ValueError as e:
        raise app.UsageError(str(e), exitcode=2) from None
    return job
