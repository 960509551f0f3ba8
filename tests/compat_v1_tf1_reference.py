"""TF1's real SyncReplicasOptimizer in graph mode, for the differential test.

Usage: compat_v1_tf1_reference.py '<json list of phases>' ['<json config>']

Builds TF's own `get_workers` fixture (v0, v1 and v_sparse) on an
in-process cluster of `workers` workers (default 2) and 1 ps on 127.0.0.1,
with `rta` (default 2), `total` (default `workers`), `num_tokens` (default
2), the inner optimizer (`inner`: "sgd", TF's GradientDescentOptimizer(2.0),
the default, or "adam", AdamOptimizer(ADAM_LR)), the global step's dtype
(`step_dtype`: "int32", TF's default, or "int64") and optional moving
averages of v0 and v1 (`ema`: the decay; resource variables then). Runs
each phase (a list of worker indices; several run concurrently), waits
until no round is pending, and prints one line per phase: `global_step v0
v1 v_sparse[0] v_sparse[1] [ema(v0) ema(v1)] local_step_0 ...`. Exits
with os._exit: the chief's queue-runner thread stays blocked in a take.
"""

import json
import os
import sys
import threading
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

from tf2sync.testing import cluster_spec_dict  # noqa: E402

ADAM_LR = 0.1


def main(phases, config):
    num_workers = config.get("workers", 2)
    rta = config.get("rta", 2)
    total = config.get("total", num_workers)
    num_tokens = config.get("num_tokens", 2)
    decay = config.get("ema")
    use_resource = decay is not None or None
    inner = config.get("inner", "sgd")
    step_dtype = tf.as_dtype(config.get("step_dtype", "int32"))
    tf.compat.v1.disable_eager_execution()
    spec = cluster_spec_dict(num_workers, 1)
    cluster = tf.train.ClusterSpec({"worker": spec["worker"], "ps": spec["ps"]})
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=4)
    servers = [
        tf.distribute.Server(
            cluster, job_name="worker", task_index=i, config=config
        )
        for i in range(num_workers)
    ]
    servers.append(tf.distribute.Server(cluster, job_name="ps", task_index=0))
    sessions, fetches = [], []
    for w in range(num_workers):
        graph = tf.Graph()
        with graph.as_default():
            with tf.device("/job:ps/task:0"):
                global_step = tf.compat.v1.Variable(
                    tf.constant(0, step_dtype),
                    name="global_step",
                    trainable=False,
                    use_resource=use_resource,
                )
                v0 = tf.compat.v1.Variable(
                    0.0, name="v0", use_resource=use_resource
                )
                v1 = tf.compat.v1.Variable(
                    1.0, name="v1", use_resource=use_resource
                )
                v_sparse = tf.compat.v1.Variable(
                    [[3.0], [4.0]], name="v_sparse", use_resource=use_resource
                )
            with tf.device(f"/job:worker/task:{w}"):
                g0 = tf.constant(0.1 + 0.2 * w)
                g1 = tf.constant(0.9 + 0.2 * w)
                g_sparse = tf.IndexedSlices(
                    tf.constant([[0.1 + 0.2 * w]]),
                    tf.constant([1], tf.int64),
                    tf.constant([2, 1], tf.int64),
                )
                ema = None
                if decay is not None:
                    ema = tf.compat.v1.train.ExponentialMovingAverage(decay)
                if inner == "adam":
                    opt = tf.compat.v1.train.AdamOptimizer(ADAM_LR)
                else:
                    opt = tf.compat.v1.train.GradientDescentOptimizer(2.0)
                sync = tf.compat.v1.train.SyncReplicasOptimizer(
                    opt,
                    replicas_to_aggregate=rta,
                    total_num_replicas=total,
                    variable_averages=ema,
                    variables_to_average=[v0, v1] if ema else None,
                )
                train_op = sync.apply_gradients(
                    zip([g0, g1, g_sparse], [v0, v1, v_sparse]), global_step
                )
                hook = sync.make_session_run_hook(w == 0, num_tokens=num_tokens)
            averages = []
            if ema is not None:
                averages = [ema.average(v0), ema.average(v1)]
            num_accumulated = sync._accumulator_list[0][0].num_accumulated()
            sessions.append(
                tf.compat.v1.train.MonitoredTrainingSession(
                    master=servers[w].target,
                    is_chief=w == 0,
                    config=config,
                    hooks=[hook],
                    stop_grace_period_secs=1,
                )
            )
            fetches.append(
                (
                    train_op,
                    global_step,
                    [v0, v1, v_sparse] + averages,
                    sync._local_step,
                    num_accumulated,
                )
            )
    train_ops = [f[0] for f in fetches]
    _, gs, values, _, num_acc = fetches[0]

    def settle():
        previous = None
        while True:
            state = sessions[0].run([gs, num_acc])
            if state[1] < rta and state == previous:
                return
            previous = state
            time.sleep(0.3)

    for phase in phases:
        threads = [
            threading.Thread(target=lambda w=w: sessions[w].run(train_ops[w]))
            for w in phase
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        settle()
        step, got = sessions[0].run([gs, values])
        flat = [step] + [x for v in got for x in tf.nest.flatten(v.tolist())]
        local = [sessions[w].run(fetches[w][3]) for w in range(num_workers)]
        print(" ".join(str(float(x)) for x in flat + local))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(
        json.loads(sys.argv[1]),
        json.loads(sys.argv[2]) if len(sys.argv) > 2 else {},
    )
