"""Sharded variables: partitioners checked, shards listed.

Under `SyncParameterServerStrategy(variable_partitioner=...)` a variable of
rank >= 1 becomes a `ShardedVariable` exactly as under stock PSS: its rows
split over `n` shards ("div" order: the first `rows % n` shards one row
longer), placed round robin over the ps tasks, carrying on from the
variables created before it (so shard 0 is not always on ps 0). Keras
lists the shards, not the `ShardedVariable`, as a layer's weights, so each
shard is a variable of its own to the rest of tf2sync: its gradient is a
tensor or an `IndexedSlices` of that shard's rows, accumulated beside the
shard on its ps (`wire.Layout` groups by the variable's device), and
applied there by the one update of the step. The update ends with the
global step's increment after every shard's write (`keras_compat.apply`),
so a step tagged after it reads every shard of the same step.

A partitioner is checked when it is given and again for every variable:
stock PSS accepts any callable and fails deep inside variable creation, or
later, on a return value such as `0`, `2.5` or `[2, 2]`.
"""

from __future__ import annotations

import functools
import numbers

import numpy as np
import tensorflow as tf

from tf2sync._src.internals import ps_variables

# A shape every partitioner must handle, to check it when it is given.
_PROBE_SHAPE = tf.TensorShape([1024, 8])


def checked(partitioner):
    """`partitioner` wrapped to check what it returns; None stays None.

    Raises:
      TypeError: If `partitioner` is not callable.
      ValueError: If it returns something other than `[n >= 1, 1, ...]`
        for a `[1024, 8]` float32 variable.
    """
    if partitioner is None:
        return None
    if isinstance(partitioner, _Checked):
        return partitioner
    if not callable(partitioner):
        raise TypeError(
            "`variable_partitioner` must be a callable (shape, dtype) -> "
            "[num_shards, 1, ...], such as tf.distribute.experimental."
            "partitioners.FixedShardsPartitioner(2), or None. Received: "
            f"variable_partitioner={partitioner!r}"
        )
    wrapped = _Checked(partitioner)
    wrapped(shape=_PROBE_SHAPE, dtype=tf.float32)
    return wrapped


class _Checked:
    """Calls the user's partitioner and refuses a malformed answer."""

    def __init__(self, partitioner):
        self.partitioner = partitioner

    def __repr__(self):
        return repr(self.partitioner)

    def __call__(self, shape, dtype, **kwargs):
        shape = tf.TensorShape(shape)
        result = self.partitioner(shape=shape, dtype=dtype, **kwargs)
        parts = list(result) if isinstance(result, (list, tuple)) else None
        ok = (
            parts is not None
            and parts
            and all(
                isinstance(p, numbers.Integral) and not isinstance(p, bool)
                for p in parts
            )
            and parts[0] >= 1
            and all(p == 1 for p in parts[1:])
        )
        if not ok:
            raise ValueError(
                "`variable_partitioner` must return a list of ints, "
                "[num_shards >= 1, 1, ...] (variables are split along axis 0 "
                f"only). It returned {result!r} for a variable of "
                f"shape {shape.as_list()} and dtype {tf.as_dtype(dtype).name}"
                f". Received: variable_partitioner={self.partitioner!r}"
            )
        return [int(p) for p in parts]


def shards(variables) -> list:
    """`variables` with each `ShardedVariable` replaced by its shards."""
    return ps_variables.shards(variables)


def is_sharded(variable) -> bool:
    """Whether `variable` is a `ShardedVariable`."""
    return ps_variables.is_sharded_variable(variable)


def whole_weights(variables) -> list:
    """The values of `variables` (e.g. `model.weights`), each sharded
    variable's shards concatenated into one array, in order: what
    `set_weights` of the same model built without a partitioner takes."""
    return [
        np.concatenate([v.numpy() for v in parts], axis=0)
        if container is not None
        else parts[0].numpy()
        for container, parts in ps_variables.group_shards(variables)
    ]


def sharded_groups(variables) -> list:
    """`[(sharded_variable, [its shards])]` for the sharded variables whose
    shards `variables` lists (e.g. `model.variables`), in order."""
    return [
        (container, parts)
        for container, parts in ps_variables.group_shards(variables)
        if container is not None
    ]


_H5_SUFFIXES = (".h5", ".hdf5")


def _is_h5(filepath, save_format, method: str) -> bool:
    """Whether tf_keras would write HDF5 for `method(filepath,
    save_format=...)`, by its own rules (`saving_api.get_save_format`,
    `saving_utils.is_hdf5_filepath`; a `.h5` path with `save_format="tf"`
    too, which its legacy saver writes as HDF5). `save_weights` to
    `*.weights.h5` is tf_keras's new format, which keeps each table whole
    (`patches.whole_weights_in_keras_files`): not refused."""
    if type(filepath).__module__.startswith("h5py"):
        return True
    path = str(filepath)
    formats = ("h5", "hdf5")
    if method == "save_weights":
        if path.endswith(".weights.h5"):
            return False
        formats += ("keras",)
        return path.endswith(_H5_SUFFIXES + (".keras",)) or (
            str(save_format).lower() in formats
        )
    return path.endswith(_H5_SUFFIXES) or str(save_format).lower() in formats


def refusing_h5(method, name: str):
    """`tf_keras.Model.save` or `save_weights` (`method`, named `name`)
    refusing HDF5 for a model with sharded variables: h5 keeps one entry
    per shard, and the file loads only into a model of the same sharding
    (`Weight count mismatch` otherwise), where `.keras`, SavedModels and
    checkpoints keep each table whole (`patches.h5_refuses_sharded`)."""

    @functools.wraps(method)
    def save(model, filepath, *args, **kwargs):
        save_format = kwargs.get(
            "save_format", args[1] if len(args) > 1 else None
        )
        if _is_h5(filepath, save_format, name) and sharded_groups(
            model.variables
        ):
            raise ValueError(
                f"A model with sharded variables cannot be saved as HDF5 "
                f"({name}): h5 keeps one entry per shard and loads only into "
                "the same sharding. Save it as .keras (model.save("
                '"model.keras")), a SavedModel, or a TensorFlow checkpoint '
                "(save_weights to a path without .h5). Received: "
                f"filepath={str(filepath)!r}"
            )
        return method(model, filepath, *args, **kwargs)

    return save
