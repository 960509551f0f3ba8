"""`loops.repeat`: steps run in order, the step's Python traced once."""

import contextlib
import functools
import os
import re
import socket
import tempfile
from unittest import mock

import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

import tf2sync  # noqa: F401 - sets TF_USE_LEGACY_KERAS, as users import it
from tf2sync._src import loops
from tf2sync._src import step_context
from tf2sync._src.internals import graph_copy


class RepeatTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("all_copies", 4, 4),
        ("groups_in_a_loop_and_a_rest", 7, 3),
        ("one_group_and_a_rest", 5, 3),
        ("while_loop_of_single_steps", 5, 1),
    )
    def test_stateful_steps_run_in_order_and_trace_once(self, steps, group):
        v = tf.Variable(1.0)
        traced = []

        def step(carry):
            traced.append(1)
            # Not commutative: any reordering of the copies changes it.
            v.assign(v * 2.0 + carry)
            return carry + 1.0

        @tf.function
        def run():
            return loops.repeat(step, steps, group, tf.constant(1.0))

        carry = float(run())
        expected = 1.0
        for i in range(steps):
            expected = expected * 2.0 + (1.0 + i)
        self.assertEqual(carry, 1.0 + steps)
        self.assertEqual(float(v.numpy()), expected)
        # Once per trace (a loop of single steps traces its body once).
        self.assertLen(traced, 1)

    def test_a_step_that_ignores_its_carry_returns_the_last_result(self):
        v = tf.Variable(0.0)
        traced = []

        def step(carry):
            self.assertIsNone(carry)
            traced.append(1)
            v.assign_add(1.0)
            return {"seen": v.read_value(), "tag": tf.constant(7)}

        @tf.function
        def run():
            return loops.repeat(step, 7, 3)

        result = run()
        self.assertEqual(float(result["seen"]), 7.0)
        self.assertEqual(int(result["tag"]), 7)
        self.assertLen(traced, 1)

    def test_copies_share_the_first_copys_constants(self):
        def step(carry):
            return carry * tf.constant(2.0) + tf.constant(1.0)

        @tf.function
        def run():
            return loops.repeat(step, 4, 4, tf.constant(0.0))

        self.assertEqual(float(run()), 15.0)  # 0 -> 1 -> 3 -> 7 -> 15
        graph = run.get_concrete_function().graph
        constants = [
            op.name
            for op in graph.get_operations()
            if op.type == "Const" and op.name.startswith("step_")
        ]
        self.assertLen(constants, 2, constants)  # the first copy's

    def test_per_copy_tracing_when_asked(self):
        traced = []

        def step(carry):
            traced.append(1)
            return carry + 1

        @tf.function
        def run():
            return loops.repeat(step, 4, 4, tf.constant(0), trace_once=False)

        self.assertEqual(int(run()), 4)
        self.assertLen(traced, 4)

    def test_a_step_passing_its_input_through_and_reading_a_capture(self):
        scale = tf.Variable(3.0)

        @tf.function
        def run():
            outer = scale * 2.0  # a tensor of the enclosing graph

            def step(carry):
                total, same = carry
                return total + outer, same

            return loops.repeat(
                step, 5, 2, (tf.constant(0.0), tf.constant(True))
            )

        total, same = run()
        self.assertEqual(float(total), 30.0)  # 5 steps of 6
        self.assertTrue(bool(same))

    def test_seeded_random_ops_draw_anew_in_each_copy(self):
        # Under a global seed each trace of a random op gets a seed of its
        # own; copies of one trace would repeat one draw, so such a step is
        # traced per copy.
        tf.random.set_seed(1)
        traced = []

        def step(carry):
            traced.append(1)
            draws, i = carry
            draw = tf.random.uniform([])
            return tf.tensor_scatter_nd_update(draws, [[i]], [draw]), i + 1

        @tf.function
        def run():
            return loops.repeat(step, 4, 4, (tf.zeros([4]), tf.constant(0)))

        draws, _ = run()
        self.assertLen(set(draws.numpy().tolist()), 4)
        self.assertLen(traced, 1 + 4)  # the trace checked, then each copy

    def test_a_call_time_capture_is_traced_per_copy(self):
        # PSS's per-worker resources are captured at call time; a copy
        # would resolve them once, where it is made.
        traced = []

        def step(carry):
            traced.append(1)
            value = tf.compat.v1.get_default_graph().capture_call_time_value(
                lambda: tf.constant(2.0), tf.TensorSpec([], tf.float32)
            )
            return carry + value

        @tf.function
        def run():
            return loops.repeat(step, 3, 3, tf.constant(0.0))

        self.assertEqual(float(run()), 6.0)
        self.assertLen(traced, 1 + 3)

    def _placed_copies(self, outer_device=None):
        """`(value, [(name, type, device, colocation)])` of 3 copies of a
        step whose ops have devices of every form and colocations, in one
        function (under `outer_device` if given)."""
        v = tf.Variable(1.0)
        here = tf.constant(0.0).device  # this task's CPU, fully named
        data = iter(
            tf.data.Dataset.range(10).map(lambda x: tf.cast(x, "float32"))
        )

        @tf.function
        def double(x):  # a nested function: the copies share it
            return x * 2.0

        def step(carry, iterator):
            with tf.device("/device:CPU:0"):
                x = next(iterator)
            with tf.compat.v1.colocate_with(v):
                y = carry + x
            with tf.device(here):
                z = double(y)
            with tf.compat.v1.colocate_with(z.op):  # with an op of the copy
                w = z + 1.0
            with tf.device("/cpu:0"):
                return w - v

        @tf.function
        def run(iterator):
            with contextlib.ExitStack() as scope:
                if outer_device:
                    scope.enter_context(tf.device(outer_device))
                return loops.repeat(
                    step, 3, 3, tf.constant(0.0), inputs=(iterator,)
                )

        graph = run.get_concrete_function(data).graph
        numbered = functools.partial(re.sub, r"\b\d+\b", "N")  # captures
        placed = [
            (
                numbered(op.name),
                op.type,
                op.device,
                [numbered(g.decode()) for g in op.colocation_groups()],
            )
            for op in graph.get_operations()
        ]
        return float(run(data)), placed, here

    @parameterized.named_parameters(
        ("outside_any_scope", None), ("under_a_device_scope", "/cpu:0")
    )
    def test_copies_are_placed_as_the_import_places_them(self, outer):
        # Copies import their ops without devices and set them after (the
        # import's own placing costs ~0.1 ms of Python per op); under a
        # device scope the import places them. Either way, as it would.
        with mock.patch.object(
            graph_copy, "_device_or_colocation_scope", return_value=True
        ):
            expected_value, expected, _ = self._placed_copies(outer)
        value, placed, here = self._placed_copies(outer)
        self.assertEqual(value, expected_value)
        self.assertEqual(placed, expected)
        devices = {device for _, _, device, _ in placed}
        self.assertIn(here, devices)
        self.assertIn("/device:CPU:0", devices)
        colocated = [
            (name, device)
            for name, _, device, groups in placed
            if name.startswith("step_3/") and groups != ["loc:@" + name]
        ]
        self.assertNotEmpty(colocated)
        # 0 -> (0 + 0) * 2 + 1 - 1 = 0 -> (0 + 1) * 2 = 2 -> (2 + 2) * 2 = 8
        self.assertEqual(value, 8.0)


