"""The launcher's flags (`launch`): the only module that defines absl flags.

Each flag is a `flags.FlagHolder`; `input` checks their values
before any task starts, and `launch` converts them to the chief's config
(`input.chief_config`). Validators here refuse a malformed single
value at parse time (absl's usage error); checks that need several flags,
TF_CONFIG or the job module are `input.check_input`'s.
"""

from __future__ import annotations

from absl import flags

from tf2sync._src.launcher import console
from tf2sync._src.launcher import flag_checks

JOB_NAME = flags.DEFINE_enum(
    "job_name",
    None,
    ["ps", "worker", "chief", "evaluator"],
    "This task's role (TF1 style). Unset: TF_CONFIG, else a JobSet pod's "
    "environment, else --local_cluster (see --cluster_from).",
)
CLUSTER_FROM = flags.DEFINE_enum(
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
TASK_INDEX = flags.DEFINE_integer("task_index", 0, "This task's index.")
PS_HOSTS = flags.DEFINE_list("ps_hosts", [], "ps tasks, host:port,...")
WORKER_HOSTS = flags.DEFINE_list(
    "worker_hosts", [], "worker tasks, host:port,..."
)
CHIEF_HOST = flags.DEFINE_string(
    "chief_host", None, "The chief (coordinator) task, host:port."
)
LOCAL_CLUSTER = flags.DEFINE_string(
    "local_cluster",
    "2,1",
    "WORKERS,PS: start this cluster as local subprocesses on 127.0.0.1 "
    "(used when neither --job_name, TF_CONFIG nor a JobSet's environment "
    "is set; see --cluster_from).",
)
NUM_PS = flags.DEFINE_integer(
    "num_ps",
    None,
    "Number of ps tasks. Local mode: the PS of --local_cluster (given "
    "alone, the workers stay at --local_cluster's default, 2; given with "
    "--local_cluster, the two must agree). With --ps_hosts or TF_CONFIG: "
    "checked against the ps tasks they name.",
)
MIN_SHARD_BYTES = flags.DEFINE_integer(
    "min_shard_bytes",
    None,
    "Shard variables of rank >= 1 along axis 0 with tf.distribute."
    "experimental.partitioners.MinSizePartitioner(min_shard_bytes, "
    "max_shards): as many shards as keep each at least this many bytes, at "
    "most --max_shards (default: the number of ps), placed round robin "
    "over the ps. Unset, and --max_shards unset: no partitioner (each "
    "variable whole on one ps).",
)
MAX_SHARDS = flags.DEFINE_integer(
    "max_shards",
    None,
    "Shard variables into at most this many shards (see --min_shard_bytes; "
    "given alone, shards are at least 256 KiB, MinSizePartitioner's "
    "default: a large table splits into --max_shards, small kernels and "
    "biases stay whole).",
)
REPLICAS_TO_AGGREGATE = flags.DEFINE_integer(
    "replicas_to_aggregate",
    None,
    "Gradients averaged per update (default: the number of workers).",
)
TOTAL_NUM_REPLICAS = flags.DEFINE_integer(
    "total_num_replicas",
    None,
    "Replicas pushing gradients (default: the number of workers).",
)
JOB_MODULE = flags.DEFINE_string(
    "job_module",
    "tf2sync._src.jobs.digits",
    "Module with build_model, train_dataset, eval_arrays, "
    "num_train_examples (unless --steps_per_epoch), LOSS, METRICS "
    "(see jobs/digits.py); it may define flags of its own and "
    "FLAG_DEFAULTS for the launcher's (jobs/clicks.py).",
)
BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Batch per replica.")
EPOCHS = flags.DEFINE_integer("epochs", 10, "Epochs to train.")
STEPS_PER_EPOCH = flags.DEFINE_integer(
    "steps_per_epoch",
    None,
    "Replica steps (pushes) per epoch, over all workers. Default: one pass "
    "over the data, each worker reading its shard once "
    "(workers x ceil(num_train_examples / workers / batch_size)).",
)
STEPS_PER_EXECUTION = flags.DEFINE_integer(
    "steps_per_execution",
    None,
    "Replica steps per scheduled function. Default: the largest divisor "
    "of a worker's steps of an epoch up to 10 (if at least 5, else 10), so "
    "that the epoch's functions are the same size (docs/data.md).",
)
UNROLL_STEPS = flags.DEFINE_boolean(
    "unroll_steps",
    True,
    "Repeat the step in each scheduled function, up to 10 copies per "
    "loop iteration (fit's default under tf2sync), instead of tf_keras's "
    "tf.range loop, whose control crosses to the ps every step. "
    "--nounroll_steps: tf_keras's loop (tracing is then faster, for large "
    "models).",
)
LEARNING_RATE = flags.DEFINE_float(
    "learning_rate",
    0.01,
    "Base SGD rate (the default job scales it per variable group).",
)
MOMENTUM = flags.DEFINE_float(
    "momentum",
    0.9,
    "SGD momentum, in [0, 1] (a job's build_optimizer gets it too).",
)
NUM_GPUS = flags.DEFINE_integer(
    "num_gpus",
    None,
    "GPUs each worker uses (default: all it sees; 0: CPU only). The ps "
    "always runs on CPU. In local mode each worker gets its own GPUs.",
)
MIXED_PRECISION = flags.DEFINE_enum(
    "mixed_precision",
    "float32",
    ["float32", "mixed_float16", "mixed_bfloat16"],
    "Keras dtype policy of the model; mixed_float16 turns on tf2sync's "
    "dynamic loss scaling.",
)
SYNC_OPTIMIZER = flags.DEFINE_enum(
    "sync_optimizer",
    "tf2sync",
    ["tf2sync", "tf1_shim"],
    "tf2sync: tf2sync.SyncOptimizer (per-step barrier, packed pushes). "
    "tf1_shim: tf2sync.compat.v1.SyncReplicasOptimizer around the job's "
    "build_optimizer() if it has one (examples/tf1_port/job.py: TF1's "
    "Adam), else TF1's MomentumOptimizer (a MultiOptimizer of momentum "
    "SGDs for a job's optimizer_groups()), with TF1's token and "
    "global-step behaviour (float32).",
)
TOKEN_TIMEOUT = flags.DEFINE_float(
    "token_timeout",
    60.0,
    "Seconds without a synchronous step and without tokens after which the "
    "chief releases the tokens a dead worker took (0: never).",
)
WORKER_TIMEOUT = flags.DEFINE_float(
    "worker_timeout",
    60.0,
    "Chief: seconds a worker may leave the chief's pings unanswered "
    "(frozen, partitioned) before it is treated as failed: its function "
    "runs again on another worker and its token is released (0: never).",
)
PS_RESTART_TIMEOUT = flags.DEFINE_float(
    "ps_restart_timeout",
    300.0,
    "Chief: seconds to wait for a failed parameter server to come back "
    "before giving up (resuming needs --checkpoint_dir).",
)
CONNECT_TIMEOUT = flags.DEFINE_float(
    "connect_timeout", 60.0, "Seconds to wait for each task to answer."
)
CHECKPOINT_DIR = flags.DEFINE_string(
    "checkpoint_dir",
    None,
    "Chief: save model and optimizer after every epoch (and as "
    "--checkpoint_every_steps and --checkpoint_every_s say) and resume from "
    "the latest on restart, inside an epoch too (created if missing). "
    "Refused at once (exit code 2) "
    "if it is a file or not writable, if its latest checkpoint is of "
    "another model, or if that checkpoint finished more epochs than "
    "--epochs (nothing to train); one that finished exactly --epochs "
    "trains nothing and evaluates the model. Evaluator: the checkpoints to "
    "evaluate.",
)
CHECKPOINT_EVERY_STEPS = flags.DEFINE_integer(
    "checkpoint_every_steps",
    None,
    "Chief: also save after every this many steps of an epoch (steps as "
    "--steps_per_epoch counts them), so that a restart redoes at most that "
    "many; each save waits for the steps under way (needs --checkpoint_dir).",
)
CHECKPOINT_EVERY_S = flags.DEFINE_float(
    "checkpoint_every_s",
    None,
    "Chief: also save when this many seconds passed since the last save "
    "(checked after each scheduled function; needs --checkpoint_dir).",
)
CHECKPOINT_IN_BACKGROUND = flags.DEFINE_bool(
    "checkpoint_in_background",
    False,
    "Chief: each save copies the variables on their own tasks and is "
    "written while training goes on (a second copy of every variable on "
    "each ps; needs --checkpoint_dir).",
)
MODEL_LOG_DIR = flags.DEFINE_string(
    "model_log_dir",
    None,
    "TensorBoard logs (chief: training and sync metrics; evaluator: eval).",
)
MAX_EVALUATIONS = flags.DEFINE_integer(
    "max_evaluations",
    None,
    "Evaluator: stop after this many checkpoints (default: --epochs).",
)
EVAL_TIMEOUT = flags.DEFINE_float(
    "eval_timeout",
    600.0,
    "Evaluator: stop when no new checkpoint comes for this many seconds.",
)
VERBOSE_SYNC_METRICS = flags.DEFINE_boolean(
    "verbose_sync_metrics",
    False,
    "Show every sync figure on the epoch line (accepted_w0, stale_w0, "
    "barrier_wait_s_epoch, ...), not only sync_steps, stale_dropped and "
    "examples_per_s. They are in the logs (History, TensorBoard) either way.",
)
INPUT_SHARDING = flags.DEFINE_enum(
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
DATA_SERVICE_PORT = flags.DEFINE_integer(
    "data_service_port",
    None,
    "With --input_sharding=service: the dispatcher's port on the chief's "
    "host; worker i's tf.data worker listens on this port + 1 + i on its "
    "host. Default: free ports in the local mode; required otherwise (the "
    "same value for every task).",
)
DATA_SERVICE_WORKER_PORT = flags.DEFINE_integer(
    "data_service_worker_port",
    None,
    "A worker's tf.data worker port (default: --data_service_port + 1 + "
    "--task_index; the local mode sets it).",
)
TASK_LOG_DIR = flags.DEFINE_string(
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
        problem = flag_checks.address_problem(host)
        if problem:
            raise flags.ValidationError(
                f"--{name} must be host:port entries. Received: "
                f"--{name}={','.join(hosts)} ({host!r} {problem})"
            )
    return True


flags.register_validator(
    "ps_hosts", lambda v: _validate_host_list("ps_hosts", v)
)
flags.register_validator(
    "worker_hosts", lambda v: _validate_host_list("worker_hosts", v)
)
flags.register_validator(
    "chief_host",
    lambda v: v is None or _validate_host_list("chief_host", [v]),
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
