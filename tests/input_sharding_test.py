"""Each example once per epoch: static sharding by worker index under fit.

The model is an embedding table with one row per example id, all zeros,
and a loss that is the mean of the looked-up rows. With plain SGD at
`lr = batch_size * replicas_to_aggregate`, every appearance of an id in an
aggregated (applied) gradient moves its row by exactly -1. After each epoch
the rows, negated, are the multiset of example ids that the epoch's
applied gradients came from: it must be the dataset, each id once.
"""

import numpy as np
import tensorflow as tf
import testutil
from absl.testing import absltest
from absl.testing import parameterized

import tf2sync

_WORKERS = 2


def _model(num_examples):
    return tf.keras.Sequential(
        [
            tf.keras.layers.Embedding(
                num_examples,
                1,
                embeddings_initializer="zeros",
                input_length=1,
                name="rows",
            ),
            tf.keras.layers.Flatten(),
        ]
    )


def _mean_of_rows(y_true, y_pred):
    del y_true
    return tf.reduce_sum(y_pred, axis=-1)  # per example: its row


class _Rows(tf.keras.callbacks.Callback):
    """The table's rows after each epoch (read from the ps)."""

    def __init__(self):
        super().__init__()
        self.after_epoch = []

    def on_epoch_end(self, epoch, logs=None):
        rows = self.model.get_layer("rows").get_weights()[0][:, 0]
        self.after_epoch.append(rows.copy())


def _sharded_ids(num_examples, batch_size):
    def dataset_fn(context):
        ids = tf.data.Dataset.range(num_examples)
        ids = ids.shard(context.num_input_pipelines, context.input_pipeline_id)
        return (
            ids.shuffle(num_examples, reshuffle_each_iteration=True)
            .batch(batch_size)
            .map(lambda i: (tf.reshape(i, [-1, 1]), tf.zeros_like(i)))
            .repeat()
        )

    return dataset_fn


class StaticShardingTest(parameterized.TestCase):
    @parameterized.parameters(
        # (batches per worker and epoch, batch size, steps per function)
        (6, 4, 6),
        (8, 2, 4),
        (12, 3, 12),
    )
    def test_each_example_once_per_epoch(self, batches, batch, per_function):
        num_examples = _WORKERS * batches * batch
        strategy = testutil.strategy(
            _WORKERS,
            1,
            replicas_to_aggregate=_WORKERS,
            total_num_replicas=_WORKERS,
        )
        with strategy.scope():
            model = _model(num_examples)
            model.compile(
                optimizer=tf2sync.SyncOptimizer(
                    tf.keras.optimizers.SGD(batch * _WORKERS)
                ),
                loss=_mean_of_rows,
                steps_per_execution=per_function,
            )
        rows = _Rows()
        model.fit(
            tf.keras.utils.experimental.DatasetCreator(
                _sharded_ids(num_examples, batch)
            ),
            epochs=3,
            steps_per_epoch=_WORKERS * batches,
            verbose=0,
            callbacks=[rows],
        )
        previous = np.zeros(num_examples)
        for epoch, after in enumerate(rows.after_epoch):
            counts = previous - after
            np.testing.assert_array_equal(
                counts,
                np.ones(num_examples),
                err_msg=f"epoch {epoch}: ids seen {counts} times",
            )
            previous = after


if __name__ == "__main__":
    absltest.main()
