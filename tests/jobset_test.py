"""examples/deploy/jobset.yaml gives every pod the cluster and role it needs.

JobSet sets no TF_CONFIG: each pod's environment is rendered from the
manifest as Kubernetes and JobSet would (the downward API's JobSet
annotations, JOB_COMPLETION_INDEX, the pod's hostname) and handed to
`jobset.cluster_from_environ`, the launcher's derivation; TensorFlow must
read the equivalent TF_CONFIG the same way. No cluster is started: the
launcher tests run `tf2sync._src.launcher.launch` in subprocesses, as a
JobSet chief whose cluster does not answer (every name resolves to
127.0.0.1, where nothing listens), with a bad JobSet environment, and for
--cluster_from's precedence.
"""

import json
import os
import re
import socket
import subprocess
import sys

import deploy_test
from absl.testing import absltest
from absl.testing import parameterized

from tf2sync._src.launcher import jobset
from tf2sync._src.launcher import processes

_JOBSET = os.path.join(deploy_test._DEPLOY, "jobset.yaml")
_COMMAND = [*deploy_test._COMMAND, "--cluster_from=jobset"]
_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
_HOSTS = {
    "chief": ["tf2sync-digits-chief-0-0.tf2sync-digits:2222"],
    "ps": ["tf2sync-digits-ps-0-0.tf2sync-digits:2222"],
    "worker": [
        "tf2sync-digits-worker-0-0.tf2sync-digits:2222",
        "tf2sync-digits-worker-0-1.tf2sync-digits:2222",
    ],
}


def _manifest():
    documents = deploy_test._load_yaml(deploy_test._read(_JOBSET))
    kinds = [d.get("kind") for d in documents]
    if kinds != ["JobSet", "NetworkPolicy"]:
        raise AssertionError(f"jobset.yaml documents: {kinds}")
    return documents


def _container(rjob):
    containers = rjob["template"]["spec"]["template"]["spec"]["containers"]
    if len(containers) != 1:
        raise AssertionError(f"{rjob['name']}: containers {containers}")
    return containers[0]


def _pod_metadata(js, rjob, job_index, pod_index):
    """Labels and annotations of a pod (JobSet's labelAndAnnotateObject)."""
    jobset_keys = {
        _NAME_LABEL: js["metadata"]["name"],
        "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
        "jobset.sigs.k8s.io/replicatedjob-replicas": str(rjob["replicas"]),
        "jobset.sigs.k8s.io/job-index": str(job_index),
    }
    index = {"batch.kubernetes.io/job-completion-index": str(pod_index)}
    return {
        "name": f"{js['metadata']['name']}-{rjob['name']}-{job_index}-x",
        "namespace": js["metadata"]["namespace"],
        "labels": dict(jobset_keys),
        "annotations": {**jobset_keys, **index},
    }


def _field(metadata, path):
    """A downward API fieldRef.fieldPath of the pod's metadata."""
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match:
        kind, key = match.groups()
        if key not in metadata[kind]:
            raise AssertionError(f"the pod has no {kind[:-1]} {key!r}")
        return metadata[kind][key]
    if path in ("metadata.name", "metadata.namespace"):
        return metadata[path.split(".")[1]]
    raise AssertionError(f"fieldPath not rendered here: {path}")


def _pod(js, rjob, job_index, pod_index):
    """(environment, labels, FQDN) of one pod, as Kubernetes makes them."""
    metadata = _pod_metadata(js, rjob, job_index, pod_index)
    environ = {}
    for entry in _container(rjob).get("env") or []:
        if "value" in entry:
            environ[entry["name"]] = entry["value"]
        else:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            environ[entry["name"]] = _field(metadata, path)
    # Set by the Job controller in every pod of an Indexed Job.
    environ["JOB_COMPLETION_INDEX"] = str(pod_index)
    # JobSet's pod hostname and subdomain (with enableDNSHostnames).
    job_name = f"{js['metadata']['name']}-{rjob['name']}-{job_index}"
    network = js["spec"].get("network") or {}
    subdomain = network.get("subdomain") or js["metadata"]["name"]
    return environ, metadata["labels"], f"{job_name}-{pod_index}.{subdomain}"


