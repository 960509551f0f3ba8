"""Repeating a training step inside one scheduled function.

A function that runs several steps in a `tf.while_loop` pays for the loop on
every iteration: the loop's body has ops on the worker and on the ps, and TF
sends the loop's control from one to the other each time round. Repeating
the step in the graph removes those transfers. `repeat` does both: it
repeats the step in groups of at most `group` copies, and loops over the
groups when there are more steps than one group holds. The group size
callers use when the user does not choose is
`tf2sync.SyncOptions.max_unrolled_steps`.

The step's Python runs once: it is traced as a function of its own, and
each copy in the graph is a copy of that function's ops
(`graph_copy.inline_copy`), the same ops a new trace would make. A call
of the function instead would run slower (TF calls it at every step rather
than inlining it), and tracing the step again per copy costs a step's trace
per copy (docs/benchmarks.md, "Measurements behind the code"). A lone step
calls the trace (`_TracedOnce.call`): the worker inlined that call when it
set the function up, which ran as fast as with a copy. Functions that
repeat the same step can share that trace through a `StepTraces`: `fit`'s
function of K steps, the single-step function its first call and an epoch's
last, shorter call run (`Trainer`'s first loop too), and the pieces of a
call split over the workers.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import socket
import threading

import tensorflow as tf

from tf2sync._src import step_context
from tf2sync._src.internals import autograph
from tf2sync._src.internals import graph_copy

_TRACING = threading.local()


def repeating() -> bool:
    """Whether the step being traced is a copy of one trace in a graph.

    True inside `repeat` with at least 2 copies per group, or with a lone
    step that calls a trace shared with another function (`StepTraces`).
    The aggregator then makes every push a call of one ps function, so
    that the ps instantiates it once per worker rather than once per copy
    (the shared trace holds that call, for every function copying or
    calling it).
    """
    return getattr(_TRACING, "repeating", False)


@contextlib.contextmanager
def _copies():
    previous = repeating()
    _TRACING.repeating = True
    try:
        yield
    finally:
        _TRACING.repeating = previous


def repeat(
    step,
    steps: int,
    group: int,
    carry=None,
    trace_once=True,
    inputs=(),
    traces=None,
):
    """Runs `carry = step(carry, *inputs)` `steps` times in the function
    being traced.

    The steps run in order. Up to `group` consecutive steps are copies in
    the graph; with more steps than that, a `tf.while_loop` runs the whole
    groups and the remainder follows, unrolled. `group=1` is a plain
    `tf.while_loop` of single steps; `group >= steps` repeats every step in
    the graph (no loop).

    Args:
      step: `step(carry, *inputs) -> carry`, tracing one step.
      steps: Steps to run, >= 1.
      group: Most copies of the step per loop iteration, >= 1.
      carry: The initial carry (tensors, fixed shapes). None: the step
        ignores its carry (it is given None each time) and the result is
        the last step's; the first group runs before the loop, whose carry
        is that group's result (as tf_keras's loop runs its first step
        before looping).
      trace_once: Whether copies copy one trace of the step's graph
        (see the module docstring) rather than tracing its Python again.
        The TF1 shim's steps are traced per copy: each copy's ops follow
        the previous copy's token, which the shim wires while tracing. A
        step whose graph copies would differ from new traces
        (`graph_copy.copies_like_traces`: per-worker resources, seeded
        random ops) is traced per copy too.
      inputs: Tensors or composite tensors (an iterator) of the function
        being traced that every step takes: passed, not closed over, a
        trace can serve another function.
      traces: Optional `StepTraces` of the functions repeating this same
        step: a trace one of them made is copied rather than made again.

    Returns:
      The carry after the last step.
    """
    group = max(1, min(group, steps))
    inputs = tuple(inputs)
    shared = trace_once and traces is not None
    run = lambda value: step(value, *inputs)  # noqa: E731
    # A loop's body is traced once anyway; a lone step calls a shared
    # trace.
    if group == 1 and (steps > 1 or not shared):
        return _repeat(run, steps, group, carry)
    with _copies():
        if trace_once:
            traces = traces if traces is not None else StepTraces()
            once = traces.trace(step, carry, inputs)
            if once.copies_like_traces:
                if steps == 1:  # shared, or `group` would be 1 (above)
                    return once.call(carry, inputs)
                run = once.copier(inputs)
        return _repeat(run, steps, group, carry)


def starts_on_single_steps(steps: int, group: int) -> bool:
    """Whether a first call of `steps` steps should run as single-step
    functions (`fit`'s first call, `Trainer`'s first loop; `fit`'s last,
    shorter call of an epoch too, reusing that function).

    Where the call's steps are all copies in one graph (at most `group`)
    and more than one: the workers first set up a function of one copy
    rather than of `steps`, so the first update comes sooner, and the
    full function (traced meanwhile, or after the first step where
    `waits_for_first_step`) is set up at the next call instead
    (docs/performance.md, "Time to the first update"). Past one group a
    `tf.while_loop` runs the groups, and splitting would take as many
    functions as steps.
    """
    return 1 < steps <= group


def waits_for_first_step(cluster_resolver, single_steps: int) -> bool:
    """Whether a run that starts on `single_steps` single-step functions
    traces its full function only once the first of them has returned.

    Tracing the full function (its copies of the step) while the workers
    set up the single-step function overlaps the two where they run on
    machines of their own. Where workers share the chief's CPUs (the local
    mode, an in-process cluster), the trace takes CPU from their set-up and
    the first update waits for it: there the chief traces after the first
    step instead, while the workers run the other single steps. That is
    where the workers on this machine, with the chief, outnumber the CPUs
    this process may use (its affinity, capped by its cgroup's CPU quota;
    ps tasks are not counted: they set up little), and where single steps
    remain once each worker has run one (otherwise the workers would only
    wait for the trace; docs/benchmarks.md, "Measurements behind the code").

    Args:
      cluster_resolver: The strategy's `ClusterResolver`, or None (a
        strategy without a cluster: False).
      single_steps: The single-step functions the run starts on.
    """
    if cluster_resolver is None:
        return False
    try:
        tasks = cluster_resolver.cluster_spec().job_tasks("worker")
    except ValueError:  # no worker job
        return False
    # A spec with gaps in its task indices lists None for the gaps.
    local = sum(1 for address in tasks if address and _on_this_host(address))
    return (
        local > 0 and local + 1 > _usable_cpus() and single_steps > len(tasks)
    )


def wait_for_first_step(first_step) -> None:
    """Waits for `first_step`, the `RemoteValue` of a run's first single
    step (see `waits_for_first_step`). Its error is raised; a cancellation
    is not (another function's error cancelled it, and the coordinator
    raises that error at the next `schedule`)."""
    with contextlib.suppress(tf.errors.CancelledError):
        first_step.fetch()


def _on_this_host(address: str) -> bool:
    """Whether a task's `host:port` names this machine (its loopback or
    its host name; another address counts as another machine)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def _usable_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The CPUs this process may use: its affinity, capped by its cgroup's
    CPU quota (a container's `--cpus`, rounded up), where the process's
    cgroup is the root of `cgroup_root` (a container's own namespace)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota(cgroup_root)
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def _cgroup_cpu_quota(root: str):
    """CPUs' worth of the CPU quota of the cgroup at `root` (v2's
    `cpu.max`, else v1's `cpu/cpu.cfs_quota_us` over its period), or None:
    no quota, or none readable."""
    words = _words(os.path.join(root, "cpu.max"))
    if words is not None:  # cgroup v2: "max 100000" or "200000 100000"
        return _ratio(*words[:2]) if len(words) >= 2 else None
    quota = _words(os.path.join(root, "cpu", "cpu.cfs_quota_us"))
    period = _words(os.path.join(root, "cpu", "cpu.cfs_period_us"))
    return _ratio(quota[0], period[0]) if quota and period else None


def _words(path: str):
    try:
        with open(path) as f:
            return f.read().split()
    except OSError:
        return None


def _ratio(quota: str, period: str):
    try:
        quota, period = float(quota), float(period)
    except ValueError:  # "max"
        return None
    return quota / period if quota > 0 and period > 0 else None


class StepTraces:
    """The traces of one step, for the functions that repeat it.

    `repeat` traces its step once per function; given the same
    `StepTraces`, a second function copies the first one's trace instead
    (`fit`'s and `Trainer`'s full function after their first call's
    single steps, whose second trace the first epoch would wait for; the
    pieces of a call `fit` splits over the workers). A
    trace serves another function when it takes the same kinds of carry
    and inputs and captured nothing of the function it was traced in (only
    variables and other values from outside it); otherwise that function
    traces its own.
    """

    def __init__(self):
        self._traces = []

    def trace(self, step, carry, inputs) -> _TracedOnce:
        """A trace of `step` for `(carry, inputs)` in the current graph."""
        graph = tf.compat.v1.get_default_graph()
        for once in self._traces:
            if once.serves(graph, carry, inputs):
                return once
        once = _TracedOnce(step, carry, inputs)
        self._traces.append(once)
        return once


class _TracedOnce:
    """`step`, traced once (now, in the current graph); each call of a
    `copier` copies the traced graph into the graph being built."""

    def __init__(self, step, carry, inputs):
        self._ignores_carry = carry is None
        # The worker index the coordinator gives the scheduled function is
        # an argument of the trace, not a capture of that function's.
        self._worker = step_context.current_worker() is not None
        # Traced with AutoGraph as the enclosing function is (a function
        # traced without it would turn it off for the step's callees).
        step = autograph.convert_as_caller(step)

        def traced(*args):  # the arguments of `_arguments`
            worker = args[0] if self._worker else None
            args = args[1:] if self._worker else args
            if self._ignores_carry:
                args = (None, *args)
            with step_context.WorkerScope(worker):
                return step(*args)

        arguments = self._arguments(carry, inputs)
        function = tf.function(traced, autograph=False)
        self._concrete = function.get_concrete_function(*arguments)
        self._graph = tf.compat.v1.get_default_graph()
        self._signature = _flat_signature(arguments)
        self._captures_graph_tensors = any(
            tf.is_symbolic_tensor(t) for t in self._concrete.captured_inputs
        )
        # Else each copy traces the step again (see `internals.graph_copy`).
        self.copies_like_traces = graph_copy.copies_like_traces(self._concrete)

    def _arguments(self, carry, inputs):
        """The trace's arguments here: worker index, carry, inputs."""
        worker = (step_context.current_worker(),) if self._worker else ()
        carry = () if self._ignores_carry else (carry,)
        return worker + carry + tuple(inputs)

    def serves(self, graph, carry, inputs) -> bool:
        """Whether copies of this trace in `graph` are the step's there."""
        if (carry is None) != self._ignores_carry or self._worker != (
            step_context.current_worker() is not None
        ):
            return False
        if self._captures_graph_tensors and graph is not self._graph:
            return False
        return self._signature == _flat_signature(
            self._arguments(carry, inputs)
        )

    def call(self, carry, inputs):
        """One step, as a call of the trace: the function being traced
        holds a call op rather than a copy of the step's ops.

        For a lone step (the single-step function `fit` and `Trainer` start
        on): copying a large step's ops took as long again as a fifth of
        its trace, and the worker inlines the call when it sets the
        function up, so the function runs as fast as with a copy
        (docs/benchmarks.md, "Measurements behind the code"). Copies
        repeat the step in one graph instead.
        """
        return self._concrete(*self._arguments(carry, inputs))

    def copier(self, inputs):
        """`run(carry)`: one more copy of the step, on `inputs`."""
        copies = 0

        def run(carry):
            nonlocal copies
            copies += 1
            return graph_copy.inline_copy(
                self._concrete,
                self._arguments(carry, inputs),
                f"step_{copies}",
            )

        return run


def _flat_signature(arguments):
    """The type specs of `arguments` (an iterator's holds its elements'
    specs), to compare a trace's arguments with another's."""

    def spec(value):
        try:
            return tf.type_spec_from_value(value)
        except TypeError:  # not a tensor: compared as itself
            return value

    return tf.nest.map_structure(spec, arguments)


def _repeat(step, steps, group, carry):
    groups, rest = divmod(steps, group)

    def run_group(value):
        for _ in range(group):
            value = step(value)
        return value

    if carry is None:
        carry = run_group(carry)
        groups -= 1
    if groups == 1:
        carry = run_group(carry)
    elif groups > 1:
        _, carry = tf.while_loop(
            lambda i, _: i < groups,
            lambda i, value: (i + 1, run_group(value)),
            (tf.constant(0), carry),
        )
    for _ in range(rest):
        carry = step(carry)
    return carry
