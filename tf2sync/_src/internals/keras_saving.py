"""Sharded weights in `.keras` files [2.21] [2.15: kept].

tf_keras's `Layer.save_own_variables` and `load_own_variables` store a
layer's weights one entry each, and a layer lists a sharded weight as its
shards. `save_own_variables` and `load_own_variables` here store each
sharded weight whole; `patches.whole_weights_in_keras_files` installs them.
They adapt tf_keras's two methods, whose sources `COPIED_SOURCES`
fingerprints (`tests/fingerprints_test.py`).
"""

from __future__ import annotations

import numpy as np
from tf_keras.src.engine import base_layer as keras_base_layer

from tf2sync._src.internals import fingerprints
from tf2sync._src.internals import ps_variables

_SAVE_OWN_VARIABLES = keras_base_layer.Layer.save_own_variables


_LOAD_OWN_VARIABLES = keras_base_layer.Layer.load_own_variables


def _weight_groups(layer):
    """A layer's saved weights (`_trainable_weights` then
    `_non_trainable_weights`, which list a sharded weight as its shards, in
    order), each sharded weight's shards as one group: `[(sharded or None,
    [variables])]`."""
    return ps_variables.group_shards(
        layer._trainable_weights + layer._non_trainable_weights
    )


def save_own_variables(layer, store):
    groups = _weight_groups(layer)
    if all(container is None for container, _ in groups):
        return _SAVE_OWN_VARIABLES(layer, store)
    for i, (_, parts) in enumerate(groups):
        store[f"{i}"] = np.concatenate([p.numpy() for p in parts], axis=0)
    return None


def load_own_variables(layer, store):
    layer._update_trackables()
    groups = _weight_groups(layer)
    if all(container is None for container, _ in groups):
        return _LOAD_OWN_VARIABLES(layer, store)
    if len(store.keys()) != len(groups):
        raise ValueError(
            f"Layer '{layer.name}' expected {len(groups)} variables, but "
            f"received {len(store.keys())} variables during loading."
        )
    for i, (_, parts) in enumerate(groups):
        value = store[f"{i}"]
        offset = 0
        for part in parts:
            rows = int(part.shape[0]) if part.shape.rank else 1
            part.assign(
                value[offset : offset + rows] if part.shape.rank else value
            )
            offset += rows
    return None


# The tf_keras sources `save_own_variables` and `load_own_variables` adapt
# (see `fingerprints`).
COPIED_SOURCES = (
    fingerprints.CopiedSource(
        original=_SAVE_OWN_VARIABLES,
        name="tf_keras.src.engine.base_layer.Layer.save_own_variables",
        copy="internals.keras_saving.save_own_variables",
        recheck="that a layer's saved weights are still "
        "`_trainable_weights + _non_trainable_weights`, one entry each "
        'named f"{i}"',
        package="tf_keras",
        hashes={"2.21": "9b454c9a7ecf5ef9"},
    ),
    fingerprints.CopiedSource(
        original=_LOAD_OWN_VARIABLES,
        name="tf_keras.src.engine.base_layer.Layer.load_own_variables",
        copy="internals.keras_saving.load_own_variables",
        recheck="`_update_trackables()` first, the weights in the same "
        "order, the count check and its message",
        package="tf_keras",
        hashes={"2.21": "9e6ecd23bc728031"},
    ),
)