class StartsOnSingleStepsTest(absltest.TestCase):
    def test_only_calls_of_several_steps_all_copies_in_one_graph(self):
        self.assertTrue(loops.starts_on_single_steps(10, 10))
        self.assertTrue(loops.starts_on_single_steps(2, 10))
        self.assertFalse(loops.starts_on_single_steps(1, 10))  # one already
        self.assertFalse(loops.starts_on_single_steps(11, 10))  # a loop
        self.assertFalse(loops.starts_on_single_steps(4, 1))  # a loop


def _resolver(*workers):
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": list(workers), "ps": ["10.0.0.9:1"]})
    )


class WaitsForFirstStepTest(absltest.TestCase):
    def _waits(self, resolver, cpus, single_steps=10):
        with mock.patch.object(loops, "_usable_cpus", return_value=cpus):
            return loops.waits_for_first_step(resolver, single_steps)

    def test_only_where_local_workers_and_the_chief_outnumber_the_cpus(self):
        local = _resolver("127.0.0.1:1", "localhost:2")
        self.assertTrue(self._waits(local, 2))  # 2 workers + chief > 2
        self.assertFalse(self._waits(local, 3))
        self.assertFalse(self._waits(local, 16))
        # Workers elsewhere set up on CPUs of their own.
        self.assertFalse(self._waits(_resolver("10.0.0.1:1", "w1:2"), 1))
        mixed = _resolver("10.0.0.1:1", "[::1]:2", "127.0.0.2:3")
        self.assertTrue(self._waits(mixed, 2))  # 2 of 3 here
        self.assertFalse(self._waits(mixed, 3))
        named = _resolver(f"{socket.gethostname()}:1")
        self.assertTrue(self._waits(named, 1))
        self.assertFalse(self._waits(None, 1))  # no cluster
        no_workers = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({"ps": ["127.0.0.1:1"]})
        )
        self.assertFalse(self._waits(no_workers, 1))
        gaps = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({"worker": {0: "127.0.0.1:1", 2: "h:2"}})
        )
        self.assertTrue(self._waits(gaps, 1))  # task 1 listed as None

    def test_only_where_single_steps_remain_after_each_workers_first(self):
        local = _resolver("127.0.0.1:1", "localhost:2")
        self.assertTrue(self._waits(local, 2, single_steps=3))
        self.assertFalse(self._waits(local, 2, single_steps=2))


