"""MultiOptimizer: one optimizer per variable group, routed by identity."""

from __future__ import annotations

import re

import tensorflow as tf
import tf_keras

from tf2sync._src import keras_compat
from tf2sync._src.internals import checkpoints
from tf2sync._src.internals import keras_optimizers
from tf2sync._src.internals import ps_variables


def _variables_of(target):
    """Trainable variables of a layer, a model, a variable, or a list."""
    if isinstance(target, (list, tuple)):
        out = []
        for t in target:
            out.extend(_variables_of(t))
        return out
    if isinstance(target, tf.Variable):
        return [target]
    if hasattr(target, "trainable_weights"):
        return list(target.trainable_weights)
    raise TypeError(
        "A group must be a layer, a model, a variable or a list of them. "
        f"Received: {target!r}"
    )


def _positions(var_list) -> tuple[dict, int]:
    """`({id(var): i}, n)`: each variable's rank among the `n` distinct
    variables of `var_list`, the shards of one sharded variable counting as
    one (so a model loaded with other shards, or none, ranks the same)."""
    ranks = {}
    owners = {}
    for var in var_list:
        owner = ps_variables.sharded_container(var)
        owner = id(var if owner is None else owner)
        ranks[id(var)] = owners.setdefault(owner, len(owners))
    return ranks, len(owners)


def _check_shards_together(routes, describe) -> None:
    """Refuses `routes` (`{group: [variables]}`) that split the shards of
    one sharded variable over several groups (a pattern matching a shard's
    `part_<i>`): one table takes one optimizer, and a model saved so would
    not load (its groups keep whole variables)."""
    groups_of = {}
    for index, variables in routes.items():
        for var in variables:
            owner = ps_variables.sharded_container(var)
            if owner is not None:
                groups_of.setdefault(id(owner), (owner, set()))[1].add(index)
    for owner, indices in groups_of.values():
        if len(indices) > 1:
            # A ShardedVariable's own name is "ShardedVariable"; its shards'
            # are the table's with "/part_<i>".
            name = re.sub(r"/part_\d+(:\d+)?$", "", owner.variables[0].name)
            raise ValueError(
                f"The shards of sharded variable {name} are routed to "
                f"several groups: {[describe(i) for i in sorted(indices)]}. "
                "A sharded variable belongs to one group: match its name "
                "without the shard's `part_<i>`."
            )


class _SavedGroup:
    """A loaded group: the ranks of the variables it got at its build."""

    def __init__(self, positions, num_variables, pattern=None):
        self.positions = sorted(int(p) for p in positions)
        self.num_variables = int(num_variables)
        self.pattern = pattern

    def __repr__(self):
        what = f"regex {self.pattern!r} as " if self.pattern else ""
        return f"{what}variables {self.positions} of {self.num_variables}"


