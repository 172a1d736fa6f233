"""Re-driving abandoned executions: ``recover_abandoned``.

A running execution whose lease expired lost its holder (a crashed process, a
worker that lost its store). ``recover_abandoned`` drives each one found, if
no live lease holds it by then, and reports what it did. The fleet's
``RecoverySweeper`` (``fleet.recovery``) does the same on a period, and also
finds dispatches lost between the write and the enqueue.

A re-drive the kernel refuses is counted as failed and named in the report with
its reason (ADR 0113 fix round 1 item 2: the record's ``onError``): code the
process may not run the log with (``FlowCodeMismatchError``, refused before the
run starts) and a replay the divergence detector refuses (``fail`` mode: the run
parks on the reserved gate). The second is only known once the re-run has
replayed, so each launched run is awaited until it is past that point
(``Run.past_replay``) or has stopped, whichever comes first, at most one lease
period; the live work after it is not waited for. The runs of one pass replay
concurrently.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fleet.kernel.engine import Engine, RunFuture
from fleet.kernel.errors import FleetError
from fleet.kernel.run import Run
from fleet.kernel.run_outcome import RunOutcome


@dataclass(frozen=True, slots=True)
class RecoveryFailure:
    """A re-drive the kernel refused: which execution, the error's type, why."""

    execution_id: str
    error: str    # the error's class name: FlowCodeMismatchError, FlowReplayDivergenceError...
    reason: str   # its message


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What one ``recover_abandoned`` pass did.

    ``failed`` counts ``failures``, which name each refused re-drive and why;
    ``last_id`` is the last execution examined (page on with ``after_id=``).
    """

    examined: int = 0
    recovered: int = 0
    skipped: int = 0
    failed: int = 0
    failures: tuple[RecoveryFailure, ...] = ()
    last_id: str | None = None


# A run that ended here in one of these kinds was not recovered by this pass.
_NOT_OURS = frozenset({"nothing_to_do", "fenced_out", "stepped_aside"})  # ended, parked, taken
_REFUSED = frozenset({"diverged_parked", "aborted"})     # the re-drive did not go through


async def recover_abandoned(engine: Engine, *, now: int | None = None, limit: int = 100,
                            updated_before: int | None = None,
                            after_id: str | None = None) -> RecoveryReport:
    """Re-drive running executions whose lease expired (their holder died).

    Args:
        now: The time leases are judged at (ms; default: the engine's clock).
        limit: At most this many executions are examined.
        updated_before: Only executions untouched since then (ms): a grace period.
        after_id: Page: only ids after this one.
    """
    now = engine.clock() if now is None else now
    rows = await engine.store.list_executions(status="running", lease_expired_at=now,
                                              updated_before=updated_before,
                                              after_id=after_id, limit=limit)
    recovered = skipped = 0
    failures: list[RecoveryFailure] = []
    launched: list[tuple[str, RunFuture, Run | None]] = []
    for summary in rows:
        execution_id = summary.execution_id
        if execution_id in engine.runs:
            skipped += 1
            continue
        try:
            future = await engine.drive_if_free(execution_id)
        except FleetError as exc:
            failures.append(RecoveryFailure(execution_id, type(exc).__name__, str(exc)))
            engine.warner.warn(f"recovery of {execution_id!r} failed: {exc}")
            continue
        if future is None:
            skipped += 1
        else:
            launched.append((execution_id, future, engine.runs.get(execution_id)))
    ends = await asyncio.gather(*(_replayed(engine, future, run) for _, future, run in launched))
    for (execution_id, _, _), end in zip(launched, ends, strict=True):
        if isinstance(end, BaseException):
            failures.append(RecoveryFailure(execution_id, type(end).__name__, str(end)))
        elif end is None or end.kind not in _NOT_OURS | _REFUSED:
            recovered += 1   # past its replay (still running), or it ran to a stop
        elif end.kind in _NOT_OURS:
            skipped += 1
        else:
            cause = end.cause
            failures.append(RecoveryFailure(
                execution_id, type(cause).__name__ if cause is not None else end.kind,
                str(cause) if cause is not None else str(end)))
    return RecoveryReport(len(rows), recovered, skipped, len(failures), tuple(failures),
                          rows[-1].execution_id if rows else None)


async def _replayed(engine: Engine, future: RunFuture,
                    run: Run | None) -> RunOutcome | BaseException | None:
    """How the run stopped if it stopped before it was past its replay (its outcome,
    or what it raised); None while it runs on past it."""
    if not future.done() and run is not None:
        waited: set[asyncio.Future[Any]] = {future, run.past_replay()}
        await asyncio.wait(waited, timeout=engine.lease_ms / 1000,
                           return_when=asyncio.FIRST_COMPLETED)
    if not future.done():
        return None
    if future.cancelled():
        return asyncio.CancelledError("the re-drive was cancelled before it replayed")
    return future.exception() or future.result()
