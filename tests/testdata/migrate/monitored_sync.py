"""Between-graph replication with MonitoredTrainingSession: the shape of
the TF 1.x "Distributed TensorFlow" guide's trainer.py, made synchronous
with SyncReplicasOptimizer's hook. Written for tests/migrate_test.py;
parsed by the migration tool, never run.
"""

import argparse
import sys

import tensorflow.compat.v1 as tf
from tensorflow.compat.v1.train import StopAtStepHook

FLAGS = None


def build_loss(features, labels):
  logits = tf.layers.dense(features, 10)
  return tf.losses.sparse_softmax_cross_entropy(labels, logits)


def main(_):
  ps_hosts = FLAGS.ps_hosts.split(",")
  worker_hosts = FLAGS.worker_hosts.split(",")
  cluster = tf.train.ClusterSpec({"ps": ps_hosts, "worker": worker_hosts})
  server = tf.train.Server(cluster,
                           job_name=FLAGS.job_name,
                           task_index=FLAGS.task_index)

  if FLAGS.job_name == "ps":
    server.join()
  elif FLAGS.job_name == "worker":
    is_chief = FLAGS.task_index == 0
    with tf.device(tf.train.replica_device_setter(
        worker_device="/job:worker/task:%d" % FLAGS.task_index,
        cluster=cluster)):
      features, labels = tf.data.make_one_shot_iterator(
          make_dataset()).get_next()
      loss = build_loss(features, labels)
      global_step = tf.train.get_or_create_global_step()
      opt = tf.train.SyncReplicasOptimizer(
          tf.train.AdagradOptimizer(0.01),
          replicas_to_aggregate=FLAGS.replicas_to_aggregate,
          total_num_replicas=len(worker_hosts))
      train_op = opt.minimize(loss, global_step=global_step)

    sync_hook = opt.make_session_run_hook(is_chief, num_tokens=0)
    hooks = [sync_hook, StopAtStepHook(last_step=1000000)]
    with tf.train.MonitoredTrainingSession(master=server.target,
                                           is_chief=is_chief,
                                           checkpoint_dir="/tmp/train_logs",
                                           hooks=hooks) as mon_sess:
      while not mon_sess.should_stop():
        mon_sess.run(train_op)


def make_dataset():
  return tf.data.Dataset.from_tensor_slices(
      (tf.zeros([64, 4]), tf.zeros([64], tf.int64))).repeat().batch(8)


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.register("type", "bool", lambda v: v.lower() == "true")
  parser.add_argument("--ps_hosts", type=str, default="",
                      help="Comma-separated list of hostname:port pairs")
  parser.add_argument("--worker_hosts", type=str, default="",
                      help="Comma-separated list of hostname:port pairs")
  parser.add_argument("--job_name", type=str, default="",
                      help="One of 'ps', 'worker'")
  parser.add_argument("--task_index", type=int, default=0,
                      help="Index of task within the job")
  parser.add_argument("--replicas-to-aggregate", type=int, default=2,
                      help="Gradients averaged per update")
  FLAGS, unparsed = parser.parse_known_args()
  tf.app.run(main=main, argv=[sys.argv[0]] + unparsed)
