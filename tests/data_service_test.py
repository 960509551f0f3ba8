"""Each example once per epoch: dynamic sharding through tf.data service.

A dispatcher and two tf.data workers run in this process (127.0.0.1, free
ports) beside the in-process cluster; `tf2sync.Trainer` reads a
`tf2sync.ServicePassPerEpoch`, so each epoch is one `distributed_epoch`
pass shared by whichever training worker asks first.

The model is an embedding table with one row per example id, all zeros,
plus one dense weight `w` that every example adds to its output; the loss
is the sum of the outputs. Each appearance of an id in a push is a
gradient of 1 on its row, and each example 1 on `w`. An update is the mean
of its `k` pushes, so with SGD at `lr = replicas_to_aggregate` (N) a full
update moves each appearance's row by -1, and the epoch's last one, of
`c < N` pushes (`Aggregator.flush`), by `-N / c`. The test reads the
weights before and after that flush: the appearances in the epoch's
applied gradients must be exactly 1 per id, and `n` in all on `w`.
"""

import numpy as np
import tensorflow as tf
import testutil
from absl.testing import absltest
from absl.testing import parameterized

import tf2sync
from tf2sync._src import cluster as cluster_lib
from tf2sync._src import coordinator as coordinator_lib

_TF_DATA_WORKERS = 2
# Epochs a test waits for a worker still setting up (see
# `ServicePassTest._assert_every_worker_takes_part`).
_EXTRA_EPOCHS = 6
_SERVICE = {}


def _service():
    """The process's dispatcher and tf.data workers, started once."""
    if not _SERVICE:
        port, *workers = cluster_lib.pick_free_ports(1 + _TF_DATA_WORKERS)
        dispatcher = tf.data.experimental.service.DispatchServer(
            tf.data.experimental.service.DispatcherConfig(port=port)
        )
        address = f"{cluster_lib.LOOPBACK}:{port}"
        _SERVICE["target"] = f"grpc://{address}"
        _SERVICE["servers"] = [dispatcher] + [
            tf.data.experimental.service.WorkerServer(
                tf.data.experimental.service.WorkerConfig(
                    dispatcher_address=address,
                    worker_address=f"{cluster_lib.LOOPBACK}:{p}",
                    port=p,
                )
            )
            for p in workers
        ]
    return _SERVICE["target"]


def _ids(num_examples, batch_size):
    ids = tf.data.Dataset.range(num_examples)
    return ids.batch(batch_size).map(
        lambda i: (tf.reshape(i, [-1, 1]), tf.zeros_like(i))
    )


def _rows(model):
    rows = model.get_layer("rows").get_weights()[0][:, 0]
    (w,) = model.get_layer("w").get_weights()[0][0]
    return np.append(rows, w)


def _model(n):
    ids = tf.keras.Input((1,), dtype=tf.int64)
    rows = tf.keras.layers.Embedding(
        n, 1, embeddings_initializer="zeros", name="rows"
    )(ids)
    ones = tf.keras.layers.Lambda(lambda i: tf.ones_like(i, tf.float32))(ids)
    w = tf.keras.layers.Dense(
        1, use_bias=False, kernel_initializer="zeros", name="w"
    )(ones)
    out = tf.keras.layers.Add()([tf.keras.layers.Flatten()(rows), w])
    return tf.keras.Model(ids, out)


def _recording_flushes(aggregator, model):
    """Wraps the aggregator's flush: `(pushes, weights before, after,
    applied)` per call."""
    flushes = []
    flush = aggregator.flush

    def recorded_flush():
        pushes = int(aggregator.count.numpy())
        before = _rows(model)
        applied = flush()
        flushes.append((pushes, before, _rows(model), applied))
        return applied

    aggregator.flush = recorded_flush
    return flushes


