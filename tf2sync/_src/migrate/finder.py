"""Finds the distributed-TF1 constructs of a program in its syntax tree.

`find(source)` parses the program (it never imports or runs it) and
returns one `Finding` per construct and line, each naming a
`table.Construct`. What counts:

* TF API names, however imported or aliased (`names.Aliases`):
  `tf.train.Server` / `tf.distribute.Server`, `ClusterSpec`,
  `replica_device_setter`, `SyncReplicasOptimizer` (and its pre-1.0
  `replica_id=` argument), `MonitoredTrainingSession`, `Supervisor`,
  `StopAtStepHook`, and the global step's creation
  (`get_or_create_global_step`, `create_global_step`,
  `tf.Variable(0, trainable=False)` / `tf.get_variable` named or assigned
  to a global step, `slim.variables.global_step()`).
* The attributes only `SyncReplicasOptimizer` and `Supervisor` have:
  `make_session_run_hook`, `get_chief_queue_runner`, `get_init_tokens_op`,
  `chief_init_op`, `local_step_init_op`, `ready_for_local_init_op`,
  `prepare_or_wait_for_session`, `managed_session`, and
  `start_queue_runners` on anything but the `tf.train` module.
* `.run(fetches)` on a session (a name bound to a TF session,
  `prepare_or_wait_for_session` / `managed_session`, or named `sess`,
  `session`, `mon_sess`, ...) inside a loop, when the fetches name the
  train op (the result of `minimize` / `apply_gradients`, a `tf.group` /
  `tf.identity` of one or made under its `control_dependencies`, or a name
  such as `train_op`, `train_step`).
* Chief branches: `if` / `while` / conditional expressions testing
  `is_chief`, and every `task_index == 0` (or `task_id`).
* Cluster flags (`table.FLAG_FORMS`) defined by `DEFINE_*` (tf.app.flags,
  absl) or argparse's `add_argument`.
"""

from __future__ import annotations

import ast
import dataclasses
import re

from tf2sync._src.migrate import names
from tf2sync._src.migrate import table

_SYNC_ATTRS = frozenset(
    {
        "make_session_run_hook",
        "get_chief_queue_runner",
        "get_init_tokens_op",
        "chief_init_op",
        "local_step_init_op",
        "ready_for_local_init_op",
    }
)
_SESSION_METHODS = frozenset({"prepare_or_wait_for_session", "managed_session"})
_GLOBAL_STEP_FUNCTIONS = frozenset(
    {"get_or_create_global_step", "create_global_step"}
)
_SESSION_NAME = re.compile(r"(^|_)(sess|session)$", re.I)
_TRAIN_OP_NAME = re.compile(r"^_?(\w+_)?train_?(op|ops|step|tensor)$", re.I)
_CHIEF_NAMES = frozenset({"is_chief", "_is_chief"})
_TASK_NAMES = frozenset({"task_index", "task_id", "_task_index", "_task_id"})
_TRAIN_OP_METHODS = frozenset({"minimize", "apply_gradients"})
_TRAIN_OP_WRAPPERS = frozenset({"group", "identity", "tuple"})
_MAX_TEXT = 60
# Cluster flags whose name a single-machine program may use for something
# else (input threads, a session target): reported only beside others.
_WEAK_FLAGS = frozenset({"num_workers", "master"})


@dataclasses.dataclass(frozen=True, order=True)
class Finding:
    """One construct on one line of the program.

    Attributes:
      line: the line it is on (1-based).
      order: its construct's position in `table.CONSTRUCTS` (for sorting).
      name: its `table.Construct.name`.
      text: how the program spells it (shortened).
      form: its TF2 / tf2sync form (a cluster flag's own counterpart).
      distributed: whether it makes the program distributed by itself
        (`table.Construct.distributed`; not the flags `_WEAK_FLAGS`).
    """

    line: int
    order: int
    name: str
    text: str
    form: str
    distributed: bool

    @property
    def construct(self) -> table.Construct:
        """Its `table.Construct`."""
        return table.BY_NAME[self.name]


