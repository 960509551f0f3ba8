"""Bad input refused before anything starts (the launcher as a subprocess).

Each bad input ends the launcher at once with absl's usage error (exit code
2) and one meaningful line on stderr naming the flag (or TF_CONFIG) and the
value: no task is started, nothing connects, no checkpoint is touched.
"""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import procutil
import pytest
from absl import app
from absl.testing import absltest
from absl.testing import parameterized

import tf2sync

pytestmark = pytest.mark.slow

# What of stderr is not the error: TensorFlow's C++ log lines, absl's
# pre-init notice, and the usage hint absl prints (__main__'s docstring).
_NOISE = re.compile(
    r"^([IWEF]\d{4} |WARNING: All log messages before absl::InitializeLog"
    r"|To enable the following instructions"
    r"|`python -m tf2sync`: the launcher)"
)
_FAST_S = 30  # TensorFlow's import alone takes several seconds here


def _host_flags(spec):
    """The role flags' host flags naming cluster `spec` (its chief if any)."""
    flags = [
        "--ps_hosts=" + ",".join(spec["ps"]),
        "--worker_hosts=" + ",".join(spec["worker"]),
    ]
    return flags + [f"--chief_host={h}" for h in spec.get("chief", [])]


def _meaningful(stderr):
    return [
        line for line in stderr.splitlines() if line and not _NOISE.match(line)
    ]


# Runs a command as an unprivileged user (root writes into a 0o500
# directory, so the unwritable-directory check needs another user).
_AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _can_run_as_nobody():
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return False
    probe = subprocess.run(
        [*_AS_NOBODY, sys.executable, "-c", "import tf2sync"],
        capture_output=True,
        env=procutil.ENV,
        timeout=120,
    )
    return probe.returncode == 0


