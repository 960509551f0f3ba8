"""A JobSet pod's cluster and role: what TF_CONFIG would say, from its env.

Kubernetes JobSet (`jobset.x-k8s.io/v1alpha2`, kubernetes-sigs/jobset) and
Indexed Jobs set no `TF_CONFIG`. In the layout of
`examples/deploy/jobset.yaml` each tf2sync role (chief, ps, worker) is one
replicated job of `replicas: 1`, an Indexed Job whose pods are the role's
tasks (`parallelism` = `completions` = the role's number of tasks), and
JobSet's `spec.network.enableDNSHostnames` gives every pod the hostname

    <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>

(`subdomain` defaults to the JobSet's name). The manifest passes a pod what
the downward API can tell it; this module turns that into the cluster.

Environment:

* `TF2SYNC_JOBSET_NAME`: the JobSet's name (the pod annotation
  `jobset.sigs.k8s.io/jobset-name`).
* `TF2SYNC_JOBSET_REPLICATED_JOB`: the pod's replicated job
  (`jobset.sigs.k8s.io/replicatedjob-name`), named after its role: chief,
  ps, worker (or evaluator, which is in no cluster).
* `TF2SYNC_JOBSET_JOB_INDEX`: the index of the pod's Job in its replicated
  job (`jobset.sigs.k8s.io/job-index`); must be 0 (one Job per role).
* `JOB_COMPLETION_INDEX`: the pod's index in its Indexed Job, set by
  Kubernetes: the task index.
* `TF2SYNC_JOBSET_REPLICAS`: the pods of every role,
  `ps=1,worker=2,chief=1` (the downward API cannot read a Job's
  `parallelism`): chief=1, ps and worker at least 1.
* `TF2SYNC_JOBSET_SUBDOMAIN` (optional): `spec.network.subdomain`, if the
  JobSet sets one (default: the JobSet's name).
* `TF2SYNC_JOBSET_PORT` (optional): every task's port (default 2222).

Nothing here imports TensorFlow.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

PREFIX = "TF2SYNC_JOBSET_"
NAME = PREFIX + "NAME"
REPLICATED_JOB = PREFIX + "REPLICATED_JOB"
JOB_INDEX = PREFIX + "JOB_INDEX"
REPLICAS = PREFIX + "REPLICAS"
SUBDOMAIN = PREFIX + "SUBDOMAIN"
PORT = PREFIX + "PORT"
COMPLETION_INDEX = "JOB_COMPLETION_INDEX"
DEFAULT_PORT = 2222

_CLUSTER_ROLES = ("chief", "ps", "worker")
_ROLES = (*_CLUSTER_ROLES, "evaluator")
# An RFC 1123 label, as Kubernetes names of JobSets and Services are.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class JobSetTask(NamedTuple):
    """A pod's cluster and role, as `TF_CONFIG` would give them."""

    cluster: dict[str, list[str]]
    task_type: str
    task_index: int


def is_jobset(environ: Mapping[str, str]) -> bool:
    """Whether `environ` is a JobSet pod's: any `TF2SYNC_JOBSET_*` set.

    `JOB_COMPLETION_INDEX` alone is not enough (every Indexed Job's pod
    has it). A pod with only some of the variables counts, so that
    `cluster_from_environ` names the missing one rather than the launcher
    falling back to a local cluster.

    Args:
        environ: the environment (`os.environ`).

    Returns:
        True if some `TF2SYNC_JOBSET_*` variable is set and not empty.
    """
    return any(k.startswith(PREFIX) and v for k, v in environ.items())


