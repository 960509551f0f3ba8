"""tf2sync.Trainer: hooks, callbacks, checkpoints and exact resume."""

import contextlib
import io
import os
import tempfile
import threading
from unittest import mock

import numpy as np
import tensorflow as tf
import testutil
from absl.testing import absltest
from absl.testing import parameterized
from tensorflow.python.data.experimental.ops import testing as data_testing

import tf2sync
from tf2sync._src import callbacks as callbacks_lib
from tf2sync._src import loops
from tf2sync._src import trainer_checks
from tf2sync._src import trainer_sync
from tf2sync._src.internals import ps_strategy

_X, _Y = testutil.data("dense", 32)


def _dataset_fn(input_context):
    del input_context
    return tf.data.Dataset.from_tensors((_X, _Y)).repeat()


def _parts(seed=0, num_ps=1, **strategy_kwargs):
    strategy = testutil.strategy(
        2, num_ps, replicas_to_aggregate=2, **strategy_kwargs
    )
    with strategy.scope():
        model = testutil.dense_model(seed)
        optimizer = tf2sync.SyncOptimizer(
            tf.keras.optimizers.Adam(0.01), ema_decay=0.9
        )
    return strategy, model, optimizer


def _trainer(parts, steps_per_loop, cls=tf2sync.Trainer, **kwargs):
    """A silent trainer of `parts` (strategy, model, optimizer)."""
    strategy, model, optimizer = parts
    kwargs.setdefault("loss_fn", testutil.mean_loss)
    kwargs.setdefault("verbose", 0)
    return cls(
        strategy=strategy,
        model=model,
        optimizer=optimizer,
        steps_per_loop=steps_per_loop,
        **kwargs,
    )


