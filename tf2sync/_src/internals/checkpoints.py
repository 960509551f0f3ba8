"""Optimizer slots in TF2 checkpoints [2.21] [2.15: kept].

TF2's checkpoint writer finds an optimizer's slots through `dir()`, and
tf_keras's legacy optimizers make their sharded variables' slot views anew
(one view per slot is kept by `patches.sharded_slot_views`).
"""

from __future__ import annotations

from tf_keras.src.optimizers.legacy import optimizer_v2 as legacy_optimizer_v2

from tf2sync._src.internals import ps_variables


def dir_without_slot_owner(names) -> list:
    """`names` (a `dir()`) without `get_slot_names`, for a wrapper optimizer.

    TF2's checkpoint writer (`checkpoint.util.serialize_slot_variables`)
    takes every object whose `dir()` lists `get_slot_names` for a slot
    owner. A wrapper that delegates `get_slot_names` to the optimizer it
    tracks as a child would name each slot a second time, and the writer
    refuses that ("A slot variable was re-used"): the slots are saved and
    restored through the child alone.
    """
    return [name for name in names if name != "get_slot_names"]


def sharded_containers(var_list) -> list:
    """The `ShardedVariable`s whose shards `var_list` holds, once each."""
    found = {}
    for var in var_list:
        container = ps_variables.sharded_container(var)
        if container is not None:
            found.setdefault(id(container), container)
    return list(found.values())


def early_sharded_slots(optimizer, containers) -> list:
    """`[(container, slot name, whole slot)]` a restore created too early.

    A checkpoint restored before the legacy optimizer is built creates
    each slot of a `ShardedVariable` as one whole variable (tf_keras's
    `_create_or_restore_slot_variable`, with the checkpoint's value); the
    build then creates the shards' slots and forgets the whole ones, so
    the restored values were lost (stock PSS too).
    """
    early = []
    for container in containers:
        slots = optimizer._slots.get(
            legacy_optimizer_v2._var_key(container), {}
        )
        for name, slot in slots.items():
            if slot is not container:  # the build's marker is the container
                early.append((container, name, slot))
    return early


def adopt_early_sharded_slots(optimizer, early) -> None:
    """Copies each early whole slot into its shards' slots, then drops it.

    A slot the build made no shard slot of (a checkpoint of another
    optimizer, restored with `expect_partial`) is left as tf_keras leaves
    it: unused.
    """
    for container, name, whole in early:
        if not all(
            name in optimizer._slots.get(legacy_optimizer_v2._var_key(s), {})
            for s in container.variables
        ):
            continue
        optimizer.get_slot(container, name).assign(whole.read_value())
        optimizer._weights = [w for w in optimizer._weights if w is not whole]


def one_view_per_slot(optimizer):
    """`optimizer.get_slot`, returning one object per slot of a
    `ShardedVariable` (for `patches.sharded_slot_views`)."""
    views = {}
    get_slot = optimizer.get_slot

    def one_view(var, slot_name):
        slot = get_slot(var, slot_name)
        if not isinstance(slot, ps_variables.ShardedVariable):
            return slot
        key = (slot_name, tuple(id(shard) for shard in slot.variables))
        return views.setdefault(key, slot)

    return one_view


def call_with_captures(concrete, args, captures):
    """Runs `concrete` (a `ConcreteFunction`) on `args`, with `captures` in
    place of the tensors it captured (`concrete.captured_inputs`, in their
    order): the same function, already registered with every task, reading
    other variables of the same dtypes and shapes on the same devices."""
    return concrete._call_flat(list(args), list(captures))  # noqa: SLF001
