"""compat_v1.step's own logic, without a cluster."""

import numpy as np
import tensorflow as tf
from absl.testing import absltest

import tf2sync  # noqa: F401  (sets TF_USE_LEGACY_KERAS first)
from tf2sync._src.compat_v1 import optimizer
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


class PerShardTest(absltest.TestCase):
    """apply_gradients' pairs for a `ShardedVariable` (no cluster needed)."""

    def setUp(self):
        super().setUp()
        self.parts = [
            tf.Variable(tf.zeros([2, 1]), name="table/part_0"),
            tf.Variable(tf.zeros([1, 1]), name="table/part_1"),
        ]
        self.table = tf.__internal__.distribute.ShardedVariable(self.parts)
        self.dense = tf.Variable(0.0)

    def test_one_gradient_per_shard_is_paired_shard_by_shard(self):
        g0, g1, gd = tf.ones([2, 1]), tf.ones([1, 1]), tf.constant(1.0)
        pairs = optimizer._per_shard([([g0, g1], self.table), (gd, self.dense)])
        self.assertEqual(
            [v for _, v in pairs], [self.parts[0], self.parts[1], self.dense]
        )
        self.assertIs(pairs[1][0], g1)

    def test_no_gradient_is_none_for_every_shard(self):
        pairs = optimizer._per_shard([(None, self.table)])
        self.assertEqual([g for g, _ in pairs], [None, None])

    def test_a_gradient_of_the_whole_variable_is_refused(self):
        for grad in (tf.zeros([3, 1]), [tf.zeros([3, 1])]):
            with self.assertRaisesRegex(
                ValueError, r"sharded variable table \(2 shards\).*per shard"
            ):
                optimizer._per_shard([(grad, self.table)])


if __name__ == "__main__":
    absltest.main()
