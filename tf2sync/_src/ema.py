"""Exponential moving averages of variables, one update per sync step."""

from __future__ import annotations

import contextlib

import tensorflow as tf


class MovingAverages:
    """Shadow copies of variables on their parameter servers.

    After each applied synchronous update, inside the critical section and
    before the tokens are released, every shadow becomes
    `decay * shadow + (1 - decay) * variable` (the variable's post-update
    value). Shadows start at the variables' values when created and are
    saved in checkpoints with the optimizer.
    """

    def __init__(self, decay: float, strategy):
        if isinstance(decay, bool) or not 0.0 <= float(decay) < 1.0:
            raise ValueError(
                f"`ema_decay` must be a float in [0, 1). Received: "
                f"ema_decay={decay!r}"
            )
        self.decay = float(decay)
        self._strategy = strategy
        self.variables = []
        self.shadows = []

    def build(self, var_list):
        """Creates a shadow per variable, eagerly, beside the variable."""
        known = {id(v) for v in self.variables}
        with tf.init_scope(), self._strategy.scope():
            for var in var_list:
                if id(var) in known:
                    continue
                with self._strategy.extended.colocate_vars_with(var):
                    shadow = tf.Variable(
                        var.read_value(),
                        trainable=False,
                        name=var.name.split(":")[0] + "/ema",
                    )
                self.variables.append(var)
                self.shadows.append(shadow)

    def update_ops(self):
        """Ops moving each shadow toward its variable (in the apply)."""
        decay = self.decay
        ops = []
        for var, shadow in zip(self.variables, self.shadows):
            value = tf.cast(var.read_value(), shadow.dtype)
            ops.append(shadow.assign(decay * shadow + (1.0 - decay) * value))
        return ops

    @contextlib.contextmanager
    def swapped(self):
        """Within the block the variables hold their averages."""
        saved = [v.read_value() for v in self.variables]
        for var, shadow in zip(self.variables, self.shadows):
            var.assign(shadow.read_value())
        try:
            yield
        finally:
            for var, value in zip(self.variables, saved):
                var.assign(value)
