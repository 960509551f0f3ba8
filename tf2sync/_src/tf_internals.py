"""Every private TensorFlow / tf_keras API tf2sync uses, behind one door.

No other module of tf2sync imports `tensorflow.python` or `tf_keras.src`
(`tests/lint_test.py` checks) or reads a private attribute of a TF or
tf_keras object. Each name here says (a) the public API it stands in for,
or why there is none, and (b) the versions it was checked on, as a tag:

* `[2.21]`: read and tested on TF 2.21.0 with tf_keras 2.21.0 (`.venv`).
* `[2.15: kept]`: TF 2.15.1 with tf_keras 2.15 and tensorflow-addons, the
  CI's second environment (`requirements-tfa.txt`), whose sources were not
  at hand here: the 2.15 path is the one the previous code, run by that
  CI, had.

A section's tag applies to each of its names unless the name has its own.
When a TF or tf_keras upgrade breaks tf2sync, the break is in this file.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import threading
import typing

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.python.autograph.core import ag_ctx as autograph_ctx
from tensorflow.python.autograph.core import config as autograph_config
from tensorflow.python.autograph.core import converter as autograph_converter
from tensorflow.python.data.experimental.ops import data_service_ops
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import input_lib
from tensorflow.python.distribute import parameter_server_strategy_v2
from tensorflow.python.distribute import ps_values
from tensorflow.python.distribute import sharded_variable
from tensorflow.python.distribute.coordinator import (
    cluster_coordinator as coordinator_lib,
)
from tensorflow.python.distribute.coordinator import (
    values as coordinator_values,
)
from tensorflow.python.eager import context as eager_context
from tensorflow.python.eager import executor as eager_executor
from tensorflow.python.framework import importer as graph_importer
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.trackable import base as trackable
from tf_keras.src.engine import base_layer as keras_base_layer
from tf_keras.src.engine import data_adapter as keras_data_adapter
from tf_keras.src.engine import training as keras_training
from tf_keras.src.mixed_precision import autocast_variable
from tf_keras.src.mixed_precision import loss_scale_optimizer as lso
from tf_keras.src.optimizers.legacy import optimizer_v2 as legacy_optimizer_v2

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


# Distribute / ParameterServerStrategy [2.21] [2.15: kept] --------------------
# PSS's variables, read cache and datasets have no public handles beyond
# `tf.distribute.Strategy`'s.


def plain_resource_variable(
    initial_value, name, dtype=None, *, device=None, trainable=False
):
    """A resource variable outside any strategy, made under `init_scope`.

    No public form: `tf.Variable` goes through the creator of the strategy
    in scope (under PSS: a ps variable, placed round-robin).
    """
    place = tf.device(device) if device else contextlib.nullcontext()
    with tf.init_scope(), place:
        return resource_variable_ops.ResourceVariable(
            initial_value, trainable=trainable, name=name, dtype=dtype
        )


def is_caching_variable(var) -> bool:
    """Whether `var` is PSS's variable with a read cache (no public class:
    `ps_values.CachingVariable`, what PSS's creator returns or wraps)."""
    return isinstance(var, ps_values.CachingVariable)


class _PerGraphCachingVariable(ps_values.CachingVariable):
    """A `CachingVariable` whose cached read is only reused where reachable.

    PSS's cache (`cached_read_value`) returns one tensor per variable per
    caching scope, whatever graph asks. A step that first reads a variable
    inside a nested graph (a `tf.cond` branch, a `Sequential` inferring its
    shapes in a scratch graph on its first call) then got that graph's
    tensor outside it: `InaccessibleTensorError`. Here a cached read is
    reused in its own graph and in graphs nested in it (which capture it);
    elsewhere the variable is read again and that read becomes the cache.
    """

    __slots__ = ()

    def cached_read_value(self):
        cached = super().cached_read_value()
        cached_graph = getattr(cached, "graph", None)  # None: eager
        if tf.executing_eagerly():  # under `init_scope` in a step
            return cached if cached_graph is None else self._v.read_value()
        graph = tf.compat.v1.get_default_graph()
        while graph is not None:
            if graph is cached_graph:
                return cached
            graph = getattr(graph, "outer_graph", None)
        self._cache = None
        return super().cached_read_value()


def cache_reads_per_graph(var) -> None:
    """Makes PSS's read cache of `var` graph-aware: see
    `_PerGraphCachingVariable` (a class swap: PSS's creator builds the
    wrapper with no way to choose its class). `var`: a `CachingVariable`,
    or the `AggregatingVariable` PSS wraps around one on workers with
    several GPUs (its reads go through the cache it wraps)."""
    if isinstance(var, ps_values.AggregatingVariable):
        var = var.get()
    if type(var) is ps_values.CachingVariable:
        var.__class__ = _PerGraphCachingVariable


def is_sharded_variable(var) -> bool:
    """Whether `var` is a `ShardedVariable` (what PSS's creator returns for
    a partitioned variable; exported only as
    `tf.__internal__.distribute.ShardedVariable`)."""
    return isinstance(var, sharded_variable.ShardedVariable)


def shards(variables) -> list:
    """`variables` with each `ShardedVariable` replaced by its shards, in
    order (a shard is a variable of its own on one ps)."""
    flat = []
    for var in variables:
        if is_sharded_variable(var):
            flat.extend(var.variables)
        else:
            flat.append(var)
    return flat


def in_read_caching_scope() -> bool:
    """Whether `read_caching_scope()` is active (it cannot nest)."""
    return distribute_utils.caching_scope_local.in_caching_scope()


def read_caching_scope():
    """PSS's `cache_variable_reads()` scope: one read per variable.

    Internal to PSS (tf_keras's coordinator evaluation used it).
    """
    return distribute_utils.cache_variable_reads()


def start_read_cache(var) -> None:
    """Empties `var`'s read cache and ties it to the current caching scope
    (`_cache`, `_current_new_cache_scope_count`)."""
    var._cache = None
    count = distribute_utils.caching_scope_local.new_cache_scope_count
    var._current_new_cache_scope_count = count


def clear_read_cache(var) -> None:
    """Empties `var`'s read cache (`_cache`)."""
    var._cache = None


def cached_read(var):
    """The tensor `var`'s read cache holds, or None (`_cache`)."""
    return var._cache


def inner_variable(var):
    """The variable a `CachingVariable` wraps (`_v`): its `device` is the
    ps task's; its `handle` is what the step's reads capture."""
    return var._v


