"""sync.local_apply: a ps's apply as one function of that ps, without a
cluster (tests/local_apply_cases.py, in a process of its own: the suite's
process has connected to clusters, and its logical devices are fixed)."""

import os
import subprocess
import sys

from absl.testing import absltest

CASES = os.path.join(os.path.dirname(__file__), "local_apply_cases.py")


class LocalApplyTest(absltest.TestCase):
    def test_cases_pass_in_a_fresh_process(self):
        out = subprocess.run(
            [sys.executable, CASES],
            capture_output=True,
            text=True,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
            timeout=300,
        )
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        self.assertIn("OK", out.stderr)


if __name__ == "__main__":
    absltest.main()
