"""The fault table: runs `benchmarks/chaos.py`, which replaced this script.

Each fault is injected at a random time inside an epoch; see chaos.py for
the faults, the flags and the table's columns.

  python tests/fault_table.py --repeats=2 [--output=docs/faults.md]
"""

import os
import runpy
import sys

if __name__ == "__main__":
    chaos = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "benchmarks",
        "chaos.py",
    )
    sys.argv[0] = chaos
    runpy.run_path(chaos, run_name="__main__")