# The class of `strategy.extended` under PSS, for subclassing: no public
# name (tf2sync overrides its `_create_variable`, `_update` and
# `_experimental_distribute_dataset` hooks).
ParameterServerExtended = (
    parameter_server_strategy_v2.ParameterServerStrategyV2Extended
)


def replace_extended_class(strategy, cls) -> None:
    """Makes `strategy.extended` a `cls`, a subclass of its class: PSS's
    `__init__` builds it with no way to choose the class."""
    if not issubclass(cls, type(strategy.extended)):
        raise TypeError(f"{cls!r} does not subclass {type(strategy.extended)}")
    strategy.extended.__class__ = cls


def num_workers(strategy) -> int:
    """A PSS's worker tasks (`extended._num_workers`), 1 for another
    strategy; public only through its cluster resolver's spec."""
    return int(getattr(strategy.extended, "_num_workers", 1))


def cluster_resolver(strategy):
    """The strategy's `ClusterResolver`, or None. PSS keeps the one it was
    given in `_cluster_resolver`; its public `cluster_resolver` property
    answers None. [2.21] [2.15]: `fit_test` reaches it on both."""
    return strategy.cluster_resolver or getattr(
        strategy, "_cluster_resolver", None
    )


def num_gpus_per_worker(strategy) -> int:
    """A PSS's GPUs per worker (`extended._num_gpus_per_worker`)."""
    return int(strategy.extended._num_gpus_per_worker)


def is_distributed_dataset(obj) -> bool:
    """Whether `obj` is what `experimental_distribute_dataset` returns
    (`input_lib.DistributedDataset`; `tf.distribute.DistributedDataset` is
    an interface that `distribute_datasets_from_function`'s shares)."""
    return isinstance(obj, input_lib.DistributedDataset)


def distributed_dataset_is_built(dataset) -> bool:
    """Whether a `DistributedDataset` built its iterators (`_built`)."""
    return bool(dataset._built)


def distributed_dataset_source(dataset):
    """The dataset a `DistributedDataset` wraps (`_original_dataset`)."""
    return dataset._original_dataset


def worker_local_dataset(dataset):
    """The one `tf.data.Dataset` of a distributed dataset built inside a
    per-worker dataset function (`_datasets[0]`, `_cloned_datasets[0]`);
    any other `dataset` unchanged."""
    if isinstance(dataset, input_lib.DistributedDatasetsFromFunction):
        return dataset._datasets[0]
    if isinstance(dataset, input_lib.DistributedDataset):
        return dataset._cloned_datasets[0]
    return dataset


# Coordinator [2.21] [2.15: kept] ---------------------------------------------
# `tf.distribute.coordinator.ClusterCoordinator` and
# `tf.distribute.experimental.coordinator.PerWorkerValues` are public: the very
# classes of `cluster_coordinator` and `coordinator.values` [2.21].


def strategy_coordinator(strategy):
    """The `ClusterCoordinator` of `strategy`, or None
    (`_cluster_coordinator`; `ClusterCoordinator(strategy)` makes one)."""
    return getattr(strategy, "_cluster_coordinator", None)


def coordinator_workers(coordinator) -> list:
    """The coordinator's workers, in task order (`_cluster.workers`); each
    has `create_resource(fn)`. No public list."""
    return list(coordinator._cluster.workers)


def indexed_per_worker_dataset(coordinator, dataset_fn_of):
    """`coordinator.create_per_worker_dataset`, with one function per worker:
    worker i's dataset and iterator resources are made by
    `dataset_fn_of(i)` (a function of no arguments), traced for it, so a
    worker that restarts rebuilds them with its own function. It is traced
    as tf2sync's code (`function_of_tf2sync`): it converts the user's
    function it calls (`convert_as_caller`).

    `values.PerWorkerDatasetFromDatasetFunction` traces one function for
    every worker; this subclass keeps one per worker and overrides the two
    methods that call it (`build`, `__iter__`), as they are in [2.21] and
    [2.15]. `element_spec` is worker 0's (the same for all).
    """
    return _IndexedPerWorkerDataset(dataset_fn_of, coordinator)


def _no_variables(next_creator, **kwargs):
    del next_creator, kwargs
    raise ValueError("Creating variables in `dataset_fn` is not allowed.")


class _IndexedPerWorkerDataset(
    coordinator_values.PerWorkerDatasetFromDatasetFunction
):
    def __init__(self, dataset_fn_of, coordinator):
        functions = []
        with tf.variable_creator_scope(_no_variables):
            for i in range(len(coordinator_workers(coordinator))):
                functions.append(
                    function_of_tf2sync(
                        dataset_fn_of(i)
                    ).get_concrete_function()
                )
        super().__init__(functions[0], coordinator)
        self._functions = functions

    def _per_worker(self, make):
        workers = coordinator_workers(self._coordinator)
        return coordinator_values.PerWorkerValues(
            tuple(
                worker.create_resource(make(function))
                for worker, function in zip(workers, self._functions)
            )
        )

    def build(self):
        def dataset_maker(function):
            return lambda: function()

        datasets = self._per_worker(dataset_maker)
        spec = self._dataset_fn.structured_outputs._type_spec
        for remote in datasets._values:
            remote._type_spec = spec
        return datasets

    def __iter__(self):
        if (
            not tf.executing_eagerly()
            or tf.compat.v1.get_default_graph().building_function
        ):
            raise RuntimeError(
                "__iter__() is not supported inside of tf.function or in "
                "graph mode."
            )

        def iterator_maker(function):
            return lambda: iter(function())

        iterators = self._per_worker(iterator_maker)
        spec = input_lib.get_iterator_spec_from_dataset(
            self._coordinator.strategy, self._dataset_fn.structured_outputs
        )
        for remote in iterators._values:
            remote._type_spec = spec
        return coordinator_values.PerWorkerDistributedIterator(
            iterators._values
        )


def inflight_closures(coordinator) -> tuple[int, bool]:
    """`(closures running on workers, whether none waits for a worker)`,
    from the closure queue; `coordinator.done()` is both in one bool."""
    queue = coordinator._cluster.closure_queue
    return int(queue._inflight_closure_count), queue._queue.empty()


