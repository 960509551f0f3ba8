"""model.fit under SyncParameterServerStrategy."""

import contextlib
import logging
from unittest import mock

import numpy as np
import tensorflow as tf
import testutil
from absl.testing import absltest
from absl.testing import parameterized

import tf2sync
from tf2sync._src import coordinator as sync_coordinator
from tf2sync._src import keras_calls
from tf2sync._src import loops
from tf2sync._src import unrolled_fit
from tf2sync._src.internals import ps_strategy


def _reference(x, y, steps, opt_fn, model_fn=testutil.dense_model):
    """`model_fn()` after `steps` single-process steps on the batch."""
    model = model_fn()
    _full_batch_steps(model, x, y, steps, opt_fn())
    return model


def _full_batch_steps(model, x, y, steps, opt):
    """`steps` single-process steps of `model`'s trainable variables."""
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = testutil.mean_loss(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))


@contextlib.contextmanager
def _tensorflow_warnings():
    """Yields a list of the "tensorflow" logger's warnings meanwhile."""
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger("tensorflow")
    logger.addHandler(handler)
    try:
        yield warnings
    finally:
        logger.removeHandler(handler)


def _compiled(learning_rate=0.05, **compile_kwargs):
    """A dense model compiled with SyncOptimizer(SGD), 2 of 2."""
    strategy = testutil.strategy(2, replicas_to_aggregate=2)
    with strategy.scope():
        model = testutil.dense_model()
        model.compile(
            optimizer=tf2sync.SyncOptimizer(
                tf.keras.optimizers.SGD(learning_rate)
            ),
            loss=testutil.LOSS,
            **compile_kwargs,
        )
    return model


def _full_batches():
    """`(x, y, dataset)`: a dense batch of 32 and a dataset repeating it."""
    x, y = testutil.data("dense", 32)
    return x, y, tf.data.Dataset.from_tensors((x, y)).repeat()


def _steps_by_function(model):
    """{id(function): steps} of the functions fit's train function made."""
    functions = getattr(model.train_function, "functions", {})
    return {id(f): steps for steps, f in functions.items()}


@contextlib.contextmanager
def _scheduled_steps(model):
    """Yields a list that collects the steps of each function `fit` of
    `model` schedules, in order."""
    coordinator_class = sync_coordinator.SyncCoordinator
    scheduled = []
    schedule = coordinator_class.schedule

    def recording(coordinator, fn, args=None, kwargs=None):
        scheduled.append(_steps_by_function(model).get(id(fn)))
        return schedule(coordinator, fn, args=args, kwargs=kwargs)

    with mock.patch.object(coordinator_class, "schedule", recording):
        yield scheduled


def _ops(function):
    """Op types of every trace of a `tf.function`."""
    return {
        op.type
        for traced in function._list_all_concrete_functions()
        for op in traced.graph.get_operations()
    }


def _unbuilt_dense_model(constant=False):
    """`testutil.dense_model`'s layers with no input shape, seeded (or
    constant: a shard of a seeded initializer draws its own values)."""

    def initializer(seed):
        if constant:
            return tf.keras.initializers.Constant(0.1 * seed)
        return tf.keras.initializers.GlorotUniform(seed)

    return tf.keras.Sequential(
        [
            tf.keras.layers.Dense(
                8, activation="relu", kernel_initializer=initializer(1)
            ),
            tf.keras.layers.Dense(3, kernel_initializer=initializer(2)),
        ]
    )


class _CondModel(tf.keras.Model):
    """Logits of a Dense called in a `tf.cond` branch, then outside it."""

    def __init__(self):
        super().__init__()
        self.hidden = tf.keras.layers.Dense(
            3, kernel_initializer=tf.keras.initializers.GlorotUniform(1)
        )

    def call(self, x):
        branch = tf.cond(
            tf.reduce_sum(x) > 0.0,
            lambda: self.hidden(x),
            lambda: self.hidden(-x),
        )
        return branch + self.hidden(x)


