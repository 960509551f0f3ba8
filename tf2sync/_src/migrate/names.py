"""Which TensorFlow API a name in a TF1 program's syntax tree stands for.

`Aliases` reads a module's imports (`import tensorflow.compat.v1 as tf`,
`from tensorflow.train import Server`, `from tensorflow.compat import v1`)
and its module-level aliases (`flags = tf.app.flags`, `slim =
tf.contrib.slim`), so that `tf_api` can turn the expression `tf.train.Server`
or `Server` into the canonical `train.Server`: the path under `tensorflow.`,
without `compat.v1.` (or `compat.v2.`), and with the private module paths
TF1 programs sometimes imported mapped to their public names.
"""

from __future__ import annotations

import ast

# Private module paths (under `tensorflow.`) -> their public API path.
_PRIVATE = {
    "python.training.server_lib.": "train.",
    "python.training.device_setter.": "train.",
    "python.training.sync_replicas_optimizer.": "train.",
    "python.training.monitored_session.": "train.",
    "python.training.supervisor.": "train.",
    "python.training.basic_session_run_hooks.": "train.",
    "python.training.training_util.": "train.",
    "python.training.training.": "train.",
}

# Canonical TF name -> `table.Construct.name`.
TF_CONSTRUCTS = {
    "train.Server": "Server",
    "distribute.Server": "Server",
    "train.ClusterSpec": "ClusterSpec",
    "train.replica_device_setter": "replica_device_setter",
    "train.SyncReplicasOptimizer": "SyncReplicasOptimizer",
    # TF 0.12's second version, renamed SyncReplicasOptimizer in 1.0.
    "train.SyncReplicasOptimizerV2": "SyncReplicasOptimizer",
    "train.MonitoredTrainingSession": "MonitoredTrainingSession",
    "train.Supervisor": "Supervisor",
    "train.StopAtStepHook": "StopAtStepHook",
    "train.get_or_create_global_step": "global_step",
    "train.create_global_step": "global_step",
    "contrib.framework.get_or_create_global_step": "global_step",
    "contrib.framework.create_global_step": "global_step",
    "contrib.slim.get_or_create_global_step": "global_step",
    "contrib.slim.create_global_step": "global_step",
}

# Canonical names of the TF1 session classes.
TF_SESSIONS = frozenset(
    {
        "Session",
        "InteractiveSession",
        "train.MonitoredTrainingSession",
        "train.MonitoredSession",
        "train.SingularMonitoredSession",
    }
)


def dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def identifier(node: ast.AST) -> str | None:
    """The last name of `x`, `a.x` (`self.sess` -> `sess`), else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


class Aliases:
    """The fully qualified module or object each local name is bound to.

    Scoping is ignored: an import inside a function counts for the whole
    file, as a TF1 program's imports practically always mean.
    """

    def __init__(self, tree: ast.Module):
        self._names: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self._names[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        self._names[top] = top
            elif isinstance(node, ast.ImportFrom):
                if node.level or not node.module:
                    continue  # A relative import: the program's own code.
                for alias in node.names:
                    if alias.name != "*":
                        local = alias.asname or alias.name
                        self._names[local] = f"{node.module}.{alias.name}"
        # `flags = tf.app.flags`: module-level aliases of TF modules.
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                name = node.targets[0].id
                value = self.qualified(node.value)
                if value and value.startswith("tensorflow.") and name != "tf":
                    self._names.setdefault(name, value)

    def qualified(self, node: ast.AST) -> str | None:
        """`tensorflow.compat.v1.train.Server` for `tf.train.Server`.

        An unimported `tf` is read as `tensorflow` (a fragment of a
        program); any other unknown root name is returned as it is.
        """
        name = dotted(node)
        if name is None:
            return None
        root, _, rest = name.partition(".")
        if root in self._names:
            root = self._names[root]
        elif root == "tf":
            root = "tensorflow"
        return f"{root}.{rest}" if rest else root

    def tf_api(self, node: ast.AST) -> str | None:
        """The canonical TF name of `node` (`train.Server`), else None."""
        name = self.qualified(node)
        if name is None or not name.startswith("tensorflow."):
            return None
        name = name[len("tensorflow.") :]
        for prefix in ("compat.v1.", "compat.v2."):
            if name.startswith(prefix):
                name = name[len(prefix) :]
        for private, public in _PRIVATE.items():
            if name.startswith(private):
                name = public + name[len(private) :]
        return name

    def is_tf(self, node: ast.AST) -> bool:
        """Whether `node` names something under `tensorflow`."""
        name = self.qualified(node)
        return name is not None and (
            name == "tensorflow" or name.startswith("tensorflow.")
        )
