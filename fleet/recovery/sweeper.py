"""The recovery sweeper: running executions nobody holds -> a drive.

Two faults end the same way: a worker that died mid-run (its lease expires)
and a dispatch lost between the write and the enqueue (no lease was ever
taken). Both leave a ``running`` execution with no live lease; after a grace
period the sweeper enqueues a drive for it (or drives it here). Executions
parked on the divergence gate are parked, not running, so they are skipped.
Several replicas are safe: the worker's drive takes the fence only when no
live lease is held, so a duplicate drive steps aside.

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
from collections.abc import Awaitable, Callable
from typing import Any

from fleet.kernel.fold import DIVERGED_GATE
from fleet.kernel.recovery import RecoveryFailure
from fleet.kernel.runtime import Runtime
from fleet.services.base import PeriodicService

Enqueue = Callable[[str], Awaitable[Any]]
log = logging.getLogger("fleet.recovery")


class RecoverySweeper(PeriodicService):
    """Finds abandoned and lost executions every ``interval_s`` and re-drives them.

    Args:
        runtime: the runtime whose store is swept.
        enqueue: hands a drive to the workers; ``None`` drives in this process.
        grace_ms: a running execution untouched for this long with no live lease
            is abandoned (keeps the sweeper off a start that is being enqueued).
        shown: how many refused re-drives and diverged parks ``stats()`` lists.
    """

    name = "recovery"

    def __init__(self, runtime: Runtime, *, enqueue: Enqueue | None = None,
                 interval_s: float = 2.0, grace_ms: int = 5_000, batch: int = 500,
                 shown: int = 20,
                 on_error: Callable[[BaseException], Any] | None = None) -> None:
        super().__init__(interval_s, on_error=on_error)
        self.runtime = runtime
        self.enqueue = enqueue
        self.grace_ms = grace_ms
        self.batch = batch
        self.shown = shown
        self.examined = 0
        self.redriven = 0
        self.skipped = 0
        self.failed = 0
        # The latest refused re-drive of each execution (driving here), newest last.
        self.failures: dict[str, RecoveryFailure] = {}
        # Executions parked on the divergence gate: id -> the steps its park names.
        self.diverged: dict[str, str] = {}

    async def tick(self) -> None:
        now = self.runtime.clock()
        after: str | None = None
        while True:
            if self.enqueue is None:
                report = await self.runtime.recover_abandoned(
                    now=now, limit=self.batch, updated_before=now - self.grace_ms,
                    after_id=after)
                self.examined += report.examined
                self.redriven += report.recovered
                self.skipped += report.skipped
                self.failed += report.failed
                self._note(report.failures)
                examined, after = report.examined, report.last_id
            else:
                rows = await self.runtime.store.list_executions(
                    status="running", lease_expired_at=now,
                    updated_before=now - self.grace_ms, after_id=after, limit=self.batch)
                for row in rows:
                    self.examined += 1
                    await self.enqueue(row.execution_id)
                    self.redriven += 1
                examined = len(rows)
                after = rows[-1].execution_id if rows else None
            if examined < self.batch:
                break
        await self._list_diverged()

    def _note(self, failures: tuple[RecoveryFailure, ...]) -> None:
        for failure in failures:
            self.failures.pop(failure.execution_id, None)  # re-inserted as the newest
            self.failures[failure.execution_id] = failure
        while len(self.failures) > self.shown:
            del self.failures[next(iter(self.failures))]

    async def _list_diverged(self) -> None:
        """Refresh ``diverged`` from the index; log each park the first time it is seen."""
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
                "skipped": self.skipped, "failed": self.failed,
                "failures": [{"executionId": f.execution_id, "error": f.error,
                              "reason": f.reason} for f in self.failures.values()],
                "diverged": [{"executionId": eid, "reason": reason}
                             for eid, reason in self.diverged.items()]}


__all__ = ["Enqueue", "RecoverySweeper"]
