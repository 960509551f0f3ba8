"""`SyncOptions`: the tunables of synchronous training, in one value."""

from __future__ import annotations

import dataclasses

from tf2sync._src import config as config_lib


@dataclasses.dataclass(frozen=True)
class SyncOptions:
    """Tunable settings of `tf2sync.SyncParameterServerStrategy`.

    Pass them as `SyncParameterServerStrategy(..., options=SyncOptions(...))`
    and read them as `strategy.options`. `model.fit` (when it repeats its
    steps, see `tf2sync.unroll_fit_steps`) and `tf2sync.Trainer` read them
    from the strategy; `Trainer(..., options=...)` overrides the strategy's
    for that trainer. A `SyncOptions` is frozen: change one with
    `dataclasses.replace(options, max_unrolled_steps=4)`, which validates
    the new value too.

    Attributes:
      max_unrolled_steps: Copies of a step per loop iteration when the
        caller does not choose: a function running more steps than this
        repeats them in groups of `max_unrolled_steps` in a
        `tf.while_loop`, the rest unrolled after it. More copies cost
        tracing time (each copy is traced) and ps memory; fewer cost a
        loop iteration's transfers to the ps per group. `model.fit` with a
        larger `steps_per_execution`, and `Trainer` with
        `use_tf_while_loop=None`, use it. Default 10.

    Raises:
      TypeError: If `max_unrolled_steps` is not an int.
      ValueError: If `max_unrolled_steps` is not positive.
    """

    max_unrolled_steps: int = 10

    def __post_init__(self):
        value = config_lib.check_positive_int(
            "max_unrolled_steps", self.max_unrolled_steps
        )
        object.__setattr__(self, "max_unrolled_steps", value)


def check(options, argument: str = "options") -> SyncOptions:
    """`options`, or `SyncOptions()` for None; raises unless a SyncOptions."""
    if options is None:
        return SyncOptions()
    if not isinstance(options, SyncOptions):
        raise TypeError(
            f"`{argument}` must be a tf2sync.SyncOptions or None. Received: "
            f"{argument}={options!r} (of type {type(options).__name__})"
        )
    return options


def of_strategy(strategy) -> SyncOptions:
    """`strategy.options` if it is a `SyncOptions`, else `SyncOptions()`."""
    options = getattr(strategy, "options", None)
    return options if isinstance(options, SyncOptions) else SyncOptions()
