"""What a launcher job module (`--job_module`) gives, checked before start.

`CONTRACT` is the one list of the names the chief and the evaluator use:
each function with the arguments the launcher passes and what it must
return, each constant with its type. `check` refuses, in one line naming
the module, a missing name, a constant of the wrong type, or a function
that cannot be called with the launcher's arguments, before any task
starts; `call` refuses, when the chief calls a function, a value of the
wrong kind. `markdown_table()` is the README's table of the
contract (tests/launch_input_test.py checks the README holds it).
"""

from __future__ import annotations

import dataclasses
import inspect

from absl import app

DOC = "tf2sync/_src/jobs/digits.py"


@dataclasses.dataclass(frozen=True)
class Name:
    """One name of the contract.

    Attributes:
      name: the module attribute.
      params: the arguments the launcher passes (a function), else None.
      returns: what the function returns, or the constant's type, in words.
      when: who uses it: "chief", "both" (chief and evaluator), or the
        condition under which the chief does (an optional name).
    """

    name: str
    params: tuple[str, ...] | None
    returns: str
    when: str

    @property
    def required_by_chief(self) -> bool:
        return self.when in ("chief", "both")

    @property
    def spelled(self) -> str:
        if self.params is None:
            return self.name
        return f"{self.name}({', '.join(self.params)})"


CONTRACT = (
    Name(
        "build_model",
        (),
        "a `tf.keras.Model`, built under the strategy's scope",
        "both",
    ),
    Name(
        "train_dataset",
        ("input_context", "batch_size"),
        "a repeated `tf.data.Dataset` of `(x, y)` batches: worker "
        "`input_context.input_pipeline_id`'s shard",
        "chief",
    ),
    Name(
        "eval_arrays",
        (),
        "`(x, y)`: held-out NumPy arrays (or dicts of them)",
        "both",
    ),
    Name(
        "num_train_examples",
        (),
        "an int: the examples of one epoch",
        "chief, without --steps_per_epoch",
    ),
    Name(
        "LOSS",
        None,
        "a loss for `model.compile` (a name or a callable)",
        "both",
    ),
    Name(
        "METRICS",
        None,
        "a list of metrics for `model.compile`; the final line shows them "
        "(the loss if it is empty)",
        "both",
    ),
    Name(
        "build_optimizer",
        ("learning_rate", "momentum"),
        "a tf_keras optimizer (or a TF1 one with --sync_optimizer=tf1_shim)",
        "optional",
    ),
    Name(
        "optimizer_groups",
        ("learning_rate",),
        "a list of `(description, predicate, learning_rate)`: a rate per "
        "variable group",
        "optional",
    ),
    Name(
        "train_pass",
        ("batch_size",),
        "the finite, batched `tf.data.Dataset` of one pass",
        "with --input_sharding=service",
    ),
    Name("callbacks", (), "a list of Keras callbacks for `fit`", "optional"),
    Name(
        "FLAG_DEFAULTS",
        None,
        "a dict of launcher flag name to default (`jobs/clicks.py`)",
        "optional",
    ),
)
BY_NAME = {n.name: n for n in CONTRACT}
_CONSTANT_TYPES = {
    "METRICS": (list, tuple),
    "FLAG_DEFAULTS": (dict,),
}


def _refuse(message: str):
    raise app.UsageError(message, exitcode=2)


def _callable_as(fn, params) -> bool:
    """Whether `fn(*params)` binds (positionally, as the launcher calls)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature
        return True
    try:
        signature.bind(*params)
    except TypeError:
        return False
    return True


def check(job, module: str, *, evaluator: bool, steps_per_epoch) -> None:
    """Refuses `job` (the module `--job_module=module`) in one line.

    Missing names (all of them, in one line), then the first name of the
    wrong kind: a constant of the wrong type, a function the launcher
    cannot call with its arguments (optional names too, when defined).
    """
    wanted = [
        n
        for n in CONTRACT
        if (n.when == "both")
        or (not evaluator and n.required_by_chief)
        or (
            not evaluator
            and n.name == "num_train_examples"
            and steps_per_epoch is None
        )
    ]
    missing = [
        n.spelled
        for n in wanted
        if getattr(job, n.name, None) is None
        or (n.params is not None and not callable(getattr(job, n.name)))
    ]
    if missing:
        _refuse(
            f"--job_module={module}: the module lacks {', '.join(missing)} "
            f"(a job defines {', '.join(n.spelled for n in wanted)}; see "
            f"{DOC})."
        )
    for n in CONTRACT:
        value = getattr(job, n.name, None)
        if value is None:
            continue
        if n.params is None:
            types = _CONSTANT_TYPES.get(n.name)
            if types and not isinstance(value, types):
                _refuse(
                    f"--job_module={module}: {n.name} must be {n.returns}. "
                    f"Received: {n.name}={value!r}"
                )
        elif not callable(value):
            _refuse(
                f"--job_module={module}: {n.name} must be a function "
                f"{n.spelled}. Received: {n.name}={value!r}"
            )
        elif not _callable_as(value, n.params):
            _refuse(
                f"--job_module={module}: the launcher calls {n.spelled}, and "
                f"{n.name}{inspect.signature(value)} cannot take that "
                f"(it must return {n.returns})."
            )


def _is_model(value) -> bool:
    import tensorflow as tf

    return isinstance(value, tf.keras.Model)


def _is_optimizer(value) -> bool:
    import tensorflow as tf

    return isinstance(
        value,
        (
            tf.keras.optimizers.Optimizer,
            tf.keras.optimizers.legacy.Optimizer,
            tf.compat.v1.train.Optimizer,
        ),
    )


def _is_dataset(value) -> bool:
    import tensorflow as tf

    return isinstance(value, tf.data.Dataset)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


_RETURNS = {
    "build_model": _is_model,
    "build_optimizer": _is_optimizer,
    "train_dataset": _is_dataset,
    "train_pass": _is_dataset,
    "eval_arrays": lambda v: isinstance(v, (tuple, list)) and len(v) == 2,
    "num_train_examples": lambda v: _is_count(getattr(v, "item", lambda: v)()),
    "optimizer_groups": lambda v: isinstance(v, (list, tuple)),
    "callbacks": lambda v: isinstance(v, (list, tuple)),
}


def call(job, name: str, *args):
    """`job.name(*args)`, refused in one line (`TypeError`) if it returns
    what `CONTRACT` says it must not."""
    value = getattr(job, name)(*args)
    if not _RETURNS[name](value):
        n = BY_NAME[name]
        text = repr(value)
        text = text if len(text) <= 80 else text[:77] + "..."
        raise TypeError(
            f"--job_module={job.__name__}: {n.spelled} must return "
            f"{n.returns}. Received: {type(value).__name__} {text}"
        )
    return value


def markdown_table() -> str:
    """The contract as the README's table."""
    rows = ["| name | returns / type | used |", "|---|---|---|"]
    for n in CONTRACT:
        used = {"both": "chief, evaluator"}.get(n.when, n.when)
        rows.append(f"| `{n.spelled}` | {n.returns} | {used} |")
    return "\n".join(rows)
