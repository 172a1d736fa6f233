"""Re-driving abandoned executions: ``recover_abandoned``.

A running execution whose lease expired lost its holder (a crashed process, a
worker that lost its store). ``recover_abandoned`` drives each one found, if
no live lease holds it by then, and reports what it did. The fleet's
``RecoverySweeper`` (``fleet.recovery``) does the same on a period, and also
finds dispatches lost between the write and the enqueue.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.kernel.engine import Engine
from fleet.kernel.errors import FleetError


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    examined: int = 0
    recovered: int = 0
    skipped: int = 0
    failed: int = 0


async def recover_abandoned(engine: Engine, *, now: int | None = None,
                            limit: int = 100) -> RecoveryReport:
    """Re-drive running executions whose lease expired (their holder died)."""
    now = engine.clock() if now is None else now
    examined = recovered = skipped = failed = 0
    for summary in await engine.store.list_executions(status="running",
                                                      lease_expired_at=now, limit=limit):
        examined += 1
        if summary.execution_id in engine.runs:
            skipped += 1
            continue
        try:
            if await engine.drive_if_free(summary.execution_id) is not None:
                recovered += 1
            else:
                skipped += 1
        except FleetError as exc:
            failed += 1
            engine.warner.warn(f"recovery of {summary.execution_id!r} failed: {exc}")
    return RecoveryReport(examined, recovered, skipped, failed)
