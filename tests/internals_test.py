"""internals: the private TF / tf_keras API, each piece without a cluster."""

import inspect
import sys
import types
from unittest import mock

import numpy as np
import tensorflow as tf
import tf_keras
from absl.testing import absltest

from tf2sync._src.internals import graph_ops
from tf2sync._src.internals import keras_fit
from tf2sync._src.internals import keras_optimizers
from tf2sync._src.internals import keras_training
from tf2sync._src.internals import mixed_precision
from tf2sync._src.internals import patches
from tf2sync._src.internals import ps_strategy
from tf2sync._src.internals import ps_variables


def _graph_ops(graph):
    """In `graph`: two constants and a pure op on each."""
    with graph.as_default():
        a = tf.constant(1.0, name="a")
        b = tf.constant(2.0, name="b")
        total = tf.add(a, a, name="total")
        other = tf.identity(b, name="other")
        return a, b, total, other


class GraphOpsTest(absltest.TestCase):
    def _graphs(self):
        yield tf.Graph()
        func = tf.function(lambda: None).get_concrete_function().graph
        yield type(func)("func_graph")  # a FuncGraph, as a traced step's

    def test_update_op_input_rewires_one_input(self):
        for graph in self._graphs():
            a, b, total, _ = _graph_ops(graph)
            graph_ops.update_op_input(total.op, 1, b)
            self.assertEqual(list(total.op.inputs), [a, b])
            self.assertIn(total.op, b.consumers())

    def test_control_inputs_are_added_and_replaced(self):
        for graph in self._graphs():
            a, b, total, other = _graph_ops(graph)
            graph_ops.add_control_inputs(total.op, [b.op, other.op])
            self.assertCountEqual(total.op.control_inputs, [b.op, other.op])
            graph_ops.replace_control_inputs(total.op, [other.op])
            self.assertEqual(total.op.control_inputs, [other.op])
            graph_ops.replace_control_inputs(total.op, [])
            self.assertEqual(total.op.control_inputs, [])
            self.assertEqual(list(total.op.inputs), [a, a])

    def test_op_is_stateful(self):
        for graph in self._graphs():
            _, _, total, _ = _graph_ops(graph)
            with graph.as_default():
                noise = tf.random.uniform([2])
                handle = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[])
            self.assertFalse(graph_ops.op_is_stateful(total.op))
            self.assertTrue(graph_ops.op_is_stateful(noise.op))
            self.assertTrue(graph_ops.op_is_stateful(handle.op))

    def test_set_up_without_grappler_keeps_the_rest_of_the_config(self):
        inner = tf.function(lambda x: (x + 1.0, x * 2.0))
        calls = []

        @tf.function
        def outer(x, off):
            outputs = inner(x)
            if off:
                graph_ops.set_up_without_grappler(outputs)
            calls.extend({t.op for t in outputs})
            return outputs

        self.assertEqual(outer(tf.constant(1.0), True)[1].numpy(), 2.0)
        outer(tf.constant(1.0), False)
        off, plain = [tf.compat.v1.ConfigProto() for _ in calls]
        off.ParseFromString(calls[0].get_attr("config_proto"))
        plain.ParseFromString(calls[1].get_attr("config_proto"))
        self.assertTrue(
            off.graph_options.rewrite_options.disable_meta_optimizer
        )
        self.assertNotEqual(off, plain)
        plain.graph_options.rewrite_options.disable_meta_optimizer = True
        self.assertEqual(off, plain)  # the rest as the context gave it

    def test_set_up_without_grappler_wants_one_call(self):
        @tf.function
        def not_a_call(x):
            with self.assertRaisesRegex(TypeError, "outputs=.*function call"):
                graph_ops.set_up_without_grappler(x + 1.0)
            return x

        not_a_call(tf.constant(1.0))


class VariableAndDatasetTest(absltest.TestCase):
    def test_plain_resource_variable_is_outside_the_strategy(self):
        strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
        with strategy.scope():
            mirrored = tf.Variable(1.0)
            plain = ps_variables.plain_resource_variable(
                [1, 2], "plain", dtype=tf.int64, device="/cpu:0"
            )
        self.assertIsInstance(mirrored, tf.distribute.DistributedValues)
        self.assertNotIsInstance(plain, tf.distribute.DistributedValues)
        self.assertEqual(plain.dtype, tf.int64)
        self.assertFalse(plain.trainable)
        self.assertIn("CPU:0", plain.device)
        self.assertFalse(ps_variables.is_caching_variable(plain))

    def test_plain_resource_variable_is_lifted_out_of_a_function(self):
        made = []

        @tf.function
        def make():
            if not made:
                made.append(ps_variables.plain_resource_variable(3.0, "v"))
            return made[0].read_value()

        self.assertEqual(float(make()), 3.0)
        self.assertEqual(float(made[0].numpy()), 3.0)  # an eager variable

    def test_worker_local_dataset_leaves_a_dataset_alone(self):
        dataset = tf.data.Dataset.range(3)
        self.assertIs(ps_strategy.worker_local_dataset(dataset), dataset)
        self.assertFalse(ps_strategy.is_distributed_dataset(dataset))

    def test_replace_extended_class_wants_a_subclass(self):
        strategy = tf.distribute.get_strategy()

        class Unrelated:
            pass

        with self.assertRaisesRegex(TypeError, "does not subclass"):
            patches.extended_class.install(strategy, Unrelated)
        self.assertEqual(ps_strategy.num_workers(strategy), 1)


