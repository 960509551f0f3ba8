"""Changing an op of a traced graph [2.21] [2.15: kept].

`tf.Operation` has no public way to change an op once it exists (TF1's
`graph_editor` is gone); tf2sync rewires a step's graph after tracing it.
These are C++ (pybind) methods of `Operation`.
"""

from __future__ import annotations

import tensorflow as tf


def update_op_input(op, index, tensor) -> None:
    """Makes `tensor` the `index`-th input of `op` (`_update_input`)."""
    op._update_input(index, tensor)


def add_control_inputs(op, ops) -> None:
    """Adds control inputs to an existing op (`_add_control_inputs`);
    `tf.control_dependencies` does it only for ops not yet created."""
    op._add_control_inputs(list(ops))


def replace_control_inputs(op, ops) -> None:
    """Makes `ops` exactly the control inputs of `op`."""
    op._remove_all_control_inputs()
    op._add_control_inputs(list(ops))


def op_is_stateful(op) -> bool:
    """Whether `op` is stateful (`_is_stateful`). The public
    `op.op_def.is_stateful` does not cover ops whose type is a function."""
    return bool(op._is_stateful)


def set_up_without_grappler(outputs) -> None:
    """Has the task that runs a function call set the function up without
    Grappler, TF's graph optimizer (the call op's `config_proto`, through
    `_set_attr`).

    Args:
      outputs: What calling a `tf.function` in a graph returned; their op
        is the call. The call keeps the rest of the configuration of the
        context that traced it.

    Raises:
      TypeError: If `outputs` are not the outputs of one function call.
    """
    ops = {t.op for t in tf.nest.flatten(outputs)}
    op = ops.pop() if len(ops) == 1 else None
    if op is None or op.type not in (
        "PartitionedCall",
        "StatefulPartitionedCall",
    ):
        raise TypeError(f"outputs={outputs!r} are not one function call's.")
    config = tf.compat.v1.ConfigProto()
    config.ParseFromString(op.get_attr("config_proto"))
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    op._set_attr(
        "config_proto", tf.compat.v1.AttrValue(s=config.SerializeToString())
    )
