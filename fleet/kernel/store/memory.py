"""The in-memory store: unit tests, embedded demos and the memory benchmark.

Everything lives in dicts owned by one asyncio loop. Every call first yields
to the loop once (the "tick") and then does all of its work in one
synchronous step, so each operation is atomic, yet concurrent callers
interleave at call boundaries the way they do against a real store; a store
that never suspended would hide races the runtime has to survive elsewhere.

It keeps its own copy of what it is given and hands out copies of what it
keeps, as a store that serialises does: a caller that mutates a payload after
appending it, or an event (a state, an output) it read, changes nothing stored
(issue 26 7b). Each event is serialised once on the way in
(``spi.encode_event``), so this store refuses exactly what SQLite and Postgres
refuse: a value that is not JSON, a lone surrogate, a NUL in a key, an integer
outside int64, an event over ``max_event_bytes`` (decision 0023).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from fleet.kernel.errors import (
    DuplicateSequenceError,
    FleetError,
    SequenceGapError,
    StaleFenceError,
    ValidationError,
)
from fleet.kernel.events import EventEnvelope, Status, wall_clock_ms
from fleet.kernel.store.backlog import Backlog, backlog_groups, check_backlog
from fleet.kernel.store.encoding import creation_anchor, encode_event, encode_state
from fleet.kernel.store.memory_queues import MemoryQueues
from fleet.kernel.store.spi import (
    APPEND_LEASED,
    APPEND_MANY,
    APPEND_MANY_LEASED,
    COUNT_EXECUTIONS,
    DEFAULT_MAX_EVENT_BYTES,
    DEFAULT_MAX_LEASE_MS,
    ORIGIN,
    AcquiringAppend,
    AppendRequest,
    CommittedEvent,
    ConditionalAppendResult,
    DueTimer,
    ExecutionSummary,
    FenceGrant,
    ManyAnswer,
    ManyRequest,
    Position,
    ReleasingAppend,
    Snapshot,
    TipObservation,
    check_batch,
    check_feed_read,
    check_id,
    check_lease_ms,
    check_limit,
    check_listing,
    check_max_lease_ms,
    index_change,
    lease_live,
)
from fleet.kernel.values import check_int64, check_ms, check_text

__all__ = ["MemoryEventStore", "MemorySnapshotStore"]


def _json_copy(value: Any) -> Any:
    """A copy of a JSON value (dicts, lists and scalars) that shares nothing mutable."""
    kind = type(value)
    if kind is dict:
        return {k: _json_copy(v) for k, v in value.items()}
    if kind is list:
        return [_json_copy(v) for v in value]
    return value


def _copied(event: EventEnvelope) -> EventEnvelope:
    """``event`` with payload and metadata of its own."""
    return EventEnvelope(event.id, event.execution_id, event.sequence, event.type,
                         event.timestamp, _json_copy(event.payload), _json_copy(event.metadata))


async def _tick() -> None:
    await asyncio.sleep(0)


@dataclass(slots=True)
class _Row:
    """One execution's index entry (mutable: updated in place on append)."""

    flow_id: str
    tenant: str | None
    owner: str | None
    status: Status
    waiting_on: str | None
    started_at: int
    updated_at: int
    head: int
    anchor: str


@dataclass(slots=True)
class _Fence:
    token: int = 0
    holder: str | None = None
    lease_expires_at: int | None = None