def on_worker_failure(coordinator, callback) -> None:
    """Calls `callback(worker_index, error)` when a worker fails a closure.

    PSS tells nobody: its `Worker._on_closure_failure` (run once the
    failure handler has classified the error as a worker failure, before
    it waits for the worker to come back) puts the closure back. Wrapped
    per worker instance, after the closure is back in the queue.
    """
    for worker in coordinator._cluster.workers:
        original = worker._on_closure_failure
        if getattr(original, "_tf2sync_hooked", False):
            continue

        def hooked(
            closure, error, original=original, index=worker.worker_index
        ):
            original(closure, error)
            callback(index, error)

        hooked._tf2sync_hooked = True
        worker._on_closure_failure = hooked


def on_function_error(coordinator, callback) -> None:
    """Calls `callback(error)` when a scheduled function fails with an
    error of its own (not a worker failure: see `on_worker_failure`).

    PSS records it with its closure queue's `mark_failed`, wrapped here
    once per queue, after the error is recorded.
    """
    queue = coordinator._cluster.closure_queue
    original = queue.mark_failed
    if getattr(original, "_tf2sync_hooked", False):
        return

    def hooked(error):
        original(error)
        callback(error)

    hooked._tf2sync_hooked = True
    queue.mark_failed = hooked


def track_closures(coordinator) -> None:
    """Lets `take_over_closure` move a worker's in-flight closure.

    Replaces each worker's `_process_closure` (per instance; its thread
    looks the method up for every closure) with `_process_tracked`: TF's
    own [2.21] [2.15: the same], plus the record of the closure running and
    the check, when it returns or fails, that nobody took it over.
    """
    for worker in coordinator._cluster.workers:
        if getattr(worker, "_tf2sync_lock", None) is not None:
            continue
        worker._tf2sync_lock = threading.Lock()
        worker._tf2sync_running = None
        worker._tf2sync_taken = None
        worker._process_closure = lambda closure, worker=worker: (
            _process_tracked(worker, closure)
        )


def take_over_closure(coordinator, index: int) -> bool:
    """Puts worker `index`'s in-flight closure back in the queue.

    Another worker then runs it, and the coordinator's count of closures in
    flight no longer includes it (`join` does not wait for it). Whatever
    the original run returns or raises later is ignored. Returns whether
    there was a closure to move (`track_closures` must have run).
    """
    worker = coordinator._cluster.workers[index]
    lock = getattr(worker, "_tf2sync_lock", None)
    if lock is None:
        return False
    with lock:
        closure = worker._tf2sync_running
        if closure is None or worker._tf2sync_taken is closure:
            return False
        worker._tf2sync_taken = closure
        coordinator._cluster.closure_queue.put_back(closure)
    return True


def _process_tracked(worker, closure):
    """`Worker._process_closure`, for `track_closures`."""
    lock = worker._tf2sync_lock
    queue = worker._cluster.closure_queue
    with lock:
        worker._tf2sync_running = closure

    def taken_over():
        # Else the closure is ours to finish: nobody may take it over now.
        with lock:
            if worker._tf2sync_taken is closure:
                return True
            worker._tf2sync_running = None
            return False

    def on_failure(error):
        if not taken_over():
            worker._on_closure_failure(closure, error)
            return
        with worker._resource_tracking_lock:  # the rest of that method
            worker._is_dead_with_error = error
            worker._set_resources_aborted(error)

    def on_transient_failure():
        if not taken_over():
            queue.put_back(closure)

    try:
        with worker.failure_handler.wait_on_failure(
            on_failure_fn=on_failure,
            on_transient_failure_fn=on_transient_failure,
            on_recovery_fn=worker._on_worker_recovery,
            worker_device_name=worker.device_name,
        ):
            closure.execute_on(worker)
            # The fetch waits on the worker too: it can be taken over still.
            closure.maybe_call_with_output_remote_value(lambda r: r.get())
            if taken_over():
                return
            queue.mark_finished()
    except Exception as e:  # noqa: BLE001 - as TF's, which reports it
        with lock:
            if worker._tf2sync_taken is closure:
                return
            worker._tf2sync_running = None  # ours to fail: not movable now
        if not isinstance(e, tf.errors.CancelledError):
            tf.compat.v1.logging.error(
                " /job:worker/task:%d encountered the following error when "
                "processing closure: %r:%s",
                worker.worker_index,
                e,
                e,
            )
        closure.maybe_call_with_output_remote_value(
            lambda r, error=e: r._set_error(error)
        )
        queue.mark_failed(e)
    finally:
        with lock:
            if worker._tf2sync_running is closure:
                worker._tf2sync_running = None
            if worker._tf2sync_taken is closure:
                worker._tf2sync_taken = None


def worker_pinger(device: str):
    """`ping()`: runs a scalar op on `device` and waits for its answer.

    With an executor of its own (as PSS gives each worker), so that a ping
    waiting on a frozen worker blocks nothing else. No public way to pick
    an executor.
    """
    executor = eager_executor.new_executor(enable_async=False)
    one = tf.constant(1, tf.int64)

    def ping():
        with eager_context.executor_scope(executor), tf.device(device):
            return int(tf.identity(one).numpy())

    return ping


@contextlib.contextmanager
def being_scheduled(strategy):
    """Marks `strategy` as tracing a function for `ClusterCoordinator.
    schedule` (its `_being_scheduled`, which `schedule` sets around its
    own trace): PSS then does not warn, once per `run` in the trace, that
    the call is not scheduled [2.21] [2.15]."""
    extended = strategy.extended
    before = getattr(extended, "_being_scheduled", False)
    extended._being_scheduled = True
    try:
        yield
    finally:
        extended._being_scheduled = before


def worker_slice_specs(structure, worker: int = 0):
    """Worker `worker`'s slice of `schedule` arguments, as the specs
    `ClusterCoordinator.schedule` traces a function with."""
    return tf.nest.map_structure(
        coordinator_lib._maybe_as_type_spec,
        coordinator_lib._select_worker_slice(worker, structure),
    )


def caller_self_of_type(type_name):
    """The nearest caller's `self` whose class is named `type_name`, or None.

    tf_keras's data handlers call the strategy without saying who they are;
    the stack does (`sys._getframe`). If tf_keras renamed the class, this
    finds nothing and each caller falls to its safe side. The names used
    (`_ClusterCoordinatorDataHandler`, `..ExactEvalDataHandler`) [2.21].
    """
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if type(owner).__name__ == type_name:
            return owner
        frame = frame.f_back
    return None