def _run(args, env=None, prefix=()):
    """`python -m tf2sync ARGS`: (returncode, stdout, stderr, seconds).

    The launcher, and any task pids it prints, are ended by PID at the end.
    """
    start = time.monotonic()
    process = subprocess.Popen(
        [*prefix, sys.executable, "-m", "tf2sync", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or procutil.ENV,
    )
    out = err = ""
    try:
        out, err = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        match = re.search(r"pids=(\[.*\])", out or "")
        for pid in json.loads(match.group(1)) if match else []:
            if procutil.alive(pid):
                os.kill(pid, signal.SIGKILL)
    return process.returncode, out, err, time.monotonic() - start


def _snapshot(directory):
    """{file name: (size, mtime, sha256)} of `directory`."""
    found = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        stat = os.stat(path)
        found[name] = (stat.st_size, stat.st_mtime_ns, digest)
    return found


def _save(directory, layers, epoch):
    """A checkpoint of `Sequential(layers)` as the chief names it."""
    import tensorflow as tf

    model = tf.keras.Sequential(layers)
    checkpoint = tf.train.Checkpoint(
        model=model, optimizer=tf.keras.optimizers.SGD(0.1)
    )
    tf.train.CheckpointManager(
        checkpoint, directory, max_to_keep=3, checkpoint_name="ckpt"
    ).save(checkpoint_number=epoch)


def _digits_layers(extra=()):
    import tensorflow as tf

    return [
        tf.keras.layers.Reshape((8, 8, 1), input_shape=(64,)),
        tf.keras.layers.Conv2D(16, 3, activation="relu", name="conv"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(10, activation="softmax", name="dense"),
        *extra,
    ]


class BadInputTest(parameterized.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        import fault_job
        import tensorflow as tf

        cls.root = tempfile.mkdtemp()
        cls.file = os.path.join(cls.root, "a_file")
        with open(cls.file, "w") as f:
            f.write("not a directory\n")
        cls.dirs = {}
        for name, layers, epoch in (
            # The default job (digits) at epoch 5.
            ("finished", _digits_layers, 5),
            # fault_job's Dense(16) on 8 inputs: another first kernel.
            ("other_shape", lambda: fault_job.build_model().layers, 1),
            # digits' conv alone: no dense layer.
            ("fewer_variables", lambda: _digits_layers()[:2], 1),
            # digits and one more dense layer.
            (
                "more_variables",
                lambda: _digits_layers([tf.keras.layers.Dense(4)]),
                1,
            ),
        ):
            directory = os.path.join(cls.root, name)
            _save(directory, layers(), epoch)
            cls.dirs[name] = directory
        cls.job_dir = os.path.join(cls.root, "jobs")
        os.makedirs(cls.job_dir)
        with open(os.path.join(cls.job_dir, "bad_import_job.py"), "w") as f:
            f.write("from os import no_such_name  # noqa: F401\n")
        with open(os.path.join(cls.job_dir, "half_job.py"), "w") as f:
            f.write(
                '"""A job module with a model only."""\n\n'
                "LOSS = 'mse'\n\n\ndef build_model():\n    return None\n"
            )

    def _env_with_job_dir(self):
        """The tests' environment, the job modules written here importable."""
        env = dict(procutil.ENV)
        env["PYTHONPATH"] = os.pathsep.join([self.job_dir, env["PYTHONPATH"]])
        return env

    def _check_refused(self, args, line, env=None, directory=None, prefix=()):
        before = _snapshot(directory) if directory else None
        code, out, err, seconds = _run(args, env=env, prefix=prefix)
        self.assertEqual(code, 2, err[-3000:])
        self.assertEqual(_meaningful(err), [line], err[-3000:])
        self.assertNotIn("Traceback", err)
        self.assertNotIn("local task pids", out)  # nothing started
        self.assertLess(seconds, _FAST_S, "took the time of a cluster")
        if directory:
            self.assertEqual(_snapshot(directory), before, "checkpoint changed")

    @parameterized.named_parameters(
        ("replicas_to_aggregate_0", "--replicas_to_aggregate=0"),
        ("replicas_to_aggregate_negative", "--replicas_to_aggregate=-1"),
        ("total_num_replicas_0", "--total_num_replicas=0"),
        ("batch_size_negative", "--batch_size=-1"),
        ("epochs_0", "--epochs=0"),
        ("steps_per_execution_0", "--steps_per_execution=0"),
        ("steps_per_epoch_0", "--steps_per_epoch=0"),
        ("checkpoint_every_steps_0", "--checkpoint_every_steps=0"),
    )
    def test_non_positive_count(self, arg):
        self._check_refused([arg], f"{arg}: must be a positive integer.")

    @parameterized.named_parameters(
        (
            "int_given_a_word",
            "--replicas_to_aggregate=two",
            "flag --replicas_to_aggregate=two: invalid literal for int() "
            "with base 10: 'two'",
        ),
        (
            "unknown_flag",
            "--replicas_to_agregate=2",
            "Unknown command line flag 'replicas_to_agregate'. Did you mean: "
            "replicas_to_aggregate ?",
        ),
        (
            "enum_value",
            "--input_sharding=dynamic",
            "flag --input_sharding=dynamic: value should be one of "
            "<static|service>",
        ),
    )
    def test_a_flag_absl_cannot_parse_exits_2_in_one_line(self, arg, line):
        # absl's own parsing error exits 1 with two lines.
        self._check_refused([arg], f"{line} (tf2sync --help lists the flags)")

    @parameterized.named_parameters(
        ("seconds_0", ["--checkpoint_every_s=0"], "0.0"),
        ("seconds_nan", ["--checkpoint_every_s=nan"], "nan"),
        ("seconds_inf", ["--checkpoint_every_s=inf"], "inf"),
    )
    def test_bad_checkpoint_seconds(self, args, shown):
        self._check_refused(
            args + ["--checkpoint_dir=/tmp/unused"],
            f"--checkpoint_every_s={shown}: must be a finite number > 0.",
        )

    @parameterized.named_parameters(
        ("seconds", "--checkpoint_every_s=30", "30"),
        ("steps", "--checkpoint_every_steps=100", "100"),
    )
    def test_checkpoint_cadence_without_a_directory(self, arg, shown):
        name = arg.split("=")[0]
        self._check_refused(
            [arg], f"{name}={shown}: needs --checkpoint_dir (where to save)."
        )

    def test_background_saves_without_a_directory(self):
        self._check_refused(
            ["--checkpoint_in_background"],
            "--checkpoint_in_background: needs --checkpoint_dir (where to "
            "save).",
        )

    def test_more_total_replicas_than_the_local_workers(self):
        self._check_refused(
            ["--local_cluster=2,1", "--total_num_replicas=3"],
            "--total_num_replicas=3: more than the 2 replica(s) of the "
            "cluster (2 worker(s)): each step would hand out tokens for "
            "replicas that do not exist and workers would push stale "
            "gradients; give at most 2.",
        )

    def test_more_total_replicas_than_the_clusters_gpus(self):
        spec = tf2sync.testing.cluster_spec_dict(2, 1)
        self._check_refused(
            ["--job_name=chief", "--num_gpus=2", "--total_num_replicas=5"]
            + _host_flags(spec),
            "--total_num_replicas=5: more than the 4 replica(s) of the "
            "cluster (2 worker(s) x 2 GPU(s)): each step would hand out "
            "tokens for replicas that do not exist and workers would push "
            "stale gradients; give at most 4.",
        )

    @parameterized.named_parameters(
        ("token_timeout", "--token_timeout=-1", "a finite number >= 0"),
        ("worker_timeout", "--worker_timeout=-1", "a finite number >= 0"),
        # NaN passed `value < 0`: the job started its tasks, then failed.
        ("token_timeout_nan", "--token_timeout=nan", "a finite number >= 0"),
        ("worker_timeout_inf", "--worker_timeout=inf", "a finite number >= 0"),
        (
            "restart_timeout_nan",
            "--ps_restart_timeout=nan",
            "a finite number >= 0",
        ),
        ("connect_timeout", "--connect_timeout=0", "> 0"),
    )
    def test_bad_timeout(self, arg, bound):
        self._check_refused([arg], f"{arg}: must be {bound}.")

    @parameterized.named_parameters(
        ("learning_rate_negative", "--learning_rate=-0.1", "-0.1"),
        ("learning_rate_0", "--learning_rate=0", "0.0"),
        ("learning_rate_nan", "--learning_rate=nan", "nan"),
        ("learning_rate_inf", "--learning_rate=inf", "inf"),
    )
    def test_bad_learning_rate(self, arg, shown):
        # A NaN or infinite rate trained on before: every gradient after
        # its first update was non-finite and dropped, and the job exited 0.
        self._check_refused(
            [arg], f"--learning_rate={shown}: must be a finite number > 0."
        )

    @parameterized.named_parameters(
        ("above_1", "--momentum=1.5", "1.5"),
        ("negative", "--momentum=-0.5", "-0.5"),
        ("nan", "--momentum=nan", "nan"),
    )
    def test_bad_momentum(self, arg, shown):
        # tf_keras's SGD refuses it too, but only once the cluster started.
        self._check_refused([arg], f"--momentum={shown}: must be in [0, 1].")

    def test_optimizer_flags_at_their_bounds_are_taken(self):
        from tf2sync._src.launcher import flag_checks

        for rate, momentum in ((1e-9, 0.0), (10.0, 1.0)):
            flag_checks.check_optimizer_flags(rate, momentum)  # no refusal
        with self.assertRaisesRegex(app.UsageError, "--momentum=1.0000001"):
            flag_checks.check_optimizer_flags(0.1, 1.0000001)

    def test_cluster_tasks_that_are_not_distinct_strings(self):
        from tf2sync._src.launcher import flag_checks

        def named(role, hosts):
            return f"TF_CONFIG cluster {role}={json.dumps(hosts)}"

        for cluster, message in (
            (  # TF's sparse form, {index: host}
                {"ps": ["h:1"], "worker": {"0": "h:2", "3": "h:2"}},
                "h:2 is both worker 0 and worker 3;",
            ),
            (
                {"ps": ["h:1"], "worker": [["h:2"]]},
                "each task must be a host:port string. Received: ['h:2']",
            ),
            ({"ps": ["h:1"], "worker": [None]}, "Received: None"),
            (  # one machine, one port: its server listens on every name
                {"ps": ["localhost:7"], "worker": ["127.0.0.1:7"]},
                "127.0.0.1:7 (localhost:7) is both ps 0 and worker 0;",
            ),
            (
                {"ps": ["H:23000"], "worker": ["h:023000"]},
                "h:023000 (H:23000) is both ps 0 and worker 0;",
            ),
            ({"ps": ["a b:1"], "worker": ["h:2"]}, "'a b:1' has a space."),
            (
                {"ps": ["h:1"], "worker": ["h:99999"]},
                "'h:99999' is not host:port with a port of 1-65535.",
            ),
            ({"ps": ["h:1"], "worker": [":2"]}, "':2' has no host."),
            ({"ps": ["h"], "worker": ["h:2"]}, "'h' is not host:port"),
            (
                {"ps": ["h:1"], "worker": "h:2"},
                'TF_CONFIG cluster worker="h:2": a role\'s tasks must be a '
                "list of host:port strings",
            ),
        ):
            with self.subTest(cluster=cluster):
                with self.assertRaises(app.UsageError) as refused:
                    flag_checks.check_distinct_addresses(cluster, named)
                self.assertIn(message, str(refused.exception))
        flag_checks.check_distinct_addresses(  # distinct: no refusal
            {
                "chief": ["h:65535"],
                "ps": ["[::1]:1", "h:1"],  # one port on two machines
                "worker": {"0": "h:2", "1": "localhost:2"},
            },
            named,
        )

    def test_tf_config_with_two_chiefs(self):
        from tf2sync._src.launcher import flag_checks

        cluster = {"chief": ["h:4", "h:3"], "ps": ["h:1"], "worker": ["h:2"]}
        text = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": 0}}
        )
        with self.assertRaises(app.UsageError) as refused:
            flag_checks.parse_tf_config(text)
        self.assertEqual(
            str(refused.exception),
            'TF_CONFIG cluster chief=["h:4", "h:3"]: a cluster has one chief.',
        )
        del cluster["chief"][1]
        flag_checks.parse_tf_config(
            json.dumps({**json.loads(text), "cluster": cluster})
        )

    def test_local_gpus_on_a_machine_without_one(self):
        import tensorflow as tf

        if tf.config.list_physical_devices("GPU"):
            self.skipTest("this machine has a GPU")
        self._check_refused(
            ["--num_gpus=1"],
            "--num_gpus=1: this machine shows TensorFlow no GPU "
            "(--num_gpus=0 trains on CPU; on an NVIDIA GPU machine "
            "TensorFlow needs its CUDA libraries: "
            f"{sys.executable} -m pip install 'tensorflow[and-cuda]==2.21.*').",
        )

    def test_service_sharding_with_the_tf1_shim(self):
        self._check_refused(
            ["--input_sharding=service", "--sync_optimizer=tf1_shim"],
            "--input_sharding=service needs --sync_optimizer=tf2sync (an "
            "epoch that ends with its data applies its last, incomplete "
            "step; the TF1 shim has no such step). Received: "
            "--sync_optimizer=tf1_shim",
        )

    def test_service_sharding_port_out_of_range(self):
        self._check_refused(
            ["--input_sharding=service", "--data_service_port=70000"],
            "--data_service_port=70000: a port is 1-65535.",
        )

    def test_service_sharding_needs_a_port_in_a_cluster(self):
        spec = tf2sync.testing.cluster_spec_dict(2, 1)
        self._check_refused(
            [
                "--input_sharding=service",
                "--job_name=chief",
                *_host_flags(spec),
            ],
            "--input_sharding=service needs --data_service_port outside the "
            "local mode (the dispatcher's port on the chief's host, the same "
            "for every task).",
        )

    def test_service_sharding_needs_the_chiefs_host(self):
        # The dispatcher's host: a worker without it failed with
        # KeyError('chief') once its server had started.
        spec = tf2sync.testing.cluster_spec_dict(2, 1)
        del spec["chief"]
        self._check_refused(
            [
                "--input_sharding=service",
                "--data_service_port=5000",
                "--job_name=worker",
                *_host_flags(spec),
            ],
            "--input_sharding=service needs --chief_host: the tf.data "
            "dispatcher runs on the chief's host.",
        )
        env = dict(procutil.ENV)
        env["TF_CONFIG"] = json.dumps(
            {"cluster": spec, "task": {"type": "worker", "index": 1}}
        )
        self._check_refused(
            ["--input_sharding=service", "--data_service_port=5000"],
            "--input_sharding=service needs a chief in TF_CONFIG: the "
            "tf.data dispatcher runs on the chief's host.",
            env=env,
        )

    def test_service_sharding_worker_port_past_65535(self):
        # Refused before the worker's server starts, not after.
        spec = tf2sync.testing.cluster_spec_dict(2, 1)
        self._check_refused(
            [
                "--input_sharding=service",
                "--data_service_port=65534",
                "--job_name=worker",
                "--task_index=1",
                *_host_flags(spec),
            ],
            "--data_service_port=65534: worker 1's tf.data worker port "
            "(65536, the port + 1 + its index) is past 65535.",
        )

    def test_service_sharding_needs_a_job_with_train_pass(self):
        self._check_refused(
            [
                "--input_sharding=service",
                "--job_module=tf2sync._src.jobs.clicks",
            ],
            "--input_sharding=service: --job_module=tf2sync._src.jobs.clicks "
            "lacks train_pass(batch_size) (the finite, batched dataset of one "
            "pass; see tf2sync/_src/jobs/digits.py).",
        )

    def test_checkpoint_dir_is_a_file(self):
        self._check_refused(
            [f"--checkpoint_dir={self.file}"],
            f"--checkpoint_dir={self.file}: is a file, not a directory.",
        )

    def test_task_log_dir_under_a_file(self):
        self._check_refused(
            [f"--task_log_dir={self.file}/logs"],
            f"--task_log_dir={self.file}/logs: cannot be created: "
            f"{self.file} is a file.",
        )

    def test_checkpoint_dir_under_a_file(self):
        path = os.path.join(self.file, "ckpt")
        self._check_refused(
            [f"--checkpoint_dir={path}"],
            f"--checkpoint_dir={path}: cannot be created: {self.file} is a "
            "file.",
        )

    def test_checkpoint_dir_where_nothing_can_be_made(self):
        # /proc takes no new entries, whoever asks; os.access tells root it
        # may write there, so the launcher makes a file to know, where an
        # epoch used to train before the first save failed.
        path = "/proc/tf2sync-ckpt"
        line = (
            f"--checkpoint_dir={path}: cannot be created: /proc is not writable"
        )
        if os.access("/proc", os.W_OK | os.X_OK):  # root: the file tells
            line += " (No such file or directory)"
        self._check_refused([f"--checkpoint_dir={path}"], line + ".")

    def test_checkpoint_dir_not_writable(self):
        prefix = ()
        if os.geteuid() == 0:  # root writes into a 0o500 directory
            if not _can_run_as_nobody():
                self.skipTest("root, and setpriv cannot run it as nobody")
            prefix = _AS_NOBODY
        directory = tempfile.mkdtemp()
        os.chmod(directory, 0o555)  # readable by the launcher, not writable
        try:
            self._check_refused(
                [f"--checkpoint_dir={directory}"],
                f"--checkpoint_dir={directory}: the directory is not writable.",
                prefix=prefix,
            )
            missing = os.path.join(directory, "ckpt")
            self._check_refused(
                [f"--checkpoint_dir={missing}"],
                f"--checkpoint_dir={missing}: cannot be created: "
                f"{directory} is not writable.",
                prefix=prefix,
            )
        finally:
            os.chmod(directory, 0o700)

    @parameterized.named_parameters(
        ("empty", ""),  # importlib: ValueError, a traceback before
        ("relative", ".digits"),  # importlib: TypeError
        ("path", "jobs/my_job.py"),
    )
    def test_job_module_that_is_not_a_module_name(self, name):
        self._check_refused(
            [f"--job_module={name}"],
            f"--job_module={name}: not a module name (a dotted import path, "
            "e.g. tf2sync._src.jobs.digits, or my_job for ./my_job.py).",
        )

    def test_job_module_whose_own_import_fails(self):
        env = self._env_with_job_dir()
        self._check_refused(
            ["--job_module=bad_import_job"],
            "--job_module=bad_import_job: cannot import name 'no_such_name' "
            f"from 'os' ({os.__file__})",
            env=env,
        )

    def test_model_log_dir_is_a_file(self):
        # It was not checked: the tasks started, then TensorBoard's writer
        # failed on it.
        self._check_refused(
            [f"--model_log_dir={self.file}"],
            f"--model_log_dir={self.file}: is a file, not a directory.",
        )

    def test_host_flags_without_a_role(self):
        # They were ignored: the launcher started a local cluster.
        ports = tf2sync.testing.pick_free_ports(2)
        a, b = (f"127.0.0.1:{port}" for port in ports)
        self._check_refused(
            [f"--ps_hosts={a}", f"--worker_hosts={b}", "--task_index=1"],
            f"--ps_hosts={a} is a role flag: it needs --job_name (ps, "
            "worker, chief or evaluator); without, the cluster comes from "
            "the local mode (a cluster on this machine) and would ignore it.",
        )
        env = dict(procutil.ENV)
        spec = tf2sync.testing.cluster_spec_dict(2, 1)
        env["TF_CONFIG"] = json.dumps(
            {"cluster": spec, "task": {"type": "worker", "index": 0}}
        )
        self._check_refused(
            [f"--chief_host={a}"],
            f"--chief_host={a} is a role flag: it needs --job_name (ps, "
            "worker, chief or evaluator); without, the cluster comes from "
            "TF_CONFIG and would ignore it.",
            env=env,
        )

    def test_job_module_without_the_job_api(self):
        env = self._env_with_job_dir()
        self._check_refused(
            ["--job_module=half_job"],
            "--job_module=half_job: the module lacks train_dataset("
            "input_context, batch_size), eval_arrays(), num_train_examples(), "
            "METRICS (a job defines build_model(), train_dataset("
            "input_context, batch_size), eval_arrays(), num_train_examples(), "
            "LOSS, METRICS; see tf2sync/_src/jobs/digits.py).",
            env=env,
        )

    @parameterized.named_parameters(
        (
            "worker_index_past_the_workers",
            {"type": "worker", "index": 5},
            "TF_CONFIG task type='worker' index=5: the cluster names 2 "
            "worker task(s), index 0 to 1.",
        ),
        (
            "chief_without_a_chief",
            {"type": "chief", "index": 0},
            "TF_CONFIG task type='chief' index=0: the cluster names no chief "
            "task (it names ps, worker).",
        ),
    )
    def test_tf_config_task_not_in_its_cluster(self, task, line):
        spec = tf2sync.testing.cluster_spec_dict(2, 1)
        del spec["chief"]
        env = dict(procutil.ENV)
        env["TF_CONFIG"] = json.dumps({"cluster": spec, "task": task})
        self._check_refused([], line, env=env)

    def test_one_address_for_two_tasks(self):
        # The second task's server could not listen there: refused at once,
        # in every task, rather than the chief waiting --connect_timeout.
        a, b = (
            f"127.0.0.1:{port}" for port in tf2sync.testing.pick_free_ports(2)
        )
        for args, line in (
            (
                ["--job_name=worker", f"--ps_hosts={a}", f"--worker_hosts={a}"],
                f"--worker_hosts={a}: {a} is both ps 0 and worker 0;",
            ),
            (
                ["--job_name=ps", f"--ps_hosts={a}", f"--worker_hosts={b},{b}"],
                f"--worker_hosts={b},{b}: {b} is both worker 0 and worker 1;",
            ),
            (
                [
                    "--job_name=chief",
                    f"--chief_host={b}",
                    f"--ps_hosts={a}",
                    f"--worker_hosts={b}",
                ],
                f"--chief_host={b}: {b} is both worker 0 and chief 0;",
            ),
        ):
            with self.subTest(args=args):
                self._check_refused(
                    args, line + " each task needs its own host:port."
                )
        env = dict(procutil.ENV)
        cluster = {"chief": [a], "worker": [b, b], "ps": [a]}
        env["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": 1}}
        )
        self._check_refused(
            [],
            f"TF_CONFIG cluster worker={json.dumps([b, b])}: {b} is both "
            "worker 0 and worker 1; each task needs its own host:port.",
            env=env,
        )

    @parameterized.named_parameters(
        (
            "other_shape",
            "other_shape",
            "it saved model/layer_with_weights-0/kernel with shape [8, 16], "
            "the model's (variable conv/kernel) has shape [3, 3, 1, 16].",
        ),
        (
            "fewer_variables",
            "fewer_variables",
            "it has no model/layer_with_weights-1/kernel (variable "
            "dense/kernel, shape [576, 10]).",
        ),
        (
            "more_variables",
            "more_variables",
            "it saved model/layer_with_weights-2/bias (shape [4]), which the "
            "model lacks.",
        ),
    )
    def test_checkpoint_of_another_model(self, name, what):
        directory = self.dirs[name]
        self._check_refused(
            [f"--checkpoint_dir={directory}", "--epochs=10"],
            f"--checkpoint_dir={directory}: the checkpoint {directory}/ckpt-1 "
            f"is of another model: {what} Build the model it was saved from, "
            "or use another directory.",
            directory=directory,
        )

    def test_finished_checkpoint_with_fewer_epochs(self):
        directory = self.dirs["finished"]
        self._check_refused(
            [f"--checkpoint_dir={directory}", "--epochs=3"],
            f"--checkpoint_dir={directory}: the checkpoint ckpt-5 already "
            "finished epoch 5 of --epochs=3, nothing to train (pass --epochs "
            "above 5 to train on, or another --checkpoint_dir).",
            directory=directory,
        )

    def test_evaluator_refuses_another_models_checkpoint(self):
        directory = self.dirs["other_shape"]
        code, out, err, _ = _run(
            ["--job_name=evaluator", f"--checkpoint_dir={directory}"]
        )
        self.assertEqual(code, 2, err[-3000:])
        self.assertLen(_meaningful(err), 1, err[-3000:])
        self.assertIn("is of another model", err)
        self.assertNotIn("eval epoch=", out)


