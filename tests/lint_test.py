"""Repository hygiene: ruff clean, BUILD names every module and its deps."""

import glob
import os
import re
import shutil
import subprocess
import sys

from absl.testing import absltest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff():
    found = shutil.which("ruff", path=os.path.dirname(sys.executable))
    return found or shutil.which("ruff")


class LintTest(absltest.TestCase):
    def _run(self, *args):
        ruff = _ruff()
        if ruff is None:
            self.fail("ruff is not installed: pip install -e '.[test]'")
        return subprocess.run(
            [ruff, *args], cwd=_ROOT, capture_output=True, text=True
        )

    def test_ruff_format(self):
        out = self._run("format", "--check", ".")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)

    def test_ruff_check(self):
        out = self._run("check", ".")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)

    def test_build_names_every_python_file(self):
        with open(os.path.join(_ROOT, "BUILD")) as f:
            build = f.read()
        named = set(re.findall(r'"([\w/]+\.py)"', build))
        files = [
            os.path.relpath(p, _ROOT)
            for pattern in (
                "tf2sync/**/*.py",
                "tests/*.py",
                "benchmarks/*.py",
                "examples/*.py",
            )
            for p in glob.glob(os.path.join(_ROOT, pattern), recursive=True)
        ]
        missing = sorted(
            f for f in files if f not in named and not f.endswith("conftest.py")
        )
        self.assertEqual(missing, [], "BUILD does not name these files")

    def test_build_targets_depend_on_what_they_import(self):
        # Each target lists the targets of the tf2sync modules its files
        # import (`from tf2sync._src import x`), so Bazel builds them.
        with open(os.path.join(_ROOT, "BUILD")) as f:
            build = f.read()
        targets = {}
        for match in re.finditer(
            r'py_(?:library|test|binary)\(\s*name = "([^"]+)",(.*?)\n\)',
            build,
            re.S,
        ):
            name, body = match.groups()
            head, _, deps = body.partition("deps")
            targets[name] = (
                re.findall(r'"([\w/]+\.py)"', head),
                set(re.findall(r'":([^"]+)"', deps)),
            )
        owner = {}
        for name, (srcs, _) in targets.items():
            for src in srcs:
                owner.setdefault(src, name)
        missing = {}
        for name, (srcs, deps) in targets.items():
            for src in srcs:
                with open(os.path.join(_ROOT, src)) as f:
                    text = f.read()
                for module in re.findall(
                    r"from tf2sync\._src import (\w+)", text
                ):
                    target = owner.get(f"tf2sync/_src/{module}.py")
                    if target not in (None, name) and target not in deps:
                        missing.setdefault(name, set()).add(target)
        self.assertEqual(missing, {}, "BUILD targets missing these deps")


if __name__ == "__main__":
    absltest.main()
