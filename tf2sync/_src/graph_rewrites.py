"""Rewrites of a traced replica step's graph, after tracing.

TF offers no public way to change a traced graph, and each rewrite below
saves a worker<->ps transfer per step that TF's placement would otherwise
add (docs/benchmarks.md, "Measurements behind the code"):

* `PackedReads`: a step's dense variable reads (and forward embedding
  lookups) cross from each ps as one tensor.
* `order_only_reads_after`: only the step's reads and stateful ops wait
  for its tag; pure ops do not.
* `riders`: the step's metric writes to a ps take their values from the
  push's tensor on that ps.
"""

from __future__ import annotations

import tensorflow as tf

from tf2sync._src import wire
from tf2sync._src.internals import graph_ops
from tf2sync._src.internals import ps_variables


class PackedReads:
    """One tensor per parameter server carries a step's variable reads.

    Each variable a replica step reads densely is otherwise its own transfer
    from the ps to the worker, and on a small model those transfers are
    most of the step. Inside this scope TF's own read cache for
    ParameterServerStrategy variables (`cache_variable_reads`) gives each
    variable one read per step. On exit the cached reads are regrouped:
    per (ps, dtype), the reads are concatenated on the ps, and the cached
    tensors on the worker are rewired to slices of that one tensor. The
    values are those of the individual reads (all after the tag). A step
    that wrote a variable and read it again would see the first read,
    which tf2sync rules out for trainable variables, the only ones packed:
    they only change in the ps's critical section. The push (and with it
    the apply and its moving averages) is traced by `merge_call` in the
    caller's thread, outside this replica thread's cache: it reads the ps.
    The step's forward lookups (an embedding's gather, ordered after the tag
    like every read) stay on the ps too, and their rows join the same
    tensor, so that a step with an embedding brings its weights in one
    transfer, not two. A lookup whose rows are also used on a ps keeps its
    own.
    """

    def __init__(self, variables, first_op):
        self._variables = variables
        self._first_op = first_op  # where the step's ops start in the graph
        self._scope = None

    def __enter__(self):
        if ps_variables.in_read_caching_scope():
            return self  # already caching (nesting is not supported)
        self._scope = ps_variables.read_caching_scope()
        self._scope.__enter__()
        self._candidates = list(self._variables.values())
        for var in self._candidates:
            ps_variables.start_read_cache(var)
        return self

    def __exit__(self, *exc):
        if self._scope is None:
            return False
        try:
            if exc[0] is None:
                self._pack()
        finally:
            for var in self._candidates:
                ps_variables.clear_read_cache(var)
            self._scope.__exit__(*exc)
        return False

    def _pack(self):
        graph = tf.compat.v1.get_default_graph()
        groups = {}
        for var in self._candidates:
            cached = ps_variables.cached_read(var)
            if (
                cached is None
                or not var.trainable  # may be written, then read, in a step
                or cached.graph is not graph
                or cached.op.type != "Identity"
                or not var.shape.is_fully_defined()
            ):
                continue
            key = (
                ps_variables.inner_variable(var).device,
                var.dtype.base_dtype,
            )
            groups.setdefault(key, []).append(var)
        gathers = {}
        for var, gather in self._gathers(graph):
            key = (
                ps_variables.inner_variable(var).device,
                var.dtype.base_dtype,
            )
            gathers.setdefault(key, []).append((var, gather))
        for key in list(groups) + [k for k in gathers if k not in groups]:
            group = groups.get(key, [])
            lookups = gathers.get(key, [])
            if len(group) + len(lookups) < 2:
                continue  # nothing to save
            # The reads themselves stay where they were traced (ordered
            # after the tag, and before the step's push by automatic control
            # dependencies); only their transfer to the worker is packed.
            with tf.device(key[0]):
                flat_rows = [tf.reshape(g.outputs[0], [-1]) for _, g in lookups]
                packed = tf.concat(
                    wire.flatten(
                        [
                            ps_variables.cached_read(v).op.inputs[0]
                            for v in group
                        ]
                    )
                    + flat_rows,
                    axis=0,
                )
            ours = tuple(t.op for t in flat_rows)
            # A gather's rows: as many as its ids, which the worker has.
            shapes = [
                tf.concat(
                    [
                        tf.shape(g.inputs[1]),
                        tf.constant(v.shape[1:].as_list(), tf.int32),
                    ],
                    axis=0,
                )
                for v, g in lookups
            ]
            sizes = [v.shape.num_elements() for v in group]
            if lookups:
                sizes = tf.stack(
                    [tf.constant(n) for n in sizes]
                    + [tf.reduce_prod(shape) for shape in shapes]
                )
            pieces = tf.split(packed, sizes, num=len(group) + len(lookups))
            for var, piece in zip(group, pieces):
                if var.shape.rank == 1:  # no op: its length, if unknown
                    piece.set_shape(var.shape)
                else:
                    piece = tf.reshape(piece, var.shape)
                graph_ops.update_op_input(
                    ps_variables.cached_read(var).op, 0, piece
                )
            for (_, gather), piece, shape in zip(
                lookups, pieces[len(group) :], shapes
            ):
                rows = gather.outputs[0]
                piece = tf.reshape(piece, shape)
                piece.set_shape(rows.shape)
                for consumer, index in self._worker_uses(rows, ours):
                    graph_ops.update_op_input(consumer, index, piece)

    def _gathers(self, graph):
        """The step's lookups of packable variables: (variable, gather op).

        Only forward lookups, whose rows go to the worker: a gather of a
        trainable variable with a static shape, not placed on a ps by the
        caller (ops of the push are), with batch_dims 0, whose rows are
        used by ops not placed on a ps.
        """
        handles = {}
        for var in self._candidates:
            if var.trainable and var.shape.is_fully_defined():
                handles[id(ps_variables.inner_variable(var).handle)] = var
        captured = {id(inner): outer for outer, inner in graph.captures}
        found = []
        for op in graph.get_operations()[self._first_op :]:
            if op.type != "ResourceGather" or "/job:" in op.device:
                continue
            outer = captured.get(id(op.inputs[0]))
            var = handles.get(id(outer)) if outer is not None else None
            if var is None or op.get_attr("batch_dims") != 0:
                continue
            if self._worker_uses(op.outputs[0], ()):
                found.append((var, op))
        return found

    @staticmethod
    def _worker_uses(tensor, exclude):
        """(consumer, input index) of `tensor`, for consumers off the ps."""
        uses = []
        for consumer in tensor.consumers():
            if consumer in exclude:
                continue
            if "/job:ps" in consumer.device or any(
                not group.endswith(consumer.name.encode())
                for group in consumer.colocation_groups()
            ):
                return []  # used on a ps too: leave this lookup alone
            for index, t in enumerate(consumer.inputs):
                if t is tensor:
                    uses.append((consumer, index))
        return uses