def _keras_call(model):
    """The nearest frame of `model`'s `fit`, `evaluate` or `predict` (any
    tf_keras model's where `model` is None), or None (`sys._getframe`;
    tf_keras's method names [2.21] [2.15])."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in ("fit", "evaluate", "predict"):
            owner = frame.f_locals.get("self")
            if owner is model or (
                model is None and isinstance(owner, tf_keras.Model)
            ):
                return frame
        frame = frame.f_back
    return None


def keras_entry_point(model):
    """Which of `model`'s `fit`, `evaluate` or `predict` is running now
    (the nearest on the stack: `evaluate` inside `fit` for its validation
    data), or None."""
    frame = _keras_call(model)
    return None if frame is None else frame.f_code.co_name


def keras_input_role(model=None):
    """What the input being built now is for: "fit" (its training data),
    "validation" (`fit`'s `validation_data`), "evaluate", "predict", or
    None outside them. `fit` builds its training data handler first, into
    its local `data_handler`, and its validation one after [2.21] [2.15]."""
    frame = _keras_call(model)
    return None if frame is None else _input_role_of(frame)


class FitValidation(typing.NamedTuple):
    """What a running `fit` will validate on (`fit_validation`)."""

    data: object  # `validation_data`, after `validation_split` made it
    x: object  # its inputs, unpacked as tf_keras unpacks them
    y: object  # its targets
    steps: object  # `validation_steps`
    validates: bool  # whether any epoch of this `fit` validates
    split: object = None  # `validation_split`


def fit_validation(model):
    """A `FitValidation` of `model`'s `fit` while it builds its training
    input, or None: outside `fit`, or once that input is built
    (`keras_input_role`). tf_keras's argument and local names (`val_x`,
    `val_y`), its truth test of `validation_data` and `_should_eval`
    [2.21] [2.15]."""
    frame = _keras_call(model)
    if frame is None or _input_role_of(frame) != "fit":
        return None
    local = frame.f_locals
    data = local.get("validation_data")
    try:
        validates = bool(data)
    except ValueError:  # an array: tf_keras's own test refuses it
        validates = True
    if validates:
        freq = local.get("validation_freq", 1)
        try:
            validates = any(
                model._should_eval(epoch, freq)
                for epoch in range(
                    local.get("initial_epoch", 0), local.get("epochs", 1)
                )
            )
        except ValueError:  # a bad validation_freq: tf_keras says so
            validates = True
    return FitValidation(
        data,
        local.get("val_x"),
        local.get("val_y"),
        local.get("validation_steps"),
        validates,
        local.get("validation_split"),
    )


def keras_converts_for_coordinator(x, y) -> bool:
    """Whether tf_keras's coordinator data handler turns `x` and `y` into a
    dataset: both tensors, NumPy arrays or pandas objects (otherwise it
    raises NotImplementedError) [2.21] [2.15]."""
    types = keras_data_adapter._get_tensor_types()
    return isinstance(x, types) and isinstance(y, types)


def _input_role_of(frame):
    """`keras_input_role` of a frame `_keras_call` found."""
    name = frame.f_code.co_name
    if name == "fit" and "data_handler" in frame.f_locals:
        return "validation"
    return name


def replica_mean_loss(loss_fn):
    """`loss_fn` allowed to reduce to the mean over a replica's batch
    under a strategy, where it is a tf_keras `Loss` of `AUTO` or
    `SUM_OVER_BATCH_SIZE` reduction (tf_keras refuses those under a
    strategy but in `compile`, which allows its own losses through
    `_allow_sum_over_batch_size` [2.21] [2.15]): a copy, the user's object
    left as it is. Any other `loss_fn` is returned as it is."""
    reduction = tf_keras.losses.Reduction
    if not isinstance(loss_fn, tf_keras.losses.Loss) or getattr(
        loss_fn, "reduction", None
    ) not in (reduction.AUTO, reduction.SUM_OVER_BATCH_SIZE):
        return loss_fn
    allowed = copy.copy(loss_fn)
    allowed._allow_sum_over_batch_size = True
    return allowed


def exact_evaluation_shards(model) -> int:
    """`compile(pss_evaluation_shards=...)` as tf_keras inferred it
    (`_pss_evaluation_shards`; 0 without exact evaluation) [2.21] [2.15]."""
    return int(getattr(model, "_pss_evaluation_shards", 0) or 0)


def after_each_epoch_join(handler, fn) -> None:
    """Makes a `_ClusterCoordinatorDataHandler` call `fn()` after each join
    that ends an epoch's steps: its `sync`, which `catch_stop_iteration`
    calls once the epoch's functions are scheduled [2.21] [2.15]."""
    join = handler.sync

    def sync():
        join()
        fn(join)

    handler.sync = sync


def data_handler_model(handler):
    """The model a tf_keras data handler serves (`_model`), or None."""
    return getattr(handler, "_model", None)


def data_handler_dataset_creator(handler):
    """The `DatasetCreator` a data handler reads (its adapter's), or None."""
    adapter = getattr(handler, "_adapter", None)
    return getattr(adapter, "dataset_creator", None)


def is_keras_arrays_creator(creator) -> bool:
    """Whether `creator` is the `DatasetCreator` tf_keras's coordinator data
    handler made of tensors, NumPy arrays or pandas objects
    (`_convert_to_dataset_creator`'s `_dataset_fn`) [2.21] [2.15]."""
    fn = getattr(creator, "dataset_fn", None)
    return getattr(fn, "__qualname__", "").startswith(
        "_ClusterCoordinatorDataHandler._convert_to_dataset_creator."
    )


def repeat_keras_arrays(creator) -> None:
    """Makes `creator` (`is_keras_arrays_creator`) repeat its dataset.

    tf_keras's adapter makes `epochs` passes over the arrays, each
    shuffled as `fit`'s `shuffle` says; under PSS each worker iterates its
    own copy with one iterator for the whole `fit`, so a worker that runs
    more batches than those passes hold fails its step. Repeated, each
    worker starts another pass instead. Its `dataset_fn` is replaced (by
    one `is_keras_arrays_creator` no longer recognises: never twice).
    """
    make = creator.dataset_fn
    creator.dataset_fn = lambda input_context: make(input_context).repeat()