@tf_keras.utils.register_keras_serializable(package="tf2sync")
class MultiOptimizer(tf_keras.optimizers.legacy.Optimizer):
    """Routes each variable to exactly one optimizer.

    Two forms, and an optional default for variables no group matches:

    * tensorflow-addons' form, `MultiOptimizer([(optimizer, layers), ...])`,
      where `layers` is a layer, a model, a variable or a list of them;
    * `MultiOptimizer(groups={pattern_or_callable: optimizer, ...})`, where
      a string is a regex searched in `variable.name` and a callable takes
      the variable and returns a bool.

    Routing is decided once, when the optimizer is built, and stored by
    variable identity: two layers with the same name in two sub-models go to
    their own groups. A variable matched by two groups, or by none without a
    `default`, raises a `ValueError` listing the variable and the groups.

    Each step applies every group's optimizer once and increments this
    optimizer's `iterations` by exactly 1. Under `SyncOptimizer` the
    gradients of all groups are aggregated together, then each group applies
    its share of the mean. Group learning rates stay settable between steps
    (`multi.optimizers[i].learning_rate = ...`).

    Saved with a model once built (`get_config`), each group keeps the
    ranks of the variables it got in the list it was built with (a model's
    `trainable_variables`; a sharded variable counts once): loaded, it
    routes the variables of the same ranks, in a model with as many (a
    loaded model's variables lose their layer names, so a pattern would
    not find them). Saved before its build, a regex group keeps its
    pattern, and a layer or callable group cannot be loaded.
    """

    def __init__(
        self,
        optimizers_and_layers=None,
        *,
        groups=None,
        default=None,
        name: str = "MultiOptimizer",
    ):
        """Creates the router; see the class docstring for the forms.

        Args:
          optimizers_and_layers: `[(optimizer, layers), ...]` (addons form).
          groups: `{regex_or_callable: optimizer}`.
          default: Optimizer for variables that no group matches.
          name: Name of this optimizer.

        Raises:
          TypeError: If an optimizer is not a tf_keras optimizer (or is a
            `tf2sync.SyncOptimizer`), or an item of `optimizers_and_layers`
            is not a pair.
          ValueError: If no group is given.
        """
        super().__init__(name=name)
        specs = []
        for i, pair in enumerate(optimizers_and_layers or []):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(
                    "`optimizers_and_layers` must be a list of (optimizer, "
                    "layer or layers) pairs. Received: "
                    f"optimizers_and_layers[{i}]={pair!r}"
                )
            optimizer, target = pair
            specs.append(("layers", target, optimizer))
        for key, optimizer in (groups or {}).items():
            kind = "regex" if isinstance(key, str) else "callable"
            if isinstance(key, _SavedGroup):
                kind = "saved"
            if kind == "callable" and not callable(key):
                raise TypeError(
                    "`groups` keys must be regex strings or callables. "
                    f"Received: {key!r}"
                )
            specs.append((kind, key, optimizer))
        if not specs and default is None:
            raise ValueError(
                "`optimizers_and_layers` or `groups`: give at least one "
                "group. Received: optimizers_and_layers="
                f"{optimizers_and_layers!r}, groups={groups!r}"
            )
        for _, _, optimizer in specs:
            keras_compat.check_optimizer(optimizer, "group optimizer")
        if default is not None:
            keras_compat.check_optimizer(default, "default")
        self._specs = specs
        self._default = default
        self.optimizers = [o for _, _, o in specs] + (
            [default] if default is not None else []
        )
        for i, optimizer in enumerate(self.optimizers):
            keras_optimizers.track_child(self, optimizer, f"group_{i}")
        self._routes = None
        # ({group: variable ranks}, count): what get_config saves. A loaded
        # router has it from its saved groups until it is built again.
        self._built = None
        if specs and all(kind == "saved" for kind, _, _ in specs):
            self._built = (
                {i: key.positions for i, (_, key, _) in enumerate(specs)},
                specs[0][1].num_variables,
            )
        _ = self.iterations  # The global step: created now, eagerly.

    def _describe(self, index):
        if index == len(self._specs):
            return "default"
        kind, key, _ = self._specs[index]
        if kind == "layers":
            return f"group {index} (layers)"
        return f"group {index} ({kind} {key!r})"

    def route(self, var_list):
        """Returns `{group_index: [variables]}`; raises on 0 or 2+ matches."""
        members = []
        ranks, count = _positions(var_list)
        for index, (kind, key, _) in enumerate(self._specs):
            if kind == "saved":
                if key.num_variables != count:
                    raise ValueError(
                        f"{self._describe(index)} was saved routing a model "
                        f"of {key.num_variables} trainable variables; this "
                        f"one has {count}. Compile it with a new "
                        "MultiOptimizer."
                    )
                positions = set(key.positions)
                members.append(lambda v, p=positions: ranks[id(v)] in p)
            elif kind == "layers":
                ids = {id(v) for v in _variables_of(key)}
                members.append(lambda v, ids=ids: id(v) in ids)
            elif kind == "regex":
                pattern = re.compile(key)
                members.append(lambda v, p=pattern: bool(p.search(v.name)))
            else:
                members.append(key)
        routes = {}
        for var in var_list:
            hits = [i for i, m in enumerate(members) if m(var)]
            if len(hits) > 1:
                raise ValueError(
                    f"Variable {var.name} is matched by several groups: "
                    f"{[self._describe(i) for i in hits]}. Each variable "
                    "must belong to exactly one group."
                )
            if not hits:
                if self._default is None:
                    raise ValueError(
                        f"Variable {var.name} is matched by no group and "
                        "there is no `default` optimizer. Groups: "
                        f"{[self._describe(i) for i in range(len(members))]}"
                    )
                hits = [len(self._specs)]
            routes.setdefault(hits[0], []).append(var)
        _check_shards_together(routes, self._describe)
        empty = [i for i in range(len(members)) if i not in routes]
        if empty:
            raise ValueError(
                f"Groups {[self._describe(i) for i in empty]} match no "
                f"variable: check them (variables: "
                f"{[v.name for v in var_list]})."
            )
        return routes

    def build(self, var_list):
        """Routes `var_list` and builds every group's slots, eagerly."""
        routes = self.route(var_list)
        self._routes = {
            id(v): i for i, variables in routes.items() for v in variables
        }
        ranks, count = _positions(var_list)
        self._built = (
            {
                i: sorted({ranks[id(v)] for v in variables})
                for i, variables in routes.items()
            },
            count,
        )
        for i, variables in routes.items():
            keras_compat.build(self.optimizers[i], variables)

    def _ensure_built(self, var_list, exact=False):
        """Builds over `var_list` unless already routed: every one of them
        (`exact`: those and no others)."""
        ids = {id(v) for v in var_list}
        routed = set(self._routes or ())
        if self._routes is None or (ids != routed if exact else ids - routed):
            with tf.init_scope():
                self.build(var_list)

    def _split(self, grads_and_vars):
        self._ensure_built([v for _, v in grads_and_vars])
        parts = {}
        for g, v in grads_and_vars:
            parts.setdefault(self._routes[id(v)], []).append((g, v))
        return parts

    def apply_aggregated(self, grads_and_vars, increment=True):
        """Applies each group's share once; increments `iterations` by 1.

        Used by `SyncOptimizer`'s apply. With `increment=False` nothing is
        incremented (one parameter server's share of an update; see
        `increment_aggregated`).
        """
        done = [
            keras_compat.apply(self.optimizers[i], gv, increment)
            for i, gv in self._split(grads_and_vars).items()
        ]
        with tf.control_dependencies(done):
            if not increment:
                return tf.no_op()
            return self.iterations.assign_add(1).op

    def increment_aggregated(self, var_list):
        """Increments what `apply_aggregated` would have for `var_list`: the
        `iterations` of each group with a variable there, then this one's."""
        done = [
            keras_compat.increment(self.optimizers[i], [v for _, v in gv])
            for i, gv in self._split([(None, v) for v in var_list]).items()
        ]
        with tf.control_dependencies(done):
            return self.iterations.assign_add(1).op

    def apply_gradients(self, grads_and_vars, name=None, **kwargs):
        """Single-process apply: each group's optimizer, then one step."""
        del name, kwargs
        grads_and_vars = list(grads_and_vars)
        # Routed over every variable given, a gradient or not (what
        # `get_config` saves), again when they change (a layer frozen).
        self._ensure_built([v for _, v in grads_and_vars], exact=True)
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        ops = [
            self.optimizers[i].apply_gradients(gv)
            for i, gv in self._split(grads_and_vars).items()
        ]
        with tf.control_dependencies([o for o in ops if o is not None]):
            return self.iterations.assign_add(1)

    def get_slot_names(self):
        """The slot names of every group's optimizer, each once, in group
        order (a new-family optimizer has none to list)."""
        names = []
        for optimizer in self.optimizers:
            slot_names = getattr(optimizer, "get_slot_names", None)
            for name in slot_names() if slot_names else ():
                if name not in names:
                    names.append(name)
        return names

    def get_slot(self, var, slot_name):
        """The slot `slot_name` of `var` in the optimizer of `var`'s group
        (a legacy one; see `get_slot_names`).

        Raises:
          KeyError: If `var` is in no group (the groups are routed over the
            model's trainable variables when built, at the latest at the
            first step), or its group's optimizer has no such slot.
        """
        # A sharded variable is routed by its shards, all in one group.
        index = (self._routes or {}).get(id(ps_variables.shards([var])[0]))
        if index is None:
            raise KeyError(
                f"{getattr(var, 'name', var)!r} is in no group of "
                f"MultiOptimizer {self._name!r}: pass one of the variables "
                "it was built over (the model's trainable variables, routed "
                "at the latest at the first step)."
            )
        return self.optimizers[index].get_slot(var, slot_name)

    def __dir__(self):
        # The slots are saved through each group's optimizer (a child).
        return checkpoints.dir_without_slot_owner(super().__dir__())

    def variables(self):
        out = [self.iterations]
        for optimizer in self.optimizers:
            out.extend(optimizer.variables())
        return out

    def get_config(self):
        # Layer and callable groups are live objects, and a loaded model's
        # variables have other names (`kernel:0`): once built, every group
        # is saved as the ranks of the variables it got.
        built = self._built
        groups = []
        for index, (kind, key, optimizer) in enumerate(self._specs):
            group = {"optimizer": tf_keras.optimizers.serialize(optimizer)}
            if kind == "regex" or getattr(key, "pattern", None):
                group["pattern"] = getattr(key, "pattern", key)
            group["variables"] = None if built is None else built[0][index]
            groups.append(group)
        default = self._default
        return {
            "name": self._name,
            "groups": groups,
            "default": default and tf_keras.optimizers.serialize(default),
            "num_variables": None if built is None else built[1],
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds the router saved by `get_config` (see the class doc).

        Raises:
          ValueError: If a layer or callable group was saved before the
            optimizer was built (nothing says which variables are its), or
            the config has no groups (saved by an earlier tf2sync).
        """

        def load(optimizer):
            return tf_keras.optimizers.deserialize(
                optimizer, custom_objects=custom_objects
            )

        if "groups" not in config:
            raise ValueError(
                f"MultiOptimizer {config.get('name')!r} was saved without its "
                "groups: load the model with compile=False and compile it "
                "with a new MultiOptimizer."
            )
        count = config.get("num_variables")
        groups = {}
        for index, group in enumerate(config["groups"]):
            pattern = group.get("pattern")
            if count is not None:
                key = _SavedGroup(group["variables"], count, pattern)
            elif pattern is not None:
                key = pattern
            else:
                raise ValueError(
                    f"MultiOptimizer {config['name']!r}: group {index} (layers "
                    "or a callable) was saved before the optimizer was built, "
                    "so its variables are unknown. Load the model with "
                    "compile=False and compile it with a new MultiOptimizer."
                )
            groups[key] = load(group["optimizer"])
        default = config.get("default")
        return cls(
            groups=groups,
            default=load(default) if default else None,
            name=config["name"],
        )
