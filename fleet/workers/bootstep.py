"""The worker bootstep that shows the fleet's counters in ``inspect stats`` and Flower.

With the threads pool it reads this process's ``WorkerProcess``; with prefork
(where the parent answers and the children drive) it allocates the shared
table before the pool forks and sums its rows (``fleet.workers.stats``).
"""

from __future__ import annotations

from typing import Any

from fleet.host.celery_api import StartStopStep, is_prefork
from fleet.workers import stats
from fleet.workers.process import local_process


class FleetStatsStep(StartStopStep):  # type: ignore[misc]
    """A worker bootstep: ``stats()["fleet"]`` in ``inspect stats`` and Flower."""

    label = "fleet"
    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        if is_prefork(worker.pool_cls):
            slots = max(int(worker.concurrency or 1), int(getattr(worker, "max_concurrency",
                                                                  0) or 0))
            stats.install_board(stats.SharedBoard(slots))

    def info(self, worker: Any) -> dict[str, Any]:
        process = local_process()
        if process is not None:
            values = process.snapshot()
        elif (board := stats.shared_board()) is not None:
            values = board.total()
            values.update(stats.source_values())
        else:
            values = stats.empty()
        return {"fleet": values}


__all__ = ["FleetStatsStep"]
