"""The tf_keras `fit`, `evaluate` or `predict` running now, and the data
handler it is building.

tf_keras's data handlers call the strategy's coordinator without saying
who they are, nor for which call. Two patches of `internals.patches`
record both, for as long as they run: `keras_calls` (each of
`tf_keras.Model.fit`, `evaluate` and `predict` pushes a `KerasCall`:
which call, the model, its arguments) and `data_handler_context` (a
`_ClusterCoordinatorDataHandler`, or its exact evaluation subclass, pushes
itself while its `__init__` builds its per-worker dataset; the first one
a `fit` builds is marked as its training data handler). The coordinator,
the strategy and `fit`'s train function read them here.

The records are context variables: each thread (each `contextvars`
context) sees its own calls. Outside those methods there is none: a
user's own training loop, or `tf2sync.Trainer`, sees no call.

Input hooks (`set_input_hooks`): `fit_inputs` rewrites the arguments of
`fit` and `evaluate` under a `SyncParameterServerStrategy`; the call is
recorded with the arguments tf_keras then receives.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import typing

import tf_keras

from tf2sync._src.internals import keras_fit
from tf2sync._src.internals import patches

_CALLS = contextvars.ContextVar("tf2sync_keras_calls", default=())
_HANDLERS = contextvars.ContextVar("tf2sync_data_handlers", default=())

# Call name -> `hook(method)`: `method` wrapped (see `set_input_hooks`).
_INPUT_HOOKS = {}


class KerasCall:
    """One running call of `fit`, `evaluate` or `predict`.

    Attributes:
      name: "fit", "evaluate" or "predict".
      model: The model whose method runs.
      arguments: Its arguments by name, the defaults included, as tf_keras
        received them (after the input hooks).
      training_handler: For `fit`: its training data handler once built
        (under a coordinator), else None.
    """

    def __init__(self, name, model, arguments):
        self.name = name
        self.model = model
        self.arguments = arguments
        self.training_handler = None


def install() -> None:
    """Installs the patches `keras_calls` and `data_handler_context`
    (idempotent)."""
    patches.keras_calls.install(method)
    patches.data_handler_context.install(handler_init)


def set_input_hooks(**hooks) -> None:
    """Sets, by call name ("fit", "evaluate"), `hook(method)`: returns a
    function called instead of `method` (same arguments) that calls
    `method`, the recorded tf_keras method, with the arguments it gives
    tf_keras. Setting one again replaces it."""
    _INPUT_HOOKS.update(hooks)


def _recorded(name, original):
    """`original` (tf_keras's method `name`), recording each call."""
    signature = inspect.signature(original)
    defaults = {
        key: parameter.default
        for key, parameter in signature.parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }

    @functools.wraps(original)
    def recorded(*args, **kwargs):
        try:
            arguments = signature.bind(*args, **kwargs).arguments
        except TypeError:  # tf_keras's own error, as it words it
            return original(*args, **kwargs)
        call = KerasCall(name, arguments["self"], {**defaults, **arguments})
        token = _CALLS.set(_CALLS.get() + (call,))
        try:
            return original(*args, **kwargs)
        finally:
            _CALLS.reset(token)

    return recorded


def method(name, original):
    """tf_keras's method `name` ("fit", "evaluate" or "predict"),
    `original`, recording each call, through the input hook of `name`
    where one is set (for the patch `keras_calls`)."""
    recorded = _recorded(name, original)
    hooked = {}  # hook -> the method it made of `recorded`

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        hook = _INPUT_HOOKS.get(name)
        if hook is None:
            return recorded(*args, **kwargs)
        made = hooked.get(hook)
        if made is None:
            made = hooked[hook] = hook(recorded)
        return made(*args, **kwargs)

    return wrapped


def handler_init(original):
    """`_ClusterCoordinatorDataHandler.__init__`, `original`, recording the
    handler while it builds (for the patch `data_handler_context`)."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        token = _HANDLERS.set(_HANDLERS.get() + (self,))
        try:
            original(self, *args, **kwargs)
        finally:
            _HANDLERS.reset(token)
        model = keras_fit.data_handler_model(self)
        call = None if model is None else current(model)
        if call is not None and call.name == "fit":
            if call.training_handler is None:  # fit builds its own first
                call.training_handler = self

    return __init__


def current(model=None):
    """The innermost running `KerasCall` of `model` (of any model where
    `model` is None), or None."""
    for call in reversed(_CALLS.get()):
        if model is None or call.model is model:
            return call
    return None


def entry_point(model):
    """Which of `model`'s `fit`, `evaluate` or `predict` runs now (the
    innermost: `evaluate` inside `fit` for its validation), or None."""
    call = current(model)
    return None if call is None else call.name


def input_role(model=None):
    """What the input being built now is for: "fit" (its training data),
    "validation" (`fit`'s `validation_data`, once its training data
    handler is built), "evaluate", "predict", or None outside them."""
    call = current(model)
    if call is None:
        return None
    if call.name == "fit" and call.training_handler is not None:
        return "validation"
    return call.name


def _running_fit(model):
    """The innermost running `fit` of `model`, or None."""
    for call in reversed(_CALLS.get()):
        if call.name == "fit" and call.model is model:
            return call
    return None


def fit_data_handler(model):
    """The training data handler of the running `fit` of `model`, or None
    (outside `fit`, before it is built, or without a coordinator)."""
    call = _running_fit(model)
    return None if call is None else call.training_handler


def fit_callbacks(model) -> list:
    """The callbacks given to the running `fit` of `model` ([] if none):
    those of a list, or of a `CallbackList`."""
    call = _running_fit(model)
    given = None if call is None else call.arguments.get("callbacks")
    given = getattr(given, "callbacks", given)  # a CallbackList's
    return list(given or [])


def _nearest_handler(cls):
    """The innermost data handler being built whose type is `cls`."""
    for handler in reversed(_HANDLERS.get()):
        if type(handler) is cls:
            return handler
    return None


def handler_being_built():
    """The `_ClusterCoordinatorDataHandler` whose `__init__` is building
    its per-worker dataset now (of `fit` or `evaluate`; not the
    exact evaluation subclass), or None."""
    return _nearest_handler(keras_fit.coordinator_handler_class())


def building_exact_evaluation() -> bool:
    """Whether tf_keras's exact evaluation is building its input.

    `model.evaluate` after `compile(pss_evaluation_shards=...)` gives its
    finite dataset through `_ClusterCoordinatorExactEvalDataHandler`.
    """
    exact = keras_fit.exact_evaluation_handler_class()
    return _nearest_handler(exact) is not None


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
    (`input_role`). As tf_keras's `fit` reads its arguments: arrays split
    off by `validation_split` where no `validation_data` is given, the
    truth test of `validation_data`, `validation_freq` over the epochs."""
    call = current(model)
    if call is None or input_role(model) != "fit":
        return None
    arguments = call.arguments
    data = arguments["validation_data"]
    split = arguments["validation_split"]
    if split and data is None:
        data = keras_fit.split_off_validation(
            arguments["x"], arguments["y"], arguments["sample_weight"], split
        )
    try:
        validates = bool(data)
    except ValueError:  # an array: tf_keras's own test refuses it
        validates = True
    x = y = None
    if validates:
        x, y, _ = tf_keras.utils.unpack_x_y_sample_weight(data)
        freq = arguments["validation_freq"]
        try:
            validates = any(
                keras_fit.should_validate(model, epoch, freq)
                for epoch in range(
                    arguments["initial_epoch"], arguments["epochs"]
                )
            )
        except ValueError:  # a bad validation_freq: tf_keras says so
            validates = True
    return FitValidation(
        data, x, y, arguments["validation_steps"], validates, split
    )
