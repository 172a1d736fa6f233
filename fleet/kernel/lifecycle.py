"""Retention, compaction and repair of logs (ADR 0116 Q3, round 3 i, round 4 item 5).

- **Retention** is measured from the newest terminal event on the log, never
  from the last event: a late outcome appended days later does not extend it.
- **Compaction** folds a prefix of the log into a checkpoint in the snapshot
  store and drops those events (``EventStore.compact_through``). For a finished
  execution the checkpoint is capped just below its newest terminal event, so
  retention always finds the end on the log. It keeps no learning evidence in
  place: the checkpoint holds ``_decisions`` and ``_outcomes``, and
  ``fleet.learning.evidence_events`` rebuilds them.
- **Repair** (``restore_terminal_event``): a log compacted by an older kernel
  lost its terminal event (the checkpoint absorbed it); the repair writes one
  (empty payload, ``metadata.restoredTerminal``) above everything on the log,
  under a freshly acquired fence, dated from the CHECKPOINT's ``updatedAt``:
  the time of the terminal event it absorbed. Never the folded ``updatedAt``:
  a late outcome an older fleet accepted above the checkpoint moved that, and
  dating the end from it is the retention extension ADR 0116 exists to
  prevent. Dry by default, idempotent; run it quiesced. It writes through
  ``LogWriter`` with no observers: ADR 0147 does not report maintenance paths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fleet.kernel.errors import (
    ConfigurationError,
    ExecutionNotFoundError,
    ExecutionStateError,
)
from fleet.kernel.events import (
    TERMINAL_EVENT,
    TERMINAL_STATUSES,
    TERMINAL_TYPES,
    EventEnvelope,
    wall_clock_ms,
)
from fleet.kernel.fold import ExecutionState, fold_log
from fleet.kernel.lease import Lease
from fleet.kernel.observers import Warner
from fleet.kernel.store.spi import EventStore, Snapshot, SnapshotStore, max_lease_of
from fleet.kernel.writes import LogWriter


@dataclass(frozen=True, slots=True)
class CompactionReport:
    execution_id: str
    checkpoint: int | None  # the sequence the checkpoint holds; None: nothing to do
    events_before: int
    bytes_before: int
    events_after: int
    bytes_after: int


@dataclass(frozen=True, slots=True)
class SweepReport:
    examined: int = 0
    deleted: int = 0
    kept: int = 0
    needs_repair: int = 0


@dataclass(frozen=True, slots=True)
class RepairReport:
    execution_id: str
    action: str  # "intact" | "would-write" | "written"
    sequence: int | None = None
    type: str | None = None
    ended_at: int | None = None  # the timestamp written: when the execution ended (ms)


class LogLifecycle:
    """Retention sweeps, compaction and the terminal-event repair over one store pair."""

    def __init__(self, store: EventStore, snapshots: SnapshotStore, *,
                 terminal_ttl_ms: int | None = None,
                 clock: Callable[[], int] | None = None, holder: str = "lifecycle") -> None:
        if terminal_ttl_ms is not None and terminal_ttl_ms < 0:
            raise ConfigurationError("terminal_ttl_ms must be >= 0")
        self.store = store
        self.snapshots = snapshots
        self.terminal_ttl_ms = terminal_ttl_ms
        self.clock: Callable[[], int] = clock or wall_clock_ms
        self.holder = holder

    async def _state(self, execution_id: str) -> tuple[ExecutionState, Snapshot | None,
                                                       list[EventEnvelope]]:
        snap = await self.snapshots.load(execution_id)
        events = await self.store.read(execution_id)
        if not events:
            raise ExecutionNotFoundError(f"no execution {execution_id!r}")
        if snap is None:
            return fold_log(events), None, events
        base = ExecutionState.from_dict(snap.state)
        return fold_log([e for e in events if e.sequence > snap.sequence], base), snap, events

    async def retention_end(self, execution_id: str) -> int | None:
        """When the execution ended: the newest terminal event's timestamp.

        ``None`` while it runs, and for a log whose terminal event an older
        kernel compacted away (repair it with ``restore_terminal_event``).
        """
        events = await self.store.read(execution_id)
        for event in reversed(events):
            if event.type in TERMINAL_TYPES:
                return event.timestamp
        return None

    async def sweep(self, now: int | None = None, *, page: int = 500) -> SweepReport:
        """Delete finished executions whose end is older than ``terminal_ttl_ms``."""
        if self.terminal_ttl_ms is None:
            raise ConfigurationError("sweep needs terminal_ttl_ms")
        now = self.clock() if now is None else now
        examined = deleted = kept = needs_repair = 0
        for status in sorted(TERMINAL_STATUSES):
            after: str | None = None
            while True:
                rows = await self.store.list_executions(status=status, after_id=after,
                                                        limit=page)
                if not rows:
                    break
                after = rows[-1].execution_id
                for row in rows:
                    examined += 1
                    end = await self.retention_end(row.execution_id)
                    if end is None:
                        needs_repair += 1
                        continue
                    if end + self.terminal_ttl_ms <= now:
                        await self.store.delete_execution(row.execution_id)
                        await self.snapshots.delete(row.execution_id)
                        deleted += 1
                    else:
                        kept += 1
                if len(rows) < page:
                    break
        return SweepReport(examined, deleted, kept, needs_repair)

    async def compact(self, execution_id: str) -> CompactionReport:
        """Fold the log below its terminal event (or its head) into a checkpoint."""
        state, snap, events = await self._state(execution_id)
        before_bytes = sum(len(e.to_json().encode()) for e in events)
        if state.terminal:
            terminal = [e.sequence for e in events if e.type in TERMINAL_TYPES]
            if not terminal:
                raise ExecutionStateError(
                    f"execution {execution_id!r} is {state.status} but its terminal event "
                    "is not on the log; run restore_terminal_event first")
            cap = terminal[-1] - 1
        else:
            cap = events[-1].sequence
        floor = snap.sequence if snap is not None else 0
        if cap <= floor:
            return CompactionReport(execution_id, None, len(events), before_bytes,
                                    len(events), before_bytes)
        base = ExecutionState.from_dict(snap.state) if snap is not None else None
        prefix = [e for e in events if floor < e.sequence <= cap or (snap is None
                                                                     and e.sequence == 0)]
        at_cap = fold_log(prefix, base) if base is not None else fold_log(prefix)
        await self.snapshots.save(Snapshot(execution_id, cap, at_cap.to_dict()))
        await self.store.compact_through(execution_id, cap)
        after = await self.store.read(execution_id)
        return CompactionReport(execution_id, cap, len(events), before_bytes, len(after),
                                sum(len(e.to_json().encode()) for e in after))

    async def restore_terminal_event(self, execution_id: str, *,
                                     apply: bool = False) -> RepairReport:
        """Write back the terminal event an older compaction removed (dry unless ``apply``)."""
        state, snap, events = await self._state(execution_id)
        if not state.terminal:
            raise ExecutionStateError(
                f"execution {execution_id!r} is {state.status}; only a finished execution "
                "has a terminal event to restore")
        if state.status == "continued":
            raise ExecutionStateError(
                f"execution {execution_id!r} continued as {state.next_execution_id!r}; its "
                "EXECUTION_CONTINUED names the successor and cannot be rebuilt empty")
        if any(e.type in TERMINAL_TYPES for e in events):
            return RepairReport(execution_id, "intact")
        type_ = TERMINAL_EVENT[state.status]
        # A terminal fold with no terminal event on the log: the checkpoint absorbed
        # it, so the checkpoint's updatedAt is when it was written (see the module).
        ended = ExecutionState.from_dict(snap.state).updated_at if snap is not None else None
        ended_at = ended if ended is not None else (state.updated_at or self.clock())
        if not apply:
            head = await self.store.head(execution_id)
            return RepairReport(execution_id, "would-write",
                                None if head is None else head + 1, type_.value, ended_at)
        async with await Lease.take(self.store, execution_id, holder=self.holder,
                                    lease_ms=min(30_000, max_lease_of(self.store)),
                                    warner=Warner(None)) as lease:
            head = await self.store.head(execution_id)
            if head is None:
                raise ExecutionNotFoundError(f"no execution {execution_id!r}")
            event = EventEnvelope.make(execution_id, head + 1, type_, ended_at, {},
                                       metadata={"restoredTerminal": True})
            await LogWriter(self.store, None).write(lease, [event])
        return RepairReport(execution_id, "written", event.sequence, type_.value, ended_at)
