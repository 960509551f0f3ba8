"""tf2sync: synchronous parameter-server training for TF2 and tf_keras.

Importing tf2sync sets `TF_USE_LEGACY_KERAS=1` (if unset) so that
`tf.keras` is tf_keras (Keras 2): Keras 3 does not support
ParameterServerStrategy. Import tf2sync before tensorflow.
"""

import os
import sys as _sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

# The `tf2sync` command: its console shows tf2sync's lines, TensorFlow's C++
# log goes to a file; this must happen before TensorFlow loads. It stays
# here, not in the launcher's entry point: `python -m tf2sync` and the
# console script import this package (and so TensorFlow) before their own
# module runs. Only the launcher's own process is touched (`is_launcher`).
from tf2sync._src.launcher import console as _console  # noqa: E402

if _console.is_launcher(_sys.argv):
    _console.setup_launcher(_sys.argv)
from tf2sync import compat  # noqa: E402
from tf2sync import testing  # noqa: E402
from tf2sync._src.callbacks import SyncMetrics  # noqa: E402
from tf2sync._src.data_service import ServicePassPerEpoch  # noqa: E402
from tf2sync._src.fit_checkpoint import SyncCheckpoint  # noqa: E402
from tf2sync._src.fit_hooks import OnePassPerEpoch  # noqa: E402
from tf2sync._src.multi_optimizer import MultiOptimizer  # noqa: E402
from tf2sync._src.optimizer import SyncOptimizer  # noqa: E402
from tf2sync._src.options import SyncOptions  # noqa: E402
from tf2sync._src.strategy import SyncParameterServerStrategy  # noqa: E402
from tf2sync._src.trainer import Trainer  # noqa: E402
from tf2sync._src.unrolled_fit import unroll_fit_steps  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "compat",
    "MultiOptimizer",
    "OnePassPerEpoch",
    "ServicePassPerEpoch",
    "SyncCheckpoint",
    "SyncMetrics",
    "SyncOptimizer",
    "SyncOptions",
    "SyncParameterServerStrategy",
    "Trainer",
    "testing",
    "unroll_fit_steps",
]
