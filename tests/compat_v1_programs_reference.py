"""Three TF1 program shapes with TF1's real optimizer, in graph mode.

Usage: compat_v1_programs_reference.py SHAPE '<json phases>' ['<json config>']

The reference side of compat_v1_programs_test.py. Each SHAPE is a TF1
program of tests/testdata/migrate/, written as the TF1 program is, one
graph and one session per worker (TF1's between-graph replication), on an
in-process cluster of 2 workers and 1 ps on 127.0.0.1 (free ports):

* "supervisor": `mnist_replica.py`. A hidden-layer MLP (`xw_plus_b`,
  `relu`, `softmax`, the clipped-log cross entropy summed), TF1's Adam
  under the SyncReplicasOptimizer, `opt.minimize(cross_entropy,
  global_step)` with TF's own int32 `Variable(0)` as global step; the
  Supervisor's `local_init_op` (`chief_init_op` on the chief,
  `local_step_init_op` elsewhere) and `ready_for_local_init_op`; the chief
  then runs `get_init_tokens_op()` and starts `get_chief_queue_runner()`
  with `sv.start_queue_runners`. Each step is fed worker w's batch of the
  phase (`feed_dict`, `batch`).
* "monitored": `monitored_sync.py`. Each worker reads its shard of one
  dataset (`make_one_shot_iterator`), a dense layer and
  `tf.compat.v1.losses.sparse_softmax_cross_entropy`, Adagrad under the
  optimizer, `get_or_create_global_step()` (int64), and
  `MonitoredTrainingSession(hooks=[opt.make_session_run_hook(is_chief,
  num_tokens), StopAtStepHook(...)])`. `num_tokens` (config, default 0 as
  the program) is the hook's.
* "three": `three_optimizers.py`. Momentum at lr, 10 lr and 20 lr on w_a,
  w_b and w_c, one `tf.group` of the three `apply_gradients` per step, one
  hook per optimizer under one MonitoredTrainingSession. TF1 refuses
  `global_step=None`, so the global step goes to the first and B and C
  get private int64 step variables (SYNC_REPLICAS_SPEC.md 1.10: the
  variant where every counter rises by 1 per round and the local steps
  are deterministic; the token queue is shared, 6 tokens a round).

Variables start from `initial(shape)` and steps are fed `batch(shape, w,
phase)` (the test builds its side from the same functions). Each phase (a
list of worker indices) runs one `session.run` per worker concurrently,
waits until no round is pending (every accumulator below rta and every
step counter still), and prints one JSON line: `steps` (the global step,
then B's and C's), `weights` (every variable flattened, in creation
order) and `local` (per worker, each optimizer's local step). Exits with
os._exit: the chief's queue-runner threads stay blocked in a take.
"""

import json
import os
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf2sync.testing import cluster_spec_dict  # noqa: E402

NUM_WORKERS = 2
PIXELS, HIDDEN, CLASSES, BATCH = 12, 5, 4, 6  # mnist_replica, made small
FEATURES = 4  # monitored_sync's dense layer: 4 features, 10 classes
MNIST_LR = 0.01  # mnist_replica's --learning_rate
ADAGRAD_LR = 0.01  # monitored_sync's
MOMENTUM_LR = 0.01  # three_optimizers' LR (then 10 LR and 20 LR)
RATES = (1, 10, 20)
PHASE_TIMEOUT = 60.0


def initial(shape):
    """`[(name, float32 array)]`: the shape's variables, in creation order."""
    rng = np.random.RandomState({"supervisor": 1, "monitored": 2}.get(shape, 3))

    def normal(*dims, scale=1.0):
        return (rng.standard_normal(dims) * scale).astype("float32")

    if shape == "supervisor":
        return [
            ("hid_w", normal(PIXELS, HIDDEN, scale=1.0 / PIXELS**0.5)),
            ("hid_b", np.zeros([HIDDEN], "float32")),
            ("sm_w", normal(HIDDEN, CLASSES, scale=1.0 / HIDDEN**0.5)),
            ("sm_b", np.zeros([CLASSES], "float32")),
        ]
    if shape == "monitored":
        return [
            ("dense/kernel", normal(FEATURES, 10, scale=0.5)),
            ("dense/bias", np.zeros([10], "float32")),
        ]
    # three_optimizers starts w_a and w_b at zero, where both gradients of
    # the product are zero: random starts, so that every group trains.
    return [
        ("w_a", normal(4, 4, scale=0.5)),
        ("w_b", normal(4, 4, scale=0.5)),
        ("w_c", np.zeros([4], "float32")),
    ]


