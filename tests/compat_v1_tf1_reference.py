"""TF1's real SyncReplicasOptimizer in graph mode, for the differential test.

Usage: compat_v1_tf1_reference.py '<json list of phases>'

Builds TF's own `get_workers` fixture (dense part) on an in-process
cluster of 2 workers and 1 ps on 127.0.0.1, runs each phase (a list of
worker indices; several run concurrently), waits until no round is
pending, and prints one line per phase:
`global_step v0 v1 local_step_0 local_step_1`. Exits with os._exit: the
chief's queue-runner thread stays blocked in a take.
"""

import json
import os
import sys
import threading
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

from tf2sync.testing import cluster_spec_dict  # noqa: E402

NUM_WORKERS = 2
RTA = 2


def main(phases):
    tf.compat.v1.disable_eager_execution()
    spec = cluster_spec_dict(NUM_WORKERS, 1)
    cluster = tf.train.ClusterSpec({"worker": spec["worker"], "ps": spec["ps"]})
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=4)
    servers = [
        tf.distribute.Server(
            cluster, job_name="worker", task_index=i, config=config
        )
        for i in range(NUM_WORKERS)
    ]
    servers.append(tf.distribute.Server(cluster, job_name="ps", task_index=0))
    sessions, fetches = [], []
    for w in range(NUM_WORKERS):
        graph = tf.Graph()
        with graph.as_default():
            with tf.device("/job:ps/task:0"):
                global_step = tf.compat.v1.Variable(
                    0, name="global_step", trainable=False
                )
                v0 = tf.compat.v1.Variable(0.0, name="v0")
                v1 = tf.compat.v1.Variable(1.0, name="v1")
            with tf.device(f"/job:worker/task:{w}"):
                g0 = tf.constant(0.1 + 0.2 * w)
                g1 = tf.constant(0.9 + 0.2 * w)
                sync = tf.compat.v1.train.SyncReplicasOptimizer(
                    tf.compat.v1.train.GradientDescentOptimizer(2.0),
                    replicas_to_aggregate=RTA,
                    total_num_replicas=NUM_WORKERS,
                )
                train_op = sync.apply_gradients(
                    zip([g0, g1], [v0, v1]), global_step
                )
                hook = sync.make_session_run_hook(w == 0, num_tokens=2)
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
                    v0,
                    v1,
                    sync._local_step,
                    num_accumulated,
                )
            )
    train_ops = [f[0] for f in fetches]
    _, gs, v0, v1, _, num_acc = fetches[0]

    def settle():
        previous = None
        while True:
            state = sessions[0].run([gs, num_acc])
            if state[1] < RTA and state == previous:
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
        values = sessions[0].run([gs, v0, v1])
        local = [sessions[w].run(fetches[w][4]) for w in range(NUM_WORKERS)]
        print(" ".join(str(float(x)) for x in list(values) + local))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