class FitTest(parameterized.TestCase):
    @parameterized.named_parameters(
        # 41 steps per epoch: not a multiple of the 2 workers. fit repeats
        # its steps by default (unroll=None: no call); the last function
        # of an epoch has 1 step.
        ("spe1_odd_steps", 1, 41),
        ("spe10_odd_steps", 10, 41),
        ("spe5_even_steps", 5, 20),
        ("spe10_odd_steps_explicit", 10, 41, True),
        # tf2sync.unroll_fit_steps(model, False): tf_keras's tf.range loop.
        ("spe10_odd_steps_keras_loop", 10, 41, False),
        # Groups of 3 copies: the first group, a tf.while_loop over 2, then
        # 1 step unrolled.
        ("spe10_odd_steps_grouped", 10, 41, True, 3),
        # An epoch of 10 + 10 + 6 steps: the last 6 as single steps, the
        # function the first call set up.
        ("spe10_last_6_single_steps", 10, 26),
        # Groups of 3: the last 6 past one group, split over the 2 workers
        # (3 + 3), their function copying the first one's trace of the step
        # (loops.StepTraces).
        ("spe10_last_6_past_a_group_split", 10, 26, True, 3),
        # Epochs shorter than steps_per_execution: 3 + 3 each.
        ("spe10_epochs_of_6_split", 10, 6),
        # 7 each: 4 + 3, two functions, both planned.
        ("spe10_epochs_of_7_split_unevenly", 10, 7),
    )
    def test_fit_matches_full_batch_reference(
        self, spe, steps_per_epoch, unroll=None, group=None
    ):
        # Every worker sees the same full batch, so any 2 fresh gradients
        # average to the full-batch gradient: U updates must equal U
        # single-process full-batch steps, whatever the interleaving.
        epochs = 2
        options = (
            tf2sync.SyncOptions(max_unrolled_steps=group) if group else None
        )
        strategy = testutil.strategy(
            2, replicas_to_aggregate=2, options=options
        )
        opt_fn = lambda: tf.keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
        with strategy.scope():
            model = testutil.dense_model()
            optimizer = tf2sync.SyncOptimizer(opt_fn())
            model.compile(
                optimizer=optimizer,
                loss=testutil.LOSS,
                steps_per_execution=spe,
            )
        if unroll is not None:
            tf2sync.unroll_fit_steps(model, unroll)
        x, y, ds = _full_batches()
        with _tensorflow_warnings() as warnings:
            history = model.fit(
                ds, epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0
            )
        inexact = [w for w in warnings if "Could not get Model metric" in w]
        pushes = epochs * steps_per_epoch
        updates = int(optimizer.iterations.numpy())
        self.assertEqual(int(optimizer.gradients_accepted.numpy()), pushes)
        self.assertEqual(int(optimizer.stale_dropped.numpy()), 0)
        # Each update takes exactly 2 pushes; an odd total leaves one pending.
        self.assertEqual(updates, pushes // 2)
        self.assertEqual(model.optimizer.iterations.numpy(), updates)
        expected = _reference(x, y, updates, opt_fn)
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), expected.get_weights()),
            1e-5,
        )
        self.assertLen(history.history["loss"], epochs)
        # tf_keras counts a step once it succeeded (once per function when
        # fit repeats its steps).
        self.assertEqual(int(model._train_counter.numpy()), pushes)
        if unroll is not False:
            # Every function fit scheduled (split pieces included) was
            # planned: the cap still holds at the run's updates.
            aggregator = sync_coordinator.core_aggregator(strategy)
            self.assertEqual(int(aggregator.step_limit.numpy()), updates)
        if unroll is False:
            # The sync counters reach the logs as the last push read them.
            self.assertGreater(history.history["sync_steps"][-1], 0)
        else:
            # Read from the ps when fit fetched its logs, after its join:
            # exact.
            logs = {k: v[-1] for k, v in history.history.items()}
            self.assertEqual(logs["sync_steps"], updates)
            # And the metrics are tf_keras's exact ones, read after the
            # join, without its warning about the last function's logs.
            self.assertEqual(inexact, [])
            self.assertAlmostEqual(
                logs["loss"], float(model.get_metrics_result()["loss"]), 6
            )
            self.assertEqual(logs["stale_dropped"], 0)
            self.assertEqual(logs["accepted_w0"] + logs["accepted_w1"], pushes)
        if unroll is False:  # tf_keras's own function, its tf.range loop
            self.assertFalse(hasattr(model.train_function, "functions"))
            if spe > 1:
                ops = _ops(model.train_tf_function)
                self.assertIn("While", ops)
        else:
            functions = model.train_function.functions
            if steps_per_epoch >= spe:
                self.assertEqual("While" in _ops(functions[spe]), bool(group))
            rest = steps_per_epoch % spe
            if steps_per_epoch < spe or rest > (group or spe):
                # Calls of fewer steps than spe that are the whole epoch, or
                # past one group, run split over both workers, in halves
                # (rounded up).
                self.assertIn(-(-rest // 2), functions)
                self.assertNotIn(rest, functions)
            elif rest > 1:
                # An epoch's last call runs as single steps: no function of
                # its own.
                self.assertEqual(sorted(functions), [1, spe])

    def test_unrolled_fit_repeats_the_step_instead_of_looping(self):
        model = _compiled(steps_per_execution=5)
        self.assertIs(tf2sync.unroll_fit_steps(model), model)
        x, y, ds = _full_batches()
        model.fit(ds, epochs=1, steps_per_epoch=10, verbose=0)
        traces = model.train_tf_function._list_all_concrete_functions()
        self.assertNotEmpty(traces)
        for traced in traces:
            ops = {op.type for op in traced.graph.get_operations()}
            self.assertFalse(ops & {"While", "StatelessWhile"}, ops)
        self.assertEqual(int(model._train_counter.numpy()), 10)
        self.assertEqual(int(model.optimizer.iterations.numpy()), 5)

    def test_an_epochs_last_function_copies_the_steps_first_trace(self):
        model = _compiled(steps_per_execution=5)
        keras_step = model.train_step
        traced = []

        def train_step(data):
            traced.append(data[0].shape[0])
            return keras_step(data)

        model.train_step = train_step
        x, y, ds = _full_batches()
        model.fit(ds, epochs=2, steps_per_epoch=13, verbose=0)
        # Functions of 1 step (the first call's, and an epoch's last 3
        # steps) and of 5, the step's Python traced once.
        self.assertEqual(sorted(model.train_function.functions), [1, 5])
        self.assertEqual(traced, [32])
        self.assertEqual(int(model.optimizer.iterations.numpy()), 13)
        # Epochs of 3 steps, split over the workers: 2 + 1, the function of
        # 2 copying the same trace.
        model.fit(ds, epochs=2, steps_per_epoch=3, verbose=0)
        self.assertEqual(sorted(model.train_function.functions), [1, 2, 5])
        self.assertEqual(traced, [32])
        self.assertEqual(int(model.optimizer.iterations.numpy()), 16)
        # Batches of another shape: a trace of their own, which the
        # functions of every length copy.
        half = tf.data.Dataset.from_tensors((x[:16], y[:16])).repeat()
        model.fit(half, epochs=1, steps_per_epoch=13, verbose=0)
        self.assertEqual(traced, [32, 16])
        self.assertEqual(int(model.optimizer.iterations.numpy()), 22)

    def test_fits_first_call_runs_single_steps(self):
        # The workers first set up a function of one step copy; the
        # function of all the copies serves the calls after it.
        model = _compiled(steps_per_execution=5)
        x, y, ds = _full_batches()
        with _scheduled_steps(model) as scheduled:
            model.fit(ds, epochs=1, steps_per_epoch=10, verbose=0)
            self.assertEqual(scheduled, [1] * 5 + [5])
            self.assertEqual(int(model.optimizer.iterations.numpy()), 5)
            self.assertEqual(int(model._train_counter.numpy()), 10)
            # A later fit finds its functions built: no single steps.
            del scheduled[:]
            model.fit(ds, epochs=1, steps_per_epoch=10, verbose=0)
            self.assertEqual(scheduled, [5, 5])
        self.assertEqual(int(model.optimizer.iterations.numpy()), 10)
        # Past one group of copies (a tf.while_loop runs the groups), the
        # first call is not split: it would take as many functions.
        grouped = testutil.strategy(
            2,
            replicas_to_aggregate=2,
            options=tf2sync.SyncOptions(max_unrolled_steps=2),
        )
        with grouped.scope():
            model = testutil.dense_model()
            model.compile(
                optimizer=tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.05)),
                loss=testutil.LOSS,
                steps_per_execution=4,
            )
        model.fit(ds, epochs=1, steps_per_epoch=8, verbose=0)
        self.assertEqual(sorted(model.train_function.functions), [4])

    @parameterized.parameters(True, False)
    def test_the_full_function_waits_for_the_first_step_where_cpus_are_shared(
        self, shared
    ):
        # Where the chief shares the workers' CPUs
        # (`loops.waits_for_first_step`, patched here: unpatched, it says
        # True on 2 cores), the call that traces the full function first
        # waits for the first single step's result.
        model = _compiled(steps_per_execution=5)
        x, y, ds = _full_batches()
        coordinator_class = sync_coordinator.SyncCoordinator
        schedule = coordinator_class.schedule
        events = []

        def recording(coordinator, fn, args=None, kwargs=None):
            value = schedule(coordinator, fn, args=args, kwargs=kwargs)
            events.append(_steps_by_function(model).get(id(fn)))
            return (
                testutil.FetchRecorded(value, events)
                if len(events) == 1
                else value
            )

        with (
            mock.patch.object(coordinator_class, "schedule", recording),
            mock.patch.object(
                loops, "waits_for_first_step", return_value=shared
            ) as waits,
        ):
            model.fit(ds, epochs=1, steps_per_epoch=10, verbose=0)
            waited = ["fetched"] if shared else []
            self.assertEqual(events, [1] * 5 + waited + [5])
            self.assertEqual(int(model.optimizer.iterations.numpy()), 5)
            # Asked with the cluster's resolver and the first call's steps.
            resolver = ps_strategy.cluster_resolver(model.distribute_strategy)
            self.assertLen(resolver.cluster_spec().job_tasks("worker"), 2)
            waits.assert_called_once_with(resolver, 5)
            # A later fit waits for nothing of this one.
            del events[:]
            model.fit(ds, epochs=1, steps_per_epoch=15, verbose=0)
            self.assertEqual(events, [5, 5, 5])

    def test_a_later_fit_does_not_wait_for_an_earlier_fits_first_step(self):
        # The first fit runs its one call as single steps and traces no
        # other function; the next fit's first call traces the full one.
        model = _compiled(steps_per_execution=5)
        x, y, ds = _full_batches()
        first = mock.Mock()
        with (
            mock.patch.object(loops, "waits_for_first_step", return_value=True),
            mock.patch.object(loops, "wait_for_first_step", first),
        ):
            model.fit(ds, epochs=1, steps_per_epoch=5, verbose=0)
            model.fit(ds, epochs=1, steps_per_epoch=10, verbose=0)
        first.assert_not_called()
        self.assertEqual(sorted(model.train_function.functions), [1, 5])

    def test_an_epochs_last_call_runs_single_steps(self):
        # 13 steps of 5: the last 3 of each epoch as single-step functions,
        # which the workers set up for the first call, and no function of
        # 3 steps (nor pieces of it) for the first epoch to wait for.
        model = _compiled(steps_per_execution=5)
        x, y, ds = _full_batches()
        with _scheduled_steps(model) as scheduled:
            model.fit(ds, epochs=2, steps_per_epoch=13, verbose=0)
        self.assertEqual(scheduled, [1] * 5 + [5, 1, 1, 1] + [5, 5, 1, 1, 1])
        self.assertEqual(sorted(model.train_function.functions), [1, 5])
        # Each step once: 26 pushes, 13 updates of 2.
        self.assertEqual(int(model._train_counter.numpy()), 26)
        self.assertEqual(int(model.optimizer.iterations.numpy()), 13)

    def test_fit_repeats_its_steps_by_default_and_can_be_told_not_to(self):
        model = _compiled(steps_per_execution=5)
        x, y, ds = _full_batches()
        model.fit(ds, epochs=1, steps_per_epoch=10, verbose=0)
        self.assertNotIn("While", _ops(model.train_function.functions[5]))
        # Opting out afterwards: tf_keras's own function and loop again.
        tf2sync.unroll_fit_steps(model, False)
        model.fit(ds, epochs=1, steps_per_epoch=10, verbose=0)
        self.assertFalse(hasattr(model.train_function, "functions"))
        self.assertIn("While", _ops(model.train_tf_function))
        self.assertEqual(int(model._train_counter.numpy()), 10)  # this fit
        self.assertEqual(int(model.optimizer.iterations.numpy()), 10)

    def test_fit_keeps_a_models_own_make_train_function(self):
        made = []

        class Custom(tf.keras.Sequential):
            def make_train_function(self, force=False):
                made.append(force)
                return super().make_train_function(force)

        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            model = Custom([tf.keras.layers.Dense(3, input_shape=(4,))])
            model.compile(
                optimizer=tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.05)),
                loss=testutil.LOSS,
                steps_per_execution=2,
            )
        x, y, ds = _full_batches()
        model.fit(ds, epochs=1, steps_per_epoch=4, verbose=0)
        self.assertNotEmpty(made)
        self.assertIn("While", _ops(model.train_tf_function))

    def test_steps_of_a_call_come_from_fits_data_handler(self):
        model = _compiled(steps_per_execution=10)
        handler = mock.Mock(step_increment=3)  # a last call of 4 steps

        def fit(self, data_handler):  # recorded as tf_keras's fit is
            # What `keras_calls.handler_init` marks once fit built it.
            keras_calls.current(self).training_handler = data_handler
            return unrolled_fit._steps_of_call(model)

        fit = keras_calls._recorded("fit", fit)
        self.assertEqual(fit(model, handler), 4)
        # Another object's fit, or no fit running: the variable.
        self.assertEqual(fit(object(), handler), 10)
        self.assertEqual(unrolled_fit._steps_of_call(model), 10)

    def test_steps_per_execution_moves_off_the_ps_once_fit_starts(self):
        # fit's data handler reads it before every function it schedules.
        model = _compiled(steps_per_execution=5)
        self.assertIn("/job:ps", model._steps_per_execution.device)
        x, y, ds = _full_batches()
        model.fit(ds, epochs=1, steps_per_epoch=7, verbose=0)  # 5, then 2
        moved = model._steps_per_execution
        self.assertNotIn("/job:ps", moved.device)
        self.assertEqual(int(moved.numpy()), 5)
        self.assertEqual(int(model._train_counter.numpy()), 7)
        self.assertNotIn(id(moved), {id(v) for v in model.variables})
        # tf_keras's loop takes it as an argument, read when scheduled.
        tf2sync.unroll_fit_steps(model, False)
        model.steps_per_execution = 3
        model.fit(ds, epochs=1, steps_per_epoch=7, verbose=0)  # 3, 3, 1
        self.assertIs(model._steps_per_execution, moved)
        self.assertEqual(int(moved.numpy()), 3)
        self.assertEqual(int(model._train_counter.numpy()), 7)
        self.assertEqual(int(model.optimizer.iterations.numpy()), 7)

    def test_logged_loss_is_exact_with_its_writes_riding_the_push(self):
        # Learning rate 0: every step's loss is the initial weights'.
        model = _compiled(learning_rate=0.0, steps_per_execution=5)
        x, y, ds = _full_batches()
        history = model.fit(ds, epochs=1, steps_per_epoch=10, verbose=0)
        expected = float(testutil.LOSS(y, model(x)))
        self.assertAlmostEqual(history.history["loss"][0], expected, places=5)
        # The loss Mean's total and count come from the push on the ps.
        graph = (
            model.train_function.functions[5]
            .get_concrete_function(
                iter(model._cluster_coordinator.create_per_worker_dataset(ds))
            )
            .graph
        )
        metric_writes = [
            op
            for op in graph.get_operations()
            if op.type == "AssignAddVariableOp"
            and op.inputs[1].dtype == tf.float32
        ]
        self.assertLen(metric_writes, 2 * 5)
        for op in metric_writes:
            self.assertIn("/job:ps", op.inputs[1].op.device, op.name)

    def test_steps_per_execution_stays_where_a_tuner_holds_it(self):
        model = _compiled(steps_per_execution=5)
        variable = model._steps_per_execution
        model._autotune_steps_per_execution = True  # its tuner holds it
        unrolled_fit.steps_per_execution_on_coordinator(model, None)
        self.assertIs(model._steps_per_execution, variable)

    def test_unroll_fit_steps_enabled_must_be_a_bool(self):
        with self.assertRaisesRegex(
            TypeError, r"`enabled` must be True or False. Received: enabled=1"
        ):
            tf2sync.unroll_fit_steps(_compiled(), 1)

    def test_unroll_fit_steps_refuses_what_is_not_a_model(self):
        with self.assertRaisesRegex(
            TypeError, r"`model` must be a tf.keras.Model \(tf_keras\)"
        ):
            tf2sync.unroll_fit_steps("model")

    @parameterized.named_parameters(("repeated", True), ("keras_loop", False))
    def test_jit_compile_is_refused_before_any_step(self, repeated):
        # XLA cannot read the ps's variables: stock PSS fails inside its
        # first step, and without this check the push failed on merge_call.
        model = _compiled(jit_compile=True)
        tf2sync.unroll_fit_steps(model, repeated)
        testutil.assert_fit_refused(
            self,
            model,
            ValueError,
            r"`jit_compile=True` cannot run .* jit_compile=True$",
        )
        self.assertEqual(int(model.optimizer.iterations.numpy()), 0)
        model.compile(  # the same model, recompiled, trains
            optimizer=model.optimizer, loss=testutil.LOSS, jit_compile=False
        )
        x, y = testutil.data("dense", 16)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(ds, epochs=1, steps_per_epoch=2, verbose=0)
        self.assertEqual(int(model.optimizer.iterations.numpy()), 1)

    def test_validation_and_evaluate_leave_weights_and_tokens(self):
        model = _compiled(metrics=["accuracy"])
        optimizer = model.optimizer
        x, y, ds = _full_batches()
        val = tf.data.Dataset.from_tensors((x, y)).repeat()
        history = model.fit(
            ds,
            epochs=2,
            steps_per_epoch=4,
            validation_data=val,
            validation_steps=3,
            verbose=0,
        )
        self.assertEqual(int(optimizer.iterations.numpy()), 4)
        aggregator = optimizer._aggregator
        # Evaluation borrowed and returned its tokens: all are back.
        self.assertEqual(aggregator.tokens_available(), 2)
        # The reported validation loss is the loss of the final weights.
        local = testutil.dense_model(seed=1)
        local.set_weights(model.get_weights())
        expected = float(testutil.mean_loss(y, local(x)))
        self.assertAlmostEqual(
            history.history["val_loss"][-1], expected, places=5
        )
        loss, accuracy = model.evaluate(val, steps=5, verbose=0)
        self.assertAlmostEqual(loss, expected, places=5)
        pred = np.argmax(local(x).numpy(), axis=1)
        self.assertAlmostEqual(accuracy, float(np.mean(pred == y)), places=5)
        self.assertEqual(int(optimizer.iterations.numpy()), 4)

    @parameterized.named_parameters(
        # No input shape: the model builds inside the traced step, each
        # Dense first reading its kernel in a scratch graph (tf_keras's
        # shape inference) and then in the step's.
        ("sequential_without_input_shape_dataset", "unbuilt", False),
        ("sequential_without_input_shape_arrays", "unbuilt", True),
        # A layer first called in a tf.cond branch, then outside it.
        ("layer_read_first_in_a_cond_branch", "cond", False),
        # Its kernels in 2 shards each (one ps: both on it).
        ("sharded_sequential_without_input_shape", "sharded", False),
    )
    def test_a_variable_read_first_in_a_nested_graph(self, kind, arrays):
        # PSS's per-step read cache gave the nested graph's read to the
        # step's graph: InaccessibleTensorError when the step was traced
        # (stock PSS, which caches nothing in a step, trained).
        opt_fn = lambda: tf.keras.optimizers.SGD(0.05)  # noqa: E731
        model_fn = {
            "unbuilt": _unbuilt_dense_model,
            "cond": _CondModel,
            "sharded": lambda: _unbuilt_dense_model(constant=True),
        }[kind]
        partitioner = None
        if kind == "sharded":
            partitioner = (
                tf.distribute.experimental.partitioners.FixedShardsPartitioner(
                    2
                )
            )
        strategy = testutil.strategy(
            2, replicas_to_aggregate=2, variable_partitioner=partitioner
        )
        with strategy.scope():
            model = model_fn()
            if kind == "cond":
                model.build((None, 4))
            model.compile(
                optimizer=tf2sync.SyncOptimizer(opt_fn()), loss=testutil.LOSS
            )
        x, y, ds = _full_batches()
        if arrays:
            model.fit(
                x, y, batch_size=32, epochs=1, steps_per_epoch=8, verbose=0
            )
        else:
            model.fit(ds, epochs=1, steps_per_epoch=8, verbose=0)
        self.assertEqual(int(model.optimizer.iterations.numpy()), 4)
        expected = _reference(x, y, 4, opt_fn, model_fn)
        # The outputs: a sharded model's weights are its shards.
        self.assertLess(
            float(np.max(np.abs(model(x).numpy() - expected(x).numpy()))),
            1e-5,
        )
        if kind != "sharded":
            self.assertLess(
                testutil.max_abs_diff(
                    model.get_weights(), expected.get_weights()
                ),
                1e-5,
            )

    def test_arrays_train_more_steps_than_their_passes_hold(self):
        # tf_keras makes arrays a dataset of `epochs` passes (here 2 of one
        # full batch), which each worker iterates as its own copy: 8 pushes
        # need about 4 batches per worker, and a worker ran out at its
        # third ("End of sequence", then a CancelledError from fit).
        opt_fn = lambda: tf.keras.optimizers.SGD(0.05)  # noqa: E731
        model = _compiled()
        x, y, _ = _full_batches()
        model.fit(x, y, batch_size=32, epochs=2, steps_per_epoch=4, verbose=0)
        optimizer = model.optimizer
        self.assertEqual(int(optimizer.gradients_accepted.numpy()), 8)
        self.assertEqual(int(optimizer.iterations.numpy()), 4)
        # Every batch is the full batch: 4 full-batch steps.
        expected = _reference(x, y, 4, opt_fn)
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), expected.get_weights()),
            1e-5,
        )

    def test_validation_data_it_would_refuse_is_refused_before_training(self):
        # Refused at the first validation, after an epoch had trained, the
        # refusal now comes before any step, naming validation_steps.
        model = _compiled()
        x, y, train = _full_batches()
        finite = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        before = model.get_weights()
        for validation, message in (
            (
                finite.repeat(),
                r"`validation_data` repeats forever: pass `validation_steps` "
                r"to `fit`, .* Received: validation_steps=None",
            ),
            (
                (x.tolist(), y),  # tf_keras's coordinator reads no lists
                r"`validation_data` under ParameterServerStrategy must be "
                r".* Received: validation_data=tuple \(x: list, y: ndarray\)",
            ),
            (
                tf2sync.ServicePassPerEpoch(finite, "grpc://127.0.0.1:1"),
                r"A tf2sync.ServicePassPerEpoch is read only as fit's "
                r"training data .* Received: "
                r"validation_data=ServicePassPerEpoch",
            ),
        ):
            with self.assertRaisesRegex(ValueError, message):
                model.fit(
                    train,
                    epochs=2,
                    steps_per_epoch=4,
                    validation_data=validation,
                    verbose=0,
                )
        self.assertEqual(int(model.optimizer.iterations.numpy()), 0)
        self.assertEqual(testutil.max_abs_diff(model.get_weights(), before), 0)
        # Finite data (a dataset, arrays, a split of them) is validated
        # once, exactly (fit_inputs_test: the whole set's metrics); a
        # repeating dataset with its steps, as each worker's copy.
        history = model.fit(
            x, y, epochs=1, steps_per_epoch=4, validation_split=0.25, verbose=0
        )
        self.assertLen(history.history["val_loss"], 1)
        for validation, steps in (
            ((x, y), None),
            (finite, None),
            ((x, y), 1),
            (finite.repeat(), 2),
        ):
            history = model.fit(
                train,
                epochs=1,
                steps_per_epoch=4,
                validation_data=validation,
                validation_steps=steps,
                verbose=0,
            )
            self.assertLen(history.history["val_loss"], 1)
        # A fit whose epochs do not validate (validation_freq) is let be.
        history = model.fit(
            train,
            epochs=2,
            steps_per_epoch=4,
            validation_data=finite,
            validation_freq=3,
            verbose=0,
        )
        self.assertNotIn("val_loss", history.history)
        # evaluate reads finite data once too: the same examples, the same
        # metrics, as a dataset or as arrays.
        np.testing.assert_allclose(
            model.evaluate(finite, verbose=0),
            model.evaluate(x, y, batch_size=8, verbose=0),
            rtol=1e-6,
        )

    def test_exact_evaluation_reads_a_finite_dataset_once(self):
        # compile(pss_evaluation_shards=...): tf_keras shards a finite
        # dataset and visits each element once. The "must repeat" guard
        # lets it through, and the result is the exact full-data metrics.
        model = _compiled(metrics=["accuracy"], pss_evaluation_shards=4)
        x, y, train = _full_batches()
        model.fit(train, epochs=1, steps_per_epoch=4, verbose=0)
        # 29 rows: the last batch is partial, and each row counts once.
        finite = tf.data.Dataset.from_tensor_slices((x[:29], y[:29])).batch(8)
        loss, accuracy = model.evaluate(finite, verbose=0)
        local = testutil.dense_model(seed=1)
        local.set_weights(model.get_weights())
        logits = local(x[:29])
        self.assertAlmostEqual(
            float(loss), float(testutil.mean_loss(y[:29], logits)), places=5
        )
        self.assertAlmostEqual(
            float(accuracy),
            float(np.mean(np.argmax(logits.numpy(), axis=1) == y[:29])),
            places=5,
        )
        # So does fit's validation, after its epoch.
        history = model.fit(
            train,
            epochs=1,
            steps_per_epoch=4,
            validation_data=finite,
            verbose=0,
        )
        self.assertAlmostEqual(
            history.history["val_loss"][0],
            float(model.evaluate(finite, verbose=0)[0]),
            places=5,
        )
        # Training still refuses a finite dataset.
        with self.assertRaisesRegex(ValueError, "The dataset must repeat"):
            model.fit(finite, epochs=1, steps_per_epoch=2, verbose=0)