def new_iterator_each_epoch(handler) -> None:
    """Makes a data handler create its iterator again at each epoch.

    `DatasetCreatorAdapter.should_recreate_iterator` is False (tf_keras
    expects a dataset function's shuffle to run across epochs); the handler
    asks its adapter at every epoch (`enumerate_epochs`) [2.21] [2.15].
    """
    handler._adapter.should_recreate_iterator = lambda: True


# Process start [2.21] [2.15: kept] -------------------------------------------
# Whether a fork of this process would share TensorFlow runtime state (see
# `processes.TaskForker`). The eager context has no public "initialised"
# flag. TF lists the physical devices at absl's app start
# (`distribute.combinations` registers a callback), before any launcher
# code: a CPU listing is harmless to a fork, a GPU one has started CUDA.


def runtime_started() -> bool:
    """Whether this process made its eager context or found a GPU."""
    ctx = eager_context.context()
    devices = getattr(ctx, "_physical_devices", None) or []
    return ctx._context_handle is not None or any(
        d.device_type == "GPU" for d in devices
    )


# AutoGraph [2.21] [2.15] ---------------------------------------------------
# AutoGraph converts every function a converted function calls, except those
# of modules on its list (tensorflow, tf_keras, numpy, ...). tf2sync's code
# runs inside the user's traced step (its `strategy.run`, its optimizer's
# `apply_gradients`), so without a place on that list AutoGraph rewrote
# tf2sync's Python, and ran its loops over a step's ops through its
# operators, on every first trace: most of a small model's trace
# (docs/performance.md, "Time to the first update"). There is no public API
# to add a module to the list (`tf.autograph.experimental.do_not_convert`
# marks one function, and turns conversion off for whatever it calls).


def skip_autograph_for_tf2sync() -> None:
    """Puts the `tf2sync` package on AutoGraph's do-not-convert list
    (`config.CONVERSION_RULES`, read at each call), once.

    As for TensorFlow's own code, a function of tf2sync called from
    converted code then runs as written, and the user's functions it calls
    are converted only where tf2sync converts them explicitly
    (`convert_as_caller`), as `tf.distribute.Strategy.run` does.
    """
    rule = autograph_config.DoNotConvert("tf2sync")
    rules = autograph_config.CONVERSION_RULES
    if not any(
        isinstance(r, type(rule)) and r._prefix == "tf2sync" for r in rules
    ):
        autograph_config.CONVERSION_RULES = (rule,) + tuple(rules)


def function_of_tf2sync(fn):
    """`tf.function(fn)` for a function of tf2sync's own code.

    A top-level `tf.function` converts its function with AutoGraph even
    from a module on the do-not-convert list (0.12-0.17 s of the Trainer's
    first trace on w1). This one does not rewrite `fn`, but traces it under
    an ENABLED AutoGraph status (`ag_ctx.ControlStatusCtx`), as inside a
    converted function: the user's functions `fn` calls through
    `convert_as_caller` (or `Strategy.run`) are still converted.
    """

    def traced(*args):
        with autograph_ctx.ControlStatusCtx(
            status=autograph_ctx.Status.ENABLED,
            options=autograph_converter.ConversionOptions(
                recursive=True, user_requested=True
            ),
        ):
            return fn(*args)

    return tf.function(functools.wraps(fn)(traced), autograph=False)


def without_retracing_warning(function):
    """`function` (a `tf.function`) that never logs TF's "triggered
    tf.function retracing" warning (`_omit_frequent_tracing_warning`). TF
    counts traces per Python code object, so a closure made once per
    instance (each optimizer's counter read) would warn after five
    instances in a process, although each traces once [2.21] [2.15]."""
    function._omit_frequent_tracing_warning = True
    return function


def untraced_copy(function):
    """A copy of the `tf.function` `function` without its traces.

    `Function._clone(None)`: the same Python function and options
    (input signature, AutoGraph, XLA), an empty cache. There is no public
    way to trace a function anew: a call reuses any trace made in the same
    context (the same outermost graph, device and strategy scope), even
    one made while `tf2sync` state read at trace time (the scheduled
    worker's index) was different. Returns `function` itself if it has no
    such method [2.21]."""
    clone = getattr(function, "_clone", None)
    return function if clone is None else clone(None)


def convert_as_caller(fn):
    """`fn`, converted by AutoGraph iff the code calling tf2sync is.

    `tf.__internal__.autograph.tf_convert` with the caller's control
    status, as `tf.distribute.Strategy.run` converts the replica function
    it is given (a function of an unconverted module runs as written).
    """
    return tf.__internal__.autograph.tf_convert(
        fn,
        tf.__internal__.autograph.control_status_ctx(),
        convert_by_default=False,
    )


# tf_keras training [2.21] [2.15: kept] ---------------------------------------
# tf2sync makes `fit`'s train function itself, from tf_keras's own pieces,
# which `tf.keras.Model` does not export.


def is_keras_train_step(fn) -> bool:
    """True for the `run_step` of tf_keras's `make_train_function`.

    Version gate: its `__qualname__` names `make_train_function`, or is
    `tf__step_function.<locals>.run_step` where AutoGraph converted
    `step_function` (tf_keras 2.15) [2.15: kept]. The test function's
    step matches the second form too.
    """
    qualname = getattr(fn, "__qualname__", "")
    return "make_train_function" in qualname or qualname.endswith(
        "step_function.<locals>.run_step"
    )


def reduce_per_replica(values, strategy, reduction):
    """tf_keras's reduction of a step's per-replica outputs."""
    return keras_training.reduce_per_replica(
        values, strategy, reduction=reduction
    )


def minimum_control_deps(outputs) -> list:
    """What tf_keras's train function waits on before counting a step."""
    return keras_training._minimum_control_deps(outputs)


def model_coordinator(model):
    """The coordinator `fit` runs `model` on (`_cluster_coordinator`)."""
    return getattr(model, "_cluster_coordinator", None)


def train_counter(model):
    """`model`'s count of train steps run (`_train_counter`)."""
    return model._train_counter


def steps_per_execution_variable(model):
    """The variable behind `model.steps_per_execution`, or None."""
    return getattr(model, "_steps_per_execution", None)


def set_steps_per_execution_variable(model, variable) -> None:
    """Makes `variable` the one behind `model.steps_per_execution`,
    untracked (as tf_keras's own, see `_configure_steps_per_execution`)."""
    with trackable.no_automatic_dependency_tracking_scope(model):
        model._steps_per_execution = variable