class MemoryEventStore(MemoryQueues):
    """An ``EventStore`` held in process memory, for one asyncio loop.

    Args:
        clock: Milliseconds since the epoch: the store's clock, on which leases are
            granted and judged (spi). Defaults to the wall clock; tests pass a
            controllable one.
        max_event_bytes: An event whose JSON is larger is refused with
            ``PayloadTooLargeError`` before anything is written (None: no limit).
        max_lease_ms: The longest lease granted or honoured (spi, decision 0044).
    """

    capabilities: frozenset[str] = frozenset({APPEND_MANY, APPEND_LEASED, APPEND_MANY_LEASED,
                                              COUNT_EXECUTIONS})

    def __init__(self, clock: Callable[[], int] | None = None, *,
                 max_event_bytes: int | None = DEFAULT_MAX_EVENT_BYTES,
                 max_lease_ms: int = DEFAULT_MAX_LEASE_MS) -> None:
        self._clock = clock or wall_clock_ms
        self.max_lease_ms = check_max_lease_ms(max_lease_ms)
        self._max_event_bytes = max_event_bytes
        self._logs: dict[str, list[EventEnvelope | None]] = {}
        self._compacted: set[str] = set()
        self._index: dict[str, _Row] = {}
        self._fences: dict[str, _Fence] = {}
        self._timers: dict[str, dict[str, int]] = {}
        # The committed feed: every event in the order its write ran (each call
        # is one synchronous step, so that is commit order), numbered from 1.
        self._feed: list[EventEnvelope] = []
        self._feed_base = 1  # the number of _feed[0]

    # -- writes ------------------------------------------------------------

    async def append(self, event: EventEnvelope, *, fence: int | None = None) -> None:
        self._encode((event,))
        await _tick()
        self._check_fence(event.execution_id, fence)
        self._write(event.execution_id, (event,))

    async def append_batch(self, events: Sequence[EventEnvelope], *,
                           fence: int | None = None) -> None:
        execution_id = check_batch(events)
        self._encode(events)
        await _tick()
        self._check_fence(execution_id, fence)
        self._write(execution_id, events)

    async def append_many(self, requests: Sequence[AppendRequest],
                          ) -> list[BaseException | None]:
        """Every request in one step (one tick), each judged alone, in order."""
        return cast(list[BaseException | None], await self._append_many(requests))

    async def append_many_leased(self, requests: Sequence[ManyRequest],
                                 ) -> list[ManyAnswer]:
        """Plain, acquiring and releasing requests in one step (one tick), each judged
        alone, in order, exactly as its single call judges it (decision 0029)."""
        return await self._append_many(requests)

    async def _append_many(self, requests: Sequence[ManyRequest]) -> list[ManyAnswer]:
        await _tick()
        results: list[ManyAnswer] = []
        for request in requests:
            try:
                if isinstance(request, AcquiringAppend):
                    execution_id = check_batch(request.events)
                    self._check_acquire(execution_id, request.holder, request.lease_ms)
                    self._encode(request.events)
                    results.append(self._acquiring(execution_id, request.events,
                                                   request.holder, request.lease_ms,
                                                   request.release))
                    continue
                if isinstance(request, ReleasingAppend):
                    execution_id = check_batch(request.events)
                    check_int64(request.fence, "fence")
                    self._encode(request.events)
                    self._releasing(execution_id, request.events, request.fence)
                else:
                    events, fence = request
                    execution_id = check_batch(events)
                    self._encode(events)
                    self._check_fence(execution_id, fence)
                    self._write(execution_id, events)
            except FleetError as exc:
                results.append(exc)
            else:
                results.append(None)
        return results

    async def append_acquiring(self, events: Sequence[EventEnvelope], *, holder: str,
                               lease_ms: int, release: bool = False) -> FenceGrant | None:
        """Take the fence if free and append under it, in one step (decision 0029)."""
        execution_id = check_batch(events)
        self._check_acquire(execution_id, holder, lease_ms)
        self._encode(events)
        await _tick()
        return self._acquiring(execution_id, events, holder, lease_ms, release)

    def _acquiring(self, execution_id: str, events: Sequence[EventEnvelope], holder: str,
                   lease_ms: int, release: bool) -> FenceGrant | None:
        if self._held(execution_id):
            return None
        held = self._fences.get(execution_id)
        before = None if held is None else (held.token, held.holder, held.lease_expires_at)
        grant = self._grant(execution_id, holder, lease_ms)
        try:
            self._write(execution_id, events)
        except BaseException:
            if before is None:
                del self._fences[execution_id]
            else:
                taken = self._fences[execution_id]
                taken.token, taken.holder, taken.lease_expires_at = before
            raise
        if release:
            self._end_lease(execution_id)
        return grant

    async def append_releasing(self, events: Sequence[EventEnvelope], *, fence: int) -> None:
        """Append under ``fence`` and end its lease, in one step (decision 0029)."""
        execution_id = check_batch(events)
        check_int64(fence, "fence")
        self._encode(events)
        await _tick()
        self._releasing(execution_id, events, fence)

    def _releasing(self, execution_id: str, events: Sequence[EventEnvelope],
                   fence: int) -> None:
        self._check_fence(execution_id, fence)
        self._write(execution_id, events)
        if fence != 0:
            self._end_lease(execution_id)

    def _end_lease(self, execution_id: str) -> None:
        held = self._fences[execution_id]
        held.holder = None
        held.lease_expires_at = None

    async def append_if_unchanged(self, execution_id: str, event: EventEnvelope | None,
                                  expect: TipObservation | None = None,
                                  ) -> ConditionalAppendResult:
        check_id(execution_id)
        if event is not None:
            if expect is None:
                raise ValidationError("append_if_unchanged with an event needs `expect`, "
                                      "the tip observed before the event was built")
            if event.execution_id != execution_id:
                raise ValidationError(f"event of {event.execution_id!r} offered to "
                                      f"{execution_id!r}")
            self._encode((event,))
        await _tick()
        # From here to the return nothing awaits: the compare and the write are
        # one step, so no other caller can move the tip in between.
        tip = self._tip(execution_id)
        if tip.head is None:
            return ConditionalAppendResult(False, "gone", tip)
        if event is None or expect is None:
            return ConditionalAppendResult(False, "observed", tip)
        if (tip.head != expect.head or tip.fence != expect.fence
                or tip.anchor != expect.anchor or event.sequence != tip.head + 1):
            return ConditionalAppendResult(False, "moved", tip)
        self._write(execution_id, (event,))
        return ConditionalAppendResult(True, None, self._tip(execution_id))

    def _encode(self, events: Sequence[EventEnvelope]) -> None:
        """Refuse what no store keeps, exactly as SQLite and Postgres do (the text is
        dropped: this store keeps the envelope)."""
        for event in events:
            encode_event(event, self._max_event_bytes)

    def _check_fence(self, execution_id: str, fence: int | None) -> None:
        if fence is None:
            return
        held = self._fences.get(execution_id)
        current = held.token if held is not None else 0
        if fence != current:
            raise StaleFenceError(f"fence {fence} of {execution_id!r} was superseded by "
                                  f"{current}; this writer must stop",
                                  presented=fence, current=current)

    def _write(self, execution_id: str, events: Sequence[EventEnvelope]) -> None:
        """Place ``events`` at the head of the log and move the index (checked first)."""
        log = self._logs.get(execution_id)
        expected = len(log) if log is not None else 0
        first = events[0]
        for event in events:
            if event.execution_id != execution_id:
                raise ValidationError(f"event of {event.execution_id!r} in a write for "
                                      f"{execution_id!r}")
            if event.id != f"{execution_id}-{event.sequence}":
                raise ValidationError(f"event id {event.id!r} does not match "
                                      f"{execution_id!r}-{event.sequence}")
        if first.sequence < expected:
            raise DuplicateSequenceError(f"{execution_id!r} already holds sequence "
                                         f"{first.sequence} (head {expected - 1})")
        if first.sequence > expected:
            raise SequenceGapError(f"{execution_id!r} expects sequence {expected}, "
                                   f"got {first.sequence}")
        if log is None:
            log = self._logs[execution_id] = []
        kept = [_copied(event) for event in events]
        log.extend(kept)
        self._feed.extend(kept)
        self._move_index(execution_id, events)

    def _move_index(self, execution_id: str, events: Iterable[EventEnvelope]) -> None:
        row = self._index.get(execution_id)
        for event in events:
            change = index_change(event)
            if row is None:  # sequence 0: the log is born
                started = change.started
                row = _Row(flow_id=started.get("flow_id", ""), tenant=started.get("tenant"),
                           owner=started.get("owner"), status=change.status or "running",
                           waiting_on=change.waiting_on, started_at=event.timestamp,
                           updated_at=event.timestamp, head=event.sequence,
                           anchor=creation_anchor(event))
                self._index[execution_id] = row
            else:
                row.head = event.sequence
                row.updated_at = event.timestamp
                if change.status is not None:
                    row.status = change.status
                    row.waiting_on = change.waiting_on
            if change.timer_add is not None:
                self._timers.setdefault(execution_id, {})[change.timer_add.timer_id] = (
                    change.timer_add.due_at)
            if change.timer_remove is not None:
                self._timers.get(execution_id, {}).pop(change.timer_remove, None)
            if change.clear_timers:
                self._timers.pop(execution_id, None)

    async def delete_execution(self, execution_id: str) -> bool:
        check_id(execution_id)
        await _tick()
        existed = self._logs.pop(execution_id, None) is not None
        self._compacted.discard(execution_id)
        self._index.pop(execution_id, None)
        self._timers.pop(execution_id, None)
        held = self._fences.get(execution_id)
        # A real token outlives the log: a zombie writer of a re-created id must
        # still present a stale token and be refused.
        if held is not None and held.token == 0:
            del self._fences[execution_id]
        return existed

    # -- fences ------------------------------------------------------------

    async def acquire_fence(self, execution_id: str, *, holder: str,
                            lease_ms: int) -> FenceGrant:
        self._check_acquire(execution_id, holder, lease_ms)
        await _tick()
        return self._grant(execution_id, holder, lease_ms)

    async def acquire_fence_if(self, execution_id: str, *, holder: str,
                               lease_ms: int) -> FenceGrant | None:
        self._check_acquire(execution_id, holder, lease_ms)
        await _tick()
        if self._held(execution_id):
            return None
        return self._grant(execution_id, holder, lease_ms)

    def _held(self, execution_id: str) -> bool:
        """Whether a live lease holds ``execution_id`` (spi.lease_live, this store's clock)."""
        held = self._fences.get(execution_id)
        return held is not None and lease_live(held.lease_expires_at, self._clock(),
                                               self.max_lease_ms)

    def _check_acquire(self, execution_id: str, holder: str, lease_ms: int) -> None:
        check_id(execution_id)
        check_text(holder, "holder")
        check_lease_ms(lease_ms, self.max_lease_ms)
        check_int64(self._clock() + lease_ms, "lease expiry")

    def _grant(self, execution_id: str, holder: str, lease_ms: int) -> FenceGrant:
        held = self._fences.setdefault(execution_id, _Fence())
        held.token += 1
        held.holder = holder
        held.lease_expires_at = self._clock() + lease_ms
        return FenceGrant(execution_id, held.token, holder, held.lease_expires_at)

    async def renew_lease(self, execution_id: str, token: int, *, lease_ms: int) -> bool:
        check_id(execution_id)
        check_int64(token, "token")
        check_lease_ms(lease_ms, self.max_lease_ms)
        await _tick()
        held = self._fences.get(execution_id)
        if held is None or held.token != token or token == 0:
            return False
        held.lease_expires_at = self._clock() + lease_ms
        return True

    async def release_fence(self, execution_id: str, token: int) -> bool:
        check_id(execution_id)
        check_int64(token, "token")
        await _tick()
        held = self._fences.get(execution_id)
        if held is None or held.token != token or token == 0:
            return False
        held.holder = None
        held.lease_expires_at = None
        return True

    # -- reads -------------------------------------------------------------

    async def read(self, execution_id: str, *, after: int = -1) -> list[EventEnvelope]:
        check_id(execution_id)
        check_int64(after, "after")
        await _tick()
        log = self._logs.get(execution_id)
        if log is None:
            return []
        # The log is contiguous from 0, so a sequence is its list index; a
        # compacted slot holds None.
        tail = log[max(after + 1, 0):]
        return [_copied(e) for e in tail if e is not None]

    async def head(self, execution_id: str) -> int | None:
        check_id(execution_id)
        await _tick()
        log = self._logs.get(execution_id)
        return len(log) - 1 if log else None

    async def compact_through(self, execution_id: str, sequence: int) -> int:
        check_id(execution_id)
        check_int64(sequence, "sequence")
        await _tick()
        log = self._logs.get(execution_id)
        if log is None:
            return 0
        dropped = 0
        for seq in range(1, min(sequence, len(log) - 1) + 1):
            if log[seq] is not None:
                log[seq] = None
                dropped += 1
        if dropped:
            self._compacted.add(execution_id)
        return dropped

    async def read_committed(self, *, after: Position = ORIGIN, limit: int = 500,
                             max_bytes: int | None = None) -> list[CommittedEvent]:
        check_feed_read(after, limit, max_bytes)
        await _tick()
        out: list[CommittedEvent] = []
        size = 0
        start = max(after.major + 1, self._feed_base)  # positions here are (n, 0)
        for number in range(start, self._feed_base + len(self._feed)):
            if len(out) >= limit or (max_bytes is not None and out and size >= max_bytes):
                break
            event = self._feed[number - self._feed_base]
            log = self._logs.get(event.execution_id)
            # Deleted or compacted since: the log no longer holds this very envelope.
            if log is None or event.sequence >= len(log) or log[event.sequence] is not event:
                continue
            if max_bytes is not None:
                size += len(event.to_json().encode("utf-8", "surrogatepass"))
            row = self._index.get(event.execution_id)
            out.append(CommittedEvent(Position(number), _copied(event),
                                      row.tenant if row is not None else None))
        return out

    def _tip(self, execution_id: str) -> TipObservation:
        held = self._fences.get(execution_id) or _Fence()
        row = self._index.get(execution_id)
        return TipObservation(head=row.head if row else None, fence=held.token,
                              anchor=row.anchor if row else None, holder=held.holder,
                              lease_expires_at=held.lease_expires_at)

    def _summary(self, execution_id: str, row: _Row) -> ExecutionSummary:
        held = self._fences.get(execution_id) or _Fence()
        return ExecutionSummary(
            execution_id=execution_id, flow_id=row.flow_id, tenant=row.tenant,
            owner=row.owner, status=row.status, waiting_on=row.waiting_on,
            started_at=row.started_at, updated_at=row.updated_at, head=row.head,
            fence=held.token, holder=held.holder, lease_expires_at=held.lease_expires_at)

    async def count_executions(self) -> dict[str, int]:
        await _tick()
        counts: dict[str, int] = {}
        for row in self._index.values():
            counts[row.status] = counts.get(row.status, 0) + 1
        return counts

    async def list_executions(self, *, status: str | None = None, flow_id: str | None = None,
                              tenant: str | None = None, waiting_on: str | None = None,
                              updated_before: int | None = None,
                              updated_after: int | None = None,
                              lease_expired_at: int | None = None,
                              after_id: str | None = None,
                              limit: int = 100) -> list[ExecutionSummary]:
        check_listing(status=status, flow_id=flow_id, tenant=tenant, waiting_on=waiting_on,
                      updated_before=updated_before, updated_after=updated_after,
                      lease_expired_at=lease_expired_at, after_id=after_id, limit=limit)
        await _tick()
        out: list[ExecutionSummary] = []
        if limit == 0:
            return out
        for execution_id in sorted(self._index):
            row = self._index[execution_id]
            if after_id is not None and execution_id <= after_id:
                continue
            if ((status is not None and row.status != status)
                    or (flow_id is not None and row.flow_id != flow_id)
                    or (tenant is not None and row.tenant != tenant)
                    or (waiting_on is not None and row.waiting_on != waiting_on)
                    or (updated_before is not None and row.updated_at >= updated_before)
                    or (updated_after is not None and row.updated_at <= updated_after)):
                continue
            if lease_expired_at is not None:
                held = self._fences.get(execution_id)
                if held is not None and lease_live(held.lease_expires_at, lease_expired_at,
                                                   self.max_lease_ms):
                    continue
            out.append(self._summary(execution_id, row))
            if len(out) >= limit:
                break
        return out

    async def get_execution(self, execution_id: str) -> ExecutionSummary | None:
        check_id(execution_id)
        await _tick()
        row = self._index.get(execution_id)
        return self._summary(execution_id, row) if row is not None else None

    async def backlog(self, now_ms: int, *, gates: Sequence[str] = ()) -> Backlog:
        wanted = check_backlog(now_ms, gates)
        await _tick()
        rows: list[tuple[str, str | None, int, int | None, int, int | None]] = []
        parked = dict.fromkeys(wanted, 0)
        for execution_id, row in self._index.items():
            if row.status == "running":
                held = self._fences.get(execution_id)
                expires = held.lease_expires_at if held is not None else None
                if expires is None or expires <= now_ms:
                    rows.append((row.flow_id, row.tenant, 1,
                                 max(row.updated_at, expires or 0), 0, None))
            elif row.status == "parked" and row.waiting_on in parked:
                parked[row.waiting_on] += 1
            due = [at for at in self._timers.get(execution_id, {}).values() if at <= now_ms]
            if due:
                rows.append((row.flow_id, row.tenant, 0, None, len(due), min(due)))
        return Backlog(backlog_groups(rows), parked)

    async def due_timers(self, now_ms: int, *, limit: int = 100) -> list[DueTimer]:
        check_ms(now_ms, "now_ms")
        check_limit(limit)
        await _tick()
        due = [DueTimer(execution_id, timer_id, due_at)
               for execution_id, timers in self._timers.items()
               for timer_id, due_at in timers.items() if due_at <= now_ms]
        due.sort(key=lambda t: (t.due_at, t.execution_id, t.timer_id))
        return due[:limit]

    async def close(self) -> None:
        """Nothing to release; the data stays readable until the store is dropped."""


class MemorySnapshotStore:
    """A ``SnapshotStore`` in process memory.

    States are copied through JSON on save and on load, so a caller that keeps
    folding the dict it saved cannot change the checkpoint, and a state that
    would not survive a real backend is refused here too.
    """

    def __init__(self) -> None:
        self._snapshots: dict[str, tuple[int, str]] = {}

    async def save(self, snapshot: Snapshot) -> None:
        text = encode_state(snapshot)
        await _tick()
        self._snapshots[snapshot.execution_id] = (snapshot.sequence, text)

    async def load(self, execution_id: str) -> Snapshot | None:
        check_id(execution_id)
        await _tick()
        stored = self._snapshots.get(execution_id)
        if stored is None:
            return None
        return Snapshot(execution_id, stored[0], json.loads(stored[1]))

    async def delete(self, execution_id: str) -> None:
        check_id(execution_id)
        await _tick()
        self._snapshots.pop(execution_id, None)

    async def close(self) -> None:
        """Nothing to release."""
