"""What each distributed-TF1 construct becomes with tf2sync, and where.

One `Construct` per kind of finding of `finder`, in the order the tool
prints its summary and `docs/migrating.md` lists them ("Constructs the
migration tool finds"; `tests/migrate_test.py` checks that the doc holds
`markdown_table()` and every anchor). Cluster flags name their own
counterpart (`FLAG_FORMS`).
"""

from __future__ import annotations

import dataclasses

DOC = "docs/migrating.md"


@dataclasses.dataclass(frozen=True)
class Construct:
    """One kind of distributed-TF1 construct.

    Attributes:
      name: the short name the summary counts it under.
      label: what the doc's table calls it.
      form: its TF2 / tf2sync form, one line.
      anchor: the section of `docs/migrating.md` that explains the form.
      distributed: whether it makes a program distributed by itself. The
        others (sessions, their loops, the global step, hooks) are reported
        only in a program that has one that does: a single-machine TF1
        program has them too, and `tf_upgrade_v2` is its tool.
    """

    name: str
    label: str
    form: str
    anchor: str
    distributed: bool = True

    @property
    def link(self) -> str:
        """`docs/migrating.md#anchor`."""
        return f"{DOC}#{self.anchor}"


_CLUSTER = "cluster-servers-and-roles"
_SESSIONS = "sessions-and-the-training-loop"
_CHIEF_CALLS = "the-chiefs-synchronization-calls"
_STEP = "global_step-and-replica_id"
_PORT = "the-port-step-by-step"

_NO_CHIEF_OP = (
    "delete it (the shim has no such attribute): the coordinator seeds "
    "the workers' local steps before the first step"
)

CONSTRUCTS = (
    Construct(
        "Server",
        "`tf.train.Server`, `tf.distribute.Server`",
        "the launcher's ps and worker tasks start the servers "
        "(`tf2sync --job_name=ps ...`, `tf2sync --job_name=worker ...`, or "
        "TF_CONFIG); on one machine "
        "`tf2sync.testing.local_cluster(num_workers, num_ps)`",
        _CLUSTER,
    ),
    Construct(
        "ClusterSpec",
        "`tf.train.ClusterSpec`",
        "the launcher's `--ps_hosts`, `--worker_hosts`, `--chief_host` or "
        "TF_CONFIG; in your own program a `TFConfigClusterResolver()` "
        "given to `tf2sync.SyncParameterServerStrategy`",
        _CLUSTER,
    ),
    Construct(
        "replica_device_setter",
        "`tf.train.replica_device_setter`",
        "create the variables under `SyncParameterServerStrategy.scope()` "
        "(placed round robin on the ps; `variable_partitioner=` for "
        "partitioned ones)",
        _PORT,
    ),
    Construct(
        "SyncReplicasOptimizer",
        "`tf.train.SyncReplicasOptimizer`",
        "`tf2sync.compat.v1.SyncReplicasOptimizer(inner, N, M)` under "
        "`strategy.scope()` (or `tf2sync.SyncOptimizer(keras_optimizer)`)",
        _PORT,
    ),
    Construct(
        "replica_id",
        "`SyncReplicasOptimizer(replica_id=...)` (before TF 1.0)",
        "delete the argument: gone since TF 1.0 (a TypeError in the shim); "
        "the strategy knows which worker runs each step",
        _STEP,
    ),
    Construct(
        "make_session_run_hook",
        "`opt.make_session_run_hook(is_chief)`",
        "optional: the coordinator starts the round before the first "
        "step with TF1's default tokens (a kept hook still works; keep one "
        "given `num_tokens`, or the run starts with other tokens)",
        _CHIEF_CALLS,
    ),
    Construct(
        "get_chief_queue_runner",
        "`opt.get_chief_queue_runner()`",
        "not needed: the coordinator starts the round (the shim's runner "
        "only starts and stops the token watchdog)",
        _CHIEF_CALLS,
    ),
    Construct(
        "get_init_tokens_op",
        "`opt.get_init_tokens_op()`",
        "not needed: the coordinator enqueues the initial tokens before "
        "the first step",
        _CHIEF_CALLS,
    ),
    Construct(
        "chief_init_op",
        "`opt.chief_init_op`",
        _NO_CHIEF_OP,
        _CHIEF_CALLS,
    ),
    Construct(
        "local_step_init_op",
        "`opt.local_step_init_op`",
        _NO_CHIEF_OP,
        _CHIEF_CALLS,
    ),
    Construct(
        "ready_for_local_init_op",
        "`opt.ready_for_local_init_op`",
        _NO_CHIEF_OP,
        _CHIEF_CALLS,
    ),
    Construct(
        "MonitoredTrainingSession",
        "`tf.train.MonitoredTrainingSession`",
        "`model.fit` or `tf2sync.Trainer(..., checkpoint_dir=DIR)` in the "
        "coordinator program (it saves and restores the checkpoints)",
        _SESSIONS,
        False,
    ),
    Construct(
        "Supervisor",
        "`tf.train.Supervisor`",
        "`model.fit` or `tf2sync.Trainer(..., checkpoint_dir=DIR)` in the "
        "coordinator program (it saves and restores the checkpoints)",
        _SESSIONS,
        False,
    ),
    Construct(
        "prepare_or_wait_for_session",
        "`sv.prepare_or_wait_for_session`, `sv.managed_session`",
        "delete it: no session; the workers wait for the steps the "
        "coordinator schedules",
        _SESSIONS,
        False,
    ),
    Construct(
        "start_queue_runners",
        "`sv.start_queue_runners`",
        "delete it: input is a `tf.data` dataset per worker, and the "
        "chief's queue runner is not needed",
        _SESSIONS,
        False,
    ),
    Construct(
        "sess.run loop",
        "`sess.run(train_op)` in a loop",
        "`coordinator.schedule(step)` of a `tf.function` that calls "
        "`strategy.run(replica_fn)` (or `model.fit`, `tf2sync.Trainer`)",
        _SESSIONS,
        False,
    ),
    Construct(
        "is_chief branch",
        "`if is_chief:`, `task_index == 0`",
        "one coordinator program (the launcher's chief task) runs the "
        "chief's part; workers run no code of yours outside the steps",
        _CLUSTER,
    ),
    Construct(
        "cluster flag",
        "cluster flags (`ps_hosts`, `worker_hosts`, `job_name`, "
        "`task_index`, `sync_replicas`, `replicas_to_aggregate`, ...)",
        "the launcher's flags or TF_CONFIG (the tool names each flag's "
        "counterpart)",
        _CLUSTER,
    ),
    Construct(
        "StopAtStepHook",
        "`tf.train.StopAtStepHook`",
        "`model.fit(epochs=..., steps_per_epoch=...)`, or the number of "
        "steps you `coordinator.schedule`",
        _SESSIONS,
        False,
    ),
    Construct(
        "global_step",
        "`global_step` creation (`get_or_create_global_step`, "
        "`tf.Variable(0, trainable=False)`)",
        "the shim: a `tf.Variable(0, dtype=tf.int64)` created under "
        "`strategy.scope()`, given to one `apply_gradients`; "
        "`tf2sync.SyncOptimizer`: its `iterations`",
        _STEP,
        False,
    ),
)

