"""Prints the TF_CONFIG of this Slurm task, for `tf2sync` with no role flags.

Role layout, by task rank (SLURM_PROCID): 0 is the chief, 1..NUM_PS are the
parameter servers, the rest are workers. Task i runs on the i-th host.

Hosts, first found:

* `--hosts=h0,h1,...` or `TF2SYNC_HOSTS` (explicit, e.g. for a local test);
* `SLURM_JOB_NODELIST`, expanded with `scontrol show hostnames` (a list with
  no `[...]` ranges is split on commas without scontrol).

Run one task per node (`--ntasks-per-node=1`): every task then listens on
`--port`. A host named k times in an explicit list gets ports port..port+k-1,
so `--hosts=127.0.0.1,127.0.0.1,...` gives a one-machine cluster.

TF's gRPC servers accept any connection without authentication: the hosts
must be on the cluster's private network, never public addresses.

Usage (inside `srun`): export TF_CONFIG="$(python3 slurm_tf_config.py)"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def _env_int(name, default):
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def expand_nodelist(nodelist):
    """Hostnames of a Slurm node list (`scontrol` only for `[...]` ranges)."""
    if "[" not in nodelist:
        return [h.strip() for h in nodelist.split(",") if h.strip()]
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


def tf_config(hosts, procid, num_ps=1, port=2222):
    """The TF_CONFIG dict of task `procid` in a chief + ps + workers cluster."""
    if num_ps < 1:
        raise ValueError(f"num_ps must be >= 1. Received: {num_ps}")
    if len(hosts) < num_ps + 2:
        raise ValueError(
            f"{len(hosts)} host(s) cannot hold a chief, {num_ps} ps and at "
            f"least one worker. Received hosts: {','.join(hosts)}"
        )
    if not 0 <= procid < len(hosts):
        raise ValueError(
            f"procid {procid} is out of range for {len(hosts)} host(s)."
        )
    seen = {}
    addresses = []
    for host in hosts:
        addresses.append(f"{host}:{port + seen.get(host, 0)}")
        seen[host] = seen.get(host, 0) + 1
    cluster = {
        "chief": addresses[:1],
        "ps": addresses[1 : 1 + num_ps],
        "worker": addresses[1 + num_ps :],
    }
    if procid == 0:
        task = {"type": "chief", "index": 0}
    elif procid <= num_ps:
        task = {"type": "ps", "index": procid - 1}
    else:
        task = {"type": "worker", "index": procid - 1 - num_ps}
    return {"cluster": cluster, "task": task}


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--hosts",
        default=os.environ.get("TF2SYNC_HOSTS"),
        help="h0,h1,...: one host per task (default: $TF2SYNC_HOSTS, else "
        "$SLURM_JOB_NODELIST).",
    )
    parser.add_argument(
        "--procid",
        type=int,
        default=_env_int("SLURM_PROCID", None),
        help="This task's rank (default: $SLURM_PROCID).",
    )
    parser.add_argument(
        "--num_ps",
        type=int,
        default=_env_int("TF2SYNC_NUM_PS", 1),
        help="Parameter servers (default: $TF2SYNC_NUM_PS, else 1).",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=_env_int("TF2SYNC_PORT", 2222),
        help="gRPC port of every task (default: $TF2SYNC_PORT, else 2222).",
    )
    parser.add_argument(
        "--ntasks",
        type=int,
        default=_env_int("SLURM_NTASKS", None),
        help="Tasks in the step, checked against the hosts "
        "(default: $SLURM_NTASKS).",
    )
    return parser.parse_args(argv)


def main(argv=None):
    args = _parse_args(argv)
    if args.hosts:
        hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    elif os.environ.get("SLURM_JOB_NODELIST"):
        hosts = expand_nodelist(os.environ["SLURM_JOB_NODELIST"])
    else:
        sys.exit("No hosts: pass --hosts, set TF2SYNC_HOSTS or run in Slurm.")
    if args.procid is None:
        sys.exit("No task rank: pass --procid or run under srun.")
    if args.ntasks is not None and args.ntasks != len(hosts):
        sys.exit(
            f"{args.ntasks} tasks but {len(hosts)} hosts "
            f"({','.join(hosts)}): run one task per node "
            "(--ntasks-per-node=1) or pass one host per task in --hosts."
        )
    try:
        config = tf_config(hosts, args.procid, args.num_ps, args.port)
    except ValueError as e:
        sys.exit(str(e))
    print(json.dumps(config))


if __name__ == "__main__":
    main()