def batch(shape, worker, phase):
    """What worker `worker` is fed in phase `phase`: a tuple of arrays."""
    rng = np.random.RandomState(1000 * phase + worker)
    if shape == "supervisor":
        x = rng.uniform(0, 1, (BATCH, PIXELS)).astype("float32")
        y = np.eye(CLASSES, dtype="float32")[rng.randint(0, CLASSES, BATCH)]
        return x, y
    return (rng.standard_normal((8, 4)).astype("float32"),)


def dataset_arrays():
    """monitored_sync's examples: features and int64 labels."""
    rng = np.random.RandomState(7)
    return (
        rng.standard_normal((64, FEATURES)).astype("float32"),
        rng.randint(0, 10, 64).astype("int64"),
    )


def make_dataset(num_shards, index):
    """monitored_sync's `make_dataset()`, sharded per worker."""
    features, labels = dataset_arrays()
    ds = tf.data.Dataset.from_tensor_slices((features, labels))
    return ds.shard(num_shards, index).repeat().batch(8)


def mlp_loss(x, y_, hid_w, hid_b, sm_w, sm_b):
    """mnist_replica's `cross_entropy`."""
    hid = tf.nn.relu(tf.compat.v1.nn.xw_plus_b(x, hid_w, hid_b))
    y = tf.nn.softmax(tf.compat.v1.nn.xw_plus_b(hid, sm_w, sm_b))
    return -tf.reduce_sum(y_ * tf.math.log(tf.clip_by_value(y, 1e-10, 1.0)))


def dense_loss(features, labels, kernel, bias):
    """monitored_sync's `build_loss` (`tf.layers.dense`'s ops)."""
    logits = tf.nn.bias_add(tf.matmul(features, kernel), bias)
    return tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)


def three_loss(x, w_a, w_b, w_c):
    """three_optimizers' `loss`."""
    return tf.reduce_sum(tf.matmul(tf.matmul(x, w_a), w_b) + w_c)


class Worker:
    """One worker's graph, session and fetches."""

    def __init__(self, shape, w, cluster, server, config, num_tokens):
        self.shape, self.w = shape, w
        self.feeds = []
        is_chief = w == 0
        self.graph = tf.Graph()
        setter = tf.compat.v1.train.replica_device_setter(
            worker_device=f"/job:worker/task:{w}/cpu:0",
            ps_device="/job:ps/cpu:0",
            cluster=cluster,
        )
        with self.graph.as_default(), self.graph.device(setter):
            build = getattr(self, f"_build_{shape}")
            hooks = build(is_chief, num_tokens)
            self.num_acc = [
                o._accumulator_list[0][0].num_accumulated() for o in self.opts
            ]
            self.local = [o._local_step for o in self.opts]
            if shape == "supervisor":
                self.session = self._supervisor(is_chief, server, config)
            else:
                self.session = tf.compat.v1.train.MonitoredTrainingSession(
                    master=server.target,
                    is_chief=is_chief,
                    checkpoint_dir=tempfile.mkdtemp(),
                    hooks=hooks,
                    config=config,
                    stop_grace_period_secs=1,
                )

    def _variables(self):
        return [
            tf.compat.v1.Variable(value, name=name.replace("/", "_"))
            for name, value in initial(self.shape)
        ]

    def _build_supervisor(self, is_chief, num_tokens):
        del num_tokens  # the program runs get_init_tokens_op()'s default
        self.global_step = tf.compat.v1.Variable(
            0, name="global_step", trainable=False
        )
        self.steps = [self.global_step]
        self.weights = self._variables()
        x = tf.compat.v1.placeholder(tf.float32, [None, PIXELS])
        y_ = tf.compat.v1.placeholder(tf.float32, [None, CLASSES])
        self.feeds = [x, y_]
        cross_entropy = mlp_loss(x, y_, *self.weights)
        opt = tf.compat.v1.train.SyncReplicasOptimizer(
            tf.compat.v1.train.AdamOptimizer(MNIST_LR),
            replicas_to_aggregate=NUM_WORKERS,
            total_num_replicas=NUM_WORKERS,
            name="mnist_sync_replicas",
        )
        self.opts = [opt]
        self.train_op = opt.minimize(
            cross_entropy, global_step=self.global_step
        )
        self.local_init_op = opt.local_step_init_op
        if is_chief:
            self.local_init_op = opt.chief_init_op
        self.ready_for_local_init_op = opt.ready_for_local_init_op
        self.chief_queue_runner = opt.get_chief_queue_runner()
        self.sync_init_op = opt.get_init_tokens_op()
        self.init_op = tf.compat.v1.global_variables_initializer()
        return None

    def _supervisor(self, is_chief, server, config):
        sv = tf.compat.v1.train.Supervisor(
            is_chief=is_chief,
            logdir=tempfile.mkdtemp(),
            init_op=self.init_op,
            local_init_op=self.local_init_op,
            ready_for_local_init_op=self.ready_for_local_init_op,
            recovery_wait_secs=1,
            global_step=self.global_step,
        )
        sess = sv.prepare_or_wait_for_session(server.target, config=config)
        if is_chief:
            sess.run(self.sync_init_op)
            sv.start_queue_runners(sess, [self.chief_queue_runner])
        return sess

    def _build_monitored(self, is_chief, num_tokens):
        iterator = tf.compat.v1.data.make_one_shot_iterator(
            make_dataset(NUM_WORKERS, self.w)
        )
        features, labels = iterator.get_next()
        self.weights = self._variables()
        loss = dense_loss(features, labels, *self.weights)
        self.global_step = tf.compat.v1.train.get_or_create_global_step()
        self.steps = [self.global_step]
        opt = tf.compat.v1.train.SyncReplicasOptimizer(
            tf.compat.v1.train.AdagradOptimizer(ADAGRAD_LR),
            replicas_to_aggregate=NUM_WORKERS,
            total_num_replicas=NUM_WORKERS,
        )
        self.opts = [opt]
        self.train_op = opt.minimize(loss, global_step=self.global_step)
        sync_hook = opt.make_session_run_hook(is_chief, num_tokens=num_tokens)
        stop = tf.compat.v1.train.StopAtStepHook(last_step=1000000)
        return [sync_hook, stop]

    def _build_three(self, is_chief, num_tokens):
        del num_tokens  # the hooks' default
        self.global_step = tf.compat.v1.train.get_or_create_global_step()
        self.steps = [self.global_step] + [
            tf.compat.v1.Variable(
                tf.constant(0, tf.int64), name=f"step_{g}", trainable=False
            )
            for g in "bc"
        ]
        self.weights = self._variables()
        x = tf.compat.v1.placeholder(tf.float32, [8, 4])
        self.feeds = [x]
        loss = three_loss(x, *self.weights)
        self.opts = [
            tf.compat.v1.train.SyncReplicasOptimizer(
                tf.compat.v1.train.MomentumOptimizer(MOMENTUM_LR * k, 0.9),
                NUM_WORKERS,
            )
            for k in RATES
        ]
        grads = tf.gradients(loss, self.weights)
        applies = [
            opt.apply_gradients([(g, v)], step)
            for opt, g, v, step in zip(
                self.opts, grads, self.weights, self.steps
            )
        ]
        self.train_op = tf.group(*applies)
        return [o.make_session_run_hook(is_chief) for o in self.opts]

    def run_step(self, phase, errors):
        feed = dict(zip(self.feeds, batch(self.shape, self.w, phase)))
        try:
            self.session.run(self.train_op, feed_dict=feed or None)
        except Exception as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)


