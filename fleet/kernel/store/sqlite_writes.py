"""A write to the SQLite store, prepared on the loop and placed on the writer thread.

``Write.of`` validates and serialises a batch (``spi.encode_event``, as every
backend does) before anything is queued; ``Write.place`` inserts it at the head
and moves the index and the timers, inside the writer's transaction.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field

from fleet.kernel.errors import DuplicateSequenceError, SequenceGapError, ValidationError
from fleet.kernel.events import EventEnvelope, Status
from fleet.kernel.store.encoding import creation_anchor, encode_event
from fleet.kernel.store.spi import (
    DueTimer,
    index_change,
)
from fleet.kernel.store.sqlite_schema import next_positions

__all__ = ["Write", "move_timers"]


@dataclass(slots=True)
class Write:
    """A write prepared on the loop: validated, serialised, ready to insert."""

    execution_id: str
    events: Sequence[EventEnvelope]
    rows: list[tuple[str, int, str, int, str]] = field(default_factory=list)

    @classmethod
    def of(cls, execution_id: str, events: Sequence[EventEnvelope],
           max_bytes: int | None) -> Write:
        write = cls(execution_id, events)
        for event in events:
            if event.execution_id != execution_id:
                raise ValidationError(f"event of {event.execution_id!r} in a write for "
                                      f"{execution_id!r}")
            body = encode_event(event, max_bytes)
            write.rows.append((execution_id, event.sequence, str(event.type),
                               event.timestamp, body))
        return write

    def place(self, conn: sqlite3.Connection, head: int | None) -> None:
        """Insert at ``head + 1`` and move the index; the fence was checked already."""
        expected = 0 if head is None else head + 1
        first = self.events[0].sequence
        if first < expected:
            raise DuplicateSequenceError(f"{self.execution_id!r} already holds sequence "
                                         f"{first} (head {head})")
        if first > expected:
            raise SequenceGapError(f"{self.execution_id!r} expects sequence {expected}, "
                                   f"got {first}")
        # Positions come from the counter inside this write transaction: SQLite
        # commits one writer at a time, so they follow commit order (decision 0020).
        first_position = next_positions(conn, len(self.rows))
        conn.executemany("INSERT INTO events (execution_id, sequence, type, timestamp, body, "
                         "position) VALUES (?, ?, ?, ?, ?, ?)",
                         [(*row, first_position + i) for i, row in enumerate(self.rows)])
        rest: Sequence[EventEnvelope] = self.events
        if head is None:
            born = self.events[0]
            change = index_change(born)
            started = change.started
            conn.execute("INSERT INTO executions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         (self.execution_id, started.get("flow_id", ""), started.get("tenant"),
                          started.get("owner"), change.status or "running", change.waiting_on,
                          born.timestamp, born.timestamp, born.sequence,
                          creation_anchor(born)))
            move_timers(conn, self.execution_id, change.timer_add, change.timer_remove,
                         change.clear_timers)
            rest = self.events[1:]
        if not rest:
            return
        status: tuple[Status, str | None] | None = None
        for event in rest:
            change = index_change(event)
            if change.status is not None:
                status = (change.status, change.waiting_on)
            move_timers(conn, self.execution_id, change.timer_add, change.timer_remove,
                         change.clear_timers)
        last = rest[-1]
        if status is None:
            conn.execute("UPDATE executions SET head = ?, updated_at = ? WHERE execution_id = ?",
                         (last.sequence, last.timestamp, self.execution_id))
        else:
            conn.execute("UPDATE executions SET head = ?, updated_at = ?, status = ?, "
                         "waiting_on = ? WHERE execution_id = ?",
                         (last.sequence, last.timestamp, status[0], status[1],
                          self.execution_id))


def move_timers(conn: sqlite3.Connection, execution_id: str, add: DueTimer | None,
                 remove: str | None, clear: bool) -> None:
    if add is not None:
        conn.execute("INSERT OR REPLACE INTO timers VALUES (?, ?, ?)",
                     (execution_id, add.timer_id, add.due_at))
    if remove is not None:
        conn.execute("DELETE FROM timers WHERE execution_id = ? AND timer_id = ?",
                     (execution_id, remove))
    if clear:
        conn.execute("DELETE FROM timers WHERE execution_id = ?", (execution_id,))
