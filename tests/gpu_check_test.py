"""benchmarks/gpu_check.sh on a machine without a GPU: it says it skipped
the GPU parts, writes its table and exits 0; it stops where TensorFlow
cannot run or cannot see a GPU nvidia-smi lists; the flags its GPU parts
pass exist (each command line parses)."""

import os
import re
import shutil
import subprocess
import sys
import tempfile

import procutil
import pytest
from absl.testing import absltest

# Multi-process: it runs benchmarks/gpu_check.sh; run by `pytest -m slow`
# and CI.
pytestmark = pytest.mark.slow

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SCRIPT = os.path.join(_ROOT, "benchmarks", "gpu_check.sh")


def _has_gpu():
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def _check(out_dir, python, **env_vars):
    """Runs the script with PYTHON=`python` and `env_vars` (None: unset);
    its CompletedProcess."""
    env = dict(procutil.ENV, PYTHON=python)
    for name, value in env_vars.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return subprocess.run(
        ["bash", _SCRIPT, out_dir],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


class GpuCheckTest(absltest.TestCase):
    def _tempdir(self):
        path = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, path, ignore_errors=True)
        return path

    def test_without_a_gpu_it_skips_and_writes_its_table(self):
        if _has_gpu():
            self.skipTest("a GPU is here: the script would run its parts")
        out_dir = tempfile.mkdtemp()
        done = _check(out_dir, sys.executable)
        self.assertEqual(done.returncode, 0, done.stderr[-2000:])
        self.assertIn("skipped the GPU parts", done.stdout)
        with open(os.path.join(out_dir, "gpu_check.md")) as f:
            table = f.read()
        rows = re.findall(
            r"^\| (\w+) \| `([^`]*)` \| - \| - \| (.*) \|$", table, re.M
        )
        self.assertEqual(
            [r[0] for r in rows],
            ["main_job_gpu", "main_job_mixed_float16", "w2_gpu_workers"],
            table,
        )
        self.assertTrue(all(r[2] == "skipped: no GPU" for r in rows), table)

    def test_an_interpreter_without_tensorflow_is_not_no_gpu(self):
        # A broken PYTHON stops the check (exit 2) rather than reading as
        # a machine without a GPU and passing.
        done = _check(tempfile.mkdtemp(), "/bin/false")
        self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
        self.assertIn("cannot import TensorFlow", done.stderr)
        self.assertNotIn("skipped the GPU parts", done.stdout)

    def test_a_gpu_tensorflow_does_not_see_is_not_no_gpu(self):
        # pip's tensorflow without its CUDA libraries sees no GPU on a GPU
        # machine: the check stops (exit 2) and says what to install,
        # rather than skip every part and pass. nvidia-smi here is a stub
        # that lists one GPU.
        if _has_gpu():
            self.skipTest("a GPU is here: TensorFlow sees it")
        bin_dir = self._tempdir()
        stub = os.path.join(bin_dir, "nvidia-smi")
        with open(stub, "w") as f:
            f.write('#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: GPU-0)"\n')
        os.chmod(stub, 0o755)
        path = bin_dir + os.pathsep + procutil.ENV.get("PATH", "")

        def check(hidden):  # CUDA_VISIBLE_DEVICES; None: unset
            return _check(
                self._tempdir(),
                sys.executable,
                PATH=path,
                CUDA_VISIBLE_DEVICES=hidden,
            )

        done = check(None)
        self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
        self.assertIn(
            "nvidia-smi lists 1 GPU(s) but TensorFlow sees none", done.stderr
        )
        self.assertIn(
            f"{sys.executable} -m pip install 'tensorflow[and-cuda]==2.",
            done.stderr,
        )
        self.assertNotIn("skipped the GPU parts", done.stdout)
        # GPUs hidden on purpose (CUDA_VISIBLE_DEVICES, which nvidia-smi
        # ignores) are skipped as before.
        for hidden in ("", "-1"):
            done = check(hidden)
            self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
            self.assertIn("skipped the GPU parts", done.stdout)

    def test_the_gpu_parts_command_lines_parse(self):
        # Each part's flags, then one the program refuses after parsing
        # them all (exit 2, or the harness's line), so nothing starts: an
        # unknown flag would be absl's "Flags parsing error" instead.
        harness = os.path.join(_ROOT, "benchmarks", "harness.py")
        for args, refusal in (
            (["-m", "tf2sync", "--num_gpus=1", "--epochs=3", "--epochs=0"], ""),
            (
                [
                    "-m",
                    "tf2sync",
                    "--num_gpus=1",
                    "--mixed_precision=mixed_float16",
                    "--epochs=0",
                ],
                "",
            ),
            (
                [
                    harness,
                    "--scenarios=main",
                    "--workloads=w2",
                    "--systems=tf2sync_fit,tf2sync_loop,pss_async,mwms",
                    "--repeats=3",
                    "--worker_gpus=1",
                    "--scenarios=no_such",
                ],
                "--scenarios: unknown ['no_such']",
            ),
        ):
            done = subprocess.run(
                [sys.executable, *args],
                capture_output=True,
                text=True,
                timeout=120,
                env=procutil.ENV,
                cwd=_ROOT,
            )
            output = done.stdout + done.stderr
            self.assertNotIn("Flags parsing error", output, args)
            self.assertNotIn("local task pids", output, args)
            if refusal:
                self.assertIn(refusal, output, args)
            else:
                self.assertEqual(done.returncode, 2, (args, output[-2000:]))
        with open(_SCRIPT) as f:
            script = f.read()
        self.assertIn("--worker_gpus=1", script)
        self.assertIn("--mixed_precision=mixed_float16", script)


if __name__ == "__main__":
    absltest.main()