def main(shape, phases, config):
    tf.compat.v1.disable_eager_execution()
    spec = cluster_spec_dict(NUM_WORKERS, 1)
    cluster = tf.train.ClusterSpec({"worker": spec["worker"], "ps": spec["ps"]})
    config_proto = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=4)
    servers = [
        tf.distribute.Server(
            cluster, job_name="worker", task_index=i, config=config_proto
        )
        for i in range(NUM_WORKERS)
    ]
    servers.append(tf.distribute.Server(cluster, job_name="ps", task_index=0))
    num_tokens = config.get("num_tokens", 0)
    workers = []
    for w in range(NUM_WORKERS):  # the chief first: the others wait for it
        session_config = tf.compat.v1.ConfigProto(
            inter_op_parallelism_threads=4,
            allow_soft_placement=True,
            device_filters=["/job:ps", f"/job:worker/task:{w}"],
        )
        workers.append(
            Worker(shape, w, cluster, servers[w], session_config, num_tokens)
        )
    chief = workers[0]

    def state():
        return chief.session.run([chief.steps, chief.num_acc])

    def settle():
        deadline = time.time() + PHASE_TIMEOUT
        previous = None
        while time.time() < deadline:
            now = state()
            if max(now[1]) < NUM_WORKERS and now == previous:
                return
            previous = now
            time.sleep(0.3)
        raise RuntimeError(f"no settled state: {now}")

    errors = []
    for i, phase in enumerate(phases):
        threads = [
            threading.Thread(target=workers[w].run_step, args=(i, errors))
            for w in phase
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PHASE_TIMEOUT)
            if t.is_alive():
                raise RuntimeError(f"phase {i} hung")
        if errors:
            raise errors[0]
        settle()
        steps, weights = chief.session.run([chief.steps, chief.weights])
        line = {
            "steps": [int(s) for s in steps],
            "weights": [float(x) for v in weights for x in v.ravel()],
            "local": [
                [int(s) for s in w.session.run(w.local)] for w in workers
            ],
        }
        print(json.dumps(line))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(
        sys.argv[1],
        json.loads(sys.argv[2]),
        json.loads(sys.argv[3]) if len(sys.argv) > 3 else {},
    )
