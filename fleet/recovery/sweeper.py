"""The recovery sweeper: running executions nobody holds -> a drive.

Two faults end the same way: a worker that died mid-run (its lease expires)
and a dispatch lost between the write and the enqueue (no lease was ever
taken). Both leave a ``running`` execution with no live lease; after a grace
period the sweeper enqueues a drive for it (or drives it here). Executions
parked on the divergence gate are parked, not running, so they are skipped.
Several replicas are safe: the worker's drive takes the fence only when no
live lease is held, so a duplicate drive steps aside.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fleet.kernel.runtime import Runtime
from fleet.services.base import PeriodicService

Enqueue = Callable[[str], Awaitable[Any]]


class RecoverySweeper(PeriodicService):
    """Finds abandoned and lost executions every ``interval_s`` and re-drives them.

    Args:
        runtime: the runtime whose store is swept.
        enqueue: hands a drive to the workers; ``None`` drives in this process.
        grace_ms: a running execution untouched for this long with no live lease
            is abandoned (keeps the sweeper off a start that is being enqueued).
    """

    name = "recovery"

    def __init__(self, runtime: Runtime, *, enqueue: Enqueue | None = None,
                 interval_s: float = 2.0, grace_ms: int = 5_000, batch: int = 500,
                 on_error: Callable[[BaseException], Any] | None = None) -> None:
        super().__init__(interval_s, on_error=on_error)
        self.runtime = runtime
        self.enqueue = enqueue
        self.grace_ms = grace_ms
        self.batch = batch
        self.examined = 0
        self.redriven = 0
        self.skipped = 0

    async def tick(self) -> None:
        now = self.runtime.clock()
        after: str | None = None
        while True:
            rows = await self.runtime.store.list_executions(
                status="running", lease_expired_at=now, updated_before=now - self.grace_ms,
                after_id=after, limit=self.batch)
            for row in rows:
                self.examined += 1
                if self.enqueue is not None:
                    await self.enqueue(row.execution_id)
                    self.redriven += 1
                elif await self.runtime.drive_if_free(row.execution_id):
                    self.redriven += 1
                else:
                    self.skipped += 1
            if len(rows) < self.batch:
                return
            after = rows[-1].execution_id

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "examined": self.examined, "redriven": self.redriven,
                "skipped": self.skipped}


__all__ = ["Enqueue", "RecoverySweeper"]
