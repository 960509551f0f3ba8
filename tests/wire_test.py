"""wire: dedup, TF1's per-row mean, and where a push's inputs are copied."""

import numpy as np
import tensorflow as tf
from absl.testing import absltest

import tf2sync  # noqa: F401  (sets TF_USE_LEGACY_KERAS first)
from tf2sync._src import wire


class SparseMeanTest(absltest.TestCase):
    def test_dedup_sums_duplicate_rows(self):
        grad = tf.IndexedSlices(
            tf.constant([[1.0], [2.0], [4.0]]), tf.constant([3, 1, 3])
        )
        ids, rows = wire.dedup(grad)
        self.assertEqual(ids.dtype, tf.int64)
        got = dict(zip(ids.numpy().tolist(), rows.numpy()[:, 0].tolist()))
        self.assertEqual(got, {3: 5.0, 1: 2.0})

    def test_row_mean_divides_each_row_by_the_pushes_containing_it(self):
        # Two pushes, each with unique ids: row 1 in both, rows 0 and 2 in
        # one each (TF1's SparseConditionalAccumulator mean).
        ids = tf.constant([0, 1, 1, 2], tf.int64)
        values = tf.constant([[2.0, 4.0], [1.0, 1.0], [3.0, 5.0], [6.0, 8.0]])
        unique, mean = wire.row_mean(ids, values)
        got = {
            i: mean.numpy()[k].tolist() for k, i in enumerate(unique.numpy())
        }
        self.assertEqual(got, {0: [2.0, 4.0], 1: [2.0, 3.0], 2: [6.0, 8.0]})

    def test_variable_key_is_identity_not_name(self):
        a = tf.Variable(1.0, name="same")
        b = tf.Variable(1.0, name="same")
        self.assertNotEqual(wire.variable_key(a), wire.variable_key(b))


class ReceivedTest(absltest.TestCase):
    def test_each_input_is_copied_to_where_it_is_used(self):
        variable = tf.Variable(tf.zeros([2]))
        layout = wire.Layout([(tf.ones([2]), variable)], "r")  # eagerly

        @tf.function
        def trace():
            inputs = {
                "tag": tf.constant(0, tf.int64),
                "tensor": tf.ones([3]),
                "packed": [tf.ones([2])],
                "sparse": [],
                "worker": None,
            }
            got = wire.received(inputs, layout, "/cpu:0")
            self.assertIs(got["tag"], inputs["tag"])  # read there already
            self.assertIsNone(got["worker"])
            self.assertEqual(got["tensor"].op.type, "Identity")
            self.assertEqual(got["packed"][0].op.type, "Identity")
            return got["tensor"]

        np.testing.assert_array_equal(trace(), np.ones([3]))


if __name__ == "__main__":
    absltest.main()
