"""The deployment examples give every task a TF_CONFIG that TF reads right.

examples/deploy/tfjob.yaml (Kubeflow TFJob + NetworkPolicy) and the Slurm
scripts (slurm.sbatch, slurm_tf_config.py). No cluster is started: the
TF_CONFIG of each task is built as the training operator or the Slurm helper
builds it and parsed by `TFConfigClusterResolver`.
"""

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from unittest import mock

import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

try:
    import yaml
except ImportError:  # PyYAML is not a dependency: _load_yaml reads the file.
    yaml = None

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEPLOY = os.path.join(_ROOT, "examples", "deploy")
_TFJOB = os.path.join(_DEPLOY, "tfjob.yaml")
_SBATCH = os.path.join(_DEPLOY, "slurm.sbatch")
_HELPER = os.path.join(_DEPLOY, "slurm_tf_config.py")
_COMMAND = ["tf2sync", "--replicas_to_aggregate=2", "--total_num_replicas=2"]
_JOB_LABEL = "training.kubeflow.org/job-name"


def _read(path):
    with open(path) as f:
        return f.read()


# A reader for the block-style YAML subset the manifest uses: mappings,
# sequences, plain/quoted scalars, comments and `---` documents. Anything
# else (flow collections, anchors, block scalars, tabs) is refused loudly.

_KEY = re.compile(
    r"^([^\s:#'\"\[\]{}|>&*!-][^:#]*?|-[^\s:#][^:#]*?):(?:\s+(.*))?$"
)


class YamlSubsetError(ValueError):
    pass


def _is_item(text):
    return text == "-" or text.startswith("- ")


def _scalar(text, number):
    if text[0] in "[{&*!|>%@`":
        raise YamlSubsetError(f"line {number}: unsupported YAML: {text!r}")
    if text[0] == '"' and text[-1] == '"' and len(text) > 1:
        return json.loads(text)
    if text[0] == "'" and text[-1] == "'" and len(text) > 1:
        return text[1:-1].replace("''", "'")
    if text[0] in "'\"":
        raise YamlSubsetError(f"line {number}: unclosed quote: {text!r}")
    if re.fullmatch(r"[-+]?[0-9]+", text):
        return int(text)
    return {"true": True, "false": False, "null": None, "~": None}.get(
        text, text
    )


def _check_dedent(lines, i, indent):
    if i < len(lines) and lines[i][0] > indent:
        raise YamlSubsetError(f"line {lines[i][2]}: unexpected indentation")


def _parse_block(lines, i, indent):
    if _is_item(lines[i][1]):
        return _parse_sequence(lines, i, indent)
    return _parse_mapping(lines, i, indent)


def _parse_sequence(lines, i, indent):
    items = []
    while i < len(lines) and lines[i][0] == indent and _is_item(lines[i][1]):
        rest, number = lines[i][1][1:], lines[i][2]
        if not rest.strip():
            i += 1
            if i >= len(lines) or lines[i][0] <= indent:
                items.append(None)
                continue
            item, i = _parse_block(lines, i, lines[i][0])
        elif _KEY.match(rest.strip()) or _is_item(rest.strip()):
            # "- key: value": the item's mapping continues on the next lines
            # at the column of `key`.
            inner = indent + 1 + len(rest) - len(rest.lstrip())
            lines[i] = (inner, rest.strip(), number)
            item, i = _parse_block(lines, i, inner)
        else:
            item, i = _scalar(rest.strip(), number), i + 1
        items.append(item)
    _check_dedent(lines, i, indent)
    return items, i


def _parse_mapping(lines, i, indent):
    out = {}
    while i < len(lines) and lines[i][0] == indent:
        _, text, number = lines[i]
        if _is_item(text):
            break
        match = _KEY.match(text)
        if not match:
            raise YamlSubsetError(f"line {number}: not `key: value`: {text}")
        key, value = match.group(1).strip(), match.group(2)
        if key in out:
            raise YamlSubsetError(f"line {number}: duplicate key {key!r}")
        i += 1
        if value:
            out[key] = _scalar(value, number)
        elif i < len(lines) and lines[i][0] > indent:
            out[key], i = _parse_block(lines, i, lines[i][0])
        elif i < len(lines) and lines[i][0] == indent and _is_item(lines[i][1]):
            out[key], i = _parse_sequence(lines, i, indent)
        else:
            out[key] = None
    _check_dedent(lines, i, indent)
    return out, i


