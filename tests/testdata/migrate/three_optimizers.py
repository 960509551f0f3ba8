"""Three SyncReplicasOptimizers (lr, 10*lr, 20*lr) sharing one global step:
only the first applies with it. A TF 1.x program of the shape
docs/migrating.md ports, with the cluster from TF_CONFIG. Written for
tests/migrate_test.py; parsed by the migration tool, never run.
"""

import json
import os

import tensorflow as tf
from tensorflow.train import MomentumOptimizer, SyncReplicasOptimizer

LR = 0.01
STEPS = 100


def main():
  tf_config = json.loads(os.environ["TF_CONFIG"])
  cluster = tf.train.ClusterSpec(tf_config["cluster"])
  task = tf_config["task"]
  server = tf.distribute.Server(cluster, job_name=task["type"],
                                task_index=task["index"])
  if task["type"] == "ps":
    server.join()
    return
  is_chief = task["index"] == 0
  num_workers = len(tf_config["cluster"]["worker"])

  with tf.device(tf.compat.v1.train.replica_device_setter(cluster=cluster)):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    w_a = tf.Variable(tf.zeros([4, 4]), name="w_a")
    w_b = tf.Variable(tf.zeros([4, 4]), name="w_b")
    w_c = tf.Variable(tf.zeros([4]), name="w_c")
    x = tf.random.normal([8, 4])
    loss = tf.reduce_sum(tf.matmul(tf.matmul(x, w_a), w_b) + w_c)

    opt_a = SyncReplicasOptimizer(MomentumOptimizer(LR, 0.9), num_workers)
    opt_b = SyncReplicasOptimizer(MomentumOptimizer(10 * LR, 0.9), num_workers)
    opt_c = SyncReplicasOptimizer(MomentumOptimizer(20 * LR, 0.9), num_workers)
    grads = tf.gradients(loss, [w_a, w_b, w_c])
    apply_a = opt_a.apply_gradients([(grads[0], w_a)], global_step)
    # TF1 refuses global_step=None: B and C count their own steps.
    step_b = tf.Variable(0, dtype=tf.int64, trainable=False, name="step_b")
    step_c = tf.Variable(0, dtype=tf.int64, trainable=False, name="step_c")
    apply_b = opt_b.apply_gradients([(grads[1], w_b)], step_b)
    apply_c = opt_c.apply_gradients([(grads[2], w_c)], step_c)
    update = tf.group(apply_a, apply_b, apply_c)

  if is_chief:
    hooks = [o.make_session_run_hook(True) for o in (opt_a, opt_b, opt_c)]
  else:
    hooks = [o.make_session_run_hook(False) for o in (opt_a, opt_b, opt_c)]
  with tf.compat.v1.train.MonitoredTrainingSession(
      master=server.target, is_chief=is_chief, hooks=hooks) as session:
    for _ in range(STEPS):
      session.run(update)


if __name__ == "__main__":
  main()
