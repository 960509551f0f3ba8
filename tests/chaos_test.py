"""The short chaos run (`benchmarks/chaos.py --short`) on 127.0.0.1.

A worker SIGKILLed mid-epoch (no backup) and a local-mode launcher
SIGKILLed mid-epoch: the training run completes on the exact trajectory
(no update applied twice, none stale), and no process outlives its run.
"""

import json
import os
import subprocess
import sys
import tempfile

import procutil
import pytest
from absl.testing import absltest

pytestmark = pytest.mark.slow

_CHAOS = os.path.join(
    os.path.dirname(procutil.TESTS_DIR), "benchmarks", "chaos.py"
)


class ChaosTest(absltest.TestCase):
    def test_short_chaos_run(self):
        results = os.path.join(tempfile.mkdtemp(), "chaos.json")
        out = subprocess.run(
            [
                sys.executable,
                _CHAOS,
                "--short",
                # Both faults aimed inside the first epoch (steps 44 and 47
                # of 100). Seed 0 aimed the kill at step 171 of 200: the
                # last epoch of this short run takes ~0.1 s, and the
                # harness, reading the step every 20-50 ms, once saw it
                # jump to the end first and skipped the kill ("not
                # injected (training done)").
                "--seed=10",
                f"--results={results}",
            ],
            capture_output=True,
            text=True,
            env=procutil.ENV,
            timeout=600,
        )
        log = out.stdout + out.stderr[-3000:]
        self.assertEqual(out.returncode, 0, log)
        with open(results) as f:
            outcomes = json.load(f)
        faults = [o["fault"] for o in outcomes]
        self.assertEqual(faults, ["worker_kill", "launcher_kill"], log)
        for o in outcomes:
            self.assertNotIn("not injected", o["note"], o)
            # launcher_kill: completed means the fault was injected.
            self.assertTrue(o["completed"], o)
            self.assertEqual(o["left_behind"], [], o)
            if o["fault"] != "launcher_kill":
                self.assertFalse(o["off_trajectory"], o)
                self.assertLen(o["stalls"], 1, o)
                # The longest pause without an update after the kill: the
                # failure seen, then 0.5 s of stall before the token is
                # released (0.7 s measured; docs/faults.md targets 3 s).
                # 10 s allows a loaded machine and is still far below the
                # 60 s token_timeout that recovered it before.
                self.assertLess(o["stalls"][0], 10.0, o)


if __name__ == "__main__":
    absltest.main()
