"""The runnable examples run and reach what they claim."""

import importlib.util
import os

from absl.testing import absltest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(_ROOT, "examples", name + ".py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CustomLoopExampleTest(absltest.TestCase):
    def test_custom_loop_trains_synchronously(self):
        example = _load("custom_loop")
        optimizer, initial, final = example.main(num_functions=10)
        pushes = 10 * example.STEPS_PER_FUNCTION
        self.assertEqual(int(optimizer.gradients_accepted.numpy()), pushes)
        self.assertEqual(int(optimizer.iterations.numpy()), pushes // 2)
        self.assertLess(final, 0.1 * initial)


if __name__ == "__main__":
    absltest.main()