def _pods(js):
    """(replicated job, pod index, environment, labels, FQDN) of every pod."""
    for rjob in js["spec"]["replicatedJobs"]:
        for job_index in range(rjob.get("replicas", 1)):
            for pod_index in range(rjob["template"]["spec"]["completions"]):
                yield (
                    rjob["name"],
                    pod_index,
                    *_pod(js, rjob, job_index, pod_index),
                )


def _chief_environ(js):
    for rjob_name, _, environ, _, _ in _pods(js):
        if rjob_name == "chief":
            return environ
    raise AssertionError("no chief pod")


class JobSetManifestTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        self.js, self.policy = _manifest()
        self.rjobs = {r["name"]: r for r in self.js["spec"]["replicatedJobs"]}

    def test_layout(self):
        self.assertEqual(self.js["apiVersion"], "jobset.x-k8s.io/v1alpha2")
        self.assertEqual(list(self.rjobs), ["ps", "worker", "chief"])
        pods = {}
        for name, rjob in self.rjobs.items():
            with self.subTest(replicated_job=name):
                # One Job per role; its pods are the role's tasks.
                self.assertEqual(rjob["replicas"], 1)
                spec = rjob["template"]["spec"]
                self.assertEqual(spec["completionMode"], "Indexed")
                self.assertEqual(spec["parallelism"], spec["completions"])
                self.assertEqual(spec["backoffLimit"], 0)
                pod_spec = spec["template"]["spec"]
                self.assertEqual(pod_spec["restartPolicy"], "Never")
                self.assertNotIn("hostNetwork", pod_spec)
                pods[name] = spec["completions"]
        self.assertEqual(pods, {"ps": 1, "worker": 2, "chief": 1})
        self.assertIs(self.js["spec"]["network"]["enableDNSHostnames"], True)

    def test_started_in_order(self):
        # The chief's Job is made once the workers run, theirs once the ps
        # does: pulling images does not count against --connect_timeout.
        self.assertNotIn("dependsOn", self.rjobs["ps"])
        self.assertEqual(
            self.rjobs["worker"]["dependsOn"],
            [{"name": "ps", "status": "Ready"}],
        )
        self.assertEqual(
            self.rjobs["chief"]["dependsOn"],
            [{"name": "worker", "status": "Ready"}],
        )
        self.assertNotIn("startupPolicy", self.js["spec"])  # exclusive

    def test_done_when_the_chief_is(self):
        self.assertEqual(
            self.js["spec"]["successPolicy"],
            {"operator": "All", "targetReplicatedJobs": ["chief"]},
        )
        self.assertEqual(self.js["spec"]["failurePolicy"], {"maxRestarts": 0})

    def test_containers(self):
        images = set()
        for name, rjob in self.rjobs.items():
            with self.subTest(replicated_job=name):
                container = _container(rjob)
                images.add(container["image"])
                self.assertEqual(container["command"], _COMMAND)
                self.assertEqual(
                    container["ports"],
                    [{"containerPort": jobset.DEFAULT_PORT}],
                )
                env = {e["name"]: e for e in container["env"]}
                self.assertNotIn("TF_CONFIG", env)
                self.assertNotIn(jobset.PORT, env)  # the default, 2222
                # TF2SYNC_JOBSET_REPLICAS: the completions of every role.
                self.assertEqual(
                    env[jobset.REPLICAS]["value"],
                    ",".join(
                        f"{n}={r['template']['spec']['completions']}"
                        for n, r in self.rjobs.items()
                    ),
                )
        self.assertLen(images, 1)
        flags = deploy_test._flag_values(_COMMAND)
        self.assertEqual(
            int(flags["total_num_replicas"]),
            self.rjobs["worker"]["template"]["spec"]["completions"],
        )

    def test_every_pod_gets_its_task(self):
        tasks = set()
        for rjob_name, pod_index, environ, _, fqdn in _pods(self.js):
            with self.subTest(pod=fqdn):
                self.assertTrue(jobset.is_jobset(environ))
                cluster, task_type, index = jobset.cluster_from_environ(environ)
                self.assertEqual(cluster, _HOSTS)
                self.assertEqual((task_type, index), (rjob_name, pod_index))
                # The pod's own task is its hostname, on the container port.
                self.assertEqual(cluster[task_type][index], f"{fqdn}:2222")
                # TensorFlow reads the equivalent TF_CONFIG the same way.
                self.assertEqual(
                    deploy_test._resolve(
                        {
                            "cluster": cluster,
                            "task": {"type": task_type, "index": index},
                        }
                    ),
                    (cluster, task_type, index),
                )
                tasks.add((task_type, index))
        self.assertEqual(
            tasks, {("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1)}
        )

    def test_network_policy_selects_every_pod(self):
        policy = self.policy
        self.assertEqual(policy["apiVersion"], "networking.k8s.io/v1")
        self.assertEqual(
            policy["metadata"]["namespace"], self.js["metadata"]["namespace"]
        )
        selector = {_NAME_LABEL: self.js["metadata"]["name"]}
        spec = policy["spec"]
        self.assertEqual(spec["podSelector"], {"matchLabels": selector})
        self.assertEqual(spec["policyTypes"], ["Ingress"])
        self.assertEqual(
            spec["ingress"],
            [
                {
                    "from": [{"podSelector": {"matchLabels": selector}}],
                    "ports": [
                        {"protocol": "TCP", "port": 2222},
                        {"protocol": "TCP", "port": 2300, "endPort": 2363},
                    ],
                }
            ],
        )
        # The tf.data service's ports, as the comment above the policy
        # says to set them: the dispatcher at --data_service_port, worker
        # i's at that + 1 + i (launch_flags), for this JobSet's workers.
        self.assertIn("--data_service_port=2300", deploy_test._read(_JOBSET))
        data = spec["ingress"][0]["ports"][1]
        workers = sum(1 for name, *_ in _pods(self.js) if name == "worker")
        self.assertGreaterEqual(workers, 1)
        for port in [2300] + [2301 + i for i in range(workers)]:
            self.assertLessEqual(data["port"], port)
            self.assertLessEqual(port, data["endPort"])
        for _, _, _, labels, fqdn in _pods(self.js):
            with self.subTest(pod=fqdn):
                self.assertLessEqual(selector.items(), labels.items())

    def test_security_note(self):
        text = deploy_test._read(_JOBSET)
        self.assertIn("SECURITY:", text)
        self.assertIn("without authentication", text)

    @absltest.skipIf(deploy_test.yaml is None, "PyYAML is not installed")
    def test_agrees_with_pyyaml(self):
        text = deploy_test._read(_JOBSET)
        self.assertEqual(
            deploy_test._load_yaml(text),
            list(deploy_test.yaml.safe_load_all(text)),
        )


def _environ(**changes):
    """The manifest's chief pod's environment, with `changes` (None: unset)."""
    environ = _chief_environ(_manifest()[0])
    for name, value in changes.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    return environ


class ClusterFromEnvironTest(parameterized.TestCase):
    def test_is_jobset(self):
        self.assertFalse(jobset.is_jobset({}))
        self.assertFalse(jobset.is_jobset({"JOB_COMPLETION_INDEX": "0"}))
        self.assertFalse(jobset.is_jobset({jobset.NAME: ""}))
        self.assertTrue(jobset.is_jobset({jobset.NAME: "x"}))
        self.assertTrue(jobset.is_jobset(_environ()))

    def test_subdomain_and_port(self):
        cluster, _, _ = jobset.cluster_from_environ(
            _environ(TF2SYNC_JOBSET_SUBDOMAIN="net", TF2SYNC_JOBSET_PORT="23")
        )
        self.assertEqual(
            cluster["worker"],
            [
                "tf2sync-digits-worker-0-0.net:23",
                "tf2sync-digits-worker-0-1.net:23",
            ],
        )

    def test_more_ps_and_workers(self):
        cluster, task_type, index = jobset.cluster_from_environ(
            _environ(
                TF2SYNC_JOBSET_REPLICAS="chief=1, ps=2, worker=3",
                TF2SYNC_JOBSET_REPLICATED_JOB="worker",
                JOB_COMPLETION_INDEX="2",
            )
        )
        self.assertEqual(
            {r: len(hosts) for r, hosts in cluster.items()},
            {"chief": 1, "ps": 2, "worker": 3},
        )
        self.assertEqual(
            cluster["ps"][1], "tf2sync-digits-ps-0-1.tf2sync-digits:2222"
        )
        self.assertEqual((task_type, index), ("worker", 2))

    def test_evaluator_is_in_no_cluster(self):
        cluster, task_type, index = jobset.cluster_from_environ(
            _environ(TF2SYNC_JOBSET_REPLICATED_JOB="evaluator")
        )
        self.assertEqual(cluster, _HOSTS)
        self.assertEqual((task_type, index), ("evaluator", 0))

    @parameterized.named_parameters(
        (
            "no_completion_index",
            {"JOB_COMPLETION_INDEX": None},
            "JOB_COMPLETION_INDEX is not set",
        ),
        (
            "index_past_replicas",
            {
                "TF2SYNC_JOBSET_REPLICATED_JOB": "worker",
                "JOB_COMPLETION_INDEX": "2",
            },
            "JOB_COMPLETION_INDEX='2': TF2SYNC_JOBSET_REPLICAS="
            "'ps=1,worker=2,chief=1' gives worker 2 pod(s), index 0 to 1",
        ),
        (
            "unknown_replicated_job",
            {"TF2SYNC_JOBSET_REPLICATED_JOB": "workers"},
            "TF2SYNC_JOBSET_REPLICATED_JOB='workers': a tf2sync replicated "
            "job is named after its role",
        ),
        (
            "bad_completion_index",
            {"JOB_COMPLETION_INDEX": "-1"},
            "JOB_COMPLETION_INDEX='-1': must be an integer >= 0",
        ),
        (
            "no_name",
            {"TF2SYNC_JOBSET_NAME": None},
            "TF2SYNC_JOBSET_NAME is not set",
        ),
        (
            "no_replicas",
            {"TF2SYNC_JOBSET_REPLICAS": None},
            "TF2SYNC_JOBSET_REPLICAS is not set",
        ),
        (
            "no_replicated_job",
            {"TF2SYNC_JOBSET_REPLICATED_JOB": None},
            "TF2SYNC_JOBSET_REPLICATED_JOB is not set",
        ),
        (
            "second_job",
            {"TF2SYNC_JOBSET_JOB_INDEX": "1"},
            "TF2SYNC_JOBSET_JOB_INDEX='1': replicated job 'chief' must have "
            "replicas: 1",
        ),
        (
            "replicas_syntax",
            {"TF2SYNC_JOBSET_REPLICAS": "ps:1,worker=2,chief=1"},
            "TF2SYNC_JOBSET_REPLICAS='ps:1,worker=2,chief=1': must be "
            "ROLE=PODS",
        ),
        (
            "replicas_zero",
            {"TF2SYNC_JOBSET_REPLICAS": "ps=1,worker=0,chief=1"},
            "worker: the pods must be an integer >= 1",
        ),
        (
            "replicas_missing_role",
            {"TF2SYNC_JOBSET_REPLICAS": "worker=2,chief=1"},
            "TF2SYNC_JOBSET_REPLICAS='worker=2,chief=1': names no ps",
        ),
        (
            "two_chiefs",
            {"TF2SYNC_JOBSET_REPLICAS": "ps=1,worker=2,chief=2"},
            "a cluster has one chief",
        ),
        (
            "bad_name",
            {"TF2SYNC_JOBSET_NAME": "Digits_1"},
            "TF2SYNC_JOBSET_NAME='Digits_1': must be a DNS label",
        ),
        (
            "bad_port",
            {"TF2SYNC_JOBSET_PORT": "70000"},
            "TF2SYNC_JOBSET_PORT='70000': must be a port",
        ),
        (
            "newline",
            {"TF2SYNC_JOBSET_REPLICATED_JOB": "ps\nworker"},
            "TF2SYNC_JOBSET_REPLICATED_JOB='ps\\nworker'",
        ),
    )
    def test_bad_environment(self, changes, message):
        with self.assertRaises(ValueError) as raised:
            jobset.cluster_from_environ(_environ(**changes))
        text = str(raised.exception)
        self.assertIn(message, text)
        self.assertNotIn("\n", text)


# Runs the launcher as `python -m tf2sync` would, with every name of the
# JobSet's subdomain resolved to 127.0.0.1 and any other name refused (no
# DNS query leaves the machine).
_LAUNCH = """
import socket
import sys

_getaddrinfo = socket.getaddrinfo


def _local_only(host, *args, **kwargs):
    if isinstance(host, bytes):
        host = host.decode()
    if host and host.endswith(".tf2sync-digits"):
        host = "127.0.0.1"
    elif host not in (None, "", "127.0.0.1", "localhost", "::1"):
        raise socket.gaierror(socket.EAI_NONAME, f"not resolved here: {host}")
    return _getaddrinfo(host, *args, **kwargs)


socket.getaddrinfo = _local_only
sys.argv[0] = "tf2sync"
from tf2sync._src.launcher import launch

launch.run()
"""


# Prints `launch_input.cluster_source()` (or its usage error) for each case of
# argv[1], a JSON list of [flags, environment]: flags parsed, nothing run.
_SOURCES = """
import json
import os
import sys

from absl import app
from absl import flags

from tf2sync._src.launcher import input as launch_input

base = dict(os.environ)
for args, environ in json.loads(sys.argv[1]):
    os.environ.clear()
    os.environ.update(base, **environ)
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["tf2sync", *args])
    try:
        print(launch_input.cluster_source())
    except app.UsageError as e:
        print(f"usage error {e.exitcode}: {e}")
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args, environ, timeout=120):
    """Runs the launcher with `environ` (plus PATH etc.); (code, stderr)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "TF_CONFIG" and not k.startswith(jobset.PREFIX)
    }
    env.update(environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    process = subprocess.Popen(
        [sys.executable, "-c", _LAUNCH, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **processes.child_kwargs(env),
    )
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()  # by PID: the one process started here
        _, stderr = process.communicate()
        raise AssertionError(
            f"the launcher ran past {timeout} s: {stderr}"
        ) from None
    return process.returncode, stderr


class LauncherTest(absltest.TestCase):
    def test_cluster_from(self):
        """--cluster_from=auto: role flags > TF_CONFIG > JobSet > local."""
        tf_config = {"TF_CONFIG": '{"cluster": {}}'}
        pod = _environ()
        cases = [
            ([], {}, "local"),
            ([], pod, "jobset"),
            ([], {**pod, **tf_config}, "tf_config"),
            (["--job_name=ps"], {**pod, **tf_config}, "flags"),
            (["--cluster_from=jobset"], {**pod, **tf_config}, "jobset"),
            (["--cluster_from=local"], {**pod, **tf_config}, "local"),
            (["--cluster_from=tf_config"], tf_config, "tf_config"),
            (["--cluster_from=flags", "--job_name=worker"], pod, "flags"),
            (
                ["--cluster_from=flags"],
                {},
                "usage error 2: --cluster_from=flags needs --job_name (and "
                "the host flags).",
            ),
            (
                ["--cluster_from=jobset", "--job_name=ps"],
                pod,
                "usage error 2: --job_name=ps conflicts with "
                "--cluster_from=jobset: role flags are --cluster_from=flags "
                "(or auto).",
            ),
            (
                ["--cluster_from=tf_config"],
                pod,
                "usage error 2: --cluster_from=tf_config but TF_CONFIG is "
                "not set.",
            ),
        ]
        env = {
            k: v
            for k, v in os.environ.items()
            if k != "TF_CONFIG" and not k.startswith(jobset.PREFIX)
        }
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                _SOURCES,
                json.dumps([[args, environ] for args, environ, _ in cases]),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            **processes.child_kwargs(env),
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(
            out.stdout.splitlines(), [want for _, _, want in cases]
        )

    def test_detects_a_jobset_chief(self):
        """No --job_name, no TF_CONFIG: the chief of the JobSet's cluster."""
        port = _free_port()
        code, stderr = _launch(
            ["--replicas_to_aggregate=2", "--connect_timeout=1"],
            _environ(TF2SYNC_JOBSET_PORT=str(port)),
        )
        self.assertEqual(code, 1, stderr)
        # The chief waits for the first ps of the derived cluster.
        self.assertIn(
            "tf2sync: TimeoutError: No task answered at "
            f"tf2sync-digits-ps-0-0.tf2sync-digits:{port} within 1 s",
            stderr,
        )

    def test_bad_environment_is_a_usage_error(self):
        code, stderr = _launch(
            ["--cluster_from=jobset"], _environ(JOB_COMPLETION_INDEX=None)
        )
        self.assertEqual(code, 2, stderr)
        # absl's usage hint, then the error on one line (a cluster role
        # keeps TensorFlow's C++ start-up lines on its stderr: left out).
        lines = [
            line
            for line in stderr.splitlines()
            if line.strip() and not re.search(r"\.cc:\d+\]|InitializeLog", line)
        ]
        self.assertEqual(lines[0].strip(), "USAGE: tf2sync [flags]", stderr)
        self.assertLen(lines, 2, stderr)
        self.assertStartsWith(lines[1], "JOB_COMPLETION_INDEX is not set:")


if __name__ == "__main__":
    absltest.main()