def _short(node: ast.AST) -> str:
    text = " ".join(ast.unparse(node).split())
    if len(text) > _MAX_TEXT:
        text = text[: _MAX_TEXT - 3] + "..."
    return text


def _targets(node: ast.AST) -> list[str]:
    """The identifiers an assignment or `with ... as` binds."""
    found = []
    for target in ast.walk(node):
        name = names.identifier(target)
        if name and isinstance(getattr(target, "ctx", None), ast.Store):
            found.append(name)
    return found


def _mentions(node: ast.AST, wanted) -> bool:
    """Whether `node` contains a name / attribute for which `wanted` holds."""
    for sub in ast.walk(node):
        name = names.identifier(sub)
        if name and wanted(name):
            return True
    return False


def _is_task_zero(node: ast.AST) -> bool:
    """`task_index == 0`, `FLAGS.task_id == 0`, `0 == task_index`."""
    if not (
        isinstance(node, ast.Compare)
        and len(node.ops) == 1
        and isinstance(node.ops[0], ast.Eq)
    ):
        return False
    sides = (node.left, node.comparators[0])
    for a, b in (sides, sides[::-1]):
        if (
            names.identifier(a) in _TASK_NAMES
            and isinstance(b, ast.Constant)
            and b.value == 0
        ):
            return True
    return False