def data_handler_steps_per_execution(handler):
    """The `steps_per_execution` variable a data handler reads, or None."""
    return getattr(handler, "_steps_per_execution", None)


def set_data_handler_steps_per_execution(handler, variable) -> None:
    """Makes a data handler read `variable` as its `steps_per_execution`."""
    handler._steps_per_execution = variable


def fit_epoch_position(handler):
    """`(first step of the call being made, steps of the epoch)` of a fit
    data handler (its `_current_step` and `inferred_steps`), or None."""
    current = getattr(handler, "_current_step", None)
    total = getattr(handler, "inferred_steps", None)
    if not isinstance(current, int) or not isinstance(total, int):
        return None
    return current, total


def _running_fit_local(model, name):
    """The local `name` of the frame of `fit` of `model` on the stack (None
    if no such frame)."""
    frame = sys._getframe(2)
    while frame is not None:
        code, names = frame.f_code, frame.f_locals
        if code.co_name == "fit" and names.get("self") is model:
            return names.get(name)
        frame = frame.f_back
    return None


def running_fit_data_handler(model):
    """The data handler of the `fit` of `model` on the stack, or None.

    (The `data_handler` local of a frame of `fit` whose `self` is `model`,
    through `sys._getframe`.) `fit` shows no public view of the call it
    makes now.
    """
    return _running_fit_local(model, "data_handler")


def running_fit_callbacks(model) -> list:
    """The callbacks of the `fit` of `model` on the stack ([] if none).

    (Its `callbacks` local, the `CallbackList` it made or was given, once
    `fit` built it: from `on_train_begin` on.) A callback has no public
    view of the others.
    """
    callbacks = _running_fit_local(model, "callbacks")
    return list(getattr(callbacks, "callbacks", None) or [])


def epoch_logs_validator(model):
    """`model`'s end-of-epoch check of its logs, which swaps in the exact
    metrics after a coordinator's join (`_validate_and_get_metrics_result`)."""
    return model._validate_and_get_metrics_result


def override_epoch_logs_validator(model, validate) -> None:
    """Makes `validate(logs)` `model`'s end-of-epoch check (the instance's)."""
    model._validate_and_get_metrics_result = validate


def restore_epoch_logs_validator(model) -> None:
    """Undoes `override_epoch_logs_validator`: the class's method again."""
    if "_validate_and_get_metrics_result" in vars(model):
        del model._validate_and_get_metrics_result


def implements_train_batch_hooks(callback) -> bool:
    """Whether a tf_keras callback acts on training batches
    (`_implements_train_batch_hooks`: an overridden batch hook, a
    `ModelCheckpoint` or `BackupAndRestore` saving every N batches, a
    `TensorBoard` tracing) [2.21] [2.15]."""
    implements = getattr(callback, "_implements_train_batch_hooks", None)
    return bool(implements()) if implements is not None else False


# tf_keras optimizers [2.21] [2.15: kept] -------------------------------------
# Both families' update kernels, for `keras_compat` to call in the ps's
# critical section, where the public `apply_gradients` (a `merge_call`;
# `iterations` + 1 per caller) cannot run.


def is_trackable(obj) -> bool:
    """Whether `obj` can be saved in a TF2 checkpoint as a child
    (`tf.__internal__.tracking.Trackable`: public only under `__internal__`)."""
    return isinstance(obj, tf.__internal__.tracking.Trackable)


def track_child(parent, child, name: str) -> None:
    """Saves `child` in `parent`'s checkpoints as `name` (`_track_trackable`;
    optimizers do not track their attributes)."""
    parent._track_trackable(child, name)


def tracks_child(parent, name: str) -> bool:
    """Whether `parent` tracks a child named `name` (`_lookup_dependency`)."""
    parent._maybe_initialize_trackable()  # as `_track_trackable` does
    return parent._lookup_dependency(name) is not None


def created_step_variable(optimizer):
    """`optimizer.iterations` if created, else None (reading it creates it)."""
    return getattr(optimizer, "_iterations", None)


def optimizer_name(optimizer) -> str:
    """The optimizer's name (`_name`, else `name`), or ""."""
    return getattr(optimizer, "_name", None) or getattr(optimizer, "name", "")


def legacy_create_all_weights(optimizer, var_list) -> None:
    """Creates a legacy optimizer's slots and hyperparameters."""
    early = _early_sharded_slots(optimizer, _sharded_containers(var_list))
    optimizer._create_all_weights(var_list)
    keep_sharded_slot_views(optimizer)
    _adopt_early_sharded_slots(optimizer, early)


def legacy_transform_gradients(optimizer, grads_and_vars):
    """A legacy optimizer's clipping of `(gradient, variable)` pairs."""
    return optimizer._transform_gradients(grads_and_vars)


def legacy_prepare(optimizer, var_list):
    """A legacy optimizer's per-step `apply_state`."""
    return optimizer._prepare(var_list)


def legacy_apply_dense(optimizer, grad, var, apply_state):
    """A legacy optimizer's dense update kernel."""
    return optimizer._resource_apply_dense(grad, var, apply_state=apply_state)


def legacy_apply_sparse(
    optimizer, values, var, indices, apply_state, *, unique
):
    """A legacy optimizer's sparse update kernel: for `indices` without
    duplicates if `unique`, else the one that sums duplicates first."""
    if unique:
        apply = optimizer._resource_apply_sparse
    else:
        apply = optimizer._resource_apply_sparse_duplicate_indices
    return apply(values, var, indices, apply_state=apply_state)


def legacy_sparse_dedup_is_plain(optimizer) -> bool:
    """Whether a legacy optimizer's duplicate-index kernel only sums the
    duplicates: the base's, or SGD's with momentum (without, it scatters)."""
    base = tf_keras.optimizers.legacy.Optimizer
    method = type(optimizer)._resource_apply_sparse_duplicate_indices
    if method is base._resource_apply_sparse_duplicate_indices:
        return True
    sgd = tf_keras.optimizers.legacy.SGD
    return (
        isinstance(optimizer, sgd)
        and method is sgd._resource_apply_sparse_duplicate_indices
        and bool(optimizer._momentum)
    )


def new_learning_rate_uncomputed(optimizer) -> bool:
    """Whether a new-family optimizer's schedule has no current rate yet."""
    schedule = tf_keras.optimizers.schedules.LearningRateSchedule
    return isinstance(optimizer._learning_rate, schedule) and not hasattr(
        optimizer, "_current_learning_rate"
    )