class ClusterResolverTest(absltest.TestCase):
    def test_the_resolver_kept_where_the_public_property_has_none(self):
        self.assertIsNone(
            ps_strategy.cluster_resolver(tf.distribute.get_strategy())
        )
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({"worker": ["127.0.0.1:1"]})
        )
        # As PSS: the property answers None, the attribute holds it.
        kept = types.SimpleNamespace(
            cluster_resolver=None, _cluster_resolver=resolver
        )
        self.assertIs(ps_strategy.cluster_resolver(kept), resolver)
        public = types.SimpleNamespace(cluster_resolver=resolver)
        self.assertIs(ps_strategy.cluster_resolver(public), resolver)


class KerasFitTest(absltest.TestCase):
    def test_the_exact_evaluation_handler_subclasses_the_coordinators(self):
        handler = keras_fit.coordinator_handler_class()
        exact = keras_fit.exact_evaluation_handler_class()
        self.assertEqual(handler.__name__, "_ClusterCoordinatorDataHandler")
        self.assertTrue(issubclass(exact, handler))
        # `patches.data_handler_context` wraps the base's `__init__`: the
        # subclass must reach it through `super().__init__`.
        self.assertIn("super().__init__", inspect.getsource(exact.__init__))

    def test_split_off_validation_is_the_last_examples(self):
        x = np.arange(10).reshape(10, 1)
        y = np.arange(10)
        val_x, val_y, val_w = keras_fit.split_off_validation(x, y, None, 0.2)
        np.testing.assert_array_equal(val_x, [[8], [9]])
        np.testing.assert_array_equal(val_y, [8, 9])
        self.assertIsNone(val_w)


class VersionGateTest(absltest.TestCase):
    def test_keras_train_step_by_qualname(self):
        def run_step():
            pass

        for qualname, expected in (
            # tf_keras's own function, unconverted.
            (
                "Model.make_train_function.<locals>.step_function.<locals>."
                "run_step",
                True,
            ),
            # AutoGraph's conversion of `step_function` (tf_keras 2.15).
            ("tf__step_function.<locals>.run_step", True),
            ("Trainer.train_step", False),
        ):
            run_step.__qualname__ = qualname
            self.assertEqual(
                keras_training.is_keras_train_step(run_step), expected, qualname
            )

    def test_tfa_multi_optimizer_by_module_without_tfa(self):
        cls = type("MultiOptimizer", (), {})
        cls.__module__ = "tensorflow_addons.optimizers.discriminative"
        optimizer = cls()
        optimizer.optimizer_specs = []
        self.assertTrue(keras_optimizers.is_tfa_multi_optimizer(optimizer))
        own = type("MultiOptimizer", (), {"optimizer_specs": []})()
        self.assertFalse(keras_optimizers.is_tfa_multi_optimizer(own))

    def test_standalone_keras_2_by_version(self):
        for version, expected in (("2.15.0", True), ("3.13.1", False)):
            keras = types.SimpleNamespace(__version__=version)
            with mock.patch.dict(sys.modules, {"keras": keras}):
                self.assertEqual(
                    keras_optimizers.standalone_keras_2_loaded(), expected
                )