def _is_false(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def _string(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


class _Program:
    """What a first pass over the whole tree learns: sessions, train ops."""

    def __init__(self, tree: ast.Module, aliases: names.Aliases):
        self.sessions: set[str] = set()
        self.train_ops: set[str] = set()
        bindings = []  # (targets, value, control-dependency expressions)
        self._collect(tree, aliases, bindings, ())
        changed = True
        while changed:  # A train op of a train op (in any order).
            changed = False
            for targets, value, deps in bindings:
                if set(targets) <= self.train_ops:
                    continue
                if self._makes_train_op(value, deps):
                    self.train_ops.update(targets)
                    changed = True

    def _collect(self, node, aliases, bindings, deps):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            inner = deps
            for item in node.items:
                expr = item.context_expr
                if item.optional_vars is not None and self._is_session(
                    expr, aliases
                ):
                    self.sessions.update(_targets(item.optional_vars))
                if (
                    isinstance(expr, ast.Call)
                    and names.identifier(expr.func) == "control_dependencies"
                ):
                    inner = inner + tuple(expr.args)
            for child in node.body:
                self._collect(child, aliases, bindings, inner)
            return
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value:
            targets = (
                node.targets if isinstance(node, ast.Assign) else [node.target]
            )
            bound = [n for t in targets for n in _targets(t)]
            if self._is_session(node.value, aliases):
                self.sessions.update(bound)
            bindings.append((bound, node.value, deps))
        for child in ast.iter_child_nodes(node):
            self._collect(child, aliases, bindings, deps)

    @staticmethod
    def _is_session(node, aliases) -> bool:
        if not isinstance(node, ast.Call):
            return False
        if names.identifier(node.func) in _SESSION_METHODS:
            return True
        return aliases.tf_api(node.func) in names.TF_SESSIONS

    def is_train_op(self, name: str) -> bool:
        """Whether `name` (an identifier) holds the train op."""
        return name in self.train_ops or bool(_TRAIN_OP_NAME.match(name))

    def _makes_train_op(self, value, deps) -> bool:
        if any(_mentions(d, self.is_train_op) for d in deps):
            return True
        if not isinstance(value, ast.Call):
            return False
        method = names.identifier(value.func)
        if method in _TRAIN_OP_METHODS:
            return True
        if method in _TRAIN_OP_WRAPPERS:
            args = list(value.args) + [k.value for k in value.keywords]
            return any(_mentions(a, self.is_train_op) for a in args)
        return False


class _Finder(ast.NodeVisitor):
    """Visits the tree once, collecting `Finding`s."""

    def __init__(self, tree: ast.Module):
        self._aliases = names.Aliases(tree)
        self._program = _Program(tree, self._aliases)
        self._loops = 0
        self._assigned: list[str] = []
        self.found: dict[tuple[int, str], Finding] = {}

    def _add(self, line, name, text, form=None, distributed=None):
        key = (line, name)
        if key not in self.found:
            construct = table.BY_NAME[name]
            self.found[key] = Finding(
                line,
                table.CONSTRUCTS.index(construct),
                name,
                text,
                form or construct.form,
                construct.distributed if distributed is None else distributed,
            )

    # Names and attributes.

    def _tf_name(self, node) -> bool:
        api = self._aliases.tf_api(node)
        if api is None:
            return False
        name = names.TF_CONSTRUCTS.get(api)
        if name is None and api.rsplit(".", 1)[-1] in _GLOBAL_STEP_FUNCTIONS:
            name = "global_step"
        if name is None:
            return False
        self._add(node.lineno, name, _short(node))
        return True

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load):
            self._tf_name(node)

    def visit_Attribute(self, node):
        if not isinstance(node.ctx, ast.Load):
            self.generic_visit(node)
            return
        if self._tf_name(node):
            return
        receiver_is_tf = self._aliases.is_tf(node.value)
        if node.attr in _SYNC_ATTRS and not receiver_is_tf:
            self._add(node.lineno, node.attr, _short(node))
        elif node.attr in _SESSION_METHODS and not receiver_is_tf:
            self._add(node.lineno, "prepare_or_wait_for_session", _short(node))
        elif node.attr == "start_queue_runners" and not receiver_is_tf:
            self._add(node.lineno, "start_queue_runners", _short(node))
        self.generic_visit(node)

    # Calls.

    def visit_Call(self, node):
        func = node.func
        api = self._aliases.tf_api(func)
        short_name = names.identifier(func)
        if names.TF_CONSTRUCTS.get(api) == "SyncReplicasOptimizer":
            for keyword in node.keywords:
                if keyword.arg == "replica_id":
                    self._add(
                        keyword.lineno,
                        "replica_id",
                        f"{_short(func)}(replica_id=...)",
                    )
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "make_session_run_hook"
            and not self._aliases.is_tf(func.value)
            and (
                len(node.args) > 1
                or any(k.arg == "num_tokens" for k in node.keywords)
            )
        ):
            self._add(
                func.lineno,
                "make_session_run_hook",
                _short(func),
                form=table.HOOK_WITH_TOKENS,
            )
        dotted = names.dotted(func) or ""
        if short_name in _GLOBAL_STEP_FUNCTIONS or (
            # The global step of the TF models' own slim (Inception).
            dotted == "variables.global_step"
            or dotted.endswith(".variables.global_step")
        ):
            self._add(node.lineno, "global_step", _short(node))
        if api in ("Variable", "get_variable") and self._is_global_step(
            node, api
        ):
            self._add(node.lineno, "global_step", _short(node))
        if short_name and short_name.startswith("DEFINE_"):
            self._flag(node, node.args[:1], "name")
        elif short_name == "add_argument":
            self._flag(node, node.args, "dest")
        if (
            self._loops
            and short_name == "run"
            and isinstance(func, ast.Attribute)
            and self._is_session(func.value)
            and self._fetches_train_op(node)
        ):
            self._add(node.lineno, "sess.run loop", _short(node))
        self.generic_visit(node)

    def _is_global_step(self, node, api) -> bool:
        trainable = [k.value for k in node.keywords if k.arg == "trainable"]
        if not (trainable and _is_false(trainable[0])):
            return False
        given = [k.value for k in node.keywords if k.arg == "name"]
        if api == "get_variable":
            given += node.args[:1]
        if any((_string(v) or "").endswith("global_step") for v in given):
            return True
        return any("global_step" in t for t in self._assigned)

    def _flag(self, node, args, keyword):
        given = list(args) + [
            k.value for k in node.keywords if k.arg == keyword
        ]
        for value in given:
            flag = _string(value)
            if flag is None:
                continue
            flag = flag.lstrip("-").replace("-", "_")
            if flag in table.FLAG_FORMS:
                self._add(
                    node.lineno,
                    "cluster flag",
                    f"flag {flag} ({_short(node.func)})",
                    table.FLAG_FORMS[flag],
                    flag not in _WEAK_FLAGS,
                )
                return

    def _is_session(self, node) -> bool:
        name = names.identifier(node)
        return bool(name) and (
            name in self._program.sessions or bool(_SESSION_NAME.search(name))
        )

    def _fetches_train_op(self, node) -> bool:
        fetches = node.args[:1] + [
            k.value for k in node.keywords if k.arg == "fetches"
        ]
        return any(_mentions(f, self._program.is_train_op) for f in fetches)

    # Assignments (the global step's name), branches and loops.

    def visit_Assign(self, node):
        self._assigned = [n for t in node.targets for n in _targets(t)]
        self.visit(node.value)
        self._assigned = []
        for target in node.targets:
            self.visit(target)

    def visit_Compare(self, node):
        if _is_task_zero(node):
            self._add(node.lineno, "is_chief branch", _short(node))
        self.generic_visit(node)

    def _branch(self, node, keyword):
        if _is_task_zero(node.test) or _mentions(
            node.test, lambda n: n in _CHIEF_NAMES
        ):
            text = f"{keyword} {_short(node.test)}" if keyword else None
            self._add(node.lineno, "is_chief branch", text or _short(node))

    def visit_If(self, node):
        self._branch(node, "if")
        self.generic_visit(node)

    def visit_IfExp(self, node):
        self._branch(node, None)
        self.generic_visit(node)

    def visit_While(self, node):
        self._branch(node, "while")
        self._loop(node)

    def visit_For(self, node):
        self._loop(node)

    visit_AsyncFor = visit_For

    def _loop(self, node):
        for field in ("target", "iter", "test"):
            if getattr(node, field, None) is not None:
                self.visit(getattr(node, field))
        self._loops += 1
        for child in node.body:
            self.visit(child)
        self._loops -= 1
        for child in node.orelse:
            self.visit(child)

    def _comprehension(self, node):
        self._loops += 1
        self.generic_visit(node)
        self._loops -= 1

    visit_ListComp = visit_SetComp = visit_GeneratorExp = _comprehension
    visit_DictComp = _comprehension

    def _scope(self, node):
        # A function defined in a loop does not run in it by being defined.
        loops, self._loops = self._loops, 0
        self.generic_visit(node)
        self._loops = loops

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _scope
    visit_ClassDef = _scope


def find(source: str | bytes, filename: str = "<program>") -> list[Finding]:
    """The distributed-TF1 constructs of a program, by line.

    Args:
      source: the program's text (bytes honour its coding declaration).
      filename: the name syntax errors carry.

    Returns:
      The findings, sorted by line, then in the table's order; none for a
      program without a construct that makes it distributed (a server,
      cluster spec or flag, device setter, `SyncReplicasOptimizer`, chief
      branch): its sessions, loops, hooks and global step are
      single-machine TF1, `tf_upgrade_v2`'s business.

    Raises:
      SyntaxError: the program is not valid Python (also for null bytes
        and undecodable text, as `ValueError` / `UnicodeDecodeError` are
        turned into one).
    """
    try:
        tree = ast.parse(source, filename=filename)
    except (ValueError, UnicodeDecodeError) as e:
        raise SyntaxError(str(e)) from e
    finder = _Finder(tree)
    finder.visit(tree)
    found = finder.found.values()
    if not any(f.distributed for f in found):
        return []
    return sorted(found)
