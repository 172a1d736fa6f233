"""The recovery sweeper: running executions nobody holds -> a drive.

Two faults end the same way: a worker that died mid-run (its lease expires)
and a dispatch lost between the write and the enqueue (no lease was ever
taken). Both leave a ``running`` execution with no live lease; after a grace
period the sweeper enqueues a drive for it (or drives it here). Executions
parked on the divergence gate are parked, not running, so they are skipped.
Several replicas are safe: the worker's drive takes the fence only when no
live lease is held, so a duplicate drive steps aside.

An execution whose drive is merely queued (workers busy with a backlog, or
catching up after a broker restart) also looks like that. With ``recent``
(the dispatcher's drive records, decision 0019) the sweeper leaves alone an
execution whose last drive was enqueued less than ``grace_ms`` ago, doubled for
each re-enqueue in a row (``queued`` in its stats): a lost message is still
re-sent, a queued one is not sent again and again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from fleet.kernel.runtime import Runtime
from fleet.services.base import PeriodicService

Enqueue = Callable[[str], Awaitable[Any]]


class DriveRecord(Protocol):
    """When a drive was last enqueued (``fleet.dispatcher.publish.DriveRecord``)."""

    def fresh(self, now_ms: int, grace_ms: int) -> bool: ...


Recent = Callable[[Sequence[str]], Awaitable[Mapping[str, DriveRecord]]]


class RecoverySweeper(PeriodicService):
    """Finds abandoned and lost executions every ``interval_s`` and re-drives them.

    Args:
        runtime: the runtime whose store is swept.
        enqueue: hands a drive to the workers; ``None`` drives in this process.
        grace_ms: a running execution untouched for this long with no live lease
            is abandoned (keeps the sweeper off a start that is being enqueued).
        recent: the drive records of a page of executions
            (``Dispatcher.recent_drives``); those still fresh are skipped.
    """

    name = "recovery"

    def __init__(self, runtime: Runtime, *, enqueue: Enqueue | None = None,
                 interval_s: float = 2.0, grace_ms: int = 5_000, batch: int = 500,
                 recent: Recent | None = None,
                 on_error: Callable[[BaseException], Any] | None = None,
                 **bounds: Any) -> None:
        super().__init__(interval_s, on_error=on_error, **bounds)
        self.runtime = runtime
        self.enqueue = enqueue
        self.grace_ms = grace_ms
        self.batch = batch
        self.recent = recent
        self.examined = 0
        self.redriven = 0
        self.skipped = 0
        self.queued = 0

    async def tick(self) -> None:
        now = self.runtime.clock()
        after: str | None = None
        while True:
            rows = await self.runtime.store.list_executions(
                status="running", lease_expired_at=now, updated_before=now - self.grace_ms,
                after_id=after, limit=self.batch)
            records = await self._records(rows)
            for row in rows:
                self.examined += 1
                record = records.get(row.execution_id)
                if record is not None and record.fresh(now, self.grace_ms):
                    self.queued += 1  # its drive is still in a queue
                elif self.enqueue is not None:
                    await self.enqueue(row.execution_id)
                    self.redriven += 1
                elif await self.runtime.drive_if_free(row.execution_id):
                    self.redriven += 1
                else:
                    self.skipped += 1
            if len(rows) < self.batch:
                return
            after = rows[-1].execution_id

    async def _records(self, rows: Sequence[Any]) -> Mapping[str, DriveRecord]:
        if self.recent is None or self.enqueue is None or not rows:
            return {}
        try:
            return await self.recent([row.execution_id for row in rows])
        except Exception as exc:  # noqa: BLE001 - without records, re-enqueue (harmless)
            if self.on_error is not None:
                self.on_error(exc)
            return {}

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "examined": self.examined, "redriven": self.redriven,
                "skipped": self.skipped, "queued": self.queued}


__all__ = ["DriveRecord", "Enqueue", "Recent", "RecoverySweeper"]