BY_NAME = {c.name: c for c in CONSTRUCTS}

_SAME_FLAG = "the launcher's `--{}` (or TF_CONFIG)"
_NO_TARGET = (
    "none: the launcher starts the servers and the chief connects to "
    "them (`--chief_host`)"
)
_NUM_PS = "the launcher's `--num_ps` (checked against `--ps_hosts`)"
_NUM_WORKERS = (
    "the number of `--worker_hosts` (on one machine "
    "`--local_cluster=WORKERS,PS`)"
)
_RTA = "the launcher's `--replicas_to_aggregate`"

# Each TF1 cluster flag (name after `--`, `-` read as `_`) -> its form.
FLAG_FORMS = {
    "ps_hosts": _SAME_FLAG.format("ps_hosts"),
    "worker_hosts": _SAME_FLAG.format("worker_hosts"),
    "job_name": (
        "the launcher's `--job_name` (ps, worker, chief; or TF_CONFIG's "
        "task type): the chief runs the training program"
    ),
    "task_index": _SAME_FLAG.format("task_index"),
    "task_id": _SAME_FLAG.format("task_index"),
    "worker_grpc_url": _NO_TARGET,
    "master": _NO_TARGET,
    "existing_servers": _NO_TARGET,
    "sync_replicas": (
        "none: `SyncParameterServerStrategy` is synchronous "
        "(`--sync_optimizer=tf1_shim` keeps TF1's protocol)"
    ),
    "replicas_to_aggregate": _RTA,
    "num_replicas_to_aggregate": _RTA,
    "total_num_replicas": "the launcher's `--total_num_replicas`",
    "num_workers": _NUM_WORKERS,
    "worker_replicas": _NUM_WORKERS,
    "num_ps": _NUM_PS,
    "num_ps_tasks": _NUM_PS,
    "ps_tasks": _NUM_PS,
    "num_parameter_servers": _NUM_PS,
}


# A hook given its own `num_tokens` (`finder`): the coordinator's start
# would enqueue TF1's default instead.
HOOK_WITH_TOKENS = (
    "keep it, called after the step is traced: its `num_tokens` sets the "
    "round's initial tokens, and without it the coordinator enqueues "
    "TF1's default (`replicas_to_aggregate`), which wastes a different "
    "number of steps"
)


def markdown_table() -> str:
    """The doc's table: one row per construct, its form and its section."""
    lines = [
        "| Construct | TF2 / tf2sync form | Section |",
        "|---|---|---|",
    ]
    for c in CONSTRUCTS:
        lines.append(f"| {c.label} | {c.form} | [#{c.anchor}](#{c.anchor}) |")
    return "\n".join(lines) + "\n"
