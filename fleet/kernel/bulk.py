"""Operator actions in bulk: cancel, retry or resume every execution a filter matches
(issue 29.5, decision 0052).

``bulk_action(runtime, "retry", ExecutionFilter(flow="onboard"), principal=ops)``
pages through the store's index in id order (``list_executions``: status, flow,
tenant, the gate a parked run waits on, age), folds a candidate only when the filter
needs what the index does not keep (the version, the parked reason), and for each
match makes the single call an operator would (``cancel``, ``retry_diverged``,
``resume``), so each action is authorised and audited exactly as that call is
(``by`` on the resume, the refusal's ``EXECUTION_DENIED``; a bulk cancel says who in
its ``reason``). The fleet's operator makes the same calls through its dispatcher
(``fleet executions ...``), which enqueues the drives.

- **Dry run** (``dry_run=True``): every match is reported (``on_item``), nothing is
  written.
- **Rate**: at most ``rate`` actions a second (default 20), so 100,000 matches become
  a steady trickle of drives, not a flood; ``limit`` stops after that many actions.
- **Resumable**: matches are visited in id order and ``report.cursor`` is the last id
  settled; ``after_id=cursor`` goes on from there. An action that already happened (a
  cancelled run, a retried one no longer parked) is skipped, not failed, so running
  the same command twice is safe too.
- **A refusal is that match's, not the run's**: a ``FleetError`` (no access, it ended,
  it moved) is counted and reported; the store being unreachable stops the run with
  the cursor to resume from.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from fleet.kernel.errors import (
    ExecutionFinishedError,
    ExecutionNotParkedError,
    FleetError,
    GateMismatchError,
    StoreUnavailableError,
    ValidationError,
)
from fleet.kernel.events import TERMINAL_STATUSES
from fleet.kernel.fold import DIVERGED_GATE, ExecutionState
from fleet.kernel.security import Principal
from fleet.kernel.store.spi import EventStore, ExecutionSummary
from fleet.kernel.values import datetime_from_ms

if TYPE_CHECKING:
    from fleet.kernel.runtime import Runtime

Action = Literal["cancel", "retry", "resume"]
ACTIONS: tuple[Action, ...] = ("cancel", "retry", "resume")
#: Refusals that mean the action is done already or no longer applies: skipped.
_SETTLED = (ExecutionFinishedError, ExecutionNotParkedError, GateMismatchError)
#: At most this many failures are kept in a report (the count is exact).
FAILURES_KEPT = 100


@dataclass(frozen=True, slots=True)
class ExecutionFilter:
    """Which executions a bulk action takes; every field given must match."""

    flow: str | None = None
    version: int | None = None
    status: str | None = None
    gate: str | None = None           # the gate a parked execution waits on
    reason: str | None = None         # text its parked reason contains
    tenant: str | None = None
    older_than: timedelta | None = None  # untouched for at least this long

    def __post_init__(self) -> None:
        if self.older_than is not None and (not isinstance(self.older_than, timedelta)
                                            or self.older_than < timedelta(0)):
            raise ValidationError("older_than must be a timedelta >= 0, e.g. timedelta(hours=1)")
        if self.version is not None and (isinstance(self.version, bool)
                                         or not isinstance(self.version, int)):
            raise ValidationError(f"version must be an int, got {self.version!r}")

    @property
    def empty(self) -> bool:
        return all(getattr(self, name) is None for name in self.__slots__)

    def describe(self) -> str:
        given = [f"{name}={getattr(self, name)}" for name in self.__slots__
                 if getattr(self, name) is not None]
        return ", ".join(given) or "every execution"


@dataclass(frozen=True, slots=True)
class Match:
    """An execution a filter matched, as the index and (when folded) its log say."""

    execution_id: str
    flow_id: str
    status: str
    waiting_on: str | None
    tenant: str | None
    updated_at: datetime
    version: int | None = None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"executionId": self.execution_id, "flow": self.flow_id,
                "version": self.version, "status": self.status,
                "waitingOn": self.waiting_on, "reason": self.reason, "tenant": self.tenant,
                "updatedAt": self.updated_at.isoformat()}


@dataclass(slots=True)
class BulkReport:
    """What a bulk action did."""

    action: Action
    dry_run: bool
    matched: int = 0
    acted: int = 0
    skipped: int = 0
    failed: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)
    cursor: str | None = None      # the last id settled: ``after_id`` resumes after it
    stopped: str | None = None     # why it stopped before the end (limit, store)

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "dryRun": self.dry_run, "matched": self.matched,
                "acted": self.acted, "skipped": self.skipped, "failed": self.failed,
                "failures": [{"executionId": e, "error": m} for e, m in self.failures],
                "cursor": self.cursor, "stopped": self.stopped}


#: What a bulk action calls per match (the execution id).
Act = Callable[[str], Awaitable[object]]
#: The folded state of an execution (for the version and the parked reason).
ReadState = Callable[[str], Awaitable[ExecutionState]]
#: Told of each match and what became of it ("would", "done", "skipped: ...", "failed: ...").
OnItem = Callable[[Match, str], None]


def _match(row: ExecutionSummary, state: ExecutionState | None) -> Match:
    reason = None
    if state is not None and state.waiting:
        reason = str(state.waiting.get("correlationKey") or state.waiting.get("reason") or "")
    return Match(row.execution_id, row.flow_id, row.status, row.waiting_on, row.tenant,
                 datetime_from_ms(row.updated_at),
                 state.flow_version if state is not None else None, reason)


async def run_bulk(store: EventStore, act: Act, flt: ExecutionFilter, *, action: Action,
                   read_state: ReadState, now_ms: int, dry_run: bool = False,
                   rate: float = 20.0, limit: int | None = None, after_id: str | None = None,
                   on_item: OnItem | None = None, page: int = 500) -> BulkReport:
    """Visit every execution ``flt`` matches after ``after_id`` and ``act`` on it (see the
    module). ``now_ms`` is when "older than" is measured from."""
    if rate <= 0:
        raise ValidationError(f"rate must be > 0 actions a second, got {rate}")
    if limit is not None and limit < 0:
        raise ValidationError(f"limit must be >= 0, got {limit}")
    report = BulkReport(action, dry_run, cursor=after_id)
    before = None if flt.older_than is None else \
        now_ms - int(flt.older_than.total_seconds() * 1000)
    fold = flt.version is not None or flt.reason is not None or dry_run
    interval, next_at = 1.0 / rate, time.monotonic()
    cursor = after_id
    while True:
        try:
            rows = await store.list_executions(
                status=flt.status, flow_id=flt.flow, tenant=flt.tenant, waiting_on=flt.gate,
                updated_before=before, after_id=cursor, limit=page)
        except StoreUnavailableError as exc:
            report.stopped = f"the store did not answer ({exc}); resume after {cursor!r}"
            return report
        for row in rows:
            cursor = row.execution_id
            state = await read_state(row.execution_id) if fold else None
            match = _match(row, state)
            if (flt.version is not None and match.version != flt.version) or (
                    flt.reason is not None and flt.reason not in (match.reason or "")):
                report.cursor = cursor
                continue
            report.matched += 1
            if dry_run:
                report.cursor = cursor
                if on_item is not None:
                    on_item(match, "would")
                continue
            if limit is not None and report.acted >= limit:
                report.matched -= 1
                report.stopped = f"limit of {limit} actions reached; resume after {report.cursor!r}"
                return report
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            next_at = max(next_at, time.monotonic()) + interval
            try:
                await act(row.execution_id)
            except _SETTLED as exc:
                report.skipped += 1
                said = f"skipped: {exc}"
            except StoreUnavailableError as exc:
                report.stopped = (f"the store did not answer ({exc}); resume after "
                                  f"{report.cursor!r}")
                return report
            except FleetError as exc:
                report.failed += 1
                if len(report.failures) < FAILURES_KEPT:
                    report.failures.append((row.execution_id, f"{type(exc).__name__}: {exc}"))
                said = f"failed: {type(exc).__name__}: {exc}"
            else:
                report.acted += 1
                said = "done"
            report.cursor = cursor
            if on_item is not None:
                on_item(match, said)
        if len(rows) < page:
            return report


async def bulk_action(runtime: Runtime, action: Action, flt: ExecutionFilter, *,
                      principal: Principal | None = None, gate: str | None = None,
                      payload: Any = None, dry_run: bool = False, rate: float = 20.0,
                      limit: int | None = None, after_id: str | None = None,
                      drive: bool = True, on_item: OnItem | None = None) -> BulkReport:
    """Cancel, retry (a diverged run) or resume (``gate`` with ``payload``) every execution
    ``flt`` matches, through ``runtime`` (see the module)."""
    act: Act
    if action == "cancel":
        if flt.empty:
            raise ValidationError("a bulk cancel needs a filter (flow, status, gate, tenant, "
                                  "reason, version or age): it would cancel everything")
        if flt.status in TERMINAL_STATUSES:
            raise ValidationError(f"executions that are {flt.status} cannot be cancelled")
        note = f"bulk cancel by {principal.actor if principal else 'system'} " \
               f"({flt.describe()})"

        async def act(eid: str) -> object:
            await runtime.cancel(eid, principal=principal, reason=note)
            return None
    elif action == "retry":
        flt = parked_on(flt, DIVERGED_GATE)

        async def act(eid: str) -> object:
            return await runtime.retry_diverged(eid, principal=principal, drive=drive)
    elif action == "resume":
        if not gate:
            raise ValidationError("a bulk resume needs the gate it answers (gate=)")
        flt = parked_on(flt, gate)

        async def act(eid: str) -> object:
            return await runtime.resume(eid, gate, payload, principal=principal, drive=drive)
    else:
        raise ValidationError(f"unknown bulk action {action!r}; one of {ACTIONS}")
    return await run_bulk(runtime.store, act, flt, action=action,
                          read_state=lambda eid: runtime.load_state(eid, principal=principal),
                          now_ms=runtime.engine.clock(), dry_run=dry_run, rate=rate,
                          limit=limit, after_id=after_id, on_item=on_item)


def parked_on(flt: ExecutionFilter, gate: str) -> ExecutionFilter:
    """``flt`` narrowed to executions parked on ``gate`` (a retry, a resume)."""
    if flt.status not in (None, "parked") or flt.gate not in (None, gate):
        raise ValidationError(f"this action takes executions parked on {gate!r}; the filter "
                              f"asks for {flt.describe()}")
    return ExecutionFilter(flt.flow, flt.version, "parked", gate, flt.reason, flt.tenant,
                           flt.older_than)


__all__ = ["ACTIONS", "Action", "BulkReport", "ExecutionFilter", "Match", "OnItem",
           "bulk_action", "parked_on", "run_bulk"]
