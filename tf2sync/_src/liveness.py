"""Liveness: a worker that stops answering is treated as failed.

PSS learns that a worker failed only from an error: a killed worker's
closure fails at once, but a frozen one (SIGSTOP, a partition, a hung
host) keeps its closure in flight, the epoch's `join` waits for it, and
without backup workers its step's token is never pushed.

`WorkerMonitor` runs on the coordinator. A thread per worker pings it (a
scalar op run on the worker, with an executor of its own) every
`timeout / 4` seconds; a worker whose ping has been unanswered for
`timeout` seconds, while another worker answered meanwhile, is declared
frozen:

* its in-flight closure is put back in the queue (`closures.
  take_over_closure`), so another worker runs it and `join` does not wait;
  whatever the frozen run returns later is ignored;
* every token watchdog is alarmed (`watchdog.alarm_all`), so the token its
  step held is released on the stall.

When its pings are answered again the worker is alive again and takes
closures as before. What the frozen run pushes once it wakes is stale (its
tag is older than the global step) or counted against the epoch's plan
(`Aggregator.plan_updates`): never applied twice. A ping that fails with an
error (a killed worker) is PSS's to handle, not the monitor's; with a
single worker nothing is ever declared (no other worker could take over).
"""

from __future__ import annotations

import threading
import time
import weakref

from absl import logging

from tf2sync._src import watchdog
from tf2sync._src.internals import closures
from tf2sync._src.internals import cluster_coordinator
from tf2sync._src.internals import patches

_LIVE = weakref.WeakSet()


def any_frozen() -> bool:
    """Whether a monitor of this process holds a worker frozen now.

    While one does, a function the chief traces waits for it (the chief
    registers every new function with every task): run eagerly instead.
    """
    return any(any(m._frozen) for m in list(_LIVE))


def stop_all() -> None:
    """Stops every monitor of this process (before connecting elsewhere)."""
    for monitor in list(_LIVE):
        monitor.stop()


class WorkerMonitor:
    """Declares frozen workers failed; see the module docstring.

    Attributes:
      declared: `(worker index, seconds unanswered)` of each declaration.
      moved: The worker index of each in-flight function moved to another
        worker: at its declaration, or later, if the worker, still frozen,
        took one meanwhile.
    """

    def __init__(self, coordinator, timeout: float, pinger=None):
        """Starts the ping threads and the watch.

        Args:
          coordinator: The strategy's `SyncCoordinator`.
          timeout: Seconds unanswered before a worker is declared frozen.
          pinger: `pinger(device) -> ping()`, for tests; by default
            `cluster_coordinator.worker_pinger`.
        """
        self._pinger = pinger or cluster_coordinator.worker_pinger
        self.timeout = float(timeout)
        self.period = max(0.05, self.timeout / 4)
        self.declared = []
        self.moved = []
        self._coordinator = weakref.ref(coordinator)
        self._stop = threading.Event()
        workers = cluster_coordinator.coordinator_workers(coordinator)
        now = time.monotonic()
        # Per worker: when its last ping was answered, and whether it is
        # declared frozen now.
        self._answered = [now] * len(workers)
        self._frozen = [False] * len(workers)
        patches.closure_tracking.install(coordinator)
        for index, worker in enumerate(workers):
            threading.Thread(
                target=self._ping_loop,
                args=(index, worker.device_name),
                name=f"tf2sync-ping-worker-{index}",
                daemon=True,
            ).start()
        threading.Thread(
            target=self._watch, name="tf2sync-worker-monitor", daemon=True
        ).start()
        _LIVE.add(self)

    def stop(self) -> None:
        self._stop.set()

    def _ping_loop(self, index, device):
        ping = self._pinger(device)
        while not self._stop.wait(self.period):
            try:
                ping()
            except Exception:  # noqa: BLE001 - a dead worker: PSS's to handle
                continue
            self._answered[index] = time.monotonic()
            if self._frozen[index]:
                self._frozen[index] = False
                logging.warning(
                    "tf2sync: worker %d answers again; it takes functions "
                    "as before.",
                    index,
                )

    def _watch(self):
        while not self._stop.wait(self.period):
            now = time.monotonic()
            silent = [now - t for t in self._answered]
            for index, seconds in enumerate(silent):
                if self._frozen[index]:
                    self._take_over(index, seconds)  # one it took since
                    continue
                others = [s for i, s in enumerate(silent) if i != index]
                if (
                    seconds < self.timeout
                    or not others
                    or min(others) >= self.timeout
                ):
                    continue
                self._declare(index, seconds)

    def _take_over(self, index, seconds):
        """Moves a closure a frozen worker took (idle when declared)."""
        coordinator = self._coordinator()
        if coordinator is None or not closures.take_over_closure(
            coordinator, index
        ):
            return
        self.moved.append(index)
        logging.warning(
            "tf2sync: worker %d, frozen, took a function: it runs again on "
            "another worker.",
            index,
        )
        watchdog.alarm_all(f"worker {index} did not answer for {seconds:.0f} s")

    def _declare(self, index, seconds):
        coordinator = self._coordinator()
        if coordinator is None:
            self.stop()
            return
        self._frozen[index] = True
        self.declared.append((index, seconds))
        moved = closures.take_over_closure(coordinator, index)
        if moved:
            self.moved.append(index)
        logging.warning(
            "tf2sync: worker %d has not answered for %.1f s "
            "(worker_timeout=%g): treated as failed%s.",
            index,
            seconds,
            self.timeout,
            "; its function runs again on another worker" if moved else "",
        )
        watchdog.alarm_all(f"worker {index} did not answer for {seconds:.0f} s")
