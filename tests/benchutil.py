"""Loading the harness's modules (benchmarks/) in tests, by path."""

import importlib.util
import os
import sys
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


def load(name):
    """benchmarks/<name>.py as a module, its siblings importable while it
    loads (benchmarks/ is not a package: the harness runs its scripts)."""
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(BENCHMARKS, f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    with mock.patch.object(sys, "path", [BENCHMARKS, *sys.path]):
        spec.loader.exec_module(module)
    return module