def _load_yaml(text):
    """Every document of `text` (the block-style subset above)."""
    documents = [[]]
    for number, raw in enumerate(text.splitlines(), 1):
        body = raw.lstrip(" ")
        if body.startswith("\t"):
            raise YamlSubsetError(f"line {number}: tab indentation")
        if raw.rstrip() == "---":
            documents.append([])
            continue
        body = re.sub(r"(^|\s)#.*$", "", body).rstrip()
        if body:
            documents[-1].append(
                (len(raw) - len(raw.lstrip(" ")), body, number)
            )
    out = []
    for lines in documents:
        if not lines:
            continue
        value, i = _parse_block(lines, 0, lines[0][0])
        if i != len(lines):
            raise YamlSubsetError(f"line {lines[i][2]}: unexpected dedent")
        out.append(value)
    return out


def _manifest():
    documents = _load_yaml(_read(_TFJOB))
    kinds = [d.get("kind") for d in documents]
    if kinds != ["TFJob", "NetworkPolicy"]:
        raise AssertionError(f"tfjob.yaml documents: {kinds}")
    return documents


def _tensorflow_container(replica_spec):
    containers = replica_spec["template"]["spec"]["containers"]
    named = [c for c in containers if c.get("name") == "tensorflow"]
    if len(named) != 1:
        raise AssertionError(f"containers named tensorflow: {named}")
    return named[0]


def _tfjob_port(replica_spec):
    """The port the operator puts in TF_CONFIG (its default is 2222)."""
    for port in _tensorflow_container(replica_spec).get("ports", []):
        if port.get("name") == "tfjob-port":
            return port["containerPort"]
    return 2222


def _operator_tf_config(tfjob, replica_type, index):
    """TF_CONFIG as the training operator sets it in one replica's pod."""
    name = tfjob["metadata"]["name"]
    namespace = tfjob["metadata"]["namespace"]
    cluster = {}
    for rtype, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        rt = rtype.lower()
        port = _tfjob_port(spec)
        cluster[rt] = [
            f"{name}-{rt}-{i}.{namespace}.svc:{port}"
            for i in range(spec["replicas"])
        ]
    return {
        "cluster": cluster,
        "task": {"type": replica_type.lower(), "index": index},
        "environment": "cloud",
    }


def _resolve(config):
    """(cluster dict, task_type, task_id) that TF reads from `config`."""
    with mock.patch.dict(os.environ, {"TF_CONFIG": json.dumps(config)}):
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        return (
            resolver.cluster_spec().as_dict(),
            resolver.task_type,
            resolver.task_id,
        )


def _flag_values(command):
    return dict(
        arg[2:].split("=", 1) for arg in command[1:] if arg.startswith("--")
    )


class YamlReaderTest(absltest.TestCase):
    def test_nested_sequences_and_mappings(self):
        text = (
            "# comment\n"
            "a:\n"
            "  b: 1\n"
            "  c:\n"
            "    - x: 'y z'\n"
            "      w:\n"
            "        - 2\n"
            "        - --flag=3  # trailing comment\n"
            "    - v\n"
            "  d:\n"
            '  - "q:r"\n'
            "e: host.example:2222\n"
            "---\n"
            "f: true\n"
        )
        self.assertEqual(
            _load_yaml(text),
            [
                {
                    "a": {
                        "b": 1,
                        "c": [{"x": "y z", "w": [2, "--flag=3"]}, "v"],
                        "d": ["q:r"],
                    },
                    "e": "host.example:2222",
                },
                {"f": True},
            ],
        )

    def test_refuses_unsupported_yaml(self):
        for text in ("a: [1, 2]\n", "a: &x 1\n", "a:\n  b: 1\n   c: 2\n"):
            with self.subTest(text=text):
                with self.assertRaises(YamlSubsetError):
                    _load_yaml(text)

    @absltest.skipIf(yaml is None, "PyYAML is not installed")
    def test_agrees_with_pyyaml(self):
        text = _read(_TFJOB)
        self.assertEqual(_load_yaml(text), list(yaml.safe_load_all(text)))


class TFJobTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        self.tf_config_before = os.environ.get("TF_CONFIG")
        self.tfjob, self.policy = _manifest()

    def tearDown(self):
        self.assertEqual(os.environ.get("TF_CONFIG"), self.tf_config_before)
        super().tearDown()

    def test_tfjob_layout(self):
        self.assertEqual(self.tfjob["apiVersion"], "kubeflow.org/v1")
        specs = self.tfjob["spec"]["tfReplicaSpecs"]
        self.assertEqual(
            {rtype: spec["replicas"] for rtype, spec in specs.items()},
            {"Chief": 1, "PS": 1, "Worker": 2},
        )
        # ps and workers serve forever: delete them once the chief is done.
        self.assertEqual(
            self.tfjob["spec"]["runPolicy"]["cleanPodPolicy"], "Running"
        )

    def test_containers(self):
        specs = self.tfjob["spec"]["tfReplicaSpecs"]
        images = set()
        for rtype, spec in specs.items():
            with self.subTest(replica_type=rtype):
                container = _tensorflow_container(spec)
                images.add(container["image"])
                self.assertEqual(container["command"], _COMMAND)
                self.assertEqual(
                    container["ports"],
                    [{"name": "tfjob-port", "containerPort": 2222}],
                )
                self.assertNotIn("hostNetwork", spec["template"]["spec"])
                # TF_CONFIG comes from the operator, never from the manifest.
                names = [e["name"] for e in container.get("env") or []]
                self.assertNotIn("TF_CONFIG", names)
        self.assertLen(images, 1)
        # One replica per worker: the launcher's default total, explicitly.
        flags = _flag_values(_COMMAND)
        self.assertEqual(
            int(flags["total_num_replicas"]), specs["Worker"]["replicas"]
        )

    @parameterized.named_parameters(
        ("chief", "Chief", 0, "chief"),
        ("ps", "PS", 0, "ps"),
        ("worker_0", "Worker", 0, "worker"),
        ("worker_1", "Worker", 1, "worker"),
    )
    def test_operator_tf_config_resolves(self, replica_type, index, task):
        config = _operator_tf_config(self.tfjob, replica_type, index)
        spec, task_type, task_id = _resolve(config)
        self.assertEqual(
            spec,
            {
                "chief": ["tf2sync-digits-chief-0.tf2sync.svc:2222"],
                "ps": ["tf2sync-digits-ps-0.tf2sync.svc:2222"],
                "worker": [
                    "tf2sync-digits-worker-0.tf2sync.svc:2222",
                    "tf2sync-digits-worker-1.tf2sync.svc:2222",
                ],
            },
        )
        self.assertEqual(task_type, task)
        self.assertEqual(task_id, index)

    def test_every_replica_has_its_own_task(self):
        tasks = set()
        for rtype, spec in self.tfjob["spec"]["tfReplicaSpecs"].items():
            for i in range(spec["replicas"]):
                _, task_type, task_id = _resolve(
                    _operator_tf_config(self.tfjob, rtype, i)
                )
                tasks.add((task_type, task_id))
        self.assertEqual(
            tasks, {("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1)}
        )

    def test_network_policy_admits_only_the_job(self):
        policy = self.policy
        self.assertEqual(policy["apiVersion"], "networking.k8s.io/v1")
        self.assertEqual(
            policy["metadata"]["namespace"],
            self.tfjob["metadata"]["namespace"],
        )
        job_pods = {"matchLabels": {_JOB_LABEL: self.tfjob["metadata"]["name"]}}
        self.assertEqual(policy["spec"]["podSelector"], job_pods)
        self.assertIn("Ingress", policy["spec"]["policyTypes"])
        port = _tfjob_port(self.tfjob["spec"]["tfReplicaSpecs"]["PS"])
        self.assertEqual(
            policy["spec"]["ingress"],
            [
                {
                    "from": [{"podSelector": job_pods}],
                    "ports": [{"protocol": "TCP", "port": port}],
                }
            ],
        )

    def test_security_comments(self):
        text = _read(_TFJOB)
        self.assertIn("without authentication", text)
        self.assertIn("private network", text)
        self.assertIn("NetworkPolicy", text)


def _clean_env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TF2SYNC_")) and k != "TF_CONFIG"
    }
    env.update(extra)
    return env


def _tempdir(test):
    # Not absltest's create_tempdir: its flags are unparsed under pytest.
    path = tempfile.mkdtemp()
    test.addCleanup(shutil.rmtree, path)
    return path


def _helper(*args, **env):
    return subprocess.run(
        [sys.executable, _HELPER, *args],
        capture_output=True,
        text=True,
        env=_clean_env(**env),
        timeout=60,
    )


_HOSTS = [f"node{i}.cluster.internal" for i in range(4)]
_SLURM_SPEC = {
    "chief": ["node0.cluster.internal:2222"],
    "ps": ["node1.cluster.internal:2222"],
    "worker": ["node2.cluster.internal:2222", "node3.cluster.internal:2222"],
}


class SlurmTFConfigTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        self.tf_config_before = os.environ.get("TF_CONFIG")

    def tearDown(self):
        self.assertEqual(os.environ.get("TF_CONFIG"), self.tf_config_before)
        super().tearDown()

    def _config(self, *args, **env):
        out = _helper(*args, **env)
        self.assertEqual(out.returncode, 0, out.stderr)
        return json.loads(out.stdout)

    @parameterized.named_parameters(
        ("chief", 0, "chief", 0),
        ("ps", 1, "ps", 0),
        ("worker_0", 2, "worker", 0),
        ("worker_1", 3, "worker", 1),
    )
    def test_procid_layout_resolves(self, procid, task, index):
        config = self._config(
            TF2SYNC_HOSTS=",".join(_HOSTS),
            SLURM_PROCID=str(procid),
            SLURM_NTASKS="4",
        )
        self.assertEqual(
            config,
            {"cluster": _SLURM_SPEC, "task": {"type": task, "index": index}},
        )
        spec, task_type, task_id = _resolve(config)
        self.assertEqual(spec, _SLURM_SPEC)
        self.assertEqual(
            {job: len(tasks) for job, tasks in spec.items()},
            {"chief": 1, "ps": 1, "worker": 2},
        )
        self.assertEqual(task_type, task)
        self.assertEqual(task_id, index)

    def test_flags_override_env(self):
        config = self._config(
            "--hosts=" + ",".join(_HOSTS),
            "--procid=3",
            "--port=2345",
            TF2SYNC_HOSTS="other0,other1,other2,other3",
            SLURM_PROCID="0",
        )
        self.assertEqual(config["cluster"]["worker"][1], f"{_HOSTS[3]}:2345")
        self.assertEqual(config["task"], {"type": "worker", "index": 1})

    @parameterized.named_parameters(
        ("flag", ["--num_ps=2"], {}),
        ("env", [], {"TF2SYNC_NUM_PS": "2"}),
    )
    def test_num_ps(self, args, env):
        hosts = ",".join(f"h{i}" for i in range(5))
        expected = {
            0: ("chief", 0),
            1: ("ps", 0),
            2: ("ps", 1),
            3: ("worker", 0),
            4: ("worker", 1),
        }
        for procid, (task, index) in expected.items():
            config = self._config(
                f"--hosts={hosts}", f"--procid={procid}", *args, **env
            )
            spec, task_type, task_id = _resolve(config)
            self.assertEqual(
                spec,
                {
                    "chief": ["h0:2222"],
                    "ps": ["h1:2222", "h2:2222"],
                    "worker": ["h3:2222", "h4:2222"],
                },
            )
            self.assertEqual((task_type, task_id), (task, index))

    def test_plain_nodelist(self):
        config = self._config(
            SLURM_JOB_NODELIST=",".join(_HOSTS), SLURM_PROCID="1"
        )
        self.assertEqual(config["cluster"], _SLURM_SPEC)
        self.assertEqual(config["task"], {"type": "ps", "index": 0})

    def test_ranged_nodelist_uses_scontrol(self):
        fake_bin = _tempdir(self)
        scontrol = os.path.join(fake_bin, "scontrol")
        with open(scontrol, "w") as f:
            f.write(
                "#!/bin/sh\n"
                '[ "$*" = "show hostnames node[01-04]" ] || exit 3\n'
                "printf 'node01\\nnode02\\nnode03\\nnode04\\n'\n"
            )
        os.chmod(scontrol, 0o755)
        config = self._config(
            SLURM_JOB_NODELIST="node[01-04]",
            SLURM_PROCID="2",
            PATH=fake_bin + os.pathsep + os.environ.get("PATH", ""),
        )
        self.assertEqual(
            config["cluster"],
            {
                "chief": ["node01:2222"],
                "ps": ["node02:2222"],
                "worker": ["node03:2222", "node04:2222"],
            },
        )
        self.assertEqual(config["task"], {"type": "worker", "index": 0})

    def test_repeated_host_gets_distinct_ports(self):
        config = self._config(
            "--hosts=" + ",".join(["127.0.0.1"] * 4), "--procid=0"
        )
        self.assertEqual(
            config["cluster"],
            {
                "chief": ["127.0.0.1:2222"],
                "ps": ["127.0.0.1:2223"],
                "worker": ["127.0.0.1:2224", "127.0.0.1:2225"],
            },
        )

    @parameterized.named_parameters(
        ("no_hosts", ["--procid=0"], {}, "No hosts"),
        ("no_procid", ["--hosts=a,b,c"], {}, "No task rank"),
        (
            "no_worker",
            ["--hosts=a,b,c", "--procid=0", "--num_ps=2"],
            {},
            "3 host(s) cannot hold a chief, 2 ps and at least one worker",
        ),
        (
            "procid_range",
            ["--hosts=a,b,c", "--procid=3"],
            {},
            "procid 3 is out of range for 3 host(s)",
        ),
        (
            "ntasks",
            ["--hosts=a,b,c", "--procid=0"],
            {"SLURM_NTASKS": "4"},
            "4 tasks but 3 hosts",
        ),
        ("num_ps", ["--hosts=a,b,c", "--procid=0", "--num_ps=0"], {}, ">= 1"),
    )
    def test_errors(self, args, env, message):
        out = _helper(*args, **env)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn(message, out.stderr)
        self.assertEqual(out.stdout, "")


class SlurmBatchScriptTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        self.text = _read(_SBATCH)

    def test_calls_helper_then_tf2sync(self):
        self.assertIn("srun", self.text)
        self.assertIn("slurm_tf_config.py", self.text)
        launch = "exec " + " ".join(_COMMAND)
        self.assertIn(launch, self.text)
        self.assertLess(
            self.text.index("slurm_tf_config.py"), self.text.index(launch)
        )
        self.assertIn("export TF_CONFIG", self.text)
        self.assertIn("without authentication", self.text)

    def test_directives_match_layout(self):
        directives = dict(
            re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", self.text, re.MULTILINE)
        )
        self.assertEqual(directives["ntasks"], "4")
        self.assertEqual(directives["nodes"], "4")
        self.assertEqual(directives["ntasks-per-node"], "1")
        # 1 chief + 1 ps (the default) + total_num_replicas workers.
        self.assertEqual(
            int(directives["ntasks"]),
            2 + int(_flag_values(_COMMAND)["total_num_replicas"]),
        )

    def test_helper_path_from_submit_dir(self):
        match = re.search(r"\$\{SLURM_SUBMIT_DIR\}/([\w/]+)\}", self.text)
        self.assertIsNotNone(match)
        self.assertTrue(
            os.path.isfile(
                os.path.join(_ROOT, match.group(1), "slurm_tf_config.py")
            )
        )

    @absltest.skipIf(shutil.which("bash") is None, "no bash")
    def test_runs_with_fake_srun(self):
        """The script itself, with stand-ins for srun and tf2sync."""
        self.assertEqual(subprocess.run(["bash", "-n", _SBATCH]).returncode, 0)
        fake_bin = _tempdir(self)
        scripts = {
            # Drops srun's options, then runs the command once per task.
            "srun": (
                "#!/bin/sh\n"
                'while [ "${1#-}" != "$1" ]; do shift; done\n'
                "p=0\n"
                'while [ "$p" -lt "$SLURM_NTASKS" ]; do\n'
                '  SLURM_PROCID=$p "$@" || exit $?\n'
                "  p=$((p + 1))\n"
                "done\n"
            ),
            "tf2sync": (
                '#!/bin/sh\nprintf "TF2SYNC %s|%s\\n" "$*" "$TF_CONFIG"\n'
            ),
        }
        for name, body in scripts.items():
            path = os.path.join(fake_bin, name)
            with open(path, "w") as f:
                f.write(body)
            os.chmod(path, 0o755)
        out = subprocess.run(
            ["bash", _SBATCH],
            capture_output=True,
            text=True,
            timeout=120,
            env=_clean_env(
                PATH=fake_bin + os.pathsep + os.environ.get("PATH", ""),
                SLURM_SUBMIT_DIR=_ROOT,
                SLURM_JOB_NODELIST=",".join(_HOSTS),
                SLURM_NTASKS="4",
                TF2SYNC_PYTHON=sys.executable,
            ),
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        runs = [
            line[len("TF2SYNC ") :].split("|", 1)
            for line in out.stdout.splitlines()
            if line.startswith("TF2SYNC ")
        ]
        self.assertLen(runs, 4)
        tasks = []
        for args, config in runs:
            self.assertEqual(args, " ".join(_COMMAND[1:]))
            spec, task_type, task_id = _resolve(json.loads(config))
            self.assertEqual(spec, _SLURM_SPEC)
            tasks.append((task_type, task_id))
        self.assertEqual(
            tasks, [("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1)]
        )


class NoPublicAddressTest(absltest.TestCase):
    def test_deploy_files_name_no_public_address(self):
        for name in sorted(os.listdir(_DEPLOY)):
            text = _read(os.path.join(_DEPLOY, name))
            for literal in re.findall(r"\b\d{1,3}(?:\.\d{1,3}){3}\b", text):
                with self.subTest(file=name, address=literal):
                    self.assertFalse(ipaddress.ip_address(literal).is_global)


if __name__ == "__main__":
    absltest.main()
