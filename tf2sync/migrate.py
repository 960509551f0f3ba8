"""`python -m tf2sync.migrate PROGRAM.py ...`: what a TF1 program needs.

Lists the distributed-TF1 constructs of each program (servers, cluster
specs and flags, `replica_device_setter`, `SyncReplicasOptimizer` and its
chief calls, sessions and their training loops, chief branches, the
global step) with their TF2 / tf2sync forms; see `docs/migrating.md`.
The programs are parsed, never imported or run.
"""

import sys

from tf2sync._src.migrate import cli

if __name__ == "__main__":
    sys.exit(cli.main())
