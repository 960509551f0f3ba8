"""What tf2sync installs when first used, not when imported.

The first `SyncParameterServerStrategy` made (its `__init__`) installs two
runtime patches of `internals.patches` that `import tf2sync` once did:
`autograph_skips_tf2sync` (tf2sync's own code runs as written inside the
user's traced steps, as TensorFlow's does: see `internals.autograph`) and
`loss_scaling_predicate` (tf_keras builds mixed_float16 layers and
loss-scale optimizers under that strategy: see `loss_scale`). Both serve
only under the strategy, and every use of tf2sync (`Trainer`,
`SyncOptimizer`, the `compat.v1` shim, `fit`) needs one made first, so
importing tf2sync changes nothing in TensorFlow or tf_keras.
"""

from __future__ import annotations

import tensorflow as tf

from tf2sync._src.internals import mixed_precision
from tf2sync._src.internals import patches


def _supports_loss_scaling(strategy_class):
    if mixed_precision.keras_supports_loss_scaling():
        return True
    return tf.distribute.has_strategy() and isinstance(
        tf.distribute.get_strategy(), strategy_class
    )


def install(strategy_class) -> None:
    """Installs both patches (idempotent); `strategy_class`: the
    `SyncParameterServerStrategy` class, under which tf_keras may scale
    losses."""
    patches.autograph_skips_tf2sync.install()
    patches.loss_scaling_predicate.install(
        lambda: _supports_loss_scaling(strategy_class)
    )
