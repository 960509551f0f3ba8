"""docs/migrating.md's walk-through runs: examples/tf1_port/job.py, the TF2
port of TensorFlow's mnist_replica.py, trained by the launcher's local
mode as the page says (`tf2sync --job_module=examples.tf1_port.job`, from
the repository's root): 2 workers and 1 ps on 127.0.0.1 (free ports the
launcher picks), each ended by its PID."""

import json
import os
import re
import subprocess
import sys

import procutil
import pytest
from absl.testing import absltest

# It starts real processes (still run in CI).
pytestmark = pytest.mark.slow

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Tf1PortTest(absltest.TestCase):
    def test_the_ported_mnist_replica_trains_with_the_tf1_shim(self):
        epochs, steps = 2, 20
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tf2sync",
                "--job_module=examples.tf1_port.job",
                f"--epochs={epochs}",
                f"--steps_per_epoch={steps}",
                "--verbosity=0",
            ],
            cwd=_ROOT,  # where `examples` imports from, as the page runs it
            capture_output=True,
            text=True,
            timeout=180,
            **procutil.child_kwargs(procutil.ENV),
        )
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        # The job's defaults: the shim around TF1's Adam, mnist_replica's
        # rate; replicas_to_aggregate and total_num_replicas the workers'.
        self.assertIn(
            "the job's optimizer AdamOptimizer learning_rate=0.01", out.stdout
        )
        self.assertIn(
            "2 workers, 1 ps, replicas_to_aggregate=2, total_num_replicas=2",
            out.stdout,
        )
        epoch_lines = re.findall(r"loss: \S+ - accuracy: \S+", out.stdout)
        self.assertLen(epoch_lines, epochs, out.stdout)
        match = re.search(
            r"accuracy=(\S+) sync_steps_applied=(\d+)", out.stdout
        )
        self.assertIsNotNone(match, out.stdout + out.stderr[-3000:])
        accuracy, applied = float(match.group(1)), int(match.group(2))
        # Ten classes: chance is 0.1; Adam reaches 0.8-0.9 in these steps.
        self.assertGreater(accuracy, 0.5)
        # The global step: one update per 2 pushes (2 of 2 aggregated), at
        # most epochs x steps / 2; TF1's order wastes each worker's first
        # step and drops a push that comes late for its round, so fewer.
        self.assertBetween(applied, epochs * steps // 4, epochs * steps // 2)
        pids = json.loads(re.search(r"pids=(\[.*\])", out.stdout).group(1))
        self.assertLen(pids, 3)
        for pid in pids:
            self.assertFalse(procutil.alive(pid), f"task {pid} left behind")


if __name__ == "__main__":
    absltest.main()