def order_only_reads_after(tag, operations):
    """Orders the step's reads and stateful ops, and only them, after its tag.

    The step is traced under a control dependency on its tag, but TF adds
    it only to ops none of whose inputs were made in the same scope: an
    embedding's gather, say, follows the tag only through the cast of its
    ids. Here every op of the step that takes a resource (a variable read,
    a gather, a call) or is stateful gets the tag as a control input of its
    own, and every pure op (stateless, no resource input) loses it: a pure
    op computes the same value whenever it runs, so that dependency only
    delayed it, and for ops on the worker it cost a transfer from the ps
    per step.
    """
    for op in operations:
        control = op.control_inputs
        if graph_ops.op_is_stateful(op) or any(
            t.dtype == tf.resource for t in op.inputs
        ):
            if tag.op not in control:
                graph_ops.add_control_inputs(op, [tag.op])
        elif tag.op in control:
            graph_ops.replace_control_inputs(
                op, [c for c in control if c is not tag.op]
            )


_WRITES = frozenset(
    ["AssignAddVariableOp", "AssignSubVariableOp", "AssignVariableOp"]
)


def riders(graph, start, device):
    """The step's writes whose values can ride in the push to `device`.

    Each write to a variable on a ps of a value computed on the worker is a
    transfer of its own: `model.fit`'s compiled loss adds two per step (its
    `Mean`'s total and count), where the push is the only other transfer
    from the worker. Those writes (ops `start` on in `graph`, traced before
    the push) may take the value from the push's tensor on the ps instead:
    the same value, written once the push has arrived rather than when it
    was computed. A write rides if its variable lives on `device`, its
    value is float32 with a static shape, and the op computing the value
    sits on no ps and reads no resource (it runs on the worker).
    """
    here = tf.DeviceSpec.from_string(device)
    found = []
    for op in graph.get_operations()[start:]:
        if op.type not in _WRITES:
            continue
        handle_device = captured_device(graph, op.inputs[0])
        value = op.inputs[1]
        producer = value.op
        if (
            handle_device
            and tf.DeviceSpec.from_string(handle_device) == here
            and value.dtype == tf.float32
            and value.shape.is_fully_defined()
            and "/job:" not in producer.device
            and not any(t.dtype == tf.resource for t in producer.inputs)
        ):
            found.append(op)
    return found


def among_ancestors(ops, tensors):
    """The ops of `ops` that `tensors` depend on (data or control)."""
    wanted = set(ops)
    found = set()
    seen = set()
    stack = [t.op for t in tensors]
    while stack and found != wanted:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if op in wanted:
            found.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return found


def captured_device(graph, tensor):
    """The device of the eager tensor that `tensor` captures, or None."""
    while tf.is_symbolic_tensor(tensor):
        outer = None
        for captured, inner in graph.captures:
            if inner is tensor:
                outer = captured
                break
        if outer is None:
            return None
        if not tf.is_symbolic_tensor(outer):
            return outer.device
        graph, tensor = outer.graph, outer
    return None
