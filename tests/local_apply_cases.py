"""sync.local_apply's cases: two logical CPUs of this process stand for two
ps. They need a process whose TensorFlow has not started yet (the logical
CPUs are set before), so `local_apply_test.py` runs this file in a process
of its own."""

import threading

import tensorflow as tf
from absl.testing import absltest

import tf2sync  # noqa: F401  (sets TF_USE_LEGACY_KERAS first)
from tf2sync._src.sync import local_apply

_CPUS = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _CPUS[0],
    [tf.config.LogicalDeviceConfiguration()] * 2,
)
HERE = "/job:localhost/replica:0/task:0/device:CPU:0"
THERE = "/job:localhost/replica:0/task:0/device:CPU:1"


def variable(value, device):
    with tf.device(device):
        return tf.Variable(value)


class ReadsAsTest(absltest.TestCase):
    def test_a_traced_read_is_the_value_given(self):
        v = variable(3.0, THERE)

        @tf.function
        def f(x):
            with local_apply.reads_as([v], [x]):
                return v * 2.0

        self.assertEqual(float(f(tf.constant(5.0))), 10.0)
        self.assertEqual(float(v.numpy()), 3.0)  # unpatched after

    def test_another_thread_reads_the_variable_meanwhile(self):
        v = variable(3.0, THERE)
        seen = []

        @tf.function
        def f(x):
            with local_apply.reads_as([v], [x]):
                reader = threading.Thread(target=lambda: seen.append(v.numpy()))
                reader.start()
                reader.join()
                return v + 0.0

        self.assertEqual(float(f(tf.constant(7.0))), 7.0)
        self.assertEqual(seen, [3.0])


class LocalApplyTest(absltest.TestCase):
    def _run(self, body, candidates):
        apply = local_apply.LocalApply(HERE, body, lambda: candidates)

        @tf.function
        def step(x):
            return apply(x)

        return apply, step

    def test_a_read_of_another_device_becomes_an_input(self):
        here = variable(1.0, HERE)
        rate = variable(0.5, THERE)

        def body(x):
            return here.assign_add(x * rate)

        apply, step = self._run(body, [rate])
        self.assertEqual(float(step(tf.constant(2.0))), 2.0)
        self.assertTrue(apply.is_call)
        rate.assign(1.0)  # read anew at each call
        self.assertEqual(float(step(tf.constant(2.0))), 4.0)

    def test_a_write_to_another_device_stays_inline(self):
        here = variable(1.0, HERE)
        there = variable(0.0, THERE)

        def body(x):
            with tf.control_dependencies([there.assign_add(1.0)]):
                return here.assign_add(x)

        apply, step = self._run(body, [there])
        self.assertEqual(float(step(tf.constant(2.0))), 3.0)
        self.assertFalse(apply.is_call)
        self.assertEqual(float(there.numpy()), 1.0)

    def test_a_read_of_an_unknown_variable_stays_inline(self):
        here = variable(1.0, HERE)
        other = variable(4.0, THERE)

        def body(x):
            return here.assign_add(x * other)

        apply, step = self._run(body, [])
        self.assertEqual(float(step(tf.constant(1.0))), 5.0)
        self.assertFalse(apply.is_call)


if __name__ == "__main__":
    absltest.main()
