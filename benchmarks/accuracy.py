"""Time to accuracy on scikit-learn's digits: tf2sync against stock PSS.

The launcher's default job (`tf2sync._src.jobs.digits`: a small conv net,
1,500 training and 297 held-out images, its `train_dataset` through a
`DatasetCreator`), trained with `model.fit` (steps_per_execution=K) and
momentum SGD (momentum 0.9), synchronously (tf2sync) or asynchronously (stock
PSS). Each epoch is 1,500 / B replica steps for both, so both see the same
examples; after each, the held-out accuracy is measured off the clock.

At one learning rate a synchronous epoch makes 1 / N of an asynchronous
one's updates (each of N replicas' mean), so the harness runs each system
over the same grid of rates (`--accuracy_learning_rates`) and compares
each at its best as well as at the first rate.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

import tf2sync  # noqa: E402
from tf2sync._src.jobs import digits  # noqa: E402

BATCH = 32


class _Clock(tf.keras.callbacks.Callback):
    """Training seconds at each epoch's end, evaluation off the clock."""

    def __init__(self, evaluate):
        super().__init__()
        self.evaluate = evaluate
        self.curve = []

    def on_train_begin(self, logs=None):
        self.seconds = 0.0
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds += time.perf_counter() - self.start
        self.curve.append((round(self.seconds, 3), self.evaluate()))
        self.start = time.perf_counter()


class AccuracyRunner:
    """Trains a fresh model on a fresh strategy per run.

    Args:
      make_strategy: Returns a new strategy (tf2sync's if `sync`).
      sync: Whether to wrap the optimizer in `tf2sync.SyncOptimizer`.
      k: steps_per_execution.
      epochs: Epochs per run.
      target: The held-out accuracy to reach.
      learning_rate: The momentum SGD's rate.
    """

    def __init__(
        self,
        make_strategy,
        *,
        sync,
        k,
        epochs,
        target,
        learning_rate,
    ):
        self.make_strategy = make_strategy
        self.sync = sync
        self.k = k
        self.epochs = epochs
        self.target = target
        self.learning_rate = learning_rate
        self.x, self.y = digits.eval_arrays()
        self.local = None

    def _accuracy(self, model):
        self.local.set_weights(model.get_weights())
        predicted = tf.argmax(self.local(self.x), axis=-1).numpy()
        return round(float((predicted == self.y).mean()), 4)

    def run(self, functions=None, window=False):
        del functions, window
        strategy = self.make_strategy()
        if self.local is None:  # after connecting: it lives on the chief
            self.local = digits.build_model()
        with strategy.scope():
            model = digits.build_model()
            inner = tf.keras.optimizers.legacy.SGD(
                self.learning_rate, momentum=0.9
            )
            opt = tf2sync.SyncOptimizer(inner) if self.sync else inner
            model.compile(
                optimizer=opt, loss=digits.LOSS, steps_per_execution=self.k
            )
        data = tf.keras.utils.experimental.DatasetCreator(
            lambda ctx: digits.train_dataset(ctx, BATCH)
        )
        steps = digits.num_train_examples() // BATCH
        clock = _Clock(lambda: self._accuracy(model))
        model.fit(
            data,
            epochs=self.epochs,
            steps_per_epoch=steps,
            verbose=0,
            callbacks=[clock],
        )
        reached = [
            (epoch + 1, s)
            for epoch, (s, acc) in enumerate(clock.curve)
            if acc >= self.target
        ]
        return {
            "target": self.target,
            "learning_rate": self.learning_rate,
            "epochs_to_target": reached[0][0] if reached else None,
            "seconds_to_target": reached[0][1] if reached else None,
            "final_accuracy": clock.curve[-1][1],
            "curve": clock.curve,
            "examples": self.epochs * steps * BATCH,
            "seconds": clock.seconds,
            "examples_per_sec": round(
                self.epochs * steps * BATCH / clock.seconds, 1
            ),
        }
