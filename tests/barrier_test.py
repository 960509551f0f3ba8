"""barrier.TokenBarrier on the local CPU: both orders, release, seeding."""

import tensorflow as tf
from absl.testing import absltest

import tf2sync  # noqa: F401  (sets TF_USE_LEGACY_KERAS first)
from tf2sync._src import barrier


class TokenBarrierTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        self.step = tf.Variable(3, dtype=tf.int32)  # a TF1-style int32 step
        self.barrier = barrier.TokenBarrier(self.step, "t")

    def test_seeded_tokens_carry_the_current_step(self):
        self.barrier.seed(2)
        self.assertEqual(self.barrier.available(), 2)
        self.assertEqual(int(self.barrier.take([])), 3)
        self.assertEqual(self.barrier.available(), 1)
        self.barrier.seed(0)  # nothing
        self.assertEqual(self.barrier.available(), 1)

    def test_acquire_reads_the_step_after_its_token_and_times_the_wait(self):
        self.barrier.seed(1)
        self.step.assign(7)  # an update between seeding and the step
        self.assertEqual(int(self.barrier.acquire()), 7)
        self.assertGreaterEqual(float(self.barrier.wait_seconds.numpy()), 0)
        self.assertEqual(self.barrier.available(), 0)

    def test_release_static_and_dynamic_counts(self):
        self.barrier.release(2, tf.constant(5, tf.int64))
        self.barrier.release(tf.constant(1, tf.int64))
        self.barrier.give_back([])
        self.assertEqual(
            [int(self.barrier.take([])) for _ in range(4)], [5, 5, 0, 0]
        )
        self.assertEqual(int(self.barrier.step().dtype == tf.int64), 1)


if __name__ == "__main__":
    absltest.main()
