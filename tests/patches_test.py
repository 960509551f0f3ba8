"""internals.patches: each runtime patch installs once and uninstalls.

For every patch of the registry: installing it twice is installing it
once, and uninstalling it puts back the very objects it replaced (a patch
installed before the test, as those a strategy installs, is installed
again after it). That `import tf2sync` installs none of the registry's
patches is `import_test`. That no module outside the registry patches TensorFlow
or tf_keras is `lint_test.test_only_the_patches_module_patches_tf`.
"""

import re
import types

import tensorflow as tf
import tf_keras
from absl.testing import absltest

from tf2sync._src import keras_calls
from tf2sync._src import sharding
from tf2sync._src.internals import closures
from tf2sync._src.internals import patch_kinds
from tf2sync._src.internals import patches
from tf2sync._src.internals import ps_variables

_ABSENT = "absent"


def _held(obj, attribute):
    """What `obj` holds itself as `attribute`."""
    return vars(obj).get(attribute, _ABSENT)


class _Worker:
    def __init__(self, index):
        self.worker_index = index
        self.failures = []

    def _on_closure_failure(self, closure, error):
        self.failures.append(error)

    def _process_closure(self, closure):
        pass


class _Queue:
    def mark_failed(self, error):
        pass


def _coordinator():
    workers = [_Worker(0), _Worker(1)]
    cluster = types.SimpleNamespace(workers=workers, closure_queue=_Queue())
    return types.SimpleNamespace(_cluster=cluster)


class _Handler:
    def __init__(self):
        self.joins = 0
        self._adapter = types.SimpleNamespace()

    def sync(self):
        self.joins += 1


class _Extended:
    pass


class _SyncExtended(_Extended):
    pass


def _global_case(patch, *args):
    """`(install, uninstall, state)` of a global patch."""
    return (
        lambda: patch.install(*args),
        patch.uninstall,
        lambda: [_held(owner, name) for owner, name in patch.targets],
    )


def _object_case(patch, target, objects, *args):
    """`(install, uninstall, state)` of a per-object patch."""
    return (
        lambda: patch.install(target, *args),
        lambda: patch.uninstall(target),
        lambda: [_held(obj, patch.attribute) for obj in objects],
    )


def _cases():
    """Patch name -> `(install, uninstall, state)`: `state()` lists what the
    patch replaces, as the objects hold it."""
    coordinator = _coordinator()
    workers = coordinator._cluster.workers
    handler = _Handler()
    creator = types.SimpleNamespace(dataset_fn=lambda context: None)
    model = tf_keras.Sequential([tf_keras.layers.Dense(1)])
    optimizer = tf_keras.optimizers.legacy.SGD(0.1)
    variable = tf.Variable(1.0)
    caching = ps_variables.CachingVariable(tf.Variable(2.0))
    strategy = types.SimpleNamespace(extended=_Extended())
    return {
        "autograph_skips_tf2sync": _global_case(
            patches.autograph_skips_tf2sync
        ),
        # tf2sync's predicate where a strategy installed it (installed again
        # after the test), else a stand-in.
        "loss_scaling_predicate": _global_case(
            patches.loss_scaling_predicate,
            getattr(*patches.loss_scaling_predicate.targets[0])
            if patches.loss_scaling_predicate.is_installed()
            else lambda: False,
        ),
        "sharded_autocast": _global_case(patches.sharded_autocast),
        "whole_weights_in_keras_files": _global_case(
            patches.whole_weights_in_keras_files
        ),
        "h5_refuses_sharded": _global_case(
            patches.h5_refuses_sharded, sharding.refusing_h5
        ),
        "nested_array_inputs": _global_case(patches.nested_array_inputs),
        "keras_calls": _global_case(patches.keras_calls, keras_calls.method),
        "data_handler_context": _global_case(
            patches.data_handler_context, keras_calls.handler_init
        ),
        "per_graph_read_cache": (
            lambda: patches.per_graph_read_cache.install(caching),
            lambda: patches.per_graph_read_cache.uninstall(caching),
            lambda: [type(caching)],
        ),
        "extended_class": (
            lambda: patches.extended_class.install(strategy, _SyncExtended),
            lambda: patches.extended_class.uninstall(strategy),
            lambda: [type(strategy.extended)],
        ),
        "worker_failure_hook": _object_case(
            patches.worker_failure_hook, coordinator, workers, print
        ),
        "function_error_hook": _object_case(
            patches.function_error_hook,
            coordinator,
            [coordinator._cluster.closure_queue],
            print,
        ),
        "closure_tracking": _object_case(
            patches.closure_tracking, coordinator, workers
        ),
        "epoch_end_hook": _object_case(
            patches.epoch_end_hook, handler, [handler], lambda join: None
        ),
        "repeat_keras_arrays": _object_case(
            patches.repeat_keras_arrays, creator, [creator]
        ),
        "new_iterator_each_epoch": _object_case(
            patches.new_iterator_each_epoch, handler, [handler._adapter]
        ),
        "exact_epoch_logs": _object_case(
            patches.exact_epoch_logs, model, [model], lambda logs: logs
        ),
        "unrolled_train_function": _object_case(
            patches.unrolled_train_function,
            model,
            [model],
            lambda force=False: None,
        ),
        "sharded_slot_views": _object_case(
            patches.sharded_slot_views, optimizer, [optimizer]
        ),
        "variable_reads": _object_case(
            patches.variable_reads, variable, [variable], lambda read: read
        ),
    }