class UsableCpusTest(absltest.TestCase):
    def _cpus(self, files, affinity=16):
        tmp = tempfile.TemporaryDirectory()  # absltest's: flags unparsed
        self.addCleanup(tmp.cleanup)
        root = tmp.name
        for name, text in files.items():
            path = os.path.join(root, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        with mock.patch.object(
            os, "sched_getaffinity", return_value=set(range(affinity))
        ):
            return loops._usable_cpus(root)

    def test_a_containers_quota_caps_the_affinity(self):
        self.assertEqual(self._cpus({"cpu.max": "200000 100000\n"}), 2)
        self.assertEqual(self._cpus({"cpu.max": "150000 100000\n"}), 2)
        self.assertEqual(self._cpus({"cpu.max": "50000 100000\n"}), 1)
        self.assertEqual(self._cpus({"cpu.max": "800000 100000"}, 4), 4)
        v1 = {
            "cpu/cpu.cfs_quota_us": "300000\n",
            "cpu/cpu.cfs_period_us": "100000\n",
        }
        self.assertEqual(self._cpus(v1), 3)

    def test_no_quota_leaves_the_affinity(self):
        self.assertEqual(self._cpus({}), 16)
        self.assertEqual(self._cpus({"cpu.max": "max 100000\n"}), 16)
        self.assertEqual(self._cpus({"cpu.max": "garbage"}), 16)
        v1 = {
            "cpu/cpu.cfs_quota_us": "-1\n",
            "cpu/cpu.cfs_period_us": "100000\n",
        }
        self.assertEqual(self._cpus(v1), 16)
        self.assertEqual(self._cpus({"cpu/cpu.cfs_quota_us": "100000"}), 16)


class WaitForFirstStepTest(absltest.TestCase):
    def test_raises_its_error_but_not_a_cancellation(self):
        cancelled = mock.Mock()
        cancelled.fetch.side_effect = tf.errors.CancelledError(
            None, None, "cancelled by another function's error"
        )
        loops.wait_for_first_step(cancelled)  # the schedule raises that one
        failed = mock.Mock()
        failed.fetch.side_effect = tf.errors.InvalidArgumentError(
            None, None, "the step's own"
        )
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "own"):
            loops.wait_for_first_step(failed)
        done = mock.Mock()
        loops.wait_for_first_step(done)
        done.fetch.assert_called_once_with()