class ServicePassTest(parameterized.TestCase):
    def _check_epochs(self, flushes, initial, n, w, epochs):
        """Every id once and `n` examples on `w` in each epoch's updates."""
        self.assertLen(flushes, epochs)
        previous = initial
        for epoch, (pushes, before, after, applied) in enumerate(flushes):
            counts = previous - before  # full updates: -1 an appearance
            if pushes:
                self.assertTrue(applied)
                counts = counts + (before - after) * pushes / w
            np.testing.assert_allclose(
                counts,
                np.append(np.ones(n), n),
                atol=1e-4,
                err_msg=f"epoch {epoch}",
            )
            previous = after

    def _assert_every_worker_takes_part(self, w, logs, another_epoch):
        """Dynamic sharding: each worker's iterator reads from the pass.

        The first worker to set up its function can drain a short pass
        alone while the others still set up theirs (on 2 loaded cores
        this once lasted 3 epochs: worker 1 took all 48 batches), so a
        worker without an accepted gradient yet gets up to
        `_EXTRA_EPOCHS` more epochs, each a new pass (`another_epoch()`
        returns its history's logs; the `accepted_w<i>` totals count from
        the start). A worker whose iterator never gives an element fails.
        """
        for _ in range(_EXTRA_EPOCHS):
            if all(logs[f"accepted_w{i}"][-1] > 0 for i in range(w)):
                break
            logs = another_epoch()
        for i in range(w):
            self.assertGreater(logs[f"accepted_w{i}"][-1], 0, logs)

    def _build(self, n, w, ps):
        strategy = testutil.strategy(
            w, ps, replicas_to_aggregate=w, total_num_replicas=w
        )
        with strategy.scope():
            model = _model(n)
            optimizer = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(float(w)))
        aggregator = coordinator_lib.core_aggregator(strategy)
        return strategy, model, optimizer, aggregator

    @parameterized.parameters(
        # (examples, batch size, steps per loop, workers, ps)
        (48, 4, 3, 2, 1),
        (61, 5, 4, 2, 1),  # a partial batch on each tf.data worker
        (70, 3, 1, 2, 2),  # a tf.while_loop of single steps
        (64, 4, 2, 3, 2),
    )
    def test_trainer_each_example_once_per_epoch(
        self, n, batch, per_loop, w, ps
    ):
        strategy, model, optimizer, aggregator = self._build(n, w, ps)
        trainer = tf2sync.Trainer(
            strategy=strategy,
            model=model,
            optimizer=optimizer,
            loss_fn=lambda y, pred: tf.reduce_sum(pred),
            steps_per_loop=per_loop,
            verbose=0,
        )
        flushes = _recording_flushes(aggregator, model)
        initial = _rows(model)

        def train(epochs):  # a new pass object per call
            return trainer.train(
                tf2sync.ServicePassPerEpoch(_ids(n, batch), _service()),
                epochs=epochs,
            ).history

        logs = train(3)
        self._check_epochs(flushes, initial, n, w, 3)
        self.assertEqual(logs["stale_dropped"][-1], 0)
        print("steps per pass:", logs["pass_steps"], [f[0] for f in flushes])
        self._assert_every_worker_takes_part(w, logs, lambda: train(1))

    @parameterized.parameters(
        # (examples, batch size, steps_per_epoch, steps per function,
        # workers, ps)
        (48, 4, 4, 2, 2, 1),  # fit schedules a third: the rest in rounds
        (61, 5, 20, 4, 2, 1),  # more steps than the pass: some run nothing
        (64, 4, 9, 3, 3, 2),
    )
    def test_fit_each_example_once_per_epoch(
        self, n, batch, steps, per_function, w, ps
    ):
        strategy, model, optimizer, aggregator = self._build(n, w, ps)
        with strategy.scope():
            model.compile(
                optimizer=optimizer,
                loss=lambda y, pred: tf.reduce_sum(pred),
                steps_per_execution=per_function,
            )
        flushes = _recording_flushes(aggregator, model)
        initial = _rows(model)

        def fit(epochs):  # a new pass object per call
            return model.fit(
                tf2sync.ServicePassPerEpoch(_ids(n, batch), _service()),
                epochs=epochs,
                steps_per_epoch=steps,
                verbose=0,
                callbacks=[tf2sync.SyncMetrics()],
            ).history

        logs = fit(3)
        self._check_epochs(flushes, initial, n, w, 3)
        self.assertEqual(logs["stale_dropped"][-1], 0)
        self.assertTrue(np.all(np.isfinite(logs["loss"])), logs)
        self._assert_every_worker_takes_part(w, logs, lambda: fit(1))

    def test_fit_again_with_a_new_pass_object(self):
        # Each fit call's steps mark the passes of its own pass object (a
        # second call once marked the first one's and never ended).
        n, w = 40, 2
        strategy, model, optimizer, aggregator = self._build(n, w, 1)
        with strategy.scope():
            model.compile(
                optimizer=optimizer,
                loss=lambda y, pred: tf.reduce_sum(pred),
                steps_per_execution=2,
            )
        flushes = _recording_flushes(aggregator, model)
        initial = _rows(model)
        for _ in range(2):
            model.fit(
                tf2sync.ServicePassPerEpoch(_ids(n, 4), _service()),
                epochs=1,
                steps_per_epoch=4,
                verbose=0,
            )
        self._check_epochs(flushes, initial, n, w, 2)

    def test_only_fit_with_tf2sync_train_function_reads_a_pass(self):
        strategy, model, optimizer, _ = self._build(8, 2, 1)
        with strategy.scope():
            model.compile(
                optimizer=optimizer, loss=lambda y, pred: tf.reduce_sum(pred)
            )
        passes = tf2sync.ServicePassPerEpoch(_ids(8, 2), _service())
        with self.assertRaisesRegex(ValueError, r"in model.evaluate\(\)"):
            model.evaluate(passes, steps=2, verbose=0)
        tf2sync.unroll_fit_steps(model, False)
        with self.assertRaisesRegex(ValueError, "tf_keras's loop"):
            model.fit(passes, epochs=1, steps_per_epoch=2, verbose=0)


