"""Queues and debounce pointers in the memory store (``spi_queues.HoldsQueues``).

A mixin of ``MemoryEventStore``: its entries live beside the store's index and
timers, and each call does its work in one synchronous step after one yield to
the loop (the memory store's atomicity), so a pass is one transaction.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from fleet.kernel.events import TERMINAL_STATUSES
from fleet.kernel.store.spi_queues import (
    DEFAULT_GRACE_MS,
    DEFAULT_REWAKE_MS,
    Admission,
    Candidate,
    DebounceClaim,
    QueueDepth,
    QueueEntry,
    QueueLimits,
    QueuePass,
    check_pass,
    check_scope,
    plan_admissions,
)
from fleet.kernel.values import check_ms, check_text

__all__ = ["MemoryQueues"]


@dataclass(slots=True)
class _Entry:
    execution_id: str
    queue: str
    key: str | None
    priority: int
    seq: int
    entered_at: int
    eligible_at: int
    admitted_at: int | None = None


class _IndexRow(Protocol):
    status: str
    waiting_on: str | None


@dataclass(slots=True)
class _QueueState:
    entries: dict[str, _Entry]
    limits: dict[str, str]
    debounce: dict[str, DebounceClaim]
    seq: int = 0


class MemoryQueues:
    """``HoldsQueues`` over a memory store's ``_index`` and ``_timers``."""

    _index: Mapping[str, Any]
    _timers: Mapping[str, Mapping[str, int]]

    @property
    def _queues(self) -> _QueueState:
        state: _QueueState | None = getattr(self, "_queue_state", None)
        if state is None:
            state = _QueueState({}, {}, {})
            self._queue_state = state
        return state

    def _status(self, execution_id: str) -> tuple[str | None, str | None]:
        row: _IndexRow | None = self._index.get(execution_id)
        return (None, None) if row is None else (row.status, row.waiting_on)

    def _live(self, entry: _Entry, now: int, grace: int) -> bool:
        """Whether an admitted entry holds its slot (its execution has not ended)."""
        status, _ = self._status(entry.execution_id)
        if status is None:
            return entry.entered_at > now - grace
        return status not in TERMINAL_STATUSES

    async def queue_pass(self, limits: QueueLimits, now_ms: int, *,
                         entry: QueueEntry | None = None, limit: int = 100,
                         grace_ms: int = DEFAULT_GRACE_MS,
                         rewake_ms: int = DEFAULT_REWAKE_MS,
                         sweep: bool = True) -> QueuePass:
        check_pass(limits, now_ms, entry, limit, grace_ms, rewake_ms)
        await asyncio.sleep(0)
        state = self._queues
        mine = limits.to_json()
        before = state.limits.get(limits.name, mine)
        state.limits[limits.name] = mine
        entered = False
        if entry is not None and entry.execution_id not in state.entries:
            state.seq += 1
            state.entries[entry.execution_id] = _Entry(
                entry.execution_id, entry.queue, entry.key, entry.priority, state.seq, now_ms,
                entry.eligible_at)
            entered = True
        ours = [e for e in state.entries.values() if e.queue == limits.name]
        running: list[_Entry] = [e for e in ours if e.admitted_at is not None
                                 and self._live(e, now_ms, grace_ms)]
        by_key: dict[str | None, int] = {}
        for e in running:
            by_key[e.key] = by_key.get(e.key, 0) + 1
        recent: list[int] = []
        if limits.rate_ms is not None:
            recent = [e.admitted_at for e in ours
                      if e.admitted_at is not None and e.admitted_at > now_ms - limits.rate_ms]
        gate = limits.gate

        def waiting(e: _Entry) -> bool:
            if e.admitted_at is not None or e.eligible_at > now_ms:
                return False
            status, on = self._status(e.execution_id)
            if status is None:
                return entered and entry is not None and e.execution_id == entry.execution_id
            return status == "parked" and on == gate

        candidates = sorted((e for e in ours if waiting(e)), key=lambda e: (e.priority, e.seq))
        admitted = plan_admissions(
            limits, now_ms, running=len(running), running_by_key=by_key, recent=recent,
            candidates=(Candidate(e.execution_id, e.key) for e in candidates), limit=limit)
        for admission in admitted:
            state.entries[admission.execution_id].admitted_at = admission.at
        if entry is not None or not sweep:  # what it entered (if any), and nothing more
            entry_at = None if entry is None else \
                state.entries[entry.execution_id].admitted_at
            return QueuePass(tuple(admitted), (), entry_at, entered,
                             None if before == mine else before)
        fresh = {a.execution_id for a in admitted}
        rewake: list[Admission] = []
        for e in sorted(ours, key=lambda e: (e.admitted_at or 0, e.seq)):
            if e.admitted_at is None or e.execution_id in fresh \
                    or e.admitted_at > now_ms - rewake_ms or len(rewake) >= limit:
                continue
            status, on = self._status(e.execution_id)
            if status == "parked" and on == gate \
                    and gate not in self._timers.get(e.execution_id, {}):
                rewake.append(Admission(e.execution_id, e.admitted_at))
        keep_ms = limits.rate_ms or 0
        for e in ours:
            status, _ = self._status(e.execution_id)
            gone = status in TERMINAL_STATUSES or (status is None
                                                   and e.entered_at <= now_ms - grace_ms)
            if gone and (e.admitted_at is None or e.admitted_at <= now_ms - keep_ms):
                del state.entries[e.execution_id]
        return QueuePass(tuple(admitted), tuple(rewake), None, False,
                         None if before == mine else before)

    async def queue_delay(self, execution_id: str, eligible_at: int) -> bool:
        check_text(execution_id, "execution id")
        check_ms(eligible_at, "eligible_at")
        await asyncio.sleep(0)
        entry = self._queues.entries.get(execution_id)
        if entry is None or entry.admitted_at is not None:
            return False
        entry.eligible_at = eligible_at
        return True

    async def queue_forget(self, execution_id: str) -> bool:
        check_text(execution_id, "execution id")
        await asyncio.sleep(0)
        return self._queues.entries.pop(execution_id, None) is not None

    async def queue_depths(self, now_ms: int) -> list[QueueDepth]:
        check_ms(now_ms, "now_ms")
        await asyncio.sleep(0)
        state = self._queues
        names = set(state.limits) | {e.queue for e in state.entries.values()}
        out = []
        for name in sorted(names):
            gate = f"__fleet_queue__:{name}"
            waiting = delayed = running = 0
            oldest: int | None = None
            for e in state.entries.values():
                if e.queue != name:
                    continue
                status, on = self._status(e.execution_id)
                if e.admitted_at is not None:
                    running += status is not None and status not in TERMINAL_STATUSES
                elif status == "parked" and on == gate:
                    if e.eligible_at > now_ms:
                        delayed += 1
                    else:
                        waiting += 1
                        since = max(e.entered_at, e.eligible_at)
                        oldest = since if oldest is None else min(oldest, since)
            out.append(QueueDepth(name, waiting, None if oldest is None else now_ms - oldest,
                                  running, delayed, state.limits.get(name)))
        return out

    async def debounce_get(self, scope: str) -> DebounceClaim | None:
        check_scope(scope)
        await asyncio.sleep(0)
        return self._queues.debounce.get(scope)

    async def debounce_claim(self, scope: str, execution_id: str, *, expect: str | None,
                             now_ms: int) -> bool:
        check_scope(scope)
        check_text(execution_id, "execution id")
        if expect is not None:
            check_text(expect, "expect")
        check_ms(now_ms, "now_ms")
        await asyncio.sleep(0)
        pointers = self._queues.debounce
        current = pointers.get(scope)
        if (current.execution_id if current is not None else None) != expect:
            return False
        pointers[scope] = DebounceClaim(execution_id, now_ms)
        return True