def _counting_steps(step, steps, traces):
    """A function of one input `x` running `steps` of `step(count, x)`
    from a count of 0, in groups of up to 10 copies sharing `traces`."""

    @tf.function
    def run(x):
        return loops.repeat(
            step, steps, 10, tf.constant(0), inputs=(x,), traces=traces
        )

    return run


class StepTracesTest(absltest.TestCase):
    def test_functions_sharing_traces_trace_the_step_once(self):
        v = tf.Variable(0.0)
        traces = loops.StepTraces()
        traced = []

        def step(carry, x):
            traced.append(x.shape.as_list())
            v.assign(v * 2.0 + tf.reduce_sum(x))
            return carry + 1

        long, short = (_counting_steps(step, n, traces) for n in (4, 3))
        self.assertEqual(int(long(tf.ones([2]))), 4)
        self.assertEqual(int(short(tf.ones([2]))), 3)
        self.assertEqual(traced, [[2]])
        expected = 0.0
        for _ in range(7):
            expected = expected * 2.0 + 2.0
        self.assertEqual(float(v.numpy()), expected)
        # An input of another shape: a trace of its own.
        self.assertEqual(int(short(tf.ones([3]))), 3)
        self.assertEqual(traced, [[2], [3]])

    def test_a_lone_step_calls_the_shared_trace_rather_than_copying_it(self):
        # The single-step function fit and Trainer start on: one call op
        # of the trace (the worker inlines it when it sets the function
        # up), not a copy of the step's ops in the function's graph.
        v = tf.Variable(0.0)
        traces = loops.StepTraces()

        def step(carry, x):
            v.assign_add(tf.reduce_sum(tf.square(x)))
            return carry + 1

        single, full = (_counting_steps(step, n, traces) for n in (1, 3))
        self.assertEqual(int(single(tf.ones([2]))), 1)
        self.assertEqual(int(full(tf.ones([2]))), 3)
        self.assertEqual(float(v.numpy()), 8.0)
        graph = single.get_concrete_function(tf.ones([2])).graph
        types = [op.type for op in graph.get_operations()]
        self.assertNotIn("Square", types)
        calls = [
            op
            for op in graph.get_operations()
            if op.type in ("PartitionedCall", "StatefulPartitionedCall")
        ]
        self.assertLen(calls, 1)
        (once,) = traces._traces
        self.assertEqual(
            calls[0].get_attr("f").name,
            once._concrete.function_def.signature.name,
        )
        full_graph = full.get_concrete_function(tf.ones([2])).graph
        self.assertLen(
            [op for op in full_graph.get_operations() if op.type == "Square"],
            3,
        )

    def test_a_trace_capturing_a_tensor_of_its_function_stays_there(self):
        traces = loops.StepTraces()
        traced = []

        def function_of(scale):
            @tf.function
            def run():
                outer = tf.constant(scale)  # of this function's graph

                def step(carry):
                    traced.append(1)
                    return carry + outer

                return loops.repeat(step, 2, 2, tf.constant(0.0), traces=traces)

            return run

        self.assertEqual(float(function_of(1.0)()), 2.0)
        self.assertEqual(float(function_of(5.0)()), 10.0)
        self.assertLen(traced, 2)

    def test_each_function_copies_the_trace_with_its_own_worker(self):
        # The coordinator gives each scheduled function its worker index
        # (step_context): an argument of the shared trace, not a capture.
        traces = loops.StepTraces()
        traced = []

        def step(carry):
            traced.append(1)
            return carry + step_context.current_worker()

        def function_of(steps):
            @tf.function
            def run(worker):
                with step_context.WorkerScope(worker):
                    return loops.repeat(
                        step,
                        steps,
                        steps,
                        tf.constant(0, tf.int64),
                        traces=traces,
                    )

            return run

        long, short = function_of(3), function_of(2)
        self.assertEqual(int(long(tf.constant(5, tf.int64))), 15)
        self.assertEqual(int(short(tf.constant(7, tf.int64))), 14)
        self.assertLen(traced, 1)


if __name__ == "__main__":
    absltest.main()
