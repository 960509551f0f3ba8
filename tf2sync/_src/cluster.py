"""Local clusters on 127.0.0.1: in-process servers, free ports."""

from __future__ import annotations

import contextlib
import socket

import tensorflow as tf

from tf2sync._src import config as config_lib

LOOPBACK = "127.0.0.1"


def pick_free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """Returns `count` distinct TCP ports free on `host` right now."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()


def cluster_spec_dict(num_workers: int, num_ps: int, host=LOOPBACK):
    """A cluster dict with one chief, `num_workers` workers, `num_ps` ps."""
    ports = pick_free_ports(1 + num_workers + num_ps, host)
    addresses = [f"{host}:{p}" for p in ports]
    return {
        "chief": addresses[:1],
        "worker": addresses[1 : 1 + num_workers],
        "ps": addresses[1 + num_workers :],
    }


def server_config(num_workers: int) -> tf.compat.v1.ConfigProto:
    """Server config that does not hang on small machines.

    Worker servers need `inter_op_parallelism_threads >= num_workers + 1`:
    with fewer, blocked token dequeues and pushes can starve the executor
    of a 2-core machine.
    """
    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = max(num_workers + 1, 4)
    return config


_SERVERS = []  # in-process servers live as long as the process
_SPECS = []  # cluster dicts, the latest last


def latest_local_cluster_spec():
    """The cluster dict of the latest `local_cluster` of this process."""
    return _SPECS[-1] if _SPECS else None


def local_cluster(num_workers: int = 2, num_ps: int = 1):
    """Starts an in-process cluster on 127.0.0.1 and returns its resolver.

    The servers listen on free ports picked on 127.0.0.1 and are named only
    by that address. TensorFlow cannot stop in-process servers: they live
    as long as this process, so start one cluster per process (use
    subprocess servers, see `tf2sync.launch`, to stop them by PID).

    Args:
      num_workers: Worker tasks to start.
      num_ps: Parameter-server tasks to start.

    Returns:
      A `tf.distribute.cluster_resolver.SimpleClusterResolver` for the chief
      (this process), with `rpc_layer="grpc"`.

    Raises:
      TypeError, ValueError: If a count is not a positive int.
    """
    config_lib.check_positive_int("num_workers", num_workers)
    config_lib.check_positive_int("num_ps", num_ps)
    spec_dict = cluster_spec_dict(num_workers, num_ps)
    spec = tf.train.ClusterSpec(spec_dict)
    config = server_config(num_workers)
    _SPECS.append(spec_dict)
    for job in ("worker", "ps"):
        for index in range(len(spec_dict[job])):
            _SERVERS.append(
                tf.distribute.Server(
                    spec,
                    job_name=job,
                    task_index=index,
                    protocol="grpc",
                    config=config,
                    start=True,
                )
            )
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type="chief", task_id=0, rpc_layer="grpc"
    )
