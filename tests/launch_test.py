"""The tf2sync binary: real multi-process clusters on 127.0.0.1."""

import contextlib
import glob
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

import procutil
import pytest
from absl.testing import absltest
from absl.testing import parameterized

# Imported at collection, before any test starts a cluster's threads:
# importing it pulls in scipy.stats, whose `_page_trend_test.py` matches
# pytest's `*_test.py` and is parsed (`ast.parse`) by its assertion
# rewriting, and on Python 3.11 a parse while another thread builds an AST
# can fail with "SystemError: AST constructor recursion depth mismatch"
# (CPython gh-106905; it did once in CI).
from sklearn.datasets import load_digits

import tf2sync

# Every test here starts real processes.
pytestmark = pytest.mark.slow

_ENV = procutil.ENV
_RESULT = re.compile(
    r"accuracy=(\S+) sync_steps_applied=(\d+) stale_gradients_dropped=(\d+)"
)
_launch = procutil.launch
_alive = procutil.alive
_Tasks = procutil.Tasks


class LaunchTest(parameterized.TestCase):
    def _trained(self, args):
        """The launcher's output for `args`, once it exited 0."""
        out = _launch(args)
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        return out

    def _assert_tasks_ended(self, out):
        """Every local task the launcher printed is gone; their pids."""
        pids = json.loads(re.search(r"pids=(\[.*\])", out.stdout).group(1))
        for pid in pids:
            self.assertFalse(_alive(pid), f"task {pid} left behind")
        return pids

    def _check_result(self, out, epochs, steps):
        match = _RESULT.search(out.stdout)
        self.assertIsNotNone(match, out.stdout + out.stderr[-3000:])
        accuracy, applied, stale = match.groups()
        # Ten digit classes: chance is 0.1; 20+ synchronous steps reach
        # 0.6-0.8 here, so 0.3 means "it trained" without flaking.
        self.assertGreater(float(accuracy), 0.3)
        # 2 workers, 2 aggregated: one update per 2 pushes.
        self.assertEqual(int(applied), epochs * steps // 2)
        self.assertEqual(int(stale), 0)

    def test_main_job_local_cluster_ends_every_process(self):
        logs = tempfile.mkdtemp()
        out = self._trained(
            [
                "--epochs=2",
                "--steps_per_epoch=20",
                "--verbosity=0",  # the tasks log their start (INFO)
                f"--task_log_dir={logs}",
            ]
        )
        self._check_result(out, 2, 20)
        self.assertIn("10 per function (unrolled)", out.stdout)
        self.assertLen(self._assert_tasks_ended(out), 3)
        # A task's lines go to its log, not the launcher's console (the
        # tasks are forks of it: see forker.TaskForker).
        self.assertNotIn("Serving ps:0", out.stdout + out.stderr)
        with open(os.path.join(logs, "ps0.log")) as f:
            self.assertIn("Serving ps:0", f.read())

    def test_service_input_sharding_local_mode(self):
        # tf.data service: a dispatcher in the launcher, a tf.data worker in
        # each worker task; each epoch one pass of the 1500 digits in
        # batches of 32 (47 or 48 batches, as the splits fall) shared by
        # whichever worker asks: 24 updates of 2 an epoch.
        out = self._trained(["--input_sharding=service", "--epochs=2"])
        match = _RESULT.search(out.stdout)
        self.assertIsNotNone(match, out.stdout + out.stderr[-3000:])
        accuracy, applied, stale = match.groups()
        self.assertGreater(float(accuracy), 0.3)
        self.assertEqual(int(applied), 2 * 24)
        self.assertEqual(int(stale), 0)
        pushes = json.loads(
            re.search(r"accepted_per_worker=(\[.*?\])", out.stdout).group(1)
        )
        self.assertBetween(sum(pushes), 2 * 47, 2 * 48)
        self._assert_tasks_ended(out)

    def test_service_input_sharding_tf1_style_flags(self):
        # Every task gets --input_sharding=service and one port: the chief
        # serves the dispatcher there, worker i its tf.data worker at
        # port + 1 + i.
        spec = tf2sync.testing.cluster_spec_dict(2, 1)
        port = self._free_port_run(3)
        service = ["--input_sharding=service", f"--data_service_port={port}"]
        tasks = _Tasks(spec, args=service)
        try:
            out = _launch(
                [
                    "--job_name=chief",
                    *procutil.host_flags(spec),
                    "--epochs=1",
                    *service,
                ]
            )
        finally:
            pids = tasks.stop()
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        match = _RESULT.search(out.stdout)
        self.assertIsNotNone(match, out.stdout + out.stderr[-3000:])
        self.assertEqual(int(match.group(2)), 24)  # one pass: 24 updates
        self.assertFalse(any(_alive(p) for p in pids))

    def test_service_input_sharding_without_tf_data_workers(self):
        # Tasks started without --input_sharding=service: no tf.data worker
        # registers, and the chief says so within --connect_timeout.
        spec = tf2sync.testing.cluster_spec_dict(2, 1)
        port = self._free_port_run(3)
        tasks = _Tasks(spec)
        try:
            out = _launch(
                [
                    "--job_name=chief",
                    *procutil.host_flags(spec),
                    "--input_sharding=service",
                    f"--data_service_port={port}",
                    "--connect_timeout=3",
                ]
            )
        finally:
            tasks.stop()
        self.assertNotEqual(out.returncode, 0)
        self.assertIn(
            "0 of 2 tf.data workers registered with the dispatcher within 3 s",
            out.stderr,
        )
        self.assertIn(f"127.0.0.1:{port + 1}, 127.0.0.1:{port + 2}", out.stderr)

    @staticmethod
    def _free_port_run(count):
        """The first of `count` consecutive free ports on 127.0.0.1."""
        import socket

        for _ in range(100):
            first = tf2sync.testing.pick_free_ports(1)[0]
            if first + count > 65535:
                continue
            sockets = []
            try:
                for p in range(first, first + count):
                    s = socket.socket()
                    s.bind(("127.0.0.1", p))
                    sockets.append(s)
            except OSError:
                continue
            finally:
                for s in sockets:
                    s.close()
            return first
        raise RuntimeError("no run of free ports")

    def test_tf1_style_flags(self):
        spec = tf2sync.testing.cluster_spec_dict(2, 1)
        tasks = _Tasks(spec)
        try:
            out = _launch(
                [
                    "--job_name=chief",
                    "--ps_hosts=" + ",".join(spec["ps"]),
                    "--worker_hosts=" + ",".join(spec["worker"]),
                    "--chief_host=" + spec["chief"][0],
                    "--epochs=2",
                    "--steps_per_epoch=20",
                ]
            )
        finally:
            pids = tasks.stop()
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        self._check_result(out, 2, 20)
        self.assertFalse(any(_alive(p) for p in pids))

    def test_tf_config(self):
        spec = tf2sync.testing.cluster_spec_dict(2, 1)
        env = dict(_ENV)
        env["TF_CONFIG"] = json.dumps(
            {"cluster": spec, "task": {"type": "chief", "index": 0}}
        )
        tasks = _Tasks(spec, env=env)
        try:
            out = _launch(
                ["--epochs=2", "--steps_per_epoch=20", "--nounroll_steps"],
                env=env,
            )
        finally:
            tasks.stop()
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        self.assertIn("10 per function (tf_keras loop)", out.stdout)
        self._check_result(out, 2, 20)

    def test_unreachable_task_times_out_naming_it(self):
        spec = tf2sync.testing.cluster_spec_dict(2, 1)
        out = _launch(
            [
                "--job_name=chief",
                "--ps_hosts=" + ",".join(spec["ps"]),
                "--worker_hosts=" + ",".join(spec["worker"]),
                "--chief_host=" + spec["chief"][0],
                "--connect_timeout=2",
            ]
        )
        self.assertNotEqual(out.returncode, 0)
        self.assertIn(
            f"No task answered at {spec['ps'][0]} within 2 s", out.stderr
        )

    @parameterized.named_parameters(
        (
            "no_hosts",
            ["--job_name=worker"],
            "--job_name needs --ps_hosts and --worker_hosts. Received: "
            "--ps_hosts= --worker_hosts=",
        ),
        (
            "bad_host",
            [
                "--job_name=ps",
                "--ps_hosts=localhost",
                "--worker_hosts=127.0.0.1:1",
            ],
            "--ps_hosts must be host:port entries. Received: "
            "--ps_hosts=localhost",
        ),
        (
            "port_out_of_range",
            [
                "--job_name=ps",
                "--ps_hosts=localhost:99999",
                "--worker_hosts=127.0.0.1:1",
            ],
            "--ps_hosts must be host:port entries. Received: "
            "--ps_hosts=localhost:99999 ('localhost:99999' is not host:port "
            "with a port of 1-65535)",
        ),
        (
            "space_in_a_host",
            [
                "--job_name=ps",
                "--ps_hosts=127.0.0.1:1",
                "--worker_hosts=my host:2",
            ],
            "('my host:2' has a space)",
        ),
        (
            "bad_chief_host",
            [
                "--job_name=chief",
                "--chief_host=nohostport",
                "--ps_hosts=127.0.0.1:1",
                "--worker_hosts=127.0.0.1:2",
            ],
            "--chief_host must be host:port entries. Received: "
            "--chief_host=nohostport",
        ),
        (
            "index",
            [
                "--job_name=worker",
                "--task_index=2",
                "--ps_hosts=127.0.0.1:1",
                "--worker_hosts=127.0.0.1:2",
            ],
            "--task_index=2 but --worker_hosts names 1 task(s).",
        ),
        (
            "chief_index",
            [
                "--job_name=chief",
                "--task_index=1",
                "--chief_host=127.0.0.1:3",
                "--ps_hosts=127.0.0.1:1",
                "--worker_hosts=127.0.0.1:2",
            ],
            "--task_index=1 but --chief_host names 1 task(s).",
        ),
        (
            "local_cluster",
            ["--local_cluster=2"],
            "--local_cluster must be WORKERS,PS with positive ints. "
            "Received: --local_cluster=2",
        ),
        (
            "bad_role",
            ["--job_name=driver"],
            "value should be one of <ps|worker|chief|evaluator>",
        ),
    )
    def test_flag_errors(self, args, message):
        out = _launch(args, timeout=60)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn(message, out.stderr)

    def test_mixed_float16_through_the_launcher(self):
        out = self._trained(
            [
                "--epochs=2",
                "--steps_per_epoch=20",
                "--mixed_precision=mixed_float16",
                "--num_gpus=0",
            ]
        )
        self.assertIn("mixed_float16", out.stdout)
        self._check_result(out, 2, 20)

    def test_tf1_shim_trains_the_main_jobs_variable_groups(self):
        # digits' three rates (TF1's pattern) under one shim, a
        # MultiOptimizer inside; TF1's order wastes a step after the start.
        out = self._trained(
            [
                "--sync_optimizer=tf1_shim",
                "--epochs=2",
                "--steps_per_epoch=20",
                "--verbosity=0",
            ]
        )
        for line in (
            "group 'conv kernels' learning_rate=0.01",
            "group 'dense kernels' learning_rate=0.1",
            "group 'biases' learning_rate=0.2",
        ):
            self.assertIn(line, out.stdout)
        # The shim's summary has no stale count (TF1's drops are its order).
        match = re.search(
            r"accuracy=(\S+) sync_steps_applied=(\d+)", out.stdout
        )
        self.assertIsNotNone(match, out.stdout + out.stderr[-3000:])
        accuracy, applied = match.groups()
        self.assertGreater(float(accuracy), 0.3)
        self.assertBetween(int(applied), 10, 20)
        self.assertNotIn("invoked without using", out.stderr)
        self._assert_tasks_ended(out)

    def test_worker_asking_for_more_gpus_than_it_has(self):
        port = tf2sync.testing.pick_free_ports(1)[0]
        out = _launch(
            [
                "--job_name=worker",
                "--num_gpus=1",
                "--ps_hosts=127.0.0.1:1",
                f"--worker_hosts=127.0.0.1:{port}",
            ],
            timeout=60,
        )
        self.assertNotEqual(out.returncode, 0)
        self.assertEqual(out.returncode, 2, out.stderr[-3000:])
        self.assertIn(
            "--num_gpus=1 but this worker sees 0 GPU(s) (on an NVIDIA GPU "
            "machine TensorFlow needs its CUDA libraries: "
            f"{sys.executable} -m pip install 'tensorflow[and-cuda]==2.21.*').",
            out.stderr,
        )

    @parameterized.named_parameters(
        ("ctrl_c", signal.SIGINT, "", 130, "interrupted (Ctrl-C)"),
        # `cmd &` in a non-interactive shell, many CI runners: SIGINT comes
        # in ignored, and the launcher still handles it.
        (
            "ctrl_c_inherited_ignored",
            signal.SIGINT,
            "trap '' INT; ",
            130,
            "interrupted (Ctrl-C)",
        ),
        ("sigterm", signal.SIGTERM, "", 143, "terminated (SIGTERM)"),
    )
    def test_ctrl_c_ends_every_local_task(self, sig, trap, code, reason):
        stderr_path = os.path.join(tempfile.mkdtemp(), "launcher.err")
        process = subprocess.Popen(
            [
                "bash",
                "-c",
                trap + 'exec "$@"',
                "bash",
                sys.executable,
                "-m",
                "tf2sync",
                "--epochs=1000",
            ],
            stdout=subprocess.PIPE,
            stderr=open(stderr_path, "w"),  # noqa: SIM115
            text=True,
            **procutil.child_kwargs(_ENV),
        )
        pids = []
        try:
            for line in process.stdout:
                match = re.search(r"pids=(\[.*\])", line)
                if match:
                    pids = json.loads(match.group(1))
                if "Epoch" in line or line.startswith("tf2sync: 2 workers"):
                    break
            self.assertLen(pids, 3)
            before = os.path.getsize(stderr_path)  # what training printed
            process.send_signal(sig)
            process.communicate(timeout=60)
        finally:
            procutil.kill(process)
            procutil.kill_pids(pids)
        with open(stderr_path) as f:
            f.seek(before)
            after = [line for line in f.read().splitlines() if line.strip()]
        # One line after the signal: no traceback, no teardown noise.
        self.assertEqual(after, [f"tf2sync: {reason}; stopped 3 local tasks."])
        self.assertEqual(process.returncode, code)
        for pid in pids:
            self.assertFalse(procutil.running(pid), f"task {pid} left behind")

    def test_checkpoints_resume_and_the_evaluator_follows_them(self):
        directory = tempfile.mkdtemp()
        ckpt = directory + "/ckpt"
        common = ["--steps_per_epoch=10", f"--checkpoint_dir={ckpt}"]
        first = _launch(
            ["--epochs=2", f"--model_log_dir={directory}/tb", *common]
        )
        self.assertEqual(first.returncode, 0, first.stderr[-3000:])
        self.assertTrue(os.path.exists(ckpt + "/ckpt-2.index"))
        # A restarted chief resumes after epoch 2: only epoch 3 runs, and
        # the global step carries on from the checkpoint.
        second = _launch(["--epochs=3", *common])
        self.assertEqual(second.returncode, 0, second.stderr[-3000:])
        self.assertIn("Resumed from", second.stderr)
        self.assertNotIn("Epoch 2/3", second.stdout)
        self._check_result(second, 3, 10)
        chief_accuracy = _RESULT.search(second.stdout).group(1)
        evaluator = _launch(
            [
                "--job_name=evaluator",
                f"--checkpoint_dir={ckpt}",
                "--max_evaluations=1",
                "--eval_timeout=10",
            ]
        )
        self.assertEqual(evaluator.returncode, 0, evaluator.stderr[-3000:])
        self.assertIn("eval epoch=3 loss=", evaluator.stdout)
        self.assertIn(f"accuracy={chief_accuracy}", evaluator.stdout)
        events = glob.glob(directory + "/tb/train/events*")
        self.assertNotEmpty(events)

    def test_evaluator_needs_a_checkpoint_dir(self):
        out = _launch(["--job_name=evaluator"], timeout=60)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("--job_name=evaluator needs --checkpoint_dir", out.stderr)

    def test_malformed_tf_config(self):
        env = dict(_ENV, TF_CONFIG="{not json")
        out = _launch([], env=env, timeout=60)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("TF_CONFIG is not valid JSON", out.stderr)


class Tf1ShimFlagTest(absltest.TestCase):
    """`--sync_optimizer=tf1_shim` refuses what the shim cannot train."""

    def test_groups_and_a_jobs_optimizer_are_wrapped_mixed_precision_refused(
        self,
    ):
        import fault_job

        from tf2sync._src.jobs import clicks
        from tf2sync._src.jobs import digits
        from tf2sync._src.launcher import chief

        shim = chief.ChiefConfig(sync_optimizer="tf1_shim")
        with contextlib.redirect_stdout(io.StringIO()):
            optimizer = chief.sync_optimizer(digits, shim, 2, 2)
        inner = optimizer._opt
        self.assertIsInstance(inner, tf2sync.MultiOptimizer)
        rates = [round(float(o.learning_rate), 6) for o in inner.optimizers]
        self.assertEqual(rates, [0.01, 0.1, 0.2])
        # A job's own optimizer is the shim's inner one (Adagrad here).
        with contextlib.redirect_stdout(io.StringIO()):
            optimizer = chief.sync_optimizer(clicks, shim, 2, 2)
        self.assertIsInstance(
            optimizer, tf2sync.compat.v1.SyncReplicasOptimizer
        )
        self.assertEqual(type(optimizer._opt).__name__, "Adagrad")
        self.assertEqual(optimizer._replicas_to_aggregate, 2)
        mixed = chief.ChiefConfig(
            sync_optimizer="tf1_shim", mixed_precision="mixed_float16"
        )
        with self.assertRaisesRegex(
            ValueError, "Received: --mixed_precision=mixed_float16"
        ):
            chief.sync_optimizer(fault_job, mixed, 2, 2)


# A line of TensorFlow's C++ logging (absl/glog format, from a C++ file),
# or absl's notice before its logging is initialized.
_NATIVE_LOG_LINE = re.compile(
    r"^[IWEF]\d{4} [\d:.]+\s+\d+ \S+\.(cc|h|cpp|c):\d+\]"
    r"|absl::InitializeLog"
)


def _run_on_a_terminal(args, env, timeout):
    """Runs `args` with stdout on a pseudo-terminal (as in a user's shell,
    where `isatty()` is true), stderr piped; returns a CompletedProcess."""
    import pty
    import select
    import time

    main, child_end = pty.openpty()
    process = subprocess.Popen(
        args,
        stdout=child_end,
        stderr=subprocess.PIPE,
        **procutil.child_kwargs(env),
    )
    os.close(child_end)
    err = process.stderr.fileno()
    chunks, errors = [], []
    open_fds, deadline = {main, err}, time.monotonic() + timeout
    try:
        while open_fds and time.monotonic() < deadline:
            ready, _, _ = select.select(list(open_fds), [], [], 1.0)
            for fd in ready:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # EIO: the terminal's other end is closed
                    data = b""
                if data:
                    (chunks if fd == main else errors).append(data)
                else:
                    open_fds.discard(fd)
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        procutil.kill(process)
        os.close(main)
    stdout = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    stderr = b"".join(errors).decode(errors="replace")
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


class MainJobConsoleTest(absltest.TestCase):
    """The README's main job as a user runs it, stdout on a terminal (where
    the launcher once asked tf_keras for a progress bar, refused under PSS).
    """

    def test_no_tensorflow_log_line_and_short_epoch_lines(self):
        script = os.path.join(os.path.dirname(sys.executable), "tf2sync")
        if not os.path.exists(script):
            self.skipTest(f"no console script at {script}")
        self._check_console([script, "--epochs=2"])

    def test_python_dash_m_has_the_same_console(self):
        self._check_console([sys.executable, "-m", "tf2sync", "--epochs=2"])

    def _check_console(self, command):
        env = dict(os.environ)  # as a user's shell: no TF_CPP_MIN_LOG_LEVEL
        for name in (
            "TF_CPP_MIN_LOG_LEVEL",
            "CUDA_VISIBLE_DEVICES",
            "TF_CONFIG",
        ):
            env.pop(name, None)
        out = _run_on_a_terminal(command, env, timeout=300)
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        console = (out.stdout + out.stderr).splitlines()
        native = [line for line in console if _NATIVE_LOG_LINE.search(line)]
        self.assertEqual(native, [], "TensorFlow C++ log lines on the console")
        epochs = [line for line in console if re.match(r"\d+/\d+ - ", line)]
        self.assertLen(epochs, 2, out.stdout)
        for line in epochs:
            self.assertLess(len(line), 200, line)
            self.assertIn("sync_steps:", line)
        # The logs went to the directory printed once.
        match = re.search(r"logs in (\S+)", out.stdout)
        self.assertIsNotNone(match, out.stdout)
        self.assertEqual(out.stdout.count("logs in "), 1)
        names = set(os.listdir(match.group(1)))
        self.assertContainsSubset(
            {"chief.log", "ps0.log", "worker0.log", "worker1.log"}, names
        )


class JobModuleTest(absltest.TestCase):
    """What a user of the `tf2sync` console script meets with --job_module."""

    def _script(self, *args, cwd):
        script = os.path.join(os.path.dirname(sys.executable), "tf2sync")
        if not os.path.exists(script):
            self.skipTest(f"no console script at {script}")
        env = dict(_ENV)
        env.pop("PYTHONPATH")  # only the working directory finds the job
        return subprocess.run(
            [script, *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
            timeout=240,
        )

    def test_a_job_module_in_the_working_directory(self):
        out = self._script(
            "--job_module=fault_job",
            "--epochs=1",
            "--steps_per_epoch=2",
            "--steps_per_execution=1",
            cwd=procutil.TESTS_DIR,
        )
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        self.assertIn("sync_steps_applied=", out.stdout)

    def test_a_job_without_metrics_ends_on_its_loss(self):
        # Not `accuracy=nan`: the final line shows the job's own metrics,
        # its loss when it has none.
        directory = tempfile.mkdtemp()
        with open(os.path.join(directory, "no_metrics.py"), "w") as f:
            f.write(
                "import sys\n"
                f"sys.path.insert(0, {procutil.TESTS_DIR!r})\n"
                "from fault_job import *  # noqa\n"
                "METRICS = []\n"
            )
        out = self._script(
            "--job_module=no_metrics",
            "--epochs=1",
            "--steps_per_epoch=2",
            "--steps_per_execution=1",
            cwd=directory,
        )
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        self.assertRegex(
            out.stdout, r"(?m)^loss=\d\.\d{4} sync_steps_applied=\d+ "
        )
        self.assertNotIn("nan", out.stdout)

    def test_a_job_module_and_its_flags_in_a_flagfile(self):
        # The job module is imported before absl parses the flags, so the
        # flags it defines can be in the same file.
        directory = tempfile.mkdtemp()
        path = os.path.join(directory, "clicks.cfg")
        with open(path, "w") as f:
            f.write(
                "--job_module=tf2sync._src.jobs.clicks\n"
                "--clicks_vocab_size=500\n--clicks_num_train=256\n"
                "--epochs=1\n"
            )
        out = self._script(f"--flagfile={path}", cwd=directory)
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        self.assertIn("sync_steps_applied=", out.stdout)

    def test_a_job_module_importing_what_is_not_installed(self):
        directory = tempfile.mkdtemp()
        with open(os.path.join(directory, "needs_more.py"), "w") as f:
            f.write("import no_such_dependency_of_tf2sync_tests\n")
        out = self._script("--job_module=needs_more", cwd=directory)
        procutil.assert_refused(
            self,
            out,
            "--job_module=needs_more: No module named "
            "'no_such_dependency_of_tf2sync_tests'",
        )

    def test_a_missing_job_module_is_a_usage_error(self):
        out = self._script("--job_module=no_such_job", cwd=tempfile.mkdtemp())
        procutil.assert_refused(
            self,
            out,
            "--job_module=no_such_job: no module named 'no_such_job' in the "
            "working directory",
            returncode=None,
        )


class DigitsJobTest(absltest.TestCase):
    """The main job's data: scikit-learn's digits, without its import."""

    def test_the_arrays_are_load_digits_shuffled(self):
        import numpy as np

        from tf2sync._src.jobs import digits

        reference = load_digits()
        order = np.random.RandomState(0).permutation(len(reference.data))
        x, y = digits._arrays()
        np.testing.assert_array_equal(
            x, (reference.data / 16.0).astype("float32")[order]
        )
        np.testing.assert_array_equal(y, reference.target[order])
        self.assertEqual((x.dtype, y.dtype), (np.float32, np.int64))
        self.assertEqual(digits._digits_table().shape, (1797, 65))

    def test_without_scikit_learn_the_launcher_says_so_before_starting(self):
        # As after `pip install -e .` without the `examples` extra: the
        # default job is refused in one line, no task started (it failed
        # in the chief's first trace, as "StagingError: in user code").
        code = (
            "import importlib.util, sys\n"
            "find = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda name, *a: (\n"
            "    None if name == 'sklearn' else find(name, *a))\n"
            "sys.argv = ['tf2sync', '--epochs=1']\n"
            "from tf2sync._src.launcher import launch\n"
            "launch.run()\n"
        )
        out = procutil.run_python(code)
        procutil.assert_refused(
            self,
            out,
            "--job_module=tf2sync._src.jobs.digits: No module named "
            "'sklearn': the digits job reads scikit-learn's copy of its "
            "data (pip install 'tf2sync[examples]')",
        )

    def test_reading_them_does_not_import_scikit_learn(self):
        # Its import (scipy.stats with it) took 0.5-0.9 s of the chief's
        # start; a fresh interpreter, as the test process imported it.
        code = (
            "import sys\n"
            "from tf2sync._src.jobs import digits\n"
            "x, y = digits._arrays()\n"
            "print(len(x), 'sklearn' in sys.modules)\n"
        )
        out = procutil.run_python(code)
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        self.assertEqual(out.stdout.split()[-2:], ["1797", "False"])


class PublicAddressWarningTest(absltest.TestCase):
    """The check only reads the host list: nothing is contacted."""

    def test_public_address_warns(self):
        from tf2sync._src.launcher import input as launch_input

        with self.assertLogs(level="WARNING") as logs:
            launch_input.warn_public(["127.0.0.1:2222", "8.8.8.8:2222"])
        self.assertLen(logs.records, 1)
        self.assertIn("8.8.8.8:2222 is a public address", logs.output[0])

    def test_private_and_names_do_not_warn(self):
        from absl import logging

        from tf2sync._src.launcher import input as launch_input

        with self.assertLogs(level="WARNING") as logs:
            logging.warning("sentinel")  # assertLogs needs one record
            launch_input.warn_public(
                ["10.0.0.1:1", "192.168.1.2:1", "ps-0.svc:2222", "[::1]:1"]
            )
        self.assertEqual([r.getMessage() for r in logs.records], ["sentinel"])


if __name__ == "__main__":
    absltest.main()
