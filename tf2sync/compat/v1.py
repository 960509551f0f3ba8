"""TF1 API shims: `tf2sync.compat.v1.SyncReplicasOptimizer`."""

from tf2sync._src.compat_v1 import SyncReplicasOptimizer

__all__ = ["SyncReplicasOptimizer"]
