"""Graph ops: rewiring a traced step's graph.

Part of `tf2sync._src.tf_internals`, the one door to private TensorFlow
and tf_keras API: see its docstring for the version tags.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.framework import importer as graph_importer

# Graph ops [2.21] [2.15: kept] -----------------------------------------------
# `tf.Operation` has no public way to change an op once it exists (TF1's
# `graph_editor` is gone); tf2sync rewires a step's graph after tracing it.
# These are C++ (pybind) methods of `Operation`.


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


def copies_like_traces(concrete) -> bool:
    """Whether `inline_copy` of `concrete` makes what tracing it again
    would. Not when its graph has call-time captures (PSS's per-worker
    resources: a lookup table made under the scope, a per-worker
    variable, the worker index), which a copy would resolve once, on the
    coordinator; nor when an op of it, or of a function it calls, has a
    nonzero random seed (under a global seed each new trace of a random
    op gets a seed of its own, and copies would draw the same numbers).
    """
    if concrete.graph.deferred_external_captures:
        return False
    graph_def = _copy_recipe(concrete).graph_def  # what copies would import
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    for node in nodes:
        for attr in ("seed", "seed2"):
            if attr in node.attr and node.attr[attr].i:
                return False
    return True


def inline_copy(concrete, args, name):
    """Copies the graph of `concrete` into the current graph, once more.

    What tracing `concrete`'s Python again here would build, without
    running that Python: its ops are imported under the name scope `name`,
    its arguments (the flat tensors of `args`: tensors and composite
    tensors only) and captures fed from this graph (captured through it
    when they live elsewhere), and its nested functions shared. Its
    constants are the first copy's in this graph (see `_CopyRecipe`), so
    copies into one graph must not be made under different
    `tf.control_dependencies` contexts (the shared constants keep the
    first copy's). Returns its structured outputs, with this copy's
    tensors. Stands in for function inlining, which TF applies only when a
    function runs (`import_graph_def` without colocation checks, since
    the arguments' placeholders are not copied, as
    `importer.import_graph_def_for_function` does; no public API copies a
    function graph with inputs mapped). [2.21] [2.15]: `fit_test` runs it
    on both.
    """
    graph = tf.compat.v1.get_default_graph()
    inner = concrete.graph
    recipe = _copy_recipe(concrete)
    flat_args = tf.nest.flatten(args, expand_composites=True)
    values = {}  # placeholder's name -> the tensor fed
    for placeholder, value in zip(inner.inputs, flat_args):
        if tf.is_symbolic_tensor(value) and value.graph is not graph:
            value = graph.capture(value)  # of an enclosing function
        values[placeholder.name] = value
    for placeholder, outer in zip(
        inner.inputs[len(flat_args) :], concrete.captured_inputs
    ):
        if getattr(outer, "graph", None) is not graph:
            outer = graph.capture(outer)
        values[placeholder.name] = outer
    input_map = {
        key: values[placeholder] for key, placeholder in recipe.input_map
    }
    shared = recipe.constants.get(graph)
    if shared is None:  # the first copy here: its constants serve the rest
        elements = recipe.wanted + recipe.constant_tensors
        graph_def = recipe.graph_def
    else:
        elements = [t for t in recipe.wanted if t not in shared]
        graph_def = recipe.without_constants
        for key, tensor_name in recipe.constant_inputs:
            input_map[key] = shared[tensor_name]
    copied = graph_importer._import_graph_def_internal(
        graph_def,
        input_map=input_map,
        return_elements=elements,
        validate_colocation_constraints=False,
        name=name,
    )
    by_name = dict(zip(elements, copied))
    if shared is None:
        shared = {t: by_name[t] for t in recipe.constant_tensors}
        recipe.constants[graph] = shared
    by_name.update(shared)
    result = []
    for t in recipe.outputs:
        if isinstance(t, tf.Tensor) and t.graph is inner:
            t = values[t.name] if t.name in values else by_name[t.name]
        result.append(t)
    return tf.nest.pack_sequence_as(
        concrete.structured_outputs, result, expand_composites=True
    )


class _CopyRecipe:
    """What every `inline_copy` of one function's graph needs: its ops
    without the placeholders fed, the outputs to return, and which fed
    placeholder each used input (data or control) maps to."""

    def __init__(self, concrete):
        inner = concrete.graph
        placeholders = {p.name for p in inner.inputs}
        fed = {name.split(":")[0] for name in placeholders}
        graph_def = inner.as_graph_def()
        kept = [node for node in graph_def.node if node.name not in fed]
        del graph_def.node[:]
        graph_def.node.extend(kept)
        self.graph_def = graph_def
        self.outputs = tf.nest.flatten(
            concrete.structured_outputs, expand_composites=True
        )
        self.wanted = [
            t.name
            for t in self.outputs
            if isinstance(t, tf.Tensor)
            and t.graph is inner
            and t.name not in placeholders
        ]
        # Only what the copied ops use (an unused mapping is refused), data
        # and control edges alike.
        used = {
            i.split(":")[0] if i.endswith(":0") else i
            for n in kept
            for i in n.input
        }
        self.input_map = []  # (input_map key, placeholder's tensor name)
        for tensor_name in sorted(placeholders):
            op_name = tensor_name.split(":")[0]
            if tensor_name in used or (
                tensor_name.endswith(":0") and op_name in used
            ):
                self.input_map.append((tensor_name, tensor_name))
            if "^" + op_name in used:
                self.input_map.append(("^" + op_name, tensor_name))
        # Constants (without control inputs) are imported with the first
        # copy in a graph only; later copies use those: a smaller graph for
        # the workers to set up (about a third of a step's ops are Const).
        constants = {
            n.name
            for n in kept
            if n.op == "Const" and not any(i.startswith("^") for i in n.input)
        }
        self.constant_tensors = sorted(c + ":0" for c in constants)
        self.without_constants = tf.compat.v1.GraphDef()
        self.without_constants.CopyFrom(graph_def)
        del self.without_constants.node[:]
        rest = [n for n in kept if n.name not in constants]
        self.without_constants.node.extend(rest)
        inputs = {i for n in rest for i in n.input}
        self.constant_inputs = []  # (input_map key, constant's tensor)
        for c in sorted(constants):
            for key in (c, c + ":0", "^" + c):
                if key in inputs:
                    self.constant_inputs.append((key, c + ":0"))
        # Graph -> its copies' constants. Kept as long as this trace (the
        # functions that hold the trace hold those graphs too).
        self.constants = {}


def _copy_recipe(concrete) -> _CopyRecipe:
    """`concrete`'s `_CopyRecipe`, made at its first copy."""
    recipe = getattr(concrete, "_tf2sync_copy_recipe", None)
    if recipe is None:
        recipe = _CopyRecipe(concrete)
        concrete._tf2sync_copy_recipe = recipe
    return recipe
