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

The launcher is three modules: `flags` defines its flags (the only
module that does), `input` refuses bad input before any task starts
and reads the cluster the flags name, and this one runs the role.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from absl import app
from absl import flags
from absl import logging

from tf2sync._src.launcher import console
from tf2sync._src.launcher import flags as launch_flags
from tf2sync._src.launcher import input as launch_input
from tf2sync._src.launcher import job_contract

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")


def _serve(spec, job, index):
    """Runs a ps or worker server until SIGTERM/SIGINT (or its parent ends).

    SIGTERM and SIGINT exit 0 at once, whatever disposition the task
    inherited. A local task (started with `processes.child_kwargs`) also
    exits when its launcher is gone (`processes.exit_with_parent`, from
    `main`).
    """
    import tensorflow as tf

    from tf2sync._src import cluster as cluster_lib
    from tf2sync._src.launcher import processes

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
    if job == "worker" and launch_flags.INPUT_SHARDING.value == "service":
        from tf2sync._src import data_service

        port = launch_flags.DATA_SERVICE_PORT.value
        dispatcher, address = data_service.addresses(
            spec, index, port, launch_flags.DATA_SERVICE_WORKER_PORT.value
        )
        tf_data_worker = data_service.start_worker(dispatcher, address)
        logging.info(
            "tf.data worker at %s (dispatcher %s)", address, dispatcher
        )
    processes.serve_forever(server)  # exits the process on a signal
    del tf_data_worker


def _forks_local_tasks() -> bool:
    """Whether the local mode will start its tasks as forks: no GPUs
    planned (see `local_tasks.LocalProcessCluster`) nor found, and TensorFlow
    has run nothing yet (a job module may at import: see
    `forker.TaskForker`)."""
    if (
        launch_flags.JOB_NAME.value is not None
        or launch_flags.NUM_GPUS.value is not None
    ):
        return False
    from tf2sync._src.internals import runtime

    if runtime.runtime_started():  # a job module ran TF, or a GPU
        return False
    try:
        return launch_input.cluster_source() == "local"
    except app.UsageError:
        return False  # said again, in its place, by `_main`


def _serve_forked(spec, job, index, args):
    """A local task forked from the launcher (`local_tasks.LocalProcessCluster`)
    : its flags `args` on top of the launcher's, then `_serve`."""
    from tf2sync._src.launcher import processes

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
    wanted = launch_flags.NUM_GPUS.value
    if wanted is None:
        wanted = len(gpus)
    if wanted > len(gpus):
        hint = f" ({launch_input.cuda_hint()})" if not gpus else ""
        raise app.UsageError(
            f"--num_gpus={wanted} but this worker sees {len(gpus)} GPU(s)"
            f"{hint}.",
            exitcode=2,
        )
    tf.config.set_visible_devices(gpus[:wanted], "GPU")
    logging.info("worker uses %d GPU(s)", wanted)


def _dispatcher_target(spec) -> str | None:
    """The tf.data service the chief's `fit` reads (`grpc://host:port`),
    or None (static sharding)."""
    if launch_flags.INPUT_SHARDING.value != "service":
        return None
    host = spec["chief"][0].rsplit(":", 1)[0]
    return f"grpc://{host}:{launch_flags.DATA_SERVICE_PORT.value}"


def train(resolver, job):
    """Runs the training job as chief (see `chief.train`); with
    --input_sharding=service, serves the tf.data dispatcher meanwhile."""
    import dataclasses

    from tf2sync._src.launcher import chief

    config = launch_input.chief_config()
    target = _dispatcher_target(resolver.cluster_spec().as_dict())
    dispatcher = None  # referenced while the chief trains
    if target is not None:
        from tf2sync._src import data_service

        dispatcher = data_service.start_dispatcher(
            launch_flags.DATA_SERVICE_PORT.value
        )
        spec = resolver.cluster_spec().as_dict()
        workers = len(spec["worker"])
        data_service.wait_for_workers(
            dispatcher,
            workers,
            launch_flags.CONNECT_TIMEOUT.value,
            [
                data_service.addresses(
                    spec,
                    i,
                    launch_flags.DATA_SERVICE_PORT.value,
                    _worker_port_flag(i),
                )[1]
                for i in range(workers)
            ],
        )
        config = dataclasses.replace(config, data_service=target)
    try:
        return chief.train(resolver, job, config)
    finally:
        del dispatcher


_FORKER = []  # the local mode's forker.TaskForker, made in `main`


