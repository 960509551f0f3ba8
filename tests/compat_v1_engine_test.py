"""compat_v1.step's own logic, without a cluster."""

import numpy as np
import tensorflow as tf
from absl.testing import absltest

import tf2sync  # noqa: F401  (sets TF_USE_LEGACY_KERAS first)
from tf2sync._src.compat_v1 import step


class OnePerVariableTest(absltest.TestCase):
    def test_replicas_of_one_worker_push_their_sum_once(self):
        dense = tf.Variable(tf.zeros([2]))
        table = tf.Variable(tf.zeros([4, 1]))
        rows = lambda v, i: tf.IndexedSlices(  # noqa: E731
            tf.constant([[v]]), tf.constant([i]), tf.constant([4, 1])
        )
        opt = object()
        entries = [
            (
                opt,
                [(tf.constant([1.0, 2.0]), dense), (rows(1.0, 0), table)],
                None,
            ),
            (
                opt,
                [(tf.constant([3.0, 4.0]), dense), (rows(2.0, 3), table)],
                None,
            ),
            (opt, [(None, dense)], None),  # a None gradient adds nothing
        ]
        pairs = step.one_per_variable(entries)
        self.assertEqual([v for _, v in pairs], [dense, table])
        np.testing.assert_array_equal(pairs[0][0], [4.0, 6.0])
        self.assertIsInstance(pairs[1][0], tf.IndexedSlices)
        np.testing.assert_array_equal(pairs[1][0].indices, [0, 3])
        np.testing.assert_array_equal(pairs[1][0].values, [[1.0], [2.0]])

    def test_one_replica_keeps_its_gradients(self):
        var = tf.Variable(0.0)
        grad = tf.constant(1.0)
        pairs = step.one_per_variable([(object(), [(grad, var)], None)])
        self.assertLen(pairs, 1)
        self.assertIs(pairs[0][0], grad)


if __name__ == "__main__":
    absltest.main()