class _Recorder(tf.keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.events = []

    def on_train_begin(self, logs=None):
        self.events.append("train_begin")

    def on_epoch_begin(self, epoch, logs=None):
        self.events.append(f"epoch_begin_{epoch}")

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(f"epoch_end_{epoch}:{logs['sync_steps']}")

    def on_train_end(self, logs=None):
        self.events.append("train_end")


class _Hooked(tf2sync.Trainer):
    begins = 0

    def train_loop_begin(self):
        self.begins += 1

    def train_loop_end(self, logs):
        return dict(logs, hooked=1.0)


def _loop_ops(trainer):
    """Op types of the function `trainer` scheduled (after `train`)."""
    (traced,) = trainer._loop._list_all_concrete_functions()
    return {op.type for op in traced.graph.get_operations()}


def _push_calls(trainer, optimizer, graph=None):
    """How many times `graph` (default: the function `trainer` scheduled)
    calls the push."""
    functions = [
        concrete.name
        for function in optimizer._aggregator._push_functions.values()
        if function is not None
        for concrete in function._list_all_concrete_functions()
    ]
    if graph is None:
        (traced,) = trainer._loop._list_all_concrete_functions()
        graph = traced.graph
    return sum(
        op.get_attr("f").name.encode() in functions
        for op in graph.get_operations()
        if op.type in ("PartitionedCall", "StatefulPartitionedCall")
    )


class TrainerTest(parameterized.TestCase):
    def test_hooks_callbacks_and_sync_steps(self):
        strategy, model, optimizer = _parts()
        recorder = _Recorder()
        trainer = _trainer(
            (strategy, model, optimizer), 4, cls=_Hooked, callbacks=[recorder]
        )
        history = trainer.train(_dataset_fn, epochs=2, steps_per_epoch=8)
        self.assertEqual(trainer.begins, 2)
        self.assertEqual(
            recorder.events,
            [
                "train_begin",
                "epoch_begin_0",
                "epoch_end_0:4",
                "epoch_begin_1",
                "epoch_end_1:8",
                "train_end",
            ],
        )
        self.assertEqual(history.history["hooked"], [1.0, 1.0])
        self.assertEqual(history.history["sync_steps"], [4, 8])
        self.assertLess(history.history["loss"][1], history.history["loss"][0])

    def test_a_checkpoint_dir_it_could_not_write_is_refused_at_once(self):
        afile = tempfile.mkstemp()[1]
        for path, problem in (
            (afile, "is a file, not a directory"),
            (
                os.path.join(afile, "ckpt"),
                f"cannot be created: {afile} is a file",
            ),
        ):
            with self.assertRaisesRegex(
                ValueError,
                f"`checkpoint_dir`: {problem}. Received: "
                f"checkpoint_dir='{path}'",
            ):
                _trainer(_parts(), 4, checkpoint_dir=path)

    def test_bad_checkpoint_cadence_is_refused(self):
        for kwargs, line in (
            (
                {"checkpoint_every_steps": 0, "checkpoint_dir": "/tmp/x"},
                "`checkpoint_every_steps` must be None or an int > 0. "
                "Received: checkpoint_every_steps=0",
            ),
            (
                {"checkpoint_every_seconds": float("nan")},
                "`checkpoint_every_seconds` must be None or a number of "
                "seconds > 0. Received: checkpoint_every_seconds=nan",
            ),
            (
                {"checkpoint_every_seconds": 30},
                "`checkpoint_every_seconds` needs `checkpoint_dir` (where to "
                "save). Received: checkpoint_every_seconds=30, "
                "checkpoint_dir=None",
            ),
            (
                {"checkpoint_in_background": 1, "checkpoint_dir": "/tmp/x"},
                "`checkpoint_in_background` must be True or False. "
                "Received: checkpoint_in_background=1",
            ),
        ):
            with self.assertRaisesWithLiteralMatch(ValueError, line):
                _trainer(_parts(), 4, **kwargs)

    def test_a_dataset_that_runs_out_is_named_and_earlier_epochs_kept(self):
        # 9 batches per worker: the first epoch's 8 pushes fit however the
        # workers share them (with 6, one that took 7 ran out in the first
        # epoch: a flaky test); the 24 pushes of 3 epochs cannot.
        def finite(input_context):
            del input_context
            return tf.data.Dataset.from_tensors((_X, _Y)).repeat(9)

        directory = tempfile.mkdtemp()
        strategy, model, optimizer = _parts()
        trainer = _trainer(
            (strategy, model, optimizer), 4, checkpoint_dir=directory
        )
        with self.assertRaisesRegex(
            ValueError,
            r"The dataset of `dataset_fn` ran out on a worker: .* must repeat "
            r"\(add `.repeat\(\)`",
        ):
            trainer.train(finite, epochs=3, steps_per_epoch=8)
        self.assertIsNotNone(tf.train.latest_checkpoint(directory))
        self.assertIn(int(trainer._epoch.numpy()), (1, 2))

    def test_callbacks_acting_on_batches_are_named_in_a_warning(self):
        # The Trainer calls epoch hooks only: a ModelCheckpoint saving
        # every 2 batches would never save, silently.
        directory = tempfile.mkdtemp()
        batch_hooked = [
            tf.keras.callbacks.ModelCheckpoint(
                os.path.join(directory, "m_{epoch}.h5"),
                save_weights_only=True,
                save_freq=2,
            ),
            tf.keras.callbacks.LambdaCallback(on_batch_end=lambda *_: None),
        ]
        epoch_only = [
            tf.keras.callbacks.ModelCheckpoint(
                os.path.join(directory, "e_{epoch}.h5"), save_weights_only=True
            ),
            tf2sync.SyncMetrics(),
        ]
        for callbacks, expected in (
            (
                batch_hooked + epoch_only,
                ["the batch hooks of ModelCheckpoint, LambdaCallback will not"],
            ),
            (epoch_only, []),
        ):
            trainer = _trainer(_parts(), 4, callbacks=callbacks)
            with mock.patch.object(
                trainer_checks.logging, "warning"
            ) as warning:
                history = trainer.train(
                    _dataset_fn, epochs=1, steps_per_epoch=4
                )
            # SyncMetrics reads the Trainer's optimizer (the model has none).
            self.assertEqual(history.history["stale_dropped_epoch"], [0])
            said = [c.args[0] % c.args[1:] for c in warning.call_args_list]
            self.assertLen(said, len(expected), said)
            for line, part in zip(said, expected):
                self.assertIn(part, line)
        self.assertEqual(os.listdir(directory), ["e_1.h5"])

    def test_the_first_loop_runs_as_single_steps(self):
        # The workers first set up a function of one step copy; the full
        # loop (its trace a copy of that step's) serves the loops after it.
        strategy, model, optimizer = _parts()
        trainer = _trainer((strategy, model, optimizer), 4)
        schedule = trainer.coordinator.schedule
        scheduled = []

        def recording(fn, args=None, kwargs=None):
            scheduled.append("loop" if fn is trainer._loop else "single")
            return schedule(fn, args=args, kwargs=kwargs)

        with mock.patch.object(trainer.coordinator, "schedule", recording):
            history = trainer.train(_dataset_fn, epochs=2, steps_per_epoch=8)
        self.assertEqual(scheduled, ["single"] * 4 + ["loop"] * 3)
        self.assertEqual(history.history["sync_steps"], [4, 8])
        self.assertEqual(int(optimizer.iterations.numpy()), 8)
        # A tf.while_loop of single steps is already one step's function.
        scheduled.clear()
        trainer = _trainer(
            (strategy, model, optimizer), 4, use_tf_while_loop=True
        )
        schedule = trainer.coordinator.schedule
        with mock.patch.object(trainer.coordinator, "schedule", recording):
            trainer.train(_dataset_fn, epochs=1, steps_per_epoch=8)
        self.assertEqual(scheduled, ["loop"] * 2)

    @parameterized.parameters(True, False)
    def test_the_first_loop_waits_for_the_first_step_where_cpus_are_shared(
        self, shared
    ):
        # Where the chief shares the workers' CPUs
        # (`loops.waits_for_first_step`, patched here: unpatched, it says
        # True on 2 cores), the full loop's schedule (its trace) waits for
        # the first single step's result; elsewhere it follows the single
        # steps.
        strategy, model, optimizer = _parts()
        trainer = _trainer((strategy, model, optimizer), 4)
        schedule = trainer.coordinator.schedule
        events = []

        def recording(fn, args=None, kwargs=None):
            value = schedule(fn, args=args, kwargs=kwargs)
            events.append("loop" if fn is trainer._loop else "single")
            return (
                testutil.FetchRecorded(value, events)
                if len(events) == 1
                else value
            )

        with (
            mock.patch.object(trainer.coordinator, "schedule", recording),
            mock.patch.object(
                loops, "waits_for_first_step", return_value=shared
            ) as waits,
        ):
            trainer.train(_dataset_fn, epochs=1, steps_per_epoch=12)
        # Asked with the cluster's resolver and the first loop's steps.
        resolver = ps_strategy.cluster_resolver(strategy)
        self.assertLen(resolver.cluster_spec().job_tasks("worker"), 2)
        waits.assert_called_once_with(resolver, 4)
        # Then fetched again with the epoch's losses.
        waited = ["fetched"] if shared else []
        self.assertEqual(
            events, ["single"] * 4 + waited + ["loop", "loop", "fetched"]
        )
        self.assertEqual(int(optimizer.iterations.numpy()), 6)

    def test_an_epochs_loss_weighs_each_function_by_its_steps(self):
        strategy, model, optimizer = _parts()
        trainer = _trainer((strategy, model, optimizer), 4)
        fetched = {"single": 1.0, "loop": 4.0}  # each function's mean loss
        trainer.coordinator = mock.Mock(spec=["schedule", "join"])
        trainer.coordinator.schedule.side_effect = lambda fn, args: mock.Mock(
            fetch=lambda: fetched[fn]
        )
        trainer._verbose = 1  # the progress bar shows the same mean
        shown = io.StringIO()
        with contextlib.redirect_stdout(shown):
            # Epoch 0 from its step 0, 8 steps: 2 loops of 4.
            logs = trainer._run_epoch("loop", None, (0, 0, 8), "single")
        # 4 single steps at 1.0 and one loop of 4 at 4.0: 2.5 a step.
        self.assertEqual(logs["loss"], 2.5)
        self.assertIn("2/2", shown.getvalue())
        self.assertIn("loss: 2.5000", shown.getvalue())

    def test_a_loss_function_needing_autograph_is_converted(self):
        # Trainer's own train_step is tf2sync code, which AutoGraph skips;
        # the user's loss function is still converted, as before.
        def loss_fn(y, logits):
            loss = testutil.mean_loss(y, logits)
            if loss > 1e9:  # a tensor in a Python `if`; never true here
                loss = loss * 0.0
            return loss

        strategy, model, optimizer = _parts()
        trainer = tf2sync.Trainer(
            strategy=strategy,
            model=model,
            optimizer=optimizer,
            loss_fn=loss_fn,
            steps_per_loop=2,
            verbose=0,
        )
        history = trainer.train(_dataset_fn, epochs=1, steps_per_epoch=4)
        self.assertEqual(history.history["sync_steps"], [2])

    def test_a_keras_loss_object_trains_on_the_replicas_mean(self):
        # tf_keras refuses a Loss of its default reduction under a strategy
        # (outside compile) and advises SUM or NONE, whose gradient is the
        # sum's. The Trainer takes it as the replica's mean, as fit does:
        # the same weights as with that mean written by hand.
        weights = []
        for loss_fn in (
            testutil.mean_loss,
            tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        ):
            parts = _parts()
            trainer = _trainer(parts, 2)
            trainer.loss_fn = loss_fn
            trainer.train(_dataset_fn, epochs=1, steps_per_epoch=4)
            self.assertEqual(int(parts[2].iterations.numpy()), 2)
            weights.append(parts[1].get_weights())
        self.assertLess(testutil.max_abs_diff(*weights), 1e-6)

    def test_a_dataset_for_dataset_fn_is_refused_in_one_line(self):
        parts = _parts()
        trainer = _trainer(parts, 2)
        dataset = _dataset_fn(None)
        with self.assertRaisesRegex(
            TypeError,
            r"^`dataset_fn` must be a function .* \(a tf.data.Dataset: .*"
            r"`lambda input_context: dataset` .*\)\. Received: "
            r"dataset_fn=_RepeatDataset$",
        ):
            trainer.train(dataset, epochs=1, steps_per_epoch=4)
        self.assertEqual(int(parts[2].iterations.numpy()), 0)

    def test_arguments_given_the_way_a_tired_user_gives_them(self):
        # Each failed later with Python's or TF's words ("'NoneType' object
        # is not callable", "<lambda>() takes 0 positional arguments",
        # "Iterating over a symbolic `tf.Tensor`"), or was taken silently
        # (verbose=3); each is now one line naming the argument.
        parts = _parts()
        for kwargs, error, message in (
            ({"loss_fn": None}, ValueError, r"needs `loss_fn`.* loss_fn=None$"),
            ({"loss_fn": "no_such"}, ValueError, r"no loss named 'no_such'"),
            ({"loss_fn": 3}, TypeError, r"Received: loss_fn=3$"),
            ({"verbose": 3}, ValueError, r"Received: verbose=3$"),
            ({"callbacks": ["tb"]}, TypeError, r"callbacks\[0\]='tb'$"),
        ):
            with self.assertRaisesRegex(error, message):
                _trainer(parts, 2, **kwargs)
        trainer = _trainer(parts, 2)
        for dataset_fn, epochs, error, message in (
            (
                lambda: _dataset_fn(None),
                1,
                TypeError,
                r"^`dataset_fn` must take one argument, the tf.distribute."
                r"InputContext .* Received: dataset_fn\(\)$",
            ),
            (_dataset_fn, "2", ValueError, r"Received: epochs='2'$"),
            (
                lambda context: _dataset_fn(context).map(lambda x, y: x),
                1,
                ValueError,
                r"^Trainer's default `train_step` takes `\(x, y\)` batches: "
                r".* Received: a batch of a tensor of shape \(32, 4\)$",
            ),
        ):
            with self.assertRaisesRegex(error, message):
                trainer.train(dataset_fn, epochs=epochs, steps_per_epoch=4)
        self.assertEqual(int(parts[2].iterations.numpy()), 0)
        # A loss's name, as compile takes it, and one callback alone. Two
        # pushes, both at the initial weights: the epoch's loss is theirs.
        initial = testutil.dense_model()
        initial.set_weights(parts[1].get_weights())
        name = "sparse_categorical_crossentropy"
        expected = tf.reduce_mean(tf.keras.losses.get(name)(_Y, initial(_X)))
        trainer = _trainer(
            parts, 2, loss_fn=name, callbacks=tf.keras.callbacks.History()
        )
        history = trainer.train(_dataset_fn, epochs=1, steps_per_epoch=2)
        self.assertEqual(int(parts[2].iterations.numpy()), 1)
        self.assertAlmostEqual(
            history.history["loss"][0], float(expected), places=5
        )

    def test_a_failed_train_leaves_no_error_and_no_token_lost(self):
        # PSS's closure queue kept the error fetched from a failed function
        # and raised it again at the next train's first schedule; and the
        # failed step's token was lost, so the next train waited for the
        # token timeout (60 s by default; an hour here, so that only the
        # release on the failure can let it go on). A label out of range
        # fails the loss, which follows the step's reads, which follow its
        # token: the failing step always holds one.
        parts = _parts(token_timeout=3600.0)
        strategy, _, optimizer = parts

        def poisoned(context):  # each worker's third batch
            bad = tf.data.Dataset.from_tensors((_X, np.full_like(_Y, 99)))
            return _dataset_fn(context).take(2).concatenate(bad.repeat())

        with self.assertRaisesRegex(
            tf.errors.InvalidArgumentError, "label value of 99"
        ):
            _trainer(parts, 1).train(poisoned, epochs=1, steps_per_epoch=8)
        before = int(optimizer.iterations.numpy())
        errors = []

        def retry():
            try:
                _trainer(parts, 1).train(
                    _dataset_fn, epochs=1, steps_per_epoch=4
                )
            except Exception as e:  # noqa: BLE001 - asserted below
                errors.append(e)

        thread = threading.Thread(target=retry, daemon=True)
        thread.start()
        thread.join(60)  # the release comes within about a second
        self.assertFalse(thread.is_alive(), "the retry waited for a token")
        self.assertEqual(errors, [])
        self.assertEqual(int(optimizer.iterations.numpy()), before + 2)
        self.assertGreaterEqual(strategy._watchdog.released, 1)

    def test_a_subclassed_model_with_its_weights_made_in_init_is_taken(self):
        # `built` stays False, but the weights exist: the optimizer builds.
        class Linear(tf.keras.Model):
            def __init__(self):
                super().__init__()
                self.w = self.add_weight("w", shape=(4, 3), initializer="zeros")

            def call(self, x):
                return tf.matmul(x, self.w)

        strategy, _, optimizer = _parts()
        with strategy.scope():
            model = Linear()
        self.assertFalse(model.built)
        trainer = _trainer((strategy, model, optimizer), 2)
        trainer.train(_dataset_fn, epochs=1, steps_per_epoch=4)
        self.assertEqual(int(optimizer.iterations.numpy()), 2)
        self.assertGreater(float(tf.reduce_sum(tf.abs(model.w))), 0.0)

    def test_a_model_making_weights_at_its_first_call_is_refused(self):
        # Adam is built when the Trainer is made, on the weights made in
        # `__init__`; the layer built at the first call has no slots, and
        # tf_keras's update step failed with a KeyError that suggested
        # `optimizer.build`. Refused at the trace, before any step ran.
        class Half(tf.keras.Model):
            def __init__(self):
                super().__init__()
                self.w = self.add_weight("w", shape=(4, 3), initializer="ones")
                self.head = tf.keras.layers.Dense(3, name="head")

            def call(self, x):
                return self.head(tf.matmul(x, self.w))

        strategy, _, optimizer = _parts()
        with strategy.scope():
            model = Half()
        trainer = _trainer((strategy, model, optimizer), 2)
        with self.assertRaisesRegex(
            ValueError,
            r"^Adam was built before the model made \['\w+/head/kernel:0', "
            r"'\w+/head/bias:0'\]: .*`model.build\(input_shape\)`.* "
            r"Received: 2 of 3 variables with gradients unknown to "
            r"optimizer=Adam$",
        ):
            trainer.train(_dataset_fn, epochs=1, steps_per_epoch=4)
        self.assertEqual(int(optimizer.iterations.numpy()), 0)
        self.assertEqual(float(tf.reduce_sum(model.w)), 12.0)
        # As the message says: the model called on one batch first trains.
        with strategy.scope():
            model = Half()
            model(_X[:1])
            adam = tf2sync.SyncOptimizer(tf.keras.optimizers.Adam(0.01))
        _trainer((strategy, model, adam), 2).train(
            _dataset_fn, epochs=1, steps_per_epoch=4
        )
        self.assertEqual(int(adam.iterations.numpy()), 2)
        self.assertNotEqual(float(tf.reduce_sum(model.w)), 12.0)

    def test_a_replaced_optimizers_trainer_changes_nothing(self):
        # Fine-tuning with a second Trainer: the first one's `train` must
        # not restore its old checkpoint over the new weights.
        strategy, model, first = _parts()
        directory = tempfile.mkdtemp()
        old = _trainer((strategy, model, first), 2, checkpoint_dir=directory)
        old.train(_dataset_fn, epochs=1, steps_per_epoch=4)
        saved = sorted(os.listdir(directory))
        with strategy.scope():
            second = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
        _trainer((strategy, model, second), 2).train(
            _dataset_fn, epochs=1, steps_per_epoch=4
        )
        trained = model.get_weights()
        with self.assertRaisesRegex(
            ValueError, r"^This SyncOptimizer \(SyncAdam\) was replaced"
        ):
            old.train(_dataset_fn, epochs=2, steps_per_epoch=4)
        self.assertEqual(testutil.max_abs_diff(trained, model.get_weights()), 0)
        self.assertEqual(sorted(os.listdir(directory)), saved)
        self.assertEqual(int(second.iterations.numpy()), 2)
        # A trainer of the replaced optimizer, or of a plain one, is
        # refused when it is created.
        with self.assertRaisesRegex(ValueError, r"\(SyncAdam\) was replaced"):
            _trainer((strategy, model, first), 2)
        with strategy.scope():
            plain = tf.keras.optimizers.SGD(0.1)
        with self.assertRaisesRegex(
            TypeError,
            r"^Trainer's `optimizer` must be a tf2sync.SyncOptimizer .* "
            r"Received: optimizer=<tf_keras.*SGD",
        ):
            _trainer((strategy, model, plain), 2)
        self.assertEqual(int(second.iterations.numpy()), 2)

    def test_a_model_without_weights_is_refused_in_one_line(self):
        # Keras's "Weights for model 'sequential' have not yet been
        # created" came from the optimizer's build, naming no argument.
        strategy, _, optimizer = _parts()
        with strategy.scope():
            unbuilt = tf.keras.Sequential([tf.keras.layers.Dense(3)])
        with self.assertRaisesRegex(
            ValueError,
            r"^Trainer's `model` has no weights yet: .*`input_shape`.* "
            r"Received: model='sequential\w*' \(built=False\)$",
        ):
            _trainer((strategy, unbuilt, optimizer), 2)
        self.assertFalse(unbuilt.built)

    def test_each_local_replica_counts_its_share_of_the_workers_gradient(
        self,
    ):
        # The SyncOptimizer sums a worker's local replicas (GPUs, none
        # here): with n of them the Trainer scales each replica's loss by
        # 1/n, as fit's compiled loss does. Told there are 2, plain SGD at
        # 0.1 takes the steps of SGD at 0.05 with one.
        weights = []
        for rate, replicas in ((0.1, 2), (0.05, 1)):
            strategy = testutil.strategy(2, 1, replicas_to_aggregate=2)
            with strategy.scope():
                model = testutil.dense_model(0)
                optimizer = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(rate))
            trainer = _trainer((strategy, model, optimizer), 2)
            with mock.patch.object(
                trainer_sync.KerasSync, "replicas", return_value=replicas
            ):
                trainer.train(_dataset_fn, epochs=1, steps_per_epoch=4)
            self.assertEqual(int(optimizer.iterations.numpy()), 2)
            weights.append(model.get_weights())
        self.assertLess(testutil.max_abs_diff(*weights), 1e-6)

    def test_the_models_own_losses_are_added_as_fit_adds_them(self):
        # A kernel regularizer (model.losses) trains as the same penalty
        # written into loss_fn by hand; it was left out before.
        def model_fn(regularizer):
            tf.keras.utils.set_random_seed(0)
            return tf.keras.Sequential(
                [
                    tf.keras.layers.Dense(
                        8,
                        activation="relu",
                        input_shape=(4,),
                        kernel_regularizer=regularizer,
                    ),
                    tf.keras.layers.Dense(3),
                ]
            )

        weights = []
        for regularized in (True, False):
            strategy = testutil.strategy(2, 1, replicas_to_aggregate=2)
            with strategy.scope():
                model = model_fn(
                    tf.keras.regularizers.L2(0.5) if regularized else None
                )
                optimizer = tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
            kernel = model.layers[0].kernel

            def by_hand(y, logits, kernel=kernel):
                return testutil.mean_loss(y, logits) + 0.5 * tf.reduce_sum(
                    tf.square(kernel)
                )

            trainer = _trainer((strategy, model, optimizer), 2)
            trainer.loss_fn = testutil.mean_loss if regularized else by_hand
            trainer.train(_dataset_fn, epochs=1, steps_per_epoch=4)
            self.assertEqual(int(optimizer.iterations.numpy()), 2)
            weights.append(model.get_weights())
        self.assertLess(testutil.max_abs_diff(*weights), 1e-6)

    def test_a_loss_that_is_not_a_scalar_is_refused_before_any_step(self):
        parts = _parts()
        trainer = _trainer(parts, 2)
        trainer.loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="none"
        )
        with self.assertRaisesRegex(
            ValueError,
            r"`loss_fn` must return a scalar, .* it returned shape \[32\]",
        ):
            trainer.train(_dataset_fn, epochs=1, steps_per_epoch=4)
        self.assertEqual(int(parts[2].iterations.numpy()), 0)

    def test_an_overridden_train_step_is_converted_and_the_loop_is_not(self):
        # The loop around the step is tf2sync's own code: AutoGraph does not
        # rewrite it (it did, as the top-level function of a tf.function:
        # 0.12-0.17 s of a first trace). A train_step the user overrides is
        # still converted, so a Python `if` on a tensor works there.
        from tensorflow.python.autograph.impl import api

        class Guarded(tf2sync.Trainer):
            def train_step(self, batch):
                x, y = batch
                if tf.reduce_sum(x) > 1e9:  # needs AutoGraph; never true
                    x = x * 0.0
                return super().train_step((x, y))

        converted = []
        convert = api._convert_actual

        def recording(entity, program_ctx):
            converted.append(getattr(entity, "__code__", None))
            return convert(entity, program_ctx)

        trainer = _trainer(_parts(), 2, cls=Guarded)
        with mock.patch.object(api, "_convert_actual", recording):
            history = trainer.train(_dataset_fn, epochs=1, steps_per_epoch=4)
        self.assertEqual(history.history["sync_steps"], [2])
        names = [code.co_name for code in converted if code]
        self.assertIn("train_step", names)
        ours = os.path.dirname(tf2sync.__file__)
        for code in converted:
            self.assertFalse(code and code.co_filename.startswith(ours), code)

    def test_resume_is_exact(self):
        strategy, model, optimizer = _parts()
        _trainer((strategy, model, optimizer), 2).train(
            _dataset_fn, epochs=4, steps_per_epoch=4
        )
        uninterrupted = model.get_weights()
        ema = [v.numpy() for v in optimizer.ema_variables]

        totals = callbacks_lib.sync_totals(optimizer)

        directory = tempfile.mkdtemp()
        strategy, model, optimizer = _parts()
        _trainer(
            (strategy, model, optimizer), 2, checkpoint_dir=directory
        ).train(_dataset_fn, epochs=2, steps_per_epoch=4)
        halfway = callbacks_lib.sync_totals(optimizer)
        # A new process would start from scratch: a fresh strategy, model
        # (other initial weights) and optimizer, the same checkpoint_dir.
        strategy, model, optimizer = _parts(seed=7)
        history = _trainer(
            (strategy, model, optimizer), 2, checkpoint_dir=directory
        ).train(_dataset_fn, epochs=4, steps_per_epoch=4)
        self.assertLen(history.history["loss"], 2)  # epochs 3 and 4 only
        self.assertEqual(int(optimizer.iterations.numpy()), 8)
        # The counters go on from the checkpoint's, as the global step
        # does: per worker, the resumed run's accepted pushes are on top
        # of the first run's (each worker's share varies run to run).
        resumed = callbacks_lib.sync_totals(optimizer)
        self.assertEqual(resumed["accepted"], totals["accepted"])
        for i in range(2):
            self.assertGreaterEqual(
                resumed[f"accepted_w{i}"], halfway[f"accepted_w{i}"]
            )
        self.assertEqual(
            sum(resumed[f"accepted_w{i}"] for i in range(2)),
            resumed["accepted"],
        )
        self.assertGreater(resumed["barrier_wait_s"], halfway["barrier_wait_s"])
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), uninterrupted), 1e-6
        )
        self.assertLess(
            testutil.max_abs_diff(
                [v.numpy() for v in optimizer.ema_variables], ema
            ),
            1e-6,
        )

    @parameterized.named_parameters(("", False), ("background", True))
    def test_resume_inside_an_epoch_is_exact(self, background):
        whole_dir = tempfile.mkdtemp()
        strategy, model, optimizer = _parts()
        _trainer(
            (strategy, model, optimizer),
            2,
            checkpoint_dir=whole_dir,
            checkpoint_every_steps=4,
            max_to_keep=10,
            checkpoint_in_background=background,
        ).train(_dataset_fn, epochs=2, steps_per_epoch=8)
        uninterrupted = model.get_weights()
        state = tf.train.get_checkpoint_state(whole_dir)
        self.assertEqual(
            [os.path.basename(p) for p in state.all_model_checkpoint_paths],
            ["ckpt-0_4", "ckpt-1", "ckpt-1_4", "ckpt-2"],
        )
        # A restart whose newest save is ckpt-1_4 (6 of 8 updates).
        directory = testutil.only_save(whole_dir, "ckpt-1_4")
        strategy, model, optimizer = _parts(seed=7)
        history = _trainer(
            (strategy, model, optimizer),
            2,
            checkpoint_dir=directory,
            checkpoint_every_steps=4,
            checkpoint_in_background=background,
        ).train(_dataset_fn, epochs=2, steps_per_epoch=8)
        self.assertLen(history.history["loss"], 1)  # epoch 2's last 4 steps
        self.assertEqual(int(optimizer.iterations.numpy()), 8)
        self.assertEqual(
            callbacks_lib.sync_totals(optimizer)["over_plan_dropped"], 0
        )
        # Steps counted from where the epoch resumed: no save at step 6.
        state = tf.train.get_checkpoint_state(directory)
        self.assertEqual(
            [os.path.basename(p) for p in state.all_model_checkpoint_paths],
            ["ckpt-1_4", "ckpt-2"],
        )
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), uninterrupted), 1e-6
        )
        # The same save resumed with epochs of 4 steps: its epoch is done.
        shorter = testutil.only_save(whole_dir, "ckpt-1_4")
        parts = _parts(seed=3)
        other = parts[2]
        history = _trainer(parts, 2, checkpoint_dir=shorter).train(
            _dataset_fn, epochs=2, steps_per_epoch=4
        )
        self.assertEqual(history.history, {})  # no step, no negative plan
        self.assertEqual(int(other.iterations.numpy()), 6)

    def test_checkpoint_seconds_are_the_trainings(self):
        # The trainer schedules an epoch's 20 functions at once (within
        # its set-up, under 0.8 s); their steps take 50 ms each (2 s an
        # epoch on 2 workers). A clock read as they are scheduled never
        # saw 0.8 s pass inside the second epoch.
        # The sleep is tf.data's own (C++, no Python): a Python function in
        # the input of an in-process worker stalled the whole suite on CI.
        def dataset_fn(input_context):
            return _dataset_fn(input_context).apply(data_testing.sleep(50_000))

        directory = tempfile.mkdtemp()
        trainer = _trainer(
            _parts(),
            4,
            checkpoint_dir=directory,
            checkpoint_every_seconds=0.8,
            max_to_keep=50,
        )
        trainer.train(dataset_fn, epochs=1, steps_per_epoch=80)  # set up
        trainer.train(dataset_fn, epochs=2, steps_per_epoch=80)
        state = tf.train.get_checkpoint_state(directory)
        names = [os.path.basename(p) for p in state.all_model_checkpoint_paths]
        self.assertNotEmpty(
            [n for n in names if n.startswith("ckpt-1_")], names
        )

    @parameterized.named_parameters(
        ("while_loop", True),
        # Each repeated step is a shim step of its own (its own local-step
        # read and token), as each loop iteration is.
        ("unrolled", False),
        # The default: groups of copies (here 2) in a tf.while_loop.
        ("grouped", None),
        # Epochs of 6: a loop of 4, then 2 single steps.
        ("grouped_epochs_short_of_a_loop", None, 6),
        # TF1's rate per variable group: a tf2sync.MultiOptimizer of
        # momentum SGDs inside the shim, its slots resumed per group.
        ("variable_groups", None, 8, True),
    )
    def test_tf1_shim_trains_and_resumes_on_the_exact_trajectory(
        self, use_tf_while_loop, steps_per_epoch=8, groups=False
    ):
        # Both workers see the same full batch: every accepted gradient is
        # the full-batch gradient at the current weights, so U rounds give
        # U single-process steps of TF1's momentum, across a resume too.
        rates = {"kernel": 0.1, "bias": 0.2 if groups else 0.1}

        def parts(seed):
            strategy = testutil.strategy(
                2,
                replicas_to_aggregate=2,
                options=tf2sync.SyncOptions(max_unrolled_steps=2),
            )
            with strategy.scope():
                model = testutil.dense_model(seed)
                inner = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
                if groups:
                    inner = tf2sync.MultiOptimizer(
                        groups={
                            key: tf.keras.optimizers.legacy.SGD(
                                rate, momentum=0.9
                            )
                            for key, rate in rates.items()
                        }
                    )
                optimizer = tf2sync.compat.v1.SyncReplicasOptimizer(inner, 2)
            return strategy, model, optimizer

        directory = tempfile.mkdtemp()
        initial = testutil.dense_model(0).get_weights()
        steps = []
        for seed, epochs in ((0, 1), (7, 3)):  # the second run resumes
            strategy, model, optimizer = parts(seed)
            trainer = _trainer(
                (strategy, model, optimizer),
                4,
                checkpoint_dir=directory,
                use_tf_while_loop=use_tf_while_loop,
            )
            history = trainer.train(
                _dataset_fn, epochs=epochs, steps_per_epoch=steps_per_epoch
            )
            steps.append(history.history["sync_steps"])
        self.assertLen(steps[1], 2)  # epochs 2 and 3 only
        updates = int(trainer.global_step.numpy())
        self.assertEqual(steps[1][-1], updates)
        self.assertGreater(steps[1][0], steps[0][-1])
        # 3 epochs of pushes, 2 per round; TF1's order wastes some (stale
        # pushes).
        self.assertBetween(
            updates, steps_per_epoch * 3 // 4, steps_per_epoch * 3 // 2
        )
        reference = testutil.dense_model(0)
        reference.set_weights(initial)
        testutil.tf1_momentum_per_group(reference, _X, _Y, rates, 0.9, updates)
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), reference.get_weights()),
            1e-5,
        )

    def test_unrolled_loop_trains_the_same_steps_without_a_while_loop(self):
        parts = _parts()
        rolled = _trainer(parts, 4, use_tf_while_loop=True)
        rolled.train(_dataset_fn, epochs=2, steps_per_epoch=8)
        expected = parts[1].get_weights()
        rolled_optimizer = parts[2]
        parts = _parts()
        unrolled = _trainer(parts, 4, use_tf_while_loop=False)
        history = unrolled.train(_dataset_fn, epochs=2, steps_per_epoch=8)
        # Repeated pushes call one ps function (the ps holds one copy per
        # worker, not one per step); a loop's lone push stays inline.
        self.assertEqual(_push_calls(unrolled, parts[2]), 4)
        self.assertEqual(_push_calls(rolled, rolled_optimizer), 0)
        self.assertEqual(history.history["sync_steps"], [4, 8])
        # One step per loop: no single-step function shares its trace, and
        # its lone push stays inline too.
        lone_parts = _parts()
        lone = _trainer(lone_parts, 1)
        lone.train(_dataset_fn, epochs=1, steps_per_epoch=2)
        self.assertEqual(_push_calls(lone, lone_parts[2]), 0)
        self.assertLess(
            testutil.max_abs_diff(parts[1].get_weights(), expected), 1e-6
        )
        # The unrolled function repeats the step in its graph; the other
        # one loops.
        self.assertIn("While", _loop_ops(rolled))
        self.assertFalse(
            _loop_ops(unrolled) & {"While", "StatelessWhile"},
        )

    def test_default_loop_repeats_the_step_in_groups(self):
        # Steps beyond one group: a tf.while_loop over groups of copies
        # (here 3, the trainer's options overriding the strategy's), the
        # rest unrolled after it; the same steps as a loop of single steps.
        parts = _parts()
        _trainer(parts, 4, use_tf_while_loop=True).train(
            _dataset_fn, epochs=2, steps_per_epoch=8
        )
        expected = parts[1].get_weights()
        parts = _parts()
        grouped = _trainer(  # 2 groups of 3 in a loop, then 2
            parts, 8, options=tf2sync.SyncOptions(max_unrolled_steps=3)
        )
        history = grouped.train(_dataset_fn, epochs=2, steps_per_epoch=8)
        self.assertEqual(history.history["sync_steps"], [4, 8])
        self.assertLess(
            testutil.max_abs_diff(parts[1].get_weights(), expected), 1e-6
        )
        (traced,) = grouped._loop._list_all_concrete_functions()
        (loop,) = [
            op for op in traced.graph.get_operations() if op.type == "While"
        ]
        body = traced.graph._functions[loop.get_attr("body").name]
        self.assertEqual(_push_calls(grouped, parts[2], body.graph), 3)
        # The 2 steps after the loop, in the function's own graph.
        self.assertEqual(_push_calls(grouped, parts[2]), 2)

    def test_default_loop_without_more_steps_than_a_group_is_unrolled(self):
        parts = _parts()
        trainer = _trainer(parts, 4)
        trainer.train(_dataset_fn, epochs=1, steps_per_epoch=8)
        self.assertFalse(_loop_ops(trainer) & {"While", "StatelessWhile"})

    def test_the_push_function_takes_the_lock_and_skips_grappler(self):
        # Each worker's first call sets the push function up on the ps: a
        # lock around the call would make the second worker's set-up wait
        # for the first's. The lock serialises the pushes, so it must be
        # inside the function, once per call.
        parts = _parts()
        trainer = _trainer(parts, 4)
        trainer.train(_dataset_fn, epochs=1, steps_per_epoch=8)
        self.assertEqual(_push_calls(trainer, parts[2]), 4)
        self.assertNotIn("MutexLock", _loop_ops(trainer))
        (function,) = [
            f
            for f in parts[2]._aggregator._push_functions.values()
            if f is not None
        ]
        (concrete,) = function._list_all_concrete_functions()
        locks = [
            op
            for op in concrete.graph.get_operations()
            if op.type == "MutexLock"
        ]
        self.assertLen(locks, 1)  # placed with its call, on the ps
        # Each call has the ps set the function up without Grappler.
        (traced,) = trainer._loop._list_all_concrete_functions()
        calls = [
            op
            for op in traced.graph.get_operations()
            if op.type == "StatefulPartitionedCall"
            and op.get_attr("f").name.encode() == concrete.name
        ]
        self.assertLen(calls, 4)
        for op in calls:
            config = tf.compat.v1.ConfigProto()
            config.ParseFromString(op.get_attr("config_proto"))
            self.assertTrue(
                config.graph_options.rewrite_options.disable_meta_optimizer
            )

    def test_unrolled_push_is_one_call_across_parameter_servers(self):
        # With 2 ps, each push stages its share on both and commits by one
        # call of the global step's ps (tf2sync/_src/sync/scale_out.py):
        # the commit holds nothing of the other ps, so it is not inlined.
        parts = _parts(num_ps=2)
        rolled = _trainer(parts, 4)
        rolled.train(_dataset_fn, epochs=1, steps_per_epoch=8)
        expected = parts[1].get_weights()
        parts = _parts(num_ps=2)
        devices = {v.device for v in parts[1].trainable_variables}
        self.assertLen({d.split("/device")[0] for d in devices}, 2, devices)
        unrolled = _trainer(parts, 4, use_tf_while_loop=False)
        unrolled.train(_dataset_fn, epochs=1, steps_per_epoch=8)
        functions = list(parts[2]._aggregator._push_functions.values())
        self.assertLen(functions, 1)
        self.assertIsNotNone(functions[0])
        self.assertEqual(_push_calls(unrolled, parts[2]), 4)
        self.assertLess(
            testutil.max_abs_diff(parts[1].get_weights(), expected), 1e-6
        )

    def test_use_tf_while_loop_must_be_a_bool(self):
        with self.assertRaisesRegex(
            ValueError,
            r"`use_tf_while_loop` must be None, True or False. Received: "
            r"use_tf_while_loop='no'",
        ):
            _trainer(_parts(), 4, use_tf_while_loop="no")

    @parameterized.named_parameters(
        # Loops of 4, the first as single steps: 4 + 2, then a loop + 2,
        # every single step the one function the first loop set up.
        ("default", {}, 6, ["one"] * 6 + ["loop"] + ["one"] * 2),
        # Epochs shorter than a loop: single steps only.
        ("short", {}, 3, ["one"] * 6),
        # No first single steps (a tf.while_loop of single steps already
        # is one step's function): a function of one step of its own.
        (
            "while_loop",
            {"use_tf_while_loop": True},
            6,
            ["loop", "one", "one"] * 2,
        ),
        # 8 copies past a group of 3: no first single steps either.
        (
            "past_a_group",
            {"options": tf2sync.SyncOptions(max_unrolled_steps=3)},
            10,
            ["loop", "one", "one"] * 2,
        ),
    )
    def test_an_epoch_short_of_a_whole_loop_ends_on_single_steps(
        self, kwargs, steps_per_epoch, expected_schedule
    ):
        # Every worker sees the same full batch: the same trajectory as
        # single steps all along.
        parts = _parts()
        _trainer(parts, 1).train(
            _dataset_fn, epochs=2, steps_per_epoch=steps_per_epoch
        )
        expected = parts[1].get_weights()
        strategy, model, optimizer = _parts()
        steps_per_loop = 8 if "options" in kwargs else 4
        trainer = _trainer(
            (strategy, model, optimizer), steps_per_loop, **kwargs
        )
        schedule = trainer.coordinator.schedule
        scheduled, others = [], set()

        def recording(fn, args=None, kwargs=None):
            scheduled.append("loop" if fn is trainer._loop else "one")
            if fn is not trainer._loop:
                others.add(fn)
            return schedule(fn, args=args, kwargs=kwargs)

        with mock.patch.object(trainer.coordinator, "schedule", recording):
            history = trainer.train(
                _dataset_fn, epochs=2, steps_per_epoch=steps_per_epoch
            )
        self.assertEqual(scheduled, expected_schedule)
        self.assertLen(others, 1)  # one function of one step
        # 2 pushes an update; an odd epoch leaves one pending.
        self.assertEqual(
            history.history["sync_steps"],
            [steps_per_epoch // 2, steps_per_epoch],
        )
        self.assertEqual(int(optimizer.iterations.numpy()), steps_per_epoch)
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), expected), 1e-6
        )


if __name__ == "__main__":
    absltest.main()
