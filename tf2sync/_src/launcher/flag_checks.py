"""The launcher's input checks: bad input refused before anything starts.

Each check raises absl's `app.UsageError` (exit code 2: absl prints the
usage hint and the message) with one line that names the flag, or
`TF_CONFIG`, and the value received. `input.check_input` runs them
all from one place, before any task starts and before the chief
connects. Nothing here imports TensorFlow; what a checkpoint holds is
checked by `checkpointing.check_model_fits`.
"""

from __future__ import annotations

import glob
import json
import math
import os

from absl import app

from tf2sync._src import directories
from tf2sync._src.launcher import job_contract

_TASK_TYPES = ("chief", "ps", "worker", "evaluator")


def _refuse(message: str):
    raise app.UsageError(message, exitcode=2)


def check_positive_ints(values: dict) -> None:
    """Refuses a flag of `values` (name to value; None: unset) below 1."""
    for name, value in values.items():
        if value is not None and value <= 0:
            _refuse(f"--{name}={value}: must be a positive integer.")


def check_non_negative(values: dict) -> None:
    """Refuses a flag of `values` (name to number; None: unset) below 0,
    NaN or infinite (a timeout: 0 is none)."""
    for name, value in values.items():
        if value is not None and not 0 <= value < math.inf:
            _refuse(f"--{name}={value:g}: must be a finite number >= 0.")


def check_positive(values: dict) -> None:
    """Refuses a flag of `values` (name to number; None: unset) not > 0."""
    for name, value in values.items():
        if value is not None and not value > 0:
            _refuse(f"--{name}={value:g}: must be > 0.")


def check_optimizer_flags(learning_rate: float, momentum: float) -> None:
    """Refuses a learning rate that is not a finite number > 0, and a
    momentum outside tf_keras SGD's [0, 1] (refused there too, but only
    once the cluster has started). A NaN or infinite rate would otherwise
    train on: its first update makes every later gradient non-finite, and
    each is dropped."""
    if not math.isfinite(learning_rate) or learning_rate <= 0:
        _refuse(
            f"--learning_rate={learning_rate!r}: must be a finite number > 0."
        )
    if not 0 <= momentum <= 1:  # NaN too
        _refuse(f"--momentum={momentum!r}: must be in [0, 1].")


def check_checkpoint_dir(
    path: str | None, *, writable: bool, name: str = "checkpoint_dir"
) -> None:
    """Refuses a --checkpoint_dir (or another directory flag, `name`) that
    `directories.directory_problem` finds wrong."""
    problem = directories.directory_problem(path, writable=writable)
    if problem:
        _refuse(f"--{name}={path}: {problem}.")


def check_job_api(
    job, name: str, *, evaluator: bool, steps_per_epoch: int | None
) -> None:
    """Refuses a job module that does not give what the chief (or the
    evaluator) uses, in one line (`job_contract.check`)."""
    job_contract.check(
        job, name, evaluator=evaluator, steps_per_epoch=steps_per_epoch
    )


def parse_tf_config(text: str) -> dict:
    """`TF_CONFIG` parsed, refused if its task is not one of its cluster.

    ps, worker and chief tasks must be in the cluster (type and index); an
    evaluator need not be. Without this, a task that is not in its cluster
    waits for --connect_timeout, or serves a cluster nobody dials.
    """
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        _refuse(f"TF_CONFIG is not valid JSON: {e}")
    if not isinstance(config, dict):
        _refuse(f"TF_CONFIG must be a JSON object. Received: {text}")
    cluster = config.get("cluster") or {}
    task = config.get("task") or {}
    if not isinstance(cluster, dict) or not isinstance(task, dict):
        _refuse(
            "TF_CONFIG must hold a 'cluster' object and a 'task' object. "
            f"Received: {text}"
        )
    check_distinct_addresses(
        cluster,
        lambda role, hosts: f"TF_CONFIG cluster {role}={json.dumps(hosts)}",
    )
    chiefs = cluster.get("chief") or []
    if len(chiefs) > 1:  # PSS has one coordinator
        _refuse(
            f"TF_CONFIG cluster chief={json.dumps(chiefs)}: a cluster has "
            "one chief."
        )
    task_type, index = task.get("type"), task.get("index", 0)
    where = f"TF_CONFIG task type={task_type!r} index={index!r}"
    if task_type not in _TASK_TYPES:
        _refuse(
            "TF_CONFIG task.type must be chief, ps, worker or evaluator. "
            f"Received: {task_type!r}"
        )
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        _refuse(f"{where}: the index must be an integer >= 0.")
    if task_type == "evaluator":
        return config
    hosts = cluster.get(task_type) or []
    if not hosts:
        _refuse(
            f"{where}: the cluster names no {task_type} task (it names "
            f"{', '.join(sorted(cluster)) or 'nothing'})."
        )
    if index >= len(hosts):
        _refuse(
            f"{where}: the cluster names {len(hosts)} {task_type} task(s), "
            f"index 0 to {len(hosts) - 1}."
        )
    return config


def address_problem(address: str) -> str | None:
    """What is wrong with a task's `host:port`, in words, or None: a space
    in it, no host, or a port that is not 1-65535 (a server cannot listen
    there, and its peers would wait for it for --connect_timeout)."""
    if any(c.isspace() for c in address):
        return "has a space"
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit() or not 0 < int(port) < 65536:
        return "is not host:port with a port of 1-65535"
    if not host.strip("[]"):
        return "has no host"
    return None


