"""Faults: lost tokens, and what the watchdog does about them."""

import threading

import tensorflow as tf
import testutil
from absl.testing import absltest

import tf2sync


class TokenWatchdogTest(absltest.TestCase):
    def test_a_token_lost_with_a_dead_worker_is_released(self):
        strategy = testutil.strategy(
            2, replicas_to_aggregate=2, token_timeout=1.0
        )
        with strategy.scope():
            model = testutil.dense_model()
            opt = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
        aggregator = opt._aggregator
        # A worker took a token and died before pushing: the token is gone.
        with tf.device(aggregator.device):
            aggregator._tokens.dequeue()
        self.assertEqual(aggregator.tokens_available(), 1)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        x, y = testutil.data("dense", 8)

        def replica():
            with tf.GradientTape() as tape:
                loss = testutil.mean_loss(y, model(x))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        @tf.function
        def step():
            strategy.run(replica)

        for _ in range(2):  # the second waits for the lost token
            coordinator.schedule(step)
        done = threading.Event()
        threading.Thread(
            target=lambda: (coordinator.join(), done.set()), daemon=True
        ).start()
        self.assertTrue(done.wait(60), "the step hung on the lost token")
        self.assertEqual(int(opt.iterations.numpy()), 1)
        self.assertEqual(strategy._watchdog.released, 1)
        self.assertEqual(int(opt.gradients_accepted.numpy()), 2)

    def test_bad_timeout(self):
        with self.assertRaisesRegex(
            ValueError,
            r"`token_timeout` must be a positive number of seconds or None. "
            r"Received: token_timeout=0",
        ):
            testutil.strategy(2, replicas_to_aggregate=2, token_timeout=0)


if __name__ == "__main__":
    absltest.main()