def _two_table_model(seed=0):
    """Two embedding tables and two dense layers: 6 variables, spread over
    the ps tasks."""
    tf.keras.utils.set_random_seed(seed)
    ids = tf.keras.Input((5,), dtype="int64")
    pooled = [
        tf.keras.layers.GlobalAveragePooling1D()(
            tf.keras.layers.Embedding(50, 4, name=name)(ids)
        )
        for name in ("table_a", "table_b")
    ]
    hidden = tf.keras.layers.Dense(8, activation="relu")(
        tf.keras.layers.Concatenate()(pooled)
    )
    return tf.keras.Model(ids, tf.keras.layers.Dense(3)(hidden))


class EpochEndGridTest(parameterized.TestCase):
    """An epoch's last call (single steps) and short epochs (split over the
    workers) across cluster shapes, with and without backup workers."""

    @parameterized.named_parameters(
        ("1ps_2workers", 1, 2, 2, None),
        ("2ps_3workers_1_backup", 2, 3, 2, 3),
        ("3ps_2workers", 3, 2, 2, None),
        ("3ps_3workers", 3, 3, 3, None),
    )
    def test_every_step_once_and_the_reference_weights(
        self, num_ps, workers, rta, total
    ):
        # Every worker sees the same full batch: each update is the
        # full-batch step, so U updates must land on U reference steps.
        strategy = testutil.strategy(
            workers, num_ps, replicas_to_aggregate=rta, total_num_replicas=total
        )
        opt_fn = lambda: tf.keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
        with strategy.scope():
            model = _two_table_model()
            optimizer = tf2sync.SyncOptimizer(opt_fn())
            model.compile(
                optimizer=optimizer, loss=testutil.LOSS, steps_per_execution=5
            )
        self.assertLen(
            {v.device for v in model.trainable_variables}, min(num_ps, 6)
        )
        x, y = testutil.data("sparse", 32)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        with _scheduled_steps(model) as scheduled:
            model.fit(ds, epochs=2, steps_per_epoch=13, verbose=0)
            self.assertEqual(int(model._train_counter.numpy()), 26)
            # Epochs shorter than steps_per_execution: split, 2 + 2.
            model.fit(ds, epochs=1, steps_per_epoch=4, verbose=0)
            self.assertEqual(int(model._train_counter.numpy()), 4)
        self.assertEqual(
            scheduled, [1] * 5 + [5, 1, 1, 1] + [5, 5, 1, 1, 1] + [2, 2]
        )
        pushes = 30
        accepted = int(optimizer.gradients_accepted.numpy())
        stale = int(optimizer.stale_dropped.numpy())
        self.assertEqual(accepted + stale, pushes)
        updates = int(optimizer.iterations.numpy())
        self.assertEqual(updates, accepted // rta)
        aggregator = sync_coordinator.core_aggregator(strategy)
        if total is None:  # no backups: nothing stale, the plan exact
            self.assertEqual(stale, 0)
            self.assertEqual(updates, pushes // rta)
            self.assertEqual(int(aggregator.step_limit.numpy()), updates)
        else:
            self.assertGreater(updates, 0)
        reference = _reference(x, y, updates, opt_fn, _two_table_model)
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), reference.get_weights()),
            1e-5,
        )


