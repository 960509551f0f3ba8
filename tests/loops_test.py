"""`loops.repeat`: steps run in order, the step's Python traced once."""

import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

import tf2sync  # noqa: F401 - sets TF_USE_LEGACY_KERAS, as users import it
from tf2sync._src import loops


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


if __name__ == "__main__":
    absltest.main()