def check_distinct_addresses(cluster: dict, named) -> None:
    """Refuses a cluster that names one host:port for two tasks (the second
    task's server cannot listen there, and the chief would wait for it for
    --connect_timeout), a task that is not a string or not a host:port
    (`address_problem`), or a role whose tasks are not a list.

    Args:
      cluster: Role to its hosts: a list, or TF's `{index: host}`.
      named: `named(role, hosts)` names, in the refusal, the argument that
        holds `role`'s `hosts` (a flag and its value, or TF_CONFIG's).
    """
    seen = {}
    for role, hosts in cluster.items():
        if isinstance(hosts, dict):  # TF's sparse form: {index: host}
            tasks = list(hosts.items())
        elif isinstance(hosts, list):
            tasks = list(enumerate(hosts))
        else:
            _refuse(
                f"{named(role, hosts)}: a role's tasks must be a list of "
                'host:port strings, e.g. ["10.0.0.1:2222"].'
            )
        for index, host in tasks:
            if not isinstance(host, str):
                _refuse(
                    f"{named(role, hosts)}: each task must be a host:port "
                    f"string. Received: {host!r}"
                )
            problem = address_problem(host)
            if problem:
                _refuse(f"{named(role, hosts)}: {host!r} {problem}.")
            key = _listening_key(host)
            if key in seen:
                first, where = seen[key]
                same = host if first == host else f"{host} ({first})"
                _refuse(
                    f"{named(role, hosts)}: {same} is both {where} and "
                    f"{role} {index}; each task needs its own host:port."
                )
            seen[key] = (host, f"{role} {index}")


_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]", "::1")


def _listening_key(address: str) -> tuple:
    """Where a task's server would listen: its host and port number, every
    name of this machine's loopback as one (a TF server listens on all of
    its machine's interfaces, so `localhost:2222` and `127.0.0.1:2222`
    are one port), a port as its number (`023000` is 23000)."""
    host, _, port = address.rpartition(":")
    host = host.lower()
    if host in _LOOPBACK_NAMES or host.startswith("127."):
        host = "loopback"
    return host, int(port)


def check_checkpoint_every(
    every_s, every_steps, directory, background=False
) -> None:
    """Refuses --checkpoint_every_s that is not a finite number > 0, and
    either cadence or --checkpoint_in_background without --checkpoint_dir
    (nowhere to save)."""
    if every_s is not None and not 0 < every_s < math.inf:
        _refuse(
            f"--checkpoint_every_s={every_s!r}: must be a finite number > 0."
        )
    for name, value in (
        ("checkpoint_every_s", every_s),
        ("checkpoint_every_steps", every_steps),
    ):
        if value is not None and not directory:
            _refuse(
                f"--{name}={value:g}: needs --checkpoint_dir (where to save)."
            )
    if background and not directory:
        _refuse(
            "--checkpoint_in_background: needs --checkpoint_dir (where to "
            "save)."
        )


def check_resume(build_model, directory, epochs, evaluator) -> None:
    """Refuses a --checkpoint_dir whose newest checkpoint another model
    saved, or (for the chief) one with no epoch left to train."""
    if not directory:
        return
    from tf2sync._src import checkpointing  # imports TensorFlow

    try:
        checkpointing.check_model_fits(build_model, directory)
    except ValueError as e:
        _refuse(f"--checkpoint_dir={directory}: {e}")
    if not evaluator:
        latest, done = checkpointing.latest_epoch(directory)
        check_epochs_left(directory, latest, done, epochs)


def check_epochs_left(
    directory: str, latest: str | None, done: int, epochs: int
) -> None:
    """Refuses a --checkpoint_dir whose newest checkpoint `latest` finished
    more epochs (`done`) than --epochs asks for: nothing to train.

    A checkpoint of exactly --epochs epochs is not refused: the chief then
    trains nothing and evaluates the finished model (a restarted chief).
    """
    if latest is not None and done > epochs:
        _refuse(
            f"--checkpoint_dir={directory}: the checkpoint "
            f"{os.path.basename(latest)} already finished epoch {done} of "
            f"--epochs={epochs}, nothing to train (pass --epochs above "
            f"{done} to train on, or another --checkpoint_dir)."
        )


def check_total_num_replicas(total, workers, gpus, local):
    """--total_num_replicas above the cluster's replicas: each step would
    hand out tokens for replicas that do not exist, so workers run ahead
    and a share of their pushes arrives stale. Checked where the replicas
    are known: one per GPU of --num_gpus, one per worker with
    --num_gpus=0, or in the `local` mode on a machine without an NVIDIA
    device (asking TensorFlow would start its runtime before the forks)."""
    if gpus is None and local and not glob.glob("/dev/nvidia[0-9]*"):
        gpus = 0
    if total is None or not workers or gpus is None:
        return
    replicas = workers * max(1, gpus or 0)
    if total > replicas:
        raise app.UsageError(
            f"--total_num_replicas={total}: more than the {replicas} "
            f"replica(s) of the cluster ({workers} worker(s)"
            + (f" x {gpus} GPU(s)" if gpus else "")
            + "): each step would hand out tokens for replicas that do not "
            "exist and workers would push stale gradients; give at most "
            f"{replicas}.",
            exitcode=2,
        )
