"""How a runtime patch is installed and uninstalled (see `patches`).

Three kinds: a `GlobalPatch` replaces attributes of TF or tf_keras modules
or classes, for the process; an `ObjectPatch` replaces an attribute of
some objects (a method of one object); a class swap (`patches` has its
two) changes an object's class. `install` is idempotent (twice is once),
and `uninstall` puts back the very objects `install` replaced.
"""

from __future__ import annotations

import types

_ABSENT = object()  # what an object had where it had no attribute itself


class Patch:
    """What every patch says of itself (see the module docstring)."""

    kind = ""

    def __init__(self, name, *, replaces, why, versions, where):
        self.name = name
        self.replaces = replaces
        self.why = why
        self.versions = versions
        self.where = where

    def __repr__(self):
        return f"<{self.kind} patch {self.name!r}: {self.replaces}>"


class GlobalPatch(Patch):
    """Attributes of TF / tf_keras modules or classes, for the process.

    `targets`: `[(owner, attribute)]`; `make(current, *args)`: their
    replacements, in order, from their current values and `install`'s
    arguments.
    """

    kind = "global"

    def __init__(self, name, targets, make, **info):
        super().__init__(name, **info)
        self.targets = targets
        self._make = make
        self._replaced = None  # while installed: what each owner held

    def is_installed(self) -> bool:
        return self._replaced is not None

    def install(self, *args) -> None:
        if self._replaced is not None:
            return
        held = [vars(owner).get(name, _ABSENT) for owner, name in self.targets]
        current = [getattr(owner, name) for owner, name in self.targets]
        for (owner, name), new in zip(self.targets, self._make(current, *args)):
            setattr(owner, name, new)
        self._replaced = held

    def uninstall(self) -> None:
        if self._replaced is None:
            return
        for (owner, name), held in zip(self.targets, self._replaced):
            if held is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, held)
        self._replaced = None


class ObjectPatch(Patch):
    """An attribute of some objects, each object's own (a method of one
    object, shadowing its class's, or the object's own function).

    `install(target, *args)` sets it on each of `objects(target)` (the
    target alone by default) to `make(obj, *args)`: a new function, marked
    with this patch and what the object held (another callable is wrapped
    in a new function), and does nothing where the mark is already.
    `uninstall(target)` puts back what was held (or removes what the
    object did not have), then calls `forget(obj)` if given.
    """

    kind = "per object"

    def __init__(
        self, name, attribute, make, objects=None, forget=None, **info
    ):
        super().__init__(name, **info)
        self.attribute = attribute
        self._make = make
        self._objects = objects or (lambda target: [target])
        self._forget = forget

    def _on(self, obj) -> bool:
        held = vars(obj).get(self.attribute)
        return getattr(held, "_tf2sync_patch", None) is self

    def is_installed(self, target) -> bool:
        return all(self._on(obj) for obj in self._objects(target))

    def install(self, target, *args) -> None:
        for obj in self._objects(target):
            if self._on(obj):
                continue
            held = vars(obj).get(self.attribute, _ABSENT)
            new = self._make(obj, *args)
            if not isinstance(new, types.FunctionType) or hasattr(
                new, "_tf2sync_patch"
            ):
                new = _forwarding(new)
            new._tf2sync_patch = self
            new._tf2sync_replaced = held
            setattr(obj, self.attribute, new)

    def uninstall(self, target) -> None:
        for obj in self._objects(target):
            if not self._on(obj):
                continue
            held = vars(obj)[self.attribute]._tf2sync_replaced
            if held is _ABSENT:
                delattr(obj, self.attribute)
            else:
                setattr(obj, self.attribute, held)
            if self._forget is not None:
                self._forget(obj)


def _forwarding(call):
    """A new function that calls `call`, to be marked in its stead."""
    return lambda *args, **kwargs: call(*args, **kwargs)