def main(argv):
    from tf2sync._src.launcher import forker
    from tf2sync._src.launcher import processes

    if _forks_local_tasks():
        # Before any thread or TensorFlow op: see forker.TaskForker.
        _FORKER.append(forker.TaskForker(_serve_forked))
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
    launch_input.check_sharding_flags()
    # Bad input: one line, exit 2, before any task starts.
    launch_input.check_input()
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
    # `launch_input.check_input` has refused bad flags, the role flags'
    # cluster and --num_ps against it, before this runs.
    job_name = launch_flags.JOB_NAME.value
    if job_name in ("ps", "worker"):
        _serve(
            launch_input.spec_from_flags(),
            job_name,
            launch_flags.TASK_INDEX.value,
        )
        return 0
    job = launch_input.load_job()
    if job_name == "chief":
        import tensorflow as tf

        spec = launch_input.spec_from_flags()
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
    source = launch_input.cluster_source()
    if source == "tf_config":
        return _main_tf_config(job)
    if source == "jobset":
        return _main_jobset(job)
    from tf2sync._src.launcher import local_tasks

    workers, ps = launch_input.local_workers_and_ps()
    log_dir = console.launcher_log_dir() or console.task_log_dir(
        launch_flags.TASK_LOG_DIR.value
    )
    cluster = local_tasks.LocalProcessCluster(
        workers,
        ps,
        log_dir=log_dir,
        num_gpus=launch_flags.NUM_GPUS.value,
        worker_args=_service_worker_args(workers),
        forker=_FORKER[0] if _FORKER else None,
    )
    try:  # a signal meanwhile stops the cluster: processes.exit_on_signals
        resolver = cluster.start(timeout=launch_flags.CONNECT_TIMEOUT.value)
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
    if launch_flags.INPUT_SHARDING.value != "service":
        return None
    from tf2sync._src import cluster as cluster_lib

    # One pick for all (separate picks could return the same port).
    ports = cluster_lib.pick_free_ports(
        num_workers + (launch_flags.DATA_SERVICE_PORT.value is None)
    )
    if launch_flags.DATA_SERVICE_PORT.value is None:
        flags.FLAGS.data_service_port = ports.pop()
    _LOCAL_WORKER_PORTS[:] = ports
    return [
        [
            "--input_sharding=service",
            f"--data_service_port={launch_flags.DATA_SERVICE_PORT.value}",
            f"--data_service_worker_port={port}",
        ]
        for port in ports
    ]


def _evaluate(job):
    """The evaluator role: evaluates the chief's checkpoints as they come."""
    from tf2sync._src import checkpointing

    if not launch_flags.CHECKPOINT_DIR.value:
        raise app.UsageError(
            "--job_name=evaluator needs --checkpoint_dir (where the chief "
            "saves its checkpoints).",
            exitcode=2,
        )
    checkpointing.evaluate_checkpoints(
        lambda: job_contract.call(job, "build_model"),
        job_contract.call(job, "eval_arrays"),
        job.LOSS,
        job.METRICS,
        launch_flags.CHECKPOINT_DIR.value,
        log_dir=launch_flags.MODEL_LOG_DIR.value,
        max_evaluations=launch_flags.MAX_EVALUATIONS.value
        or launch_flags.EPOCHS.value,
        timeout=launch_flags.EVAL_TIMEOUT.value,
    )
    return 0


def _wait_all(spec):
    from tf2sync._src.launcher import local_tasks

    for address in spec["ps"] + spec["worker"]:
        local_tasks.wait_for_port(address, launch_flags.CONNECT_TIMEOUT.value)


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

    spec, task_type, index = launch_input.jobset_task()
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
    launch_input.warn_public([h for hosts in spec.values() for h in hosts])
    launch_input.check_num_ps(len(spec["ps"]))
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
    not import is left to `launch_input.load_job`, which reports it after
    parsing.
    """
    name = (
        console.flag_value(argv, "job_module")
        or launch_flags.JOB_MODULE.default
    )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        job = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - reported by launch_input.load_job after parsing
        return
    for flag_name, default in getattr(job, "FLAG_DEFAULTS", {}).items():
        flags.FLAGS.set_default(flag_name, default)


# absl's help flags: each prints help and exits (absl: 1; here: 0).
_HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml", "h", "?")


def _asks_for_help(argv) -> bool:
    for arg in argv[1:]:
        if arg == "--":
            return False
        if arg.startswith("-") and arg.lstrip("-").split("=")[0] in _HELP_FLAGS:
            return True
    return False


def _parse_flags(argv):
    """absl's flag parsing with the launcher's exit codes: a flag absl
    cannot parse (an unknown flag, a value of the wrong type) ends it with
    one line and exit 2, as every other bad input; `--help` exits 0."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        message = " ".join(str(error).split())
        sys.stderr.write(f"{message} (tf2sync --help lists the flags)\n")
        sys.stderr.flush()
        sys.exit(2)
    except SystemExit as done:
        if done.code == 1 and _asks_for_help(argv):
            sys.exit(0)
        raise


def run():
    """Console-script entry point."""
    console.setup_launcher(sys.argv)  # done already by `tf2sync`'s import
    _import_job_before_flags(sys.argv)
    console.flags_in_help(
        launch_flags.__name__,
        console.flag_value(sys.argv, "job_module")
        or launch_flags.JOB_MODULE.default,
    )
    app.run(main, flags_parser=_parse_flags)
