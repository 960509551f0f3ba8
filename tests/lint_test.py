"""Repository hygiene: ruff clean, BUILD names every module and its deps."""

import ast
import glob
import os
import re
import shutil
import subprocess
import sys

from absl.testing import absltest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The one package of tf2sync whose modules may use private TensorFlow /
# tf_keras API.
_INTERNALS = "tf2sync/_src/internals/"

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


def _read(name):
    with open(os.path.join(_ROOT, name)) as f:
        return f.read()


def _pypi_name(requirement):
    """The normalized (PEP 503) project name of a requirement string."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


def _locked_names():
    """The normalized names that requirements_lock.txt pins (`name==`)."""
    return {
        _pypi_name(name)
        for name in re.findall(
            r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==",
            _read("requirements_lock.txt"),
            re.M,
        )
    }


def tf2sync_imports(root):
    """{module: modules of tf2sync it imports}, at any depth of the file
    (imports inside functions too: they hide a cycle, not break it). The
    package root (`tf2sync`) is left out: every module is inside it."""
    paths = {}
    for path in glob.glob(
        os.path.join(root, "tf2sync", "**", "*.py"), recursive=True
    ):
        name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
        paths[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in paths.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in paths else node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {
            m for m in found if m in paths and m not in (name, "tf2sync")
        }
    return graph


def import_cycle(graph):
    """One cycle of `graph` as a list of modules, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


# The modules that may patch TensorFlow / tf_keras: the registry and the
# kinds of patch it installs.
_PATCHES = (
    "tf2sync/_src/internals/patches.py",
    "tf2sync/_src/internals/patch_kinds.py",
)

# tf_keras's slots for the functions a model makes (`make_train_function`
# sets `train_function`): data, set by tf2sync's train function maker as by
# tf_keras's, not methods replaced.
_FUNCTION_SLOTS = frozenset(
    ("train_function", "train_tf_function", "test_function", "predict_function")
)


def _tf_names(tree):
    """The names a module binds to TensorFlow / tf_keras modules (or to
    what it imports from them)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("tensorflow", "tf_keras"):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in ("tensorflow", "tf_keras"):
                names.update(a.asname or a.name for a in node.names)
    return names


def _root(node):
    """The name an attribute chain (`a.b.c`) starts from, or None."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def patch_sites(text):
    """`[(line, source)]`: where `text` (a module) replaces something of
    TensorFlow or tf_keras at run time: an attribute of a TF / tf_keras
    module or class set or deleted (`tf.x = ...`, `setattr(tf.x, ...)`),
    an object's class swapped (`x.__class__ = ...`), or a method of one
    object replaced by a function (`x.method = lambda ...`, or a function
    defined in the module, or what a function of the module that returns
    one of its nested functions returns) or deleted (`del x.method`).
    `self`'s and `cls`'s attributes, tf2sync's own marks (`_tf2sync_*`)
    and tf_keras's `_FUNCTION_SLOTS` are left out."""
    tree = ast.parse(text)
    tf_names = _tf_names(tree)
    defs = {}  # function name -> the names of the functions nested in it
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs[node.name] = {
                n.name
                for n in node.body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            }

    def makes_function(value):
        if isinstance(value, ast.Lambda):
            return True
        if isinstance(value, ast.Name):
            return value.id in defs
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            return bool(defs.get(value.func.id))  # a factory of functions
        return False

    def ours(target):
        return (
            _root(target.value) in ("self", "cls")
            or target.attr.startswith("_tf2sync")
            or target.attr in _FUNCTION_SLOTS
        )

    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = getattr(node, "targets", None) or [node.target]
            for target in targets:
                if not isinstance(target, ast.Attribute):
                    continue
                if _root(target) in tf_names or target.attr == "__class__":
                    found.append(node)
                elif ours(target):
                    continue
                elif isinstance(node, ast.Delete) or makes_function(node.value):
                    found.append(node)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
            and _root(node.args[0]) in tf_names
        ):
            found.append(node)
    return sorted({(n.lineno, ast.unparse(n)) for n in found})