def optimizer_state_variables(optimizer) -> list:
    """Every variable an optimizer's apply may read: `variables()`, a
    legacy optimizer's hyperparameters (`_hyper`, not listed there), a new
    one's rate variables, and those of the optimizers it holds (tf2sync's
    `MultiOptimizer`, tensorflow-addons'). Checked on tf_keras 2.21."""
    found = list(optimizer.variables())
    found += [
        v
        for v in getattr(optimizer, "_hyper", {}).values()
        if isinstance(v, tf.Variable)
    ]
    for name in ("_learning_rate", "_current_learning_rate", "_iterations"):
        value = getattr(optimizer, name, None)
        if isinstance(value, tf.Variable):
            found.append(value)
    for inner in getattr(optimizer, "optimizers", None) or ():
        found += optimizer_state_variables(inner)
    for spec in getattr(optimizer, "optimizer_specs", None) or ():
        found += optimizer_state_variables(spec["optimizer"])
    return found


def new_compute_learning_rate(optimizer) -> None:
    """Evaluates a new-family optimizer's rate at its `iterations`."""
    optimizer._compute_current_learning_rate()


def new_clip_gradients(optimizer, grads):
    """A new-family optimizer's clipping."""
    return optimizer._clip_gradients(grads)


def new_apply_weight_decay(optimizer, var_list) -> None:
    """A new-family optimizer's decoupled weight decay."""
    optimizer._apply_weight_decay(var_list)


def new_update_step(optimizer, grad, var):
    """A new-family optimizer's per-variable update kernel."""
    return optimizer._update_step(grad, var)


def new_unknown_variables(optimizer, var_list) -> list:
    """The variables of `var_list` a built new-family optimizer has no
    slots for: its update step would fail on them with a `KeyError`
    (`_index_dict` maps the variables it was built on). Empty while it is
    not built, or where it keeps no such map."""
    known = getattr(optimizer, "_index_dict", None)
    if not getattr(optimizer, "_built", False) or known is None:
        return []
    return [v for v in var_list if optimizer._var_key(v) not in known]


def new_update_moving_averages(optimizer, var_list) -> None:
    """A new-family optimizer's `use_ema` update of the model's variables."""
    optimizer._update_model_variables_moving_average(var_list)


def legacy_distributed_apply(optimizer, strategy, grads_and_vars, state, name):
    """A legacy optimizer's cross-replica apply (`_distributed_apply`, with
    `state` from `legacy_prepare`): its kernels, then `iterations` + 1."""
    return optimizer._distributed_apply(
        strategy, grads_and_vars, state, name=name
    )


def new_distributed_apply(optimizer, strategy, grads_and_vars):
    """A new-family optimizer's cross-replica apply, `iterations` + 1."""
    return optimizer._distributed_apply_gradients_fn(strategy, grads_and_vars)


def is_tfa_multi_optimizer(optimizer) -> bool:
    """True for `tfa.optimizers.MultiOptimizer`, without importing tfa.

    Version gate: tensorflow-addons imports only up to TF 2.15 [2.15:
    kept]; on 2.21 nothing is one [2.21]. `optimizer_specs` is public.
    """
    cls = type(optimizer)
    return (
        cls.__name__ == "MultiOptimizer"
        and (cls.__module__ or "").startswith("tensorflow_addons.")
        and isinstance(getattr(optimizer, "optimizer_specs", None), list)
    )


def standalone_keras_2_loaded() -> bool:
    """Whether `import keras` gave Keras 2, not tf_keras: a version gate
    (TF <= 2.15 ships Keras 2 as `keras` [2.15: kept]; 2.16+ Keras 3)."""
    version = getattr(sys.modules.get("keras"), "__version__", "")
    return version.startswith("2.")


# Checkpoints [2.21] [2.15: kept] ---------------------------------------------
# TF2's checkpoint writer finds an optimizer's slots through `dir()`, and
# tf_keras's legacy optimizers make their sharded variables' slot views anew.


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


def keep_sharded_slot_views(optimizer) -> None:
    """Makes a legacy optimizer's slot of a `ShardedVariable` one object.

    tf_keras's legacy `get_slot(sharded_variable, name)` builds a new
    `ShardedVariable` over the shards' slots at every call. A restore binds
    one such view (restoring the shards' slots through it) and
    `assert_existing_objects_matched` then lists another, unbound (stock
    PSS does the same), although every slot was restored. With one view
    per slot, kept here, the check finds the object the restore bound
    (after a restore into a built optimizer; one before the build binds
    the early whole slots, see `_early_sharded_slots`, and a check after
    the build still lists the views).
    Wraps `get_slot` on this instance only; calling it again does nothing.
    """
    if getattr(optimizer, "_tf2sync_slot_views", None) is not None:
        return
    views = {}
    get_slot = optimizer.get_slot

    def one_view(var, slot_name):
        slot = get_slot(var, slot_name)
        if not isinstance(slot, sharded_variable.ShardedVariable):
            return slot
        key = (slot_name, tuple(id(shard) for shard in slot.variables))
        return views.setdefault(key, slot)

    optimizer._tf2sync_slot_views = views
    optimizer.get_slot = one_view


def _sharded_containers(var_list) -> list:
    """The `ShardedVariable`s whose shards `var_list` holds, once each."""
    found = {}
    for var in var_list:
        container = sharded_container(var)
        if container is not None:
            found.setdefault(id(container), container)
    return list(found.values())


def _early_sharded_slots(optimizer, containers) -> list:
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


def _adopt_early_sharded_slots(optimizer, early) -> None:
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


# tf.compat.v1.train optimizers (the TF1 shim) [2.21] [2.15: kept] ------------
# A TF1 optimizer's `apply_gradients` under a strategy does a `merge_call`; the
# shim applies in cross-replica context itself.


def tf1_optimizer_apply(optimizer, strategy, grads_and_vars, global_step):
    """A TF1 optimizer's cross-replica apply (`_distributed_apply`)."""
    return optimizer._distributed_apply(strategy, grads_and_vars, global_step)


def tf1_optimizer_create_slots(optimizer, var_list) -> None:
    """A TF1 optimizer's slots for `var_list` (`_create_slots`)."""
    optimizer._create_slots(var_list)


