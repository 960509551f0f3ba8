"""TF1 compatibility shims (`tf2sync.compat.v1`)."""

from tf2sync.compat import v1

__all__ = ["v1"]
