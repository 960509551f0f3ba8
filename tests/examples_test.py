"""The runnable examples run, as a user runs them, and do what they say."""

import os
import re
import subprocess
import sys

from absl.testing import absltest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CustomLoopExampleTest(absltest.TestCase):
    def test_custom_loop_trains_synchronously(self):
        out = subprocess.run(
            [sys.executable, os.path.join(_ROOT, "examples", "custom_loop.py")],
            capture_output=True,
            text=True,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
            timeout=300,
        )
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        match = re.search(
            r"full_data_loss: (\S+) -> (\S+) sync_steps_applied=(\d+) "
            r"stale_gradients_dropped=(\d+)",
            out.stdout,
        )
        self.assertIsNotNone(match, out.stdout)
        initial, final, applied, stale = match.groups()
        # 20 functions x 10 steps = 200 pushes, 2 per synchronous update.
        self.assertEqual(int(applied), 100)
        self.assertEqual(int(stale), 0)
        self.assertLess(float(final), 0.1 * float(initial))


if __name__ == "__main__":
    absltest.main()
