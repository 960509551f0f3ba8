"""A large embedding on synthetic click data: shard it over the ps.

Each example is `--clicks_ids_per_example` ids out of a vocabulary of
`--clicks_vocab_size` (1,000,000 by default: a 1,000,000 x 32 float32
table, 128 MB), drawn from a skewed (Zipf-like) distribution, as clicks
are. Its label is drawn from `sigmoid(3 * score)`, where `score` sums a
hidden weight per id (fixed seed), so a model that learns the ids' weights
can predict it; unseen ids make the task noisy, and learning is measured
with AUC (0.5: chance; about 0.92 for a model knowing every weight).

The model: the table, mean-pooled over an example's ids, two dense layers
and a sigmoid. Shard the table over the parameter servers:

    tf2sync --job_module=tf2sync._src.jobs.clicks --num_ps=2 --max_shards=2

The table's gradient is sparse (the rows of a batch); Adagrad
(`build_optimizer`) updates only those rows, where momentum SGD would
rewrite the whole table every step. The job's `FLAG_DEFAULTS` set the
launcher's defaults (batch 256, 2 epochs, rate 0.05); flags on the command
line win.
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf
from absl import flags

_VOCAB_SIZE = flags.DEFINE_integer(
    "clicks_vocab_size",
    1_000_000,
    "clicks job: rows of the embedding table.",
    lower_bound=1,
)
_EMBEDDING_DIM = flags.DEFINE_integer(
    "clicks_embedding_dim",
    32,
    "clicks job: columns of the table.",
    lower_bound=1,
)
_IDS_PER_EXAMPLE = flags.DEFINE_integer(
    "clicks_ids_per_example",
    8,
    "clicks job: ids per example, mean-pooled.",
    lower_bound=1,
)
_NUM_TRAIN = flags.DEFINE_integer(
    "clicks_num_train",
    200_000,
    "clicks job: training examples (one epoch).",
    lower_bound=1,
)

# The launcher's defaults for this job (see `launcher/flags.py`).
FLAG_DEFAULTS = {"batch_size": 256, "epochs": 2, "learning_rate": 0.05}

LOSS = "binary_crossentropy"
# Names, not metric objects: every `compile` makes its own.
METRICS = ["accuracy", "AUC"]

_NUM_EVAL = 10_000
_SEED = 0
# ids are drawn as `floor(vocab * u**_SKEW)`, then permuted: the most
# frequent ids spread over the table, hence over its shards.
_SKEW = 3.0


def _value(flag):
    """The flag's value, or its default where flags are not parsed."""
    return flag.value if flags.FLAGS.is_parsed() else flag.default


def vocab_size() -> int:
    return _value(_VOCAB_SIZE)


@functools.lru_cache(maxsize=4)
def _data(vocab: int, ids_per_example: int, num_train: int):
    rng = np.random.RandomState(_SEED)
    hidden = rng.normal(size=vocab).astype("float32")
    permutation = rng.permutation(vocab)
    total = num_train + _NUM_EVAL
    ranks = np.floor(
        vocab * rng.uniform(size=(total, ids_per_example)) ** _SKEW
    )
    ids = permutation[np.minimum(ranks.astype("int64"), vocab - 1)]
    score = hidden[ids].sum(axis=1) / np.sqrt(ids_per_example)
    probability = 1.0 / (1.0 + np.exp(-3.0 * score))
    labels = (rng.uniform(size=total) < probability).astype("float32")
    return ids.astype("int32"), labels[:, None]


def _arrays():
    return _data(
        vocab_size(),
        _value(_IDS_PER_EXAMPLE),
        num_train_examples(),
    )


def build_model() -> tf.keras.Model:
    ids_per_example = _value(_IDS_PER_EXAMPLE)
    return tf.keras.Sequential(
        [
            tf.keras.layers.Embedding(
                vocab_size(),
                _value(_EMBEDDING_DIM),
                input_length=ids_per_example,
                name="embedding",
            ),
            tf.keras.layers.GlobalAveragePooling1D(name="mean"),
            tf.keras.layers.Dense(64, activation="relu", name="hidden"),
            tf.keras.layers.Dense(1, activation="sigmoid", name="click"),
        ]
    )


def build_optimizer(learning_rate: float, momentum: float):
    """Adagrad: sparse updates of the table (momentum is not used)."""
    del momentum
    return tf.keras.optimizers.Adagrad(
        learning_rate, initial_accumulator_value=1e-12, epsilon=1e-12
    )


def train_dataset(input_context, batch_size: int) -> tf.data.Dataset:
    ids, labels = _arrays()
    n = num_train_examples()
    ds = tf.data.Dataset.from_tensor_slices((ids[:n], labels[:n]))
    # Each worker its shard (the input context names it under tf2sync).
    ds = ds.shard(
        input_context.num_input_pipelines, input_context.input_pipeline_id
    )
    shard = -(-n // input_context.num_input_pipelines)
    return ds.shuffle(min(shard, 50_000)).batch(batch_size).repeat()


def eval_arrays():
    ids, labels = _arrays()
    n = num_train_examples()
    return ids[n:], labels[n:]


def num_train_examples() -> int:
    return _value(_NUM_TRAIN)
