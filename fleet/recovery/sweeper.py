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
(the dispatcher's drive records, decisions 0019 and 0048) the sweeper asks each
record for its ``verdict``: a drive a live worker took and has not finished is
``held``, one still on its queue (the oldest message there is no younger) is
``queued``, and so is one younger than ``grace_ms`` doubled per re-enqueue where
the queue cannot be read; only a ``lost`` one is re-sent (taken by a worker that
stopped reporting, gone from its queue untaken, or ended with the run still
waiting). So a backlog, however long it takes to drain, is never re-sent.

The grace is judged on the dates of the executions' last writes, which the writers'
clocks set. A write dated more than the grace ahead of the sweeper's clock (a worker
whose clock runs fast, or a forged event) would hide its execution from that filter
until the date came; a second scan finds those (``future_dated`` in its stats) and
re-drives them as the others (issue 25 item 12). Whether a lease is live is the
store's judgement on its own clock (decision 0044).

Refused re-drives are surfaced with their ids and reasons (ADR 0113 fix round
1 item 2). Driving here, the sweeper reports what ``Runtime.recover_abandoned``
reports: a code mismatch or a diverged replay is ``failed``, each named in
``failures``. Enqueuing, a worker drives and its task result says
``divergence_parked``; the sweeper then learns of the refusal from the log:
every tick it lists the executions parked on the divergence gate
(``diverged``, the first ``shown`` by id, with the skipped steps the park
names) and logs each as it first appears in that list.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from fleet.kernel.fold import DIVERGED_GATE
from fleet.kernel.recovery import RecoveryFailure
from fleet.kernel.runtime import Runtime
from fleet.kernel.values import datetime_from_ms
from fleet.services.base import PeriodicService

Enqueue = Callable[[str], Awaitable[Any]]
log = logging.getLogger("fleet.recovery")


class DriveRecord(Protocol):
    """What is known of an execution's last drive (``fleet.dispatcher.drive_records``)."""

    def verdict(self, now_ms: int, grace_ms: int) -> str:
        """``held`` (a live worker has it), ``queued`` (still on its queue) or ``lost``."""
        ...


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
        shown: how many refused re-drives and diverged parks ``stats()`` lists.
    """

    name = "recovery"

    def __init__(self, runtime: Runtime, *, enqueue: Enqueue | None = None,
                 interval_s: float = 2.0, grace_ms: int = 5_000, batch: int = 500,
                 recent: Recent | None = None, shown: int = 20,
                 on_error: Callable[[BaseException], Any] | None = None,
                 **bounds: Any) -> None:
        super().__init__(interval_s, on_error=on_error, **bounds)
        self.runtime = runtime
        self.enqueue = enqueue
        self.grace_ms = grace_ms
        self.batch = batch
        self.recent = recent
        self.shown = shown
        self.examined = 0
        self.redriven = 0
        self.skipped = 0
        self.queued = 0
        self.held = 0
        self.failed = 0
        self.future_dated = 0
        # The latest refused re-drive of each execution (driving here), newest last.
        self.failures: dict[str, RecoveryFailure] = {}
        # Executions parked on the divergence gate: id -> the steps its park names.
        self.diverged: dict[str, str] = {}

    async def tick(self) -> None:
        if self.enqueue is None:
            await self._drive_here()
        else:
            await self._enqueue(self.enqueue)
        await self._future_dated()
        await self._list_diverged()

    async def _drive_here(self) -> None:
        """Re-drive in this process: ``recover_abandoned`` page by page."""
        now = self.runtime.engine.clock()
        after: str | None = None
        while True:
            report = await self.runtime.recover_abandoned(
                now=datetime_from_ms(now), limit=self.batch,
                updated_before=datetime_from_ms(now - self.grace_ms), after_id=after)
            self.examined += report.examined
            self.redriven += report.recovered
            self.skipped += report.skipped
            self.failed += report.failed
            self._note(report.failures)
            if report.examined < self.batch:
                return
            after = report.last_id

    async def _enqueue(self, enqueue: Enqueue) -> None:
        """Hand each abandoned execution's drive to the workers, unless still queued."""
        now = self.runtime.engine.clock()
        after: str | None = None
        while True:
            rows = await self.runtime.store.list_executions(
                status="running", lease_expired_at=now, updated_before=now - self.grace_ms,
                after_id=after, limit=self.batch)
            await self._redrive(rows, now, enqueue)
            if len(rows) < self.batch:
                return
            after = rows[-1].execution_id

    async def _redrive(self, rows: Sequence[Any], now: int, enqueue: Enqueue) -> None:
        records = await self._records(rows)
        for row in rows:
            self.examined += 1
            record = records.get(row.execution_id)
            verdict = record.verdict(now, self.grace_ms) if record is not None else "lost"
            if verdict == "held":
                self.held += 1    # a live worker took its drive and is on it
            elif verdict == "queued":
                self.queued += 1  # its drive is still in a queue
            else:
                await enqueue(row.execution_id)
                self.redriven += 1

    async def _future_dated(self) -> None:
        """Running, no live lease, last write dated more than the grace ahead of this
        clock: re-driven as the abandoned ones are (see the module)."""
        now = self.runtime.engine.clock()
        after: str | None = None
        while True:
            rows = await self.runtime.store.list_executions(
                status="running", lease_expired_at=now, updated_after=now + self.grace_ms,
                after_id=after, limit=self.batch)
            self.future_dated += len(rows)
            if self.enqueue is not None:
                await self._redrive(rows, now, self.enqueue)
            else:
                for row in rows:
                    self.examined += 1
                    if await self.runtime.engine.drive_if_free(row.execution_id) is not None:
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

    def _note(self, failures: tuple[RecoveryFailure, ...]) -> None:
        for failure in failures:
            self.failures.pop(failure.execution_id, None)  # re-inserted as the newest
            self.failures[failure.execution_id] = failure
        while len(self.failures) > self.shown:
            del self.failures[next(iter(self.failures))]

    async def _list_diverged(self) -> None:
        """Refresh ``diverged`` from the index; log each park as it first appears there."""
        rows = await self.runtime.store.list_executions(
            status="parked", waiting_on=DIVERGED_GATE, limit=self.shown)
        seen: dict[str, str] = {}
        for row in rows:
            reason = self.diverged.get(row.execution_id)
            if reason is None:
                state = await self.runtime.load_state(row.execution_id, system=True)
                reason = str((state.waiting or {}).get("correlationKey") or "")
                log.warning("execution %s is parked on %s (%s): fix, pin or migrate its "
                            "code, then retry_diverged", row.execution_id, DIVERGED_GATE,
                            reason)
            seen[row.execution_id] = reason
        self.diverged = seen

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "examined": self.examined, "redriven": self.redriven,
                "skipped": self.skipped, "queued": self.queued, "held": self.held,
                "failed": self.failed, "future_dated": self.future_dated,
                "failures": [{"executionId": f.execution_id, "error": f.error,
                              "reason": f.reason} for f in self.failures.values()],
                "diverged": [{"executionId": eid, "reason": reason}
                             for eid, reason in self.diverged.items()]}


__all__ = ["DriveRecord", "Enqueue", "Recent", "RecoverySweeper"]