def _same(a, b):
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class RegistryTest(absltest.TestCase):
    def test_every_patch_is_registered_and_says_what_it_does(self):
        made = [
            value
            for value in vars(patches).values()
            if isinstance(value, patch_kinds.Patch)
        ]
        self.assertCountEqual(made, list(patches.REGISTRY.values()))
        for name, patch in patches.REGISTRY.items():
            self.assertEqual(patch.name, name)
            for info in (patch.replaces, patch.why, patch.where):
                self.assertTrue(info.strip(), name)
            self.assertRegex(patch.versions, r"^\[2\.21\]", name)

    def test_every_patch_has_a_case_here(self):
        self.assertCountEqual(_cases(), patches.REGISTRY)


class InstallTest(absltest.TestCase):
    def test_install_twice_is_once_and_uninstall_restores(self):
        for name, (install, uninstall, state) in _cases().items():
            with self.subTest(name):
                was = state()
                uninstall()  # one installed before (by a strategy) is undone
                before = state()
                try:
                    install()
                    once = state()
                    self.assertFalse(_same(once, before), "nothing replaced")
                    install()
                    self.assertTrue(_same(state(), once), "installed twice")
                    uninstall()
                    self.assertTrue(_same(state(), before), "not restored")
                    uninstall()  # twice: nothing more
                    self.assertTrue(_same(state(), before), "not restored")
                finally:
                    if not _same(was, before):  # installed before: again
                        install()


class HookTest(absltest.TestCase):
    def test_a_hook_installed_twice_calls_back_once(self):
        coordinator = _coordinator()
        worker = coordinator._cluster.workers[1]
        failed = []
        for _ in range(2):
            patches.worker_failure_hook.install(
                coordinator, lambda i, e: failed.append((i, e))
            )
        worker._on_closure_failure("closure", "error")
        self.assertEqual(failed, [(1, "error")])
        self.assertEqual(worker.failures, ["error"])  # the original's too
        handler, ends = _Handler(), []
        for _ in range(2):
            patches.epoch_end_hook.install(handler, ends.append)
        handler.sync()
        self.assertEqual((handler.joins, len(ends)), (1, 1))

    def test_closure_tracking_uninstalled_moves_nothing(self):
        coordinator = _coordinator()
        patches.closure_tracking.install(coordinator)
        self.assertTrue(patches.closure_tracking.is_installed(coordinator))
        self.assertFalse(closures.take_over_closure(coordinator, 0))  # idle
        patches.closure_tracking.uninstall(coordinator)
        self.assertFalse(
            hasattr(coordinator._cluster.workers[0], "_tf2sync_lock")
        )

    def test_a_caller_function_installed_on_two_objects_is_wrapped(self):
        validate = lambda logs: "ours"  # noqa: E731
        first = tf_keras.Sequential([tf_keras.layers.Dense(1)])
        second = tf_keras.Sequential([tf_keras.layers.Dense(1)])
        patches.exact_epoch_logs.install(first, validate)
        patches.exact_epoch_logs.install(second, validate)
        self.assertEqual(second._validate_and_get_metrics_result({}), "ours")
        for model in (first, second):
            patches.exact_epoch_logs.uninstall(model)
            self.assertNotIn("_validate_and_get_metrics_result", vars(model))

    def test_the_extended_class_must_subclass(self):
        strategy = types.SimpleNamespace(extended=_Extended())
        with self.assertRaisesRegex(TypeError, "does not subclass"):
            patches.extended_class.install(strategy, int)
        self.assertFalse(patches.extended_class.is_installed(strategy))

    def test_read_cache_swap_reads_as_before(self):
        caching = ps_variables.CachingVariable(tf.Variable(3.0))
        patches.per_graph_read_cache.install(caching)
        self.assertEqual(float(caching.read_value()), 3.0)
        self.assertTrue(patches.per_graph_read_cache.is_installed(caching))
        plain = tf.Variable(1.0)
        patches.per_graph_read_cache.install(plain)  # not a caching one
        self.assertIs(type(plain), type(tf.Variable(2.0)))

    def test_variable_reads_wrap_the_variables_own(self):
        variable = tf.Variable(4.0)
        patches.variable_reads.install(
            variable, lambda read: lambda *a, **k: tf.constant(5.0)
        )
        self.assertEqual(float(tf.function(variable.read_value)()), 5.0)
        patches.variable_reads.uninstall(variable)
        self.assertEqual(float(tf.function(variable.read_value)()), 4.0)


class DescriptionTest(absltest.TestCase):
    def test_each_where_names_a_place_in_tf2sync(self):
        for name, patch in patches.REGISTRY.items():
            self.assertTrue(
                re.search(r"\w+\.(\w+|py)", patch.where), (name, patch.where)
            )


if __name__ == "__main__":
    absltest.main()