class InputTest(absltest.TestCase):
    def test_cpu_workers_iterate_the_wrapped_dataset_in_order(self):
        # What fit builds (a distributed dataset) and what Trainer builds
        # (datasets from a function): on CPU workers each worker iterates
        # the dataset itself (no multi-device iterator: 16% of a small
        # fit step), and still gets its own copy's batches in order.
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

        def make_dataset(context=None):
            return tf.data.Dataset.range(40).batch(4).repeat()

        @tf.function
        def take(iterator):
            return next(iterator)

        inputs = {
            "distribute_dataset": strategy.experimental_distribute_dataset(
                make_dataset()
            ),
            "from_function": lambda: strategy.distribute_datasets_from_function(
                make_dataset
            ),
        }
        for name, source in inputs.items():
            iterator = iter(coordinator.create_per_worker_dataset(source))
            for remote in iterator._values:
                self.assertIsInstance(remote._type_spec, tf.data.IteratorSpec)
            got = [
                coordinator.schedule(take, args=(iterator,)).fetch()
                for _ in range(6)
            ]
            # Each worker's copy starts at the first batch: the batches
            # fetched are two prefixes of the sequence, merged.
            firsts = [int(batch[0]) // 4 for batch in got]
            counts = [firsts.count(i) for i in range(6)]
            self.assertEqual(sum(counts), 6, name)
            self.assertEqual(counts, sorted(counts, reverse=True), name)
            self.assertLessEqual(max(counts), 2, name)
            for batch in got:
                np.testing.assert_array_equal(
                    batch, np.arange(batch[0], batch[0] + 4)
                )


class ReplaceOptimizerTest(absltest.TestCase):
    """Fine-tuning: train a head, unfreeze, compile again with a new
    SyncOptimizer, train everything; the new one replaces the old one."""

    def test_fine_tuning_with_a_new_sync_optimizer_matches_the_reference(
        self,
    ):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        opt_fn = lambda: tf.keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
        with strategy.scope():
            model = testutil.dense_model()
            model.layers[0].trainable = False
            first = tf2sync.SyncOptimizer(opt_fn())
            model.compile(first, loss=testutil.LOSS, steps_per_execution=2)
        x, y, ds = _full_batches()
        base = model.layers[0].get_weights()
        model.fit(ds, epochs=1, steps_per_epoch=4, verbose=0)
        self.assertEqual(
            testutil.max_abs_diff(model.layers[0].get_weights(), base), 0.0
        )
        self.assertEqual(int(first.iterations.numpy()), 2)
        old_train_function = model.train_function

        # Same object, another variable list: refused with what to do.
        model.layers[0].trainable = True
        with strategy.scope():
            model.compile(first, loss=testutil.LOSS, steps_per_execution=2)
        testutil.assert_fit_refused(
            self, model, ValueError, r"compile with a new tf2sync.SyncOpt"
        )
        with strategy.scope():
            second = tf2sync.SyncOptimizer(opt_fn())
            model.compile(second, loss=testutil.LOSS, steps_per_execution=2)
        history = model.fit(ds, epochs=2, steps_per_epoch=3, verbose=0)
        # Its own global step, from 0; the first one's stays where it was.
        self.assertEqual(int(second.iterations.numpy()), 3)
        self.assertEqual(history.history["sync_steps"], [1, 3])
        self.assertEqual(int(first.iterations.numpy()), 2)

        # The reference: 2 full-batch steps of the head, then 3 of both.
        reference = testutil.dense_model()
        reference.layers[0].trainable = False
        _full_batch_steps(reference, x, y, 2, opt_fn())
        reference.layers[0].trainable = True
        _full_batch_steps(reference, x, y, 3, opt_fn())
        self.assertLess(
            testutil.max_abs_diff(model.get_weights(), reference.get_weights()),
            1e-5,
        )

        # The first optimizer's steps fail, traced before or after, and
        # change nothing.
        trained = model.get_weights()
        model.train_function = old_train_function
        with self.assertRaisesRegex(
            tf.errors.InvalidArgumentError, r"was replaced by a later one"
        ):
            model.fit(ds, epochs=1, steps_per_epoch=4, verbose=0)
        self.assertEqual(
            testutil.max_abs_diff(model.get_weights(), trained), 0.0
        )
        # Its own variable list again: refused all the same, at the trace.
        model.layers[0].trainable = False
        with strategy.scope():
            model.compile(first, loss=testutil.LOSS)
        testutil.assert_fit_refused(
            self, model, ValueError, r"\(SyncSGD\) was replaced by a later"
        )
        self.assertEqual(int(first.iterations.numpy()), 2)
        self.assertEqual(int(second.iterations.numpy()), 3)

    def test_compiling_again_and_again_logs_no_retracing_warning(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        _, _, ds = _full_batches()
        with _tensorflow_warnings() as warnings:
            for _ in range(6):  # TF warns at 5 traces of one code object
                with strategy.scope():
                    model = testutil.dense_model()
                    model.compile(
                        tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1)),
                        loss=testutil.LOSS,
                    )
                history = model.fit(ds, epochs=2, steps_per_epoch=2, verbose=0)
                self.assertEqual(history.history["sync_steps"], [1, 2])
        self.assertEqual([w for w in warnings if "retracing" in w], [])

    def test_no_replacement_while_the_current_ones_steps_run(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
        with tf.device("/job:ps/replica:0/task:0"):
            gate = tf.queue.FIFOQueue(1, [tf.int32], shapes=[[]])
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        # Runs until the gate opens: an item to dequeue, no timing.
        coordinator.schedule(tf.function(gate.dequeue))
        try:
            with strategy.scope():
                with self.assertRaisesRegex(
                    ValueError,
                    r"would replace this strategy's while functions "
                    r"scheduled for the current one are still running",
                ):
                    tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))
        finally:
            gate.enqueue(0)
            coordinator.join()
        with strategy.scope():
            tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))

    def test_the_tf1_shim_and_a_sync_optimizer_do_not_mix(self):
        strategy = testutil.strategy(2, replicas_to_aggregate=2)
        with strategy.scope():
            tf2sync.compat.v1.SyncReplicasOptimizer(
                tf.compat.v1.train.GradientDescentOptimizer(0.1),
                replicas_to_aggregate=2,
            )
            with self.assertRaisesRegex(
                ValueError, r"of the other kind .* do not mix on one strategy"
            ):
                tf2sync.SyncOptimizer(tf.keras.optimizers.SGD(0.1))


if __name__ == "__main__":
    absltest.main()
