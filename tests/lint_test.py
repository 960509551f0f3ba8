"""Repository hygiene: ruff clean, BUILD names every module and its deps."""

import glob
import os
import re
import shutil
import subprocess
import sys

from absl.testing import absltest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The one module of tf2sync that may use private TensorFlow / tf_keras API.
_TF_INTERNALS = "tf2sync/_src/tf_internals.py"

# An import of a private TF / tf_keras path: `from tensorflow.python...`,
# `import tensorflow.python... [as ...]`, `from tensorflow import python`,
# and the same through `__import__(...)` or `importlib.import_module(...)`.
_PRIVATE_IMPORT = re.compile(
    r"^[ \t]*(from|import) (tensorflow\.python|tf_keras\.src)\b"
    r"|^[ \t]*from (tensorflow|tf_keras) import [^#\n]*\b(python|src)\b"
    r"|(__import__|import_module)\(\s*[\"'](tensorflow\.python|tf_keras\.src)",
    re.M,
)


def private_imports(text):
    """The line numbers of `text` that import a private TF/tf_keras path."""
    return [
        text.count("\n", 0, m.start()) + 1
        for m in _PRIVATE_IMPORT.finditer(text)
    ]


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

    def test_only_tf_internals_imports_private_tf_paths(self):
        found = {}
        for path in glob.glob(
            os.path.join(_ROOT, "tf2sync/**/*.py"), recursive=True
        ):
            name = os.path.relpath(path, _ROOT).replace(os.sep, "/")
            if name == _TF_INTERNALS:
                continue
            with open(path) as f:
                lines = private_imports(f.read())
            if lines:
                found[name] = lines
        self.assertEqual(
            found,
            {},
            "These modules import private TensorFlow / tf_keras paths "
            "(tensorflow.python, tf_keras.src): add a function to "
            f"{_TF_INTERNALS} and call it instead (file: line numbers).",
        )

    def test_private_import_pattern(self):
        for line in (
            "from tensorflow.python.ops import resource_variable_ops",
            "import tensorflow.python as tfp",
            "    from tf_keras.src.engine import training",
            "import tf_keras.src.engine.training",
            "from tensorflow import python as tf_python",
            'ops = importlib.import_module("tensorflow.python.ops")',
            "x = __import__('tf_keras.src.engine')",
        ):
            self.assertEqual(private_imports(line), [1], line)
        for line in (
            "import tensorflow as tf",
            "import tf_keras",
            "from tf2sync import SyncOptions",
            "# from tensorflow.python import x, in a comment",
            "from tensorflow import keras  # the python API",
        ):
            self.assertEqual(private_imports(line), [], line)

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