def tf1_optimizer_variables(optimizer) -> list:
    """A TF1 optimizer's non-slot variables and slots, of any graph (its
    `variables()` keeps those of the thread's default graph)."""
    found = list(optimizer._non_slot_variables())
    for slots in optimizer._slots.values():
        found.extend(slots.values())
    return found


# Mixed precision [2.21] [2.15: kept] -----------------------------------------
# `tf_keras.mixed_precision.LossScaleOptimizer` (public) is the base class of
# both families' loss-scale optimizers [2.21], for `isinstance`. tf_keras
# refuses loss scaling under PSS, with no hook.

# The legacy family's loss-scale optimizer, to subclass: the public class
# picks the family from its inner optimizer (a metaclass) when called.
LegacyLossScaleOptimizer = lso.LossScaleOptimizer

# tf_keras's own answer, kept before `install_loss_scaling_predicate`.
_KERAS_SUPPORTS_LOSS_SCALING = lso.strategy_supports_loss_scaling


def keras_supports_loss_scaling() -> bool:
    """tf_keras's own `strategy_supports_loss_scaling()`."""
    return _KERAS_SUPPORTS_LOSS_SCALING()


def install_loss_scaling_predicate(predicate) -> None:
    """Makes tf_keras ask `predicate()` whether the strategy in scope
    supports loss scaling, before it builds a mixed_float16 layer or a
    loss-scale optimizer (it looks the function up at each call)."""
    lso.strategy_supports_loss_scaling = predicate


_CREATE_AUTOCAST = autocast_variable.create_autocast_variable


def _create_autocast_sharded(variable):
    if not is_sharded_variable(variable):
        return _CREATE_AUTOCAST(variable)
    parts = [_CREATE_AUTOCAST(v) for v in variable.variables]
    return sharded_variable.ShardedVariable(parts, name=variable.name)


def install_sharded_autocast() -> None:
    """Lets a mixed_float16 layer create a sharded weight.

    tf_keras wraps each float weight of such a layer in an
    `AutoCastVariable` (`autocast_variable.create_autocast_variable`, looked
    up at each call by `Layer.add_weight`), which refuses a
    `ShardedVariable` (tf_keras 2.21 fails so under stock PSS too). Once
    installed, a `ShardedVariable` becomes a `ShardedVariable` of
    autocast shards: each shard reads as float16 in the layer's compute,
    stays float32 on its ps, and is a variable of its own to the
    optimizer and to tf2sync. Idempotent; other variables are wrapped as
    before.
    """
    autocast_variable.create_autocast_variable = _create_autocast_sharded


_SAVE_OWN_VARIABLES = keras_base_layer.Layer.save_own_variables
_LOAD_OWN_VARIABLES = keras_base_layer.Layer.load_own_variables


def _weight_groups(layer):
    """A layer's saved weights (`_trainable_weights` then
    `_non_trainable_weights`, which list a sharded weight as its shards, in
    order), each sharded weight's shards as one group: `[(sharded or None,
    [variables])]`."""
    return group_shards(layer._trainable_weights + layer._non_trainable_weights)


def sharded_container(var):
    """The `ShardedVariable` `var` is a shard of, or None
    (`_sharded_container`, a weak reference `ShardedVariable` sets on each
    of its shards)."""
    ref = getattr(var, "_sharded_container", None)
    return ref() if ref is not None else None


def group_shards(variables) -> list:
    """`[(sharded or None, [variables])]`: consecutive shards of one
    `ShardedVariable` as one group, in order (as Keras lists them)."""
    groups = []
    for var in variables:
        container = sharded_container(var)
        if container is not None and groups and groups[-1][0] is container:
            groups[-1][1].append(var)
        else:
            groups.append((container, [var]))
    return groups


def _save_own_variables(layer, store):
    groups = _weight_groups(layer)
    if all(container is None for container, _ in groups):
        return _SAVE_OWN_VARIABLES(layer, store)
    for i, (_, parts) in enumerate(groups):
        store[f"{i}"] = np.concatenate([p.numpy() for p in parts], axis=0)
    return None


def _load_own_variables(layer, store):
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


def install_whole_weights_in_keras_files() -> None:
    """Makes the `.keras` format save a sharded weight whole.

    tf_keras's `Layer.save_own_variables` (and `load_own_variables`)
    store `layer.weights` one entry each, and a layer lists a sharded
    weight as its shards: a `.keras` file of a model with 3 shards would
    load only into a model with 3 shards (no other file of tf_keras
    splits a weight). Once installed, a layer with sharded weights stores
    each whole (its shards concatenated) and loads it into however many
    shards it has, 1 included; other layers are saved as before.
    """
    keras_base_layer.Layer.save_own_variables = _save_own_variables
    keras_base_layer.Layer.load_own_variables = _load_own_variables


def dynamic_loss_scale_state(optimizer):
    """A dynamic loss-scale optimizer's state (`_loss_scale`), with public
    `current_loss_scale`, `counter`, `multiplier` and `growth_steps`."""
    return optimizer._loss_scale


def is_wrapped_by_loss_scale_optimizer(optimizer) -> bool:
    """Whether a tf_keras loss-scale optimizer wraps `optimizer` (the flag
    it sets on it)."""
    return bool(getattr(optimizer, "_is_wrapped_by_loss_scale_optimizer", 0))


# tf.data service [2.21] [2.15] ----------------------------------------------


def service_dataset_of_job(service, dataset_id, element_spec, job_name):
    """`tf.data.experimental.service.from_dataset_id` in "distributed_epoch"
    mode with `job_name` a string *tensor* (computed on the worker).

    The public function takes only a Python string; its private
    `_from_dataset_id`, which it calls, takes a tensor too [2.21] [2.15].
    Its uncompression function is cached per element spec and added only
    to the graph that first made it; made again here, it is in the
    library of every worker's function (else a process that connects to
    a second cluster sends a function whose definition it lacks).
    """
    cache = getattr(data_service_ops, "_get_uncompress_func", None)
    if cache is not None and hasattr(cache, "cache_clear"):
        cache.cache_clear()
    return data_service_ops._from_dataset_id(
        processing_mode="distributed_epoch",
        service=service,
        dataset_id=dataset_id,
        element_spec=element_spec,
        job_name=job_name,
    )


def dispatcher_num_workers(dispatcher) -> int:
    """tf.data workers registered with a `DispatchServer` (its
    `_num_workers`) [2.21] [2.15]."""
    return int(dispatcher._num_workers())
