"""One parameter server's apply as one function of that ps.

A ps cannot reach another ps (ParameterServerStrategy's device filters
let a ps see only the workers and the chief), so a function called on a
ps must hold nothing of another ps. An optimizer's apply reads a few
variables that may live elsewhere: the step (`iterations`), its
hyperparameters (the rate, the momentum). `LocalApply` traces the apply
once to find them, then traces it again with each such read replaced by an
input of the function, which the caller reads where it runs (a worker) and
sends along. Where the apply does more than read another ps (it writes
there, or reads what is not a known variable), it stays inline in the
caller's graph, as before.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from tf2sync._src.internals import patches


def _here(device):
    return tf.DeviceSpec.from_string(device)


def _foreign(concrete, device):
    here = _here(device)
    return [
        t
        for t in concrete.captured_inputs
        if getattr(t, "device", "") and _here(t.device) != here
    ]


def _handle(variable):
    return getattr(variable, "handle", None)


def _outermost(tensor):
    """The tensor a capture stands for in the outermost graph (traced
    inside a step, a function captures the step graph's placeholder of a
    variable's handle, not the handle itself)."""
    while True:
        graph = getattr(tensor, "graph", None)  # none for an eager tensor
        captures = getattr(graph, "captures", None)
        if not captures:
            return tensor
        outer = {id(internal): external for external, internal in captures}
        if id(tensor) not in outer:
            return tensor
        tensor = outer[id(tensor)]


@contextlib.contextmanager
def reads_as(variables, values):
    """Within the block, a read of `variables[i]` traced by this thread
    traces as `values[i]`. Other threads (the token watchdog reads the
    global step eagerly) read the variable as usual meanwhile."""
    patched = []
    owner = threading.get_ident()
    try:
        for variable, value in zip(variables, values):

            def wrap(original, value=value):
                def read(*args, value=value, original=original, **kwargs):
                    if threading.get_ident() == owner and tf.inside_function():
                        return value
                    return original(*args, **kwargs)

                return read

            patches.variable_reads.install(variable, wrap)
            patched.append(variable)
        yield
    finally:
        for variable in patched:
            patches.variable_reads.uninstall(variable)


class LocalApply:
    """`body(*args)` on `device`, called as one function where it can be.

    Args:
      device: The ps.
      body: Traces the apply from its tensor arguments.
      candidates: Returns the variables whose reads may be passed in.
    """

    def __init__(self, device, body, candidates):
        self.device = device
        self._body = body
        self._candidates = candidates
        self._function = None  # False: inline
        self._remote = []

    @property
    def is_call(self) -> bool:
        """Whether it is called as a function (known once traced)."""
        return bool(self._function)

    def __call__(self, *args):
        if not self.prepare(*args):
            return self.inline(*args)
        return self.call(args, self.reads())

    def prepare(self, *args) -> bool:
        """Traces the function for `args` (once); whether it is a call."""
        if self._function is None:
            self._function = self._build(args) or False
        return bool(self._function)

    def inline(self, *args):
        """The body traced inline, on `device`."""
        with tf.device(self.device):
            return self._body(*args)

    def reads(self) -> list:
        """The reads the function takes as inputs, where the caller runs
        (after `prepare`)."""
        return [v.read_value() for v in self._remote]

    def call(self, args, values):
        """Calls the function (after `prepare`) with `values` of `reads`."""
        with tf.device(self.device):
            return self._function(*args, values)

    def _build(self, args):
        remote = self._remote

        def traced(*inputs):
            *body_args, values = inputs
            with reads_as(remote, values):
                return self._body(*body_args)

        function = tf.function(
            traced,
            autograph=False,
            experimental_attributes={"_noinline": True},
        )
        with tf.device(self.device):
            concrete = function.get_concrete_function(*args, [])
        foreign = _foreign(concrete, self.device)
        if not foreign:
            return function
        by_handle = {id(_handle(v)): v for v in self._candidates()}
        found = [by_handle.get(id(_outermost(t))) for t in foreign]
        if any(v is None for v in found):
            return None
        remote.extend(found)
        specs = [tf.TensorSpec(v.shape, v.dtype.base_dtype) for v in found]
        with tf.device(self.device):
            concrete = function.get_concrete_function(*args, specs)
        if _foreign(concrete, self.device):
            del remote[:]
            return None
        return function