class HelpTest(absltest.TestCase):
    def test_help_lists_the_launchers_and_the_jobs_flags(self):
        script = os.path.join(os.path.dirname(sys.executable), "tf2sync")
        runs = [("python -m tf2sync", ())]
        if os.path.exists(script):
            runs.append(("tf2sync", (script,)))
        for name, command in runs:
            with self.subTest(name):
                if command:
                    process = subprocess.run(
                        [*command, "--help"],
                        capture_output=True,
                        text=True,
                        env=procutil.ENV,
                        timeout=120,
                    )
                    rc, out = process.returncode, process.stdout
                else:
                    rc, out, _, _ = _run(["--help"])
                self.assertEqual(rc, 0)  # absl's exits 1: help is no error
                for flag in (
                    "--local_cluster",
                    "--job_name",
                    "--replicas_to_aggregate",
                    "--checkpoint_dir",
                    "--learning_rate",
                ):
                    self.assertIn(f"  {flag}: ", out)
                self.assertIn("tf2sync", out.splitlines()[0])
                # Only the launcher's, not every library's (--helpfull).
                self.assertNotIn("--xml_output_file", out)
        # A job's own flags too (jobs/clicks.py defines --clicks_vocab_size).
        rc, out, _, _ = _run(
            ["--job_module=tf2sync._src.jobs.clicks", "--help"]
        )
        self.assertEqual(rc, 0)
        self.assertIn("  --clicks_vocab_size: ", out)


