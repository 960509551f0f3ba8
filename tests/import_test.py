"""`import tf2sync` is quiet: it patches nothing, moves no log, prints nothing.

Importing tf2sync sets `TF_USE_LEGACY_KERAS` and loads TensorFlow; the
runtime patches of `internals.patches` wait for the first
`SyncParameterServerStrategy`, and the launcher's console set-up
(`launcher.console.setup_launcher`) is for the launcher's process only.
Each check runs in a fresh interpreter: the suite's process has long
imported tf2sync and made strategies.
"""

import json
import os
import re
import subprocess
import sys

from absl.testing import absltest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# TensorFlow's C++ runtime writes to descriptor 2 as it loads, before and
# outside Python (glog lines such as `I0000 00:00:...`), and the CPU
# feature guard's second line: not tf2sync's.
_NATIVE_LINE = re.compile(
    r"^([IWEF]\d{4} |WARNING: All log messages before absl::InitializeLog"
    r"|To enable the following instructions:)"
)

_IMPORT = """
import json, logging, os, sys
fd2 = os.fstat(2)
import tf2sync
from absl import logging as absl_logging
from tf2sync._src.internals import patch_kinds, patches
from tf2sync._src.launcher import console

streams = [absl_logging.get_absl_handler().python_handler.stream]
for logger in [logging.getLogger()] + list(
    logging.root.manager.loggerDict.values()
):
    for handler in getattr(logger, "handlers", []):
        streams.append(getattr(handler, "stream", None))
now = os.fstat(2)
print(json.dumps({
    "installed": sorted(
        name for name, patch in patches.REGISTRY.items()
        if isinstance(patch, patch_kinds.GlobalPatch) and patch.is_installed()
    ),
    "stdio": sys.stdout is sys.__stdout__ and sys.stderr is sys.__stderr__,
    "handlers": all(
        s in (None, sys.__stderr__, sys.__stdout__) for s in streams
    ),
    "fd2": (now.st_dev, now.st_ino) == (fd2.st_dev, fd2.st_ino),
    "log_dir": console.launcher_log_dir(),
    "legacy_keras": os.environ.get("TF_USE_LEGACY_KERAS"),
}))
"""

_STRATEGY = """
import json
import tf2sync
from tf2sync._src.internals import patches

resolver = tf2sync.testing.local_cluster(num_workers=1, num_ps=1)
tf2sync.SyncParameterServerStrategy(resolver, replicas_to_aggregate=1)
print(json.dumps([
    patches.autograph_skips_tf2sync.is_installed(),
    patches.loss_scaling_predicate.is_installed(),
]))
"""


def _fresh(code):
    """`(stdout, stderr)` of `code` in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=_ROOT)
    env.pop("TF_USE_LEGACY_KERAS", None)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=_ROOT,
        env=env,
    )
    if out.returncode:
        raise AssertionError(out.stderr[-3000:])
    return out.stdout, out.stderr


class QuietImportTest(absltest.TestCase):
    def test_import_patches_nothing_moves_no_log_prints_nothing(self):
        stdout, stderr = _fresh(_IMPORT)
        lines = stdout.splitlines()
        self.assertLen(lines, 1, stdout)  # the report alone
        report = json.loads(lines[0])
        self.assertEqual(report["installed"], [])
        self.assertTrue(report["stdio"], "sys.stdout / sys.stderr replaced")
        self.assertTrue(report["handlers"], "a log handler was redirected")
        self.assertTrue(report["fd2"], "descriptor 2 was moved")
        self.assertIsNone(report["log_dir"])
        self.assertEqual(report["legacy_keras"], "1")
        ours = [
            line
            for line in stderr.splitlines()
            if line.strip() and not _NATIVE_LINE.match(line)
        ]
        self.assertEqual(ours, [], stderr)

    def test_a_strategy_installs_the_patches_import_used_to(self):
        stdout, _ = _fresh(_STRATEGY)
        self.assertEqual(json.loads(stdout.splitlines()[-1]), [True, True])


if __name__ == "__main__":
    absltest.main()
