"""Copying a function's graph into another graph, once more [2.21]
[2.15: kept].

`inline_copy` makes what tracing a function's Python again would build,
without running that Python (a repeated step's copies); no public API
copies a function graph with its inputs mapped.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.framework import importer as graph_importer


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

    What tracing `concrete`'s Python again here would build, without running
    that Python: its ops are imported under the name scope `name`, its
    arguments (the flat tensors of `args`: tensors and composite tensors
    only) and captures fed from this graph (captured through it when they
    live elsewhere), and its nested functions shared. Its constants are the
    first copy's in this graph (see `_CopyRecipe`), so copies into one graph
    must not be made under different `tf.control_dependencies` contexts (the
    shared constants keep the first copy's); its nested functions are added
    to a graph with its first copy there. Outside any device or colocation
    scope its ops are placed after the import, as the import would place
    them (see `_CopyRecipe`; `Operation._set_device`, as the import's
    `_ProcessNewOps` uses it). Returns its
    structured outputs, with this copy's tensors. Stands in for function
    inlining, which TF applies only when a function runs (`import_graph_def`
    without colocation checks, since the arguments' placeholders are not
    copied, as `importer.import_graph_def_for_function` does; no public API
    copies a function graph with inputs mapped). [2.21] [2.15]: `fit_test`
    runs it on both.
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
    first = shared is None  # the first copy here: its constants serve the rest
    if first:
        elements = recipe.wanted + recipe.constant_tensors
        graph_def = recipe.graph_def
    else:
        elements = [t for t in recipe.wanted if t not in shared]
        graph_def = recipe.without_constants
        for key, tensor_name in recipe.constant_inputs:
            input_map[key] = shared[tensor_name]
    placed = []
    if not _device_or_colocation_scope(graph):  # placed after the import
        graph_def, placed = recipe.without_devices[first]
    copied = graph_importer._import_graph_def_internal(
        graph_def,
        input_map=input_map,
        return_elements=elements + [n for n, _ in placed],
        validate_colocation_constraints=False,
        name=name,
    )
    for (_, device), op in zip(placed, copied[len(elements) :]):
        op._set_device(device)
    by_name = dict(zip(elements, copied))
    if first:
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
        # Nor its functions: the first copy added them to the graph.
        self.without_constants.ClearField("library")
        inputs = {i for n in rest for i in n.input}
        self.constant_inputs = []  # (input_map key, constant's tensor)
        for c in sorted(constants):
            for key in (c, c + ":0", "^" + c):
                if key in inputs:
                    self.constant_inputs.append((key, c + ":0"))
        # Graph -> its copies' constants. Kept as long as this trace (the
        # functions that hold the trace hold those graphs too).
        self.constants = {}
        # The import places each op by entering its device as a scope
        # (`tf.device`: in TF2 about 0.1 ms of Python per op). Outside any
        # device or colocation scope that makes the op's own device,
        # canonical: the copies import their ops without devices and get
        # them set after; colocated ops, and those they are colocated
        # with, are left to the import.
        self.without_devices = {
            True: _without_devices(graph_def),
            False: _without_devices(self.without_constants),
        }


def _without_devices(graph_def):
    """`(graph_def, [(node name, canonical device)])`: the nodes listed
    have their devices cleared, to be set after the import. The import
    still places the colocated nodes (it ignores their own devices), from
    the devices of the nodes they are colocated with, which keep theirs."""
    bare = tf.compat.v1.GraphDef()
    bare.CopyFrom(graph_def)
    colocations = {
        node.name: {
            group[len(b"loc:@") :].decode()
            for group in node.attr["_class"].list.s
            if group.startswith(b"loc:@")
        }
        - {node.name}
        for node in bare.node
        if "_class" in node.attr
    }
    by_import = {n for n, targets in colocations.items() if targets}
    by_import.update(t for targets in colocations.values() for t in targets)
    placed = []
    for node in bare.node:
        if node.device and node.name not in by_import:
            spec = tf.DeviceSpec.from_string(node.device)
            placed.append((node.name, spec.to_string()))
            node.device = ""
    return bare, placed


def _device_or_colocation_scope(graph) -> bool:
    """Whether ops made in `graph` now get a device or colocation from an
    enclosing `tf.device` or colocation scope (no public API says whether
    one is open: the graph's two stacks, read). [2.21] [2.15]: loops_test
    runs on both."""
    return any(True for _ in graph._device_function_stack.peek_objs()) or any(
        True for _ in graph._colocation_stack.peek_objs()
    )


def _copy_recipe(concrete) -> _CopyRecipe:
    """`concrete`'s `_CopyRecipe`, made at its first copy."""
    recipe = getattr(concrete, "_tf2sync_copy_recipe", None)
    if recipe is None:
        recipe = _CopyRecipe(concrete)
        concrete._tf2sync_copy_recipe = recipe
    return recipe