class KerasTest(absltest.TestCase):
    def test_legacy_kernels_update_like_apply_gradients(self):
        sgd = tf_keras.optimizers.legacy.SGD(0.5)
        var = tf.Variable([1.0, 2.0])
        keras_optimizers.legacy_create_all_weights(sgd, [var])
        state = keras_optimizers.legacy_prepare(sgd, [var])
        keras_optimizers.legacy_apply_dense(
            sgd, tf.constant([1.0, 1.0]), var, state
        )
        keras_optimizers.legacy_apply_sparse(
            sgd, tf.constant([2.0]), var, tf.constant([1]), state, unique=False
        )
        self.assertEqual(var.numpy().tolist(), [0.5, 0.5])

    def test_sparse_dedup_is_plain(self):
        legacy = tf_keras.optimizers.legacy
        check = keras_optimizers.legacy_sparse_dedup_is_plain
        self.assertTrue(check(legacy.SGD(0.1, momentum=0.9)))
        self.assertTrue(check(legacy.Adam(0.1)))
        self.assertFalse(check(legacy.SGD(0.1)))

    def test_new_update_step_and_learning_rate(self):
        schedule = tf_keras.optimizers.schedules.ExponentialDecay(1.0, 1, 0.5)
        sgd = tf_keras.optimizers.SGD(schedule)
        var = tf.Variable([1.0])
        sgd.build([var])
        self.assertIsNone(keras_optimizers.created_step_variable(object()))
        self.assertIs(
            keras_optimizers.created_step_variable(sgd), sgd.iterations
        )
        if keras_optimizers.new_learning_rate_uncomputed(sgd):
            keras_optimizers.new_compute_learning_rate(sgd)
        self.assertFalse(keras_optimizers.new_learning_rate_uncomputed(sgd))
        grads = keras_optimizers.new_clip_gradients(sgd, [tf.constant([1.0])])
        keras_optimizers.new_update_step(sgd, grads[0], var)
        self.assertEqual(var.numpy().tolist(), [0.0])

    def test_new_unknown_variables(self):
        adam = tf_keras.optimizers.Adam(0.1)
        first, later = tf.Variable([1.0]), tf.Variable([2.0])
        self.assertEqual(
            keras_optimizers.new_unknown_variables(adam, [later]), []
        )
        adam.build([first])
        self.assertEqual(
            keras_optimizers.new_unknown_variables(adam, [first, later]),
            [later],
        )
        # Where the check would be wrong the update step itself fails.
        with self.assertRaises(KeyError):
            keras_optimizers.new_update_step(adam, tf.constant([1.0]), later)

    def test_track_child(self):
        parent = tf_keras.optimizers.legacy.SGD(0.1)
        child = tf.Variable(1.0)
        self.assertFalse(keras_optimizers.tracks_child(parent, "child"))
        keras_optimizers.track_child(parent, child, "child")
        self.assertTrue(keras_optimizers.tracks_child(parent, "child"))
        self.assertEqual(keras_optimizers.optimizer_name(parent), "SGD")

    def test_tf1_optimizer_variables_are_its_slots_and_non_slots(self):
        opt = tf.compat.v1.train.AdamOptimizer(0.1)
        var = tf.Variable([1.0])
        opt.apply_gradients([(tf.constant([1.0]), var)])
        found = keras_optimizers.tf1_optimizer_variables(opt)
        self.assertLen(found, 4)  # beta1_power, beta2_power, m, v
        self.assertCountEqual(
            [id(v) for v in found], [id(v) for v in opt.variables()]
        )

    def test_epoch_logs_validator_is_overridden_and_restored(self):
        model = tf_keras.Sequential([tf_keras.layers.Dense(1)])
        own = keras_training.epoch_logs_validator(model)
        patches.exact_epoch_logs.install(model, lambda logs: "ours")
        self.assertEqual(keras_training.epoch_logs_validator(model)({}), "ours")
        patches.exact_epoch_logs.uninstall(model)
        self.assertEqual(keras_training.epoch_logs_validator(model), own)
        patches.exact_epoch_logs.uninstall(model)  # twice: no error

    def test_steps_per_execution_variable_is_replaced_untracked(self):
        model = tf_keras.Sequential(
            [tf_keras.layers.Dense(1, input_shape=(2,))]
        )
        model.compile(loss="mse", steps_per_execution=3)
        self.assertEqual(
            int(keras_training.steps_per_execution_variable(model).numpy()), 3
        )
        here = ps_variables.plain_resource_variable(5, "spe", dtype=tf.int64)
        keras_training.set_steps_per_execution_variable(model, here)
        self.assertIs(keras_training.steps_per_execution_variable(model), here)
        self.assertNotIn(id(here), {id(v) for v in model.variables})
        self.assertEqual(keras_training.minimum_control_deps([here]), [])


class MixedPrecisionTest(absltest.TestCase):
    def test_the_legacy_loss_scale_optimizer_is_a_public_one(self):
        public = tf_keras.mixed_precision.LossScaleOptimizer
        self.assertTrue(
            issubclass(mixed_precision.LegacyLossScaleOptimizer, public)
        )
        lso = public(tf_keras.optimizers.legacy.SGD(0.1))
        self.assertIsInstance(lso, mixed_precision.LegacyLossScaleOptimizer)
        state = mixed_precision.dynamic_loss_scale_state(lso)
        self.assertEqual(float(state.current_loss_scale.numpy()), 2.0**15)
        self.assertTrue(
            mixed_precision.is_wrapped_by_loss_scale_optimizer(
                lso.inner_optimizer
            )
        )
        self.assertTrue(mixed_precision.keras_supports_loss_scaling())


if __name__ == "__main__":
    absltest.main()
