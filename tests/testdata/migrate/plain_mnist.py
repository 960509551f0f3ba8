"""Single-machine TF 1.x softmax regression on MNIST: a session, a global
step, a training loop and a checkpointing hook, nothing distributed.
Written for tests/migrate_test.py; parsed by the migration tool, never run.
"""

import argparse

import tensorflow as tf
from tensorflow.examples.tutorials.mnist import input_data

parser = argparse.ArgumentParser()
parser.add_argument("--data_dir", default="/tmp/mnist")
parser.add_argument("--num_workers", type=int, default=4,
                    help="Input threads")
parser.add_argument("--steps", type=int, default=1000)


def main(args):
  mnist = input_data.read_data_sets(args.data_dir, one_hot=True)
  x = tf.placeholder(tf.float32, [None, 784])
  y_ = tf.placeholder(tf.float32, [None, 10])
  w = tf.Variable(tf.zeros([784, 10]))
  b = tf.Variable(tf.zeros([10]))
  y = tf.matmul(x, w) + b
  loss = tf.reduce_mean(
      tf.nn.softmax_cross_entropy_with_logits(labels=y_, logits=y))
  global_step = tf.Variable(0, name="global_step", trainable=False)
  train_step = tf.train.GradientDescentOptimizer(0.5).minimize(
      loss, global_step=global_step)

  with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    for _ in range(args.steps):
      batch_xs, batch_ys = mnist.train.next_batch(100)
      sess.run(train_step, feed_dict={x: batch_xs, y_: batch_ys})

  hooks = [tf.train.StopAtStepHook(last_step=args.steps)]
  with tf.train.MonitoredTrainingSession(checkpoint_dir="/tmp/ckpt",
                                         hooks=hooks) as mon_sess:
    while not mon_sess.should_stop():
      mon_sess.run(train_step)


if __name__ == "__main__":
  main(parser.parse_args())
