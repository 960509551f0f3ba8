"""Process start [2.21] [2.15: kept].

Whether a fork of this process would share TensorFlow runtime state (see
`forker.TaskForker`). The eager context has no public "initialised"
flag. TF lists the physical devices at absl's app start
(`distribute.combinations` registers a callback), before any launcher
code: a CPU listing is harmless to a fork, a GPU one has started CUDA.
"""

from __future__ import annotations

from tensorflow.python.eager import context as eager_context


def runtime_started() -> bool:
    """Whether this process made its eager context or found a GPU."""
    ctx = eager_context.context()
    devices = getattr(ctx, "_physical_devices", None) or []
    return ctx._context_handle is not None or any(
        d.device_type == "GPU" for d in devices
    )