class BadInputTest(parameterized.TestCase):
    def test_dataset_must_be_a_dataset(self):
        with self.assertRaisesRegex(TypeError, "dataset=<function"):
            tf2sync.ServicePassPerEpoch(lambda ctx: None, "grpc://a:1")

    @parameterized.parameters("", "  ")
    def test_service_must_be_an_address(self, service):
        with self.assertRaisesRegex(ValueError, "service="):
            tf2sync.ServicePassPerEpoch(_ids(8, 2), service)

    @parameterized.parameters(None, 5000)
    def test_service_must_be_a_str(self, service):
        with self.assertRaisesRegex(TypeError, f"service={service}"):
            tf2sync.ServicePassPerEpoch(_ids(8, 2), service)

    def test_dataset_must_be_finite(self):
        with self.assertRaisesRegex(ValueError, "must be finite"):
            tf2sync.ServicePassPerEpoch(_ids(8, 2).repeat(), "grpc://a:1")

    def test_trainer_refuses_steps_per_epoch_with_a_pass(self):
        strategy = testutil.strategy(
            2, 1, replicas_to_aggregate=2, total_num_replicas=2
        )
        with strategy.scope():
            model = _model(8)
            optimizer = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(1.0))
        trainer = tf2sync.Trainer(
            strategy=strategy,
            model=model,
            optimizer=optimizer,
            loss_fn=lambda y, pred: tf.reduce_sum(pred),
            steps_per_loop=2,
            verbose=0,
        )
        data = tf2sync.ServicePassPerEpoch(_ids(8, 2), "grpc://127.0.0.1:1")
        with self.assertRaisesRegex(ValueError, "steps_per_epoch=4"):
            trainer.train(data, epochs=1, steps_per_epoch=4)
        with self.assertRaisesRegex(ValueError, "steps_per_epoch=None"):
            trainer.train(lambda ctx: _ids(8, 2).repeat(), epochs=1)


if __name__ == "__main__":
    absltest.main()