def cluster_from_environ(environ: Mapping[str, str]) -> JobSetTask:
    """The cluster and this pod's role, from a JobSet pod's environment.

    Task `i` of role `r` is `<name>-<r>-0-<i>.<subdomain>:<port>`, the
    hostname JobSet gives pod `i` of the first Job of replicated job `r`.

    Args:
        environ: the environment (`os.environ`), with the variables of the
            module docstring.

    Returns:
        `JobSetTask(cluster, task_type, task_index)`: cluster is
        `{"chief": [...], "ps": [...], "worker": [...]}`.

    Raises:
        ValueError: a variable is missing or bad; the one-line message
            names it and its value.
    """
    name = _label(environ, NAME, _required(environ, NAME))
    subdomain = _label(environ, SUBDOMAIN, environ.get(SUBDOMAIN) or name)
    port = _int(environ, PORT, environ.get(PORT) or str(DEFAULT_PORT))
    if not 0 < port < 65536:
        _bad(PORT, environ[PORT], "must be a port, 1 to 65535")
    replicas = _replicas(_required(environ, REPLICAS))
    role = _required(environ, REPLICATED_JOB)
    if role not in _ROLES:
        _bad(
            REPLICATED_JOB,
            role,
            "a tf2sync replicated job is named after its role: "
            f"{', '.join(_ROLES)}",
        )
    job_index = _int(environ, JOB_INDEX, _required(environ, JOB_INDEX))
    if job_index != 0:
        _bad(
            JOB_INDEX,
            environ[JOB_INDEX],
            f"replicated job {role!r} must have replicas: 1 (tf2sync wants "
            "one Job per role; give the Job more pods with parallelism and "
            "completions, and TF2SYNC_JOBSET_REPLICAS)",
        )
    if COMPLETION_INDEX not in environ:
        raise ValueError(
            f"{COMPLETION_INDEX} is not set: Kubernetes sets it in the pods "
            "of an Indexed Job (completionMode: Indexed, JobSet's default)."
        )
    index = _int(environ, COMPLETION_INDEX, environ[COMPLETION_INDEX])
    if role in replicas and index >= replicas[role]:
        _bad(
            COMPLETION_INDEX,
            environ[COMPLETION_INDEX],
            f"{REPLICAS}={environ[REPLICAS]!r} gives {role} "
            f"{replicas[role]} pod(s), index 0 to {replicas[role] - 1}",
        )
    cluster = {
        r: [f"{name}-{r}-0-{i}.{subdomain}:{port}" for i in range(replicas[r])]
        for r in _CLUSTER_ROLES
    }
    return JobSetTask(cluster, role, index)


def _bad(variable: str, value: str, why: str):
    raise ValueError(f"{variable}={value!r}: {why}.")


def _required(environ: Mapping[str, str], variable: str) -> str:
    value = environ.get(variable)
    if not value:
        raise ValueError(
            f"{variable} is not set (a JobSet pod needs it; see "
            "examples/deploy/jobset.yaml)."
        )
    return value


def _int(environ: Mapping[str, str], variable: str, text: str) -> int:
    if not re.fullmatch(r"[0-9]+", text.strip()):
        _bad(variable, environ.get(variable, text), "must be an integer >= 0")
    return int(text)


def _label(environ: Mapping[str, str], variable: str, text: str) -> str:
    if len(text) > 63 or not _DNS_LABEL.fullmatch(text):
        _bad(
            variable,
            environ.get(variable, text),
            "must be a DNS label (lower-case letters, digits and '-')",
        )
    return text


def _replicas(text: str) -> dict[str, int]:
    """`ps=1,worker=2,chief=1` as {"ps": 1, "worker": 2, "chief": 1}."""
    out = {}
    for part in text.split(","):
        role, sep, count = part.strip().partition("=")
        role, count = role.strip(), count.strip()
        if not sep or role not in _CLUSTER_ROLES or role in out:
            _bad(
                REPLICAS,
                text,
                "must be ROLE=PODS for each of chief, ps and worker, once "
                "each, e.g. ps=1,worker=2,chief=1",
            )
        if not re.fullmatch(r"[0-9]+", count) or int(count) < 1:
            _bad(REPLICAS, text, f"{role}: the pods must be an integer >= 1")
        out[role] = int(count)
    missing = [r for r in _CLUSTER_ROLES if r not in out]
    if missing:
        _bad(REPLICAS, text, f"names no {', '.join(missing)}")
    if out["chief"] != 1:
        _bad(REPLICAS, text, "a cluster has one chief (chief=1)")
    return out
