"""Validated configuration of synchronous aggregation.

Every check here raises before any variable, queue or server exists, with a
message that names the argument and the value received.
"""

from __future__ import annotations

import dataclasses
import numbers


def check_positive_int(name: str, value) -> int:
    """Returns `value` if it is a positive int, else raises naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{name}` must be a positive int. Received: {name}={value!r} "
            f"(of type {type(value).__name__})"
        )
    if value <= 0:
        raise ValueError(
            f"`{name}` must be a positive int. Received: {name}={value!r}"
        )
    return int(value)


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """How many gradients make one synchronous step.

    Attributes:
      replicas_to_aggregate: Fresh gradients averaged into each update (N).
      total_num_replicas: Replicas pushing gradients (M). `M > N` gives
        `M - N` backup replicas whose late gradients are dropped as stale;
        `N > M` makes each replica contribute several gradients per update.
    """

    replicas_to_aggregate: int
    total_num_replicas: int

    @classmethod
    def create(cls, replicas_to_aggregate, total_num_replicas=None):
        """Validates; `total_num_replicas=None` means N (as in TF1)."""
        rta = check_positive_int("replicas_to_aggregate", replicas_to_aggregate)
        if total_num_replicas is None:
            total = rta
        else:
            total = check_positive_int("total_num_replicas", total_num_replicas)
        return cls(replicas_to_aggregate=rta, total_num_replicas=total)

    @property
    def tokens_per_step(self) -> int:
        """Tokens released per applied update: `max(M, N)`, as in TF1."""
        return max(self.replicas_to_aggregate, self.total_num_replicas)

    @property
    def num_backup_replicas(self) -> int:
        return max(0, self.total_num_replicas - self.replicas_to_aggregate)

    def backup_note(self) -> str | None:
        """What backup replicas cost, for the log at start; None without.

        Each update applies the first N fresh pushes; the others of its
        round arrive tagged with the old step and are dropped as stale. On
        replicas of equal speed about `(M - N) / M` of the pushes are
        dropped: the compute paid to not wait for the slowest.
        """
        backups = self.num_backup_replicas
        if not backups:
            return None
        total = self.total_num_replicas
        return (
            f"{backups} backup replica(s): each update applies the first "
            f"{self.replicas_to_aggregate} of {total} pushes and the late "
            f"ones are dropped as stale; on replicas of equal speed about "
            f"{backups / total:.0%} of the pushes (and their compute) are "
            "dropped, the price of not waiting for the slowest."
        )