class FlagChecksTest(parameterized.TestCase):
    """The pure checks, in process: what they let through."""

    def test_checkpoint_dir_created_if_missing(self):
        from tf2sync._src.launcher import flag_checks

        root = tempfile.mkdtemp()
        for path in (root, f"{root}/new", f"{root}/new/deeper", "gs://b/x"):
            flag_checks.check_checkpoint_dir(path, writable=True)
        flag_checks.check_checkpoint_dir(None, writable=True)

    def test_evaluator_may_wait_for_a_missing_dir_but_not_a_file(self):
        from tf2sync._src.launcher import flag_checks

        root = tempfile.mkdtemp()
        flag_checks.check_checkpoint_dir(f"{root}/later", writable=False)
        with open(f"{root}/f", "w"):
            pass
        with self.assertRaises(app.UsageError) as raised:
            flag_checks.check_checkpoint_dir(f"{root}/f", writable=False)
        self.assertEqual(raised.exception.exitcode, 2)

    def test_num_train_examples_not_needed_with_steps_per_epoch(self):
        import fault_job

        from tf2sync._src.launcher import flag_checks

        class Job:
            build_model = eval_arrays = staticmethod(lambda: None)
            train_dataset = staticmethod(lambda context, batch_size: None)
            LOSS, METRICS = "mse", []

        flag_checks.check_job_api(
            Job, "job", evaluator=False, steps_per_epoch=3
        )
        flag_checks.check_job_api(
            Job, "job", evaluator=True, steps_per_epoch=None
        )
        flag_checks.check_job_api(
            fault_job, "fault_job", evaluator=False, steps_per_epoch=None
        )
        with self.assertRaisesRegex(app.UsageError, "num_train_examples"):
            flag_checks.check_job_api(
                Job, "job", evaluator=False, steps_per_epoch=None
            )

    def test_evaluator_need_not_be_in_the_cluster(self):
        from tf2sync._src.launcher import flag_checks

        text = json.dumps(
            {
                "cluster": {"ps": ["a:1"], "worker": ["b:1"]},
                "task": {"type": "evaluator", "index": 0},
            }
        )
        self.assertEqual(
            flag_checks.parse_tf_config(text)["task"]["type"], "evaluator"
        )

    def test_exactly_finished_checkpoint_is_let_through(self):
        from tf2sync._src.launcher import flag_checks

        flag_checks.check_epochs_left("d", "d/ckpt-3", 3, 3)
        flag_checks.check_epochs_left("d", None, 0, 1)
        with self.assertRaisesRegex(app.UsageError, "finished epoch 4"):
            flag_checks.check_epochs_left("d", "d/ckpt-4", 4, 3)

    def test_a_checkpoint_of_this_model_fits(self):
        from tf2sync._src import checkpointing
        from tf2sync._src.jobs import digits

        directory = tempfile.mkdtemp()
        _save(directory, _digits_layers(), 2)
        checkpointing.check_model_fits(digits.build_model, directory)
        checkpointing.check_model_fits(digits.build_model, directory + "/none")
        self.assertEqual(
            checkpointing.latest_epoch(directory), (f"{directory}/ckpt-2", 2)
        )


if __name__ == "__main__":
    absltest.main()
