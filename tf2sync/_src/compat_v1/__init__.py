"""TF1's `SyncReplicasOptimizer` on tf2sync's core barrier (a shim).

`optimizer` is the public class, `engine` the step protocol that runs it
on `aggregation.Aggregator`, `step` one traced step's record, `inner` the
wrapped optimizers, `hooks` TF1's chief objects.
"""

from tf2sync._src.compat_v1.optimizer import SyncReplicasOptimizer

__all__ = ["SyncReplicasOptimizer"]