def patch_sites_outside_patches(root):
    """`{file: [(line, source)]}`: `patch_sites` of tf2sync's modules other
    than `_PATCHES`."""
    found = {}
    for path in glob.glob(
        os.path.join(root, "tf2sync/**/*.py"), recursive=True
    ):
        name = os.path.relpath(path, root).replace(os.sep, "/")
        if name in _PATCHES:
            continue
        with open(path) as f:
            sites = patch_sites(f.read())
        if sites:
            found[name] = sites
    return found


class LintTest(absltest.TestCase):
    def _run(self, *args):
        ruff = _ruff()
        if ruff is None:
            self.fail("ruff is not installed: pip install -e '.[test]'")
        return subprocess.run(
            [ruff, *args], cwd=_ROOT, capture_output=True, text=True
        )

    def test_no_import_cycle_in_tf2sync(self):
        # Function-level imports count: they only hide a cycle. Parsed in a
        # fresh interpreter: in the suite's process Python 3.11.7's
        # `ast.parse` failed ("AST constructor recursion depth mismatch")
        # after the TensorFlow tests.
        code = (
            "import sys; sys.path.insert(0, sys.argv[1]); import lint_test; "
            "print(lint_test.import_cycle(lint_test.tf2sync_imports(sys.argv[2])))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, os.path.dirname(__file__), _ROOT],
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertEqual(out.returncode, 0, out.stderr[-2000:])
        self.assertEqual(out.stdout.strip(), "None")

    def _fresh(self, code):
        """What `code` prints, run with this module in a fresh interpreter
        (see `test_no_import_cycle_in_tf2sync`)."""
        out = subprocess.run(
            [sys.executable, "-c", code, os.path.dirname(__file__), _ROOT],
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertEqual(out.returncode, 0, out.stderr[-2000:])
        return out.stdout.strip()

    def test_only_the_patches_module_patches_tf(self):
        # Every runtime patch of TensorFlow / tf_keras goes through the
        # registry of tf2sync/_src/internals/patches.py (tests/patches_test.py
        # checks each one's install and uninstall).
        found = self._fresh(
            "import sys; sys.path.insert(0, sys.argv[1]); import lint_test; "
            "print(lint_test.patch_sites_outside_patches(sys.argv[2]))"
        )
        self.assertEqual(
            found,
            "{}",
            "These modules patch TensorFlow / tf_keras at run time (file: "
            "[(line, code)]): add the patch to "
            f"{_PATCHES[0]}'s REGISTRY and install it from there.",
        )

    def test_the_patch_finder_finds_patches(self):
        code = (
            "from tf_keras.src.engine import base_layer\n"
            "import tensorflow as tf\n"
            "def hooked(x):\n"
            "    pass\n"
            "def factory(model):\n"
            "    def made():\n"
            "        pass\n"
            "    return made\n"
            "base_layer.Layer.save_own_variables = hooked\n"
            "setattr(tf.keras.Model, 'fit', hooked)\n"
            "var.__class__ = Other\n"
            "worker._process_closure = lambda closure: None\n"
            "queue.mark_failed = hooked\n"
            "model.make_train_function = factory(model)\n"
            "del model.make_train_function\n"
            "self.fn = lambda: None\n"
            "worker._tf2sync_lock = lock\n"
            "var._cache = None\n"
            "model.train_function = factory\n"
        )
        found = self._fresh(
            "import sys; sys.path.insert(0, sys.argv[1]); import lint_test; "
            f"print([n for n, _ in lint_test.patch_sites({code!r})])"
        )
        self.assertEqual(found, str(list(range(9, 16))))

    def test_the_cycle_finder_finds_a_cycle(self):
        graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
        self.assertEqual(import_cycle(graph), ["a", "b", "c", "a"])
        self.assertIsNone(import_cycle({"a": {"b"}, "b": set()}))

    def test_ruff_format(self):
        out = self._run("format", "--check", ".")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)

    def test_ruff_check(self):
        out = self._run("check", ".")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)

    def test_only_internals_import_private_tf_paths(self):
        found = {}
        for path in glob.glob(
            os.path.join(_ROOT, "tf2sync/**/*.py"), recursive=True
        ):
            name = os.path.relpath(path, _ROOT).replace(os.sep, "/")
            if name.startswith(_INTERNALS):
                continue
            with open(path) as f:
                lines = private_imports(f.read())
            if lines:
                found[name] = lines
        self.assertEqual(
            found,
            {},
            "These modules import private TensorFlow / tf_keras paths "
            "(tensorflow.python, tf_keras.src): add a function to a module of "
            f"{_INTERNALS} and call it instead (file: line numbers).",
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
        # import (`from tf2sync._src import x`, `from tf2sync._src.launcher
        # import x`), so Bazel builds them.
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
                for package, module in re.findall(
                    r"^[ \t]*from tf2sync\._src(\.internals|\.launcher)? "
                    r"import (\w+)",
                    text,
                    re.M,
                ):
                    where = "tf2sync/_src" + package.replace(".", "/")
                    target = owner.get(
                        f"{where}/{module}.py",
                        owner.get(f"{where}/{module}/__init__.py"),
                    )
                    if target not in (None, name) and target not in deps:
                        missing.setdefault(name, set()).add(target)
        self.assertEqual(missing, {}, "BUILD targets missing these deps")

    def test_module_pip_hub_is_the_one_build_loads(self):
        # MODULE.bazel's pip.parse makes the hub; BUILD's `requirement()`
        # comes from it, so the names must match.
        module = _read("MODULE.bazel")
        hubs = re.findall(r'\bhub_name = "([^"]+)"', module)
        self.assertLen(hubs, 1, "MODULE.bazel: one pip.parse hub_name")
        build = _read("BUILD")
        loaded = set(
            re.findall(r'load\("@([\w.-]+)//:requirements\.bzl"', build)
        )
        self.assertEqual(loaded, set(hubs), "BUILD loads another pip hub")
        hub = re.escape(hubs[0])
        self.assertRegex(module, rf'use_repo\(\s*pip,\s*"{hub}"')
        self.assertIn('requirements_lock = "//:requirements_lock.txt"', module)
        # pip.parse's Python is the one python.toolchain registers.
        versions = re.findall(r'\bpython_version = "([^"]+)"', module)
        self.assertLen(set(versions), 1, versions)

    def test_lock_pins_every_dependency(self):
        # requirements_lock.txt (the @pip hub) pins every dependency that
        # pyproject.toml names, extras included, and every `requirement()`
        # of BUILD: regenerate it when pyproject.toml changes (its header).
        if tomllib is None:
            self.skipTest("tomllib needs Python 3.11")
        project = tomllib.loads(_read("pyproject.toml"))["project"]
        wanted = list(project["dependencies"])
        for extra in project.get("optional-dependencies", {}).values():
            wanted += extra
        locked = _locked_names()
        missing = sorted({_pypi_name(r) for r in wanted} - locked)
        self.assertEqual(missing, [], "requirements_lock.txt does not pin")
        used = re.findall(r'requirement\("([^"]+)"\)', _read("BUILD"))
        missing = sorted({_pypi_name(r) for r in used} - locked)
        self.assertEqual(missing, [], "BUILD requires what the lock lacks")

    def test_lock_header_is_the_regeneration_command(self):
        # The pip-compile command at the top of the lock compiles every
        # extra, and BUILD's compile_pip_requirements writes the same header.
        if tomllib is None:
            self.skipTest("tomllib needs Python 3.11")
        lock = _read("requirements_lock.txt")
        match = re.search(r"^#    (pip-compile .*)$", lock, re.M)
        self.assertIsNotNone(match, "requirements_lock.txt has no command")
        command = match.group(1).split()
        self.assertIn("--generate-hashes", command)
        self.assertEqual(command[-1], "pyproject.toml")
        extras = tomllib.loads(_read("pyproject.toml"))["project"].get(
            "optional-dependencies", {}
        )
        for extra in extras:
            self.assertIn(f"--extra={extra}", command)
        build = _read("BUILD")
        self.assertIn(
            f'"CUSTOM_COMPILE_COMMAND": "{match.group(1)}"',
            build,
            "BUILD's compile_pip_requirements env must give the lock's header",
        )
        for extra in extras:
            self.assertIn(f'"--extra={extra}"', build)


if __name__ == "__main__":
    absltest.main()
