"""Queues and debounce pointers in the SQLite store (``spi_queues.HoldsQueues``).

A mixin of ``SqliteEventStore``. A pass is one job on the file's writer
connection, so it runs inside SQLite's write transaction: one pass at a time for
every process on the file, and every read in it sees the index as the pass
leaves it. The tables are schema version 3 (``sqlite_schema``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from fleet.kernel.events import TERMINAL_STATUSES
from fleet.kernel.store.spi_queues import (
    DEFAULT_GRACE_MS,
    DEFAULT_REWAKE_MS,
    QUEUE_GATE_PREFIX,
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

__all__ = ["SqliteQueues"]

T = TypeVar("T")


class _Connection(Protocol):
    """A connection thread of the file (``sqlite._Worker``)."""

    async def call(self, job: Callable[[sqlite3.Connection], T]) -> T: ...


class _Database(Protocol):
    @property
    def writer(self) -> _Connection: ...

    @property
    def reader(self) -> _Connection: ...


class _Store(Protocol):
    """What the mixin uses of ``SqliteEventStore``: its file's connections."""

    @property
    def _db(self) -> _Database: ...

_ENDED = "(" + ", ".join(f"'{s}'" for s in sorted(TERMINAL_STATUSES)) + ")"
# An admitted entry holds its slot: its execution has not ended, or has no log yet
# (for grace after it was entered).
_LIVE = f"(e.status NOT IN {_ENDED} OR (e.execution_id IS NULL AND q.entered_at > :since))"
_WAITING = ("q.admitted_at IS NULL AND q.eligible_at <= :now AND ((e.status = 'parked' AND "
            "e.waiting_on = :gate) OR (e.execution_id IS NULL AND q.execution_id = :new))")
_FROM = ("FROM fleet_queue_entries AS q "
         "LEFT JOIN executions AS e ON e.execution_id = q.execution_id")
_RUNNING = f"SELECT q.qkey {_FROM} WHERE q.queue = :queue AND q.admitted_at IS NOT NULL AND {_LIVE}"
_CANDIDATES = (f"SELECT q.execution_id, q.qkey {_FROM} WHERE q.queue = :queue AND {_WAITING} "
               "ORDER BY q.priority, q.seq LIMIT :free")
_CANDIDATES_BY_KEY = f"""
WITH act AS (SELECT q.qkey AS qkey, count(*) AS k {_FROM}
             WHERE q.queue = :queue AND q.admitted_at IS NOT NULL AND {_LIVE} GROUP BY q.qkey),
     cand AS (SELECT q.execution_id, q.qkey, q.priority, q.seq,
                     row_number() OVER (PARTITION BY q.qkey ORDER BY q.priority, q.seq) AS rn
              {_FROM} WHERE q.queue = :queue AND {_WAITING}
                AND q.qkey NOT IN (SELECT a.qkey FROM act AS a WHERE a.k >= :per_key))
SELECT cand.execution_id, cand.qkey FROM cand LEFT JOIN act ON act.qkey = cand.qkey
WHERE cand.rn <= :per_key - coalesce(act.k, 0)
ORDER BY cand.priority, cand.seq LIMIT :free
"""
_REWAKE = """
SELECT q.execution_id, q.admitted_at FROM fleet_queue_entries AS q
JOIN executions AS e ON e.execution_id = q.execution_id
WHERE q.queue = :queue AND q.admitted_at IS NOT NULL AND q.admitted_at <= :woken
  AND e.status = 'parked' AND e.waiting_on = :gate
  AND NOT EXISTS (SELECT 1 FROM timers AS t WHERE t.execution_id = q.execution_id
                  AND t.timer_id = :gate)
ORDER BY q.admitted_at, q.seq LIMIT :limit
"""
# Entries of ended runs (or with no log past the grace) leave on passes without an
# entry: admitted ones once outside the rate window.
_GONE = f"""
  AND NOT EXISTS (SELECT 1 FROM executions AS e WHERE e.execution_id =
                  fleet_queue_entries.execution_id AND e.status NOT IN {_ENDED})
  AND (entered_at <= :since OR EXISTS (SELECT 1 FROM executions AS e WHERE
       e.execution_id = fleet_queue_entries.execution_id))
"""
_PRUNE_ADMITTED = ("DELETE FROM fleet_queue_entries WHERE queue = :queue AND admitted_at IS "
                   "NOT NULL AND admitted_at <= :kept" + _GONE)
_PRUNE_WAITING = "DELETE FROM fleet_queue_entries WHERE queue = :queue AND admitted_at IS NULL" \
    + _GONE
_DEPTHS = f"""
SELECT q.queue,
  sum(CASE WHEN q.admitted_at IS NULL AND e.status = 'parked' AND e.waiting_on =
      '{QUEUE_GATE_PREFIX}' || q.queue AND q.eligible_at <= :now THEN 1 ELSE 0 END),
  min(CASE WHEN q.admitted_at IS NULL AND e.status = 'parked' AND e.waiting_on =
      '{QUEUE_GATE_PREFIX}' || q.queue AND q.eligible_at <= :now
      THEN max(q.entered_at, q.eligible_at) END),
  sum(CASE WHEN q.admitted_at IS NOT NULL AND e.status NOT IN {_ENDED} THEN 1 ELSE 0 END),
  sum(CASE WHEN q.admitted_at IS NULL AND e.status = 'parked' AND e.waiting_on =
      '{QUEUE_GATE_PREFIX}' || q.queue AND q.eligible_at > :now THEN 1 ELSE 0 END)
{_FROM} GROUP BY q.queue
"""


def _pass(conn: sqlite3.Connection, limits: QueueLimits, now: int, entry: QueueEntry | None,
          limit: int, grace: int, rewake: int, sweep: bool) -> QueuePass:
    mine = limits.to_json()
    conn.execute("INSERT INTO fleet_queues (name, limits, updated_at) VALUES (?, ?, ?) "
                 "ON CONFLICT (name) DO NOTHING", (limits.name, mine, now))
    (before,) = conn.execute("SELECT limits FROM fleet_queues WHERE name = ?",
                             (limits.name,)).fetchone()
    if before != mine:
        conn.execute("UPDATE fleet_queues SET limits = ?, updated_at = ? WHERE name = ?",
                     (mine, now, limits.name))
    entered = False
    if entry is not None:
        entered = conn.execute(
            "INSERT INTO fleet_queue_entries (execution_id, queue, qkey, priority, entered_at, "
            "eligible_at) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (execution_id) DO NOTHING",
            (entry.execution_id, entry.queue, entry.key or "", entry.priority, now,
             entry.eligible_at)).rowcount == 1
    args: dict[str, Any] = {"queue": limits.name, "now": now, "since": now - grace,
                            "gate": limits.gate,
                            "new": entry.execution_id if entered and entry else None}
    by_key: dict[str | None, int] = {}
    running = 0
    for (key,) in conn.execute(_RUNNING, args):
        running += 1
        by_key[key] = by_key.get(key, 0) + 1
    recent: list[int] = []
    if limits.rate_n is not None and limits.rate_ms is not None:
        recent = [row[0] for row in conn.execute(
            "SELECT admitted_at FROM fleet_queue_entries WHERE queue = ? AND admitted_at > ? "
            "ORDER BY admitted_at DESC LIMIT ?",
            (limits.name, now - limits.rate_ms, limits.rate_n))]
    free = limit if limits.concurrency is None else min(limit, limits.concurrency - running)
    admitted: list[Admission] = []
    if free > 0:
        sql = _CANDIDATES if limits.per_key is None else _CANDIDATES_BY_KEY
        rows = conn.execute(sql, {**args, "free": free, "per_key": limits.per_key}).fetchall()
        admitted = plan_admissions(limits, now, running=running, running_by_key=by_key,
                                   recent=recent, limit=limit,
                                   candidates=(Candidate(eid, key) for eid, key in rows))
        conn.executemany("UPDATE fleet_queue_entries SET admitted_at = ? WHERE execution_id = ?",
                         [(a.at, a.execution_id) for a in admitted])
    changed = None if before == mine else before
    if entry is not None:  # a start's pass: what it entered, and nothing more
        (entry_at,) = conn.execute("SELECT admitted_at FROM fleet_queue_entries WHERE "
                                   "execution_id = ?", (entry.execution_id,)).fetchone()
        return QueuePass(tuple(admitted), (), entry_at, entered, changed)
    if not sweep:
        return QueuePass(tuple(admitted), (), None, False, changed)
    fresh = {a.execution_id for a in admitted}
    woken = [Admission(eid, at) for eid, at in conn.execute(
        _REWAKE, {**args, "woken": now - rewake, "limit": limit + len(fresh)})
        if eid not in fresh][:limit]
    prune = {"queue": limits.name, "kept": now - (limits.rate_ms or 0), "since": now - grace}
    conn.execute(_PRUNE_ADMITTED, prune)
    conn.execute(_PRUNE_WAITING, prune)
    return QueuePass(tuple(admitted), tuple(woken), None, False, changed)


class SqliteQueues:
    """``HoldsQueues`` on a SQLite store's file (its ``_db`` writer and reader)."""

    async def queue_pass(self: _Store, limits: QueueLimits, now_ms: int, *,
                         entry: QueueEntry | None = None, limit: int = 100,
                         grace_ms: int = DEFAULT_GRACE_MS,
                         rewake_ms: int = DEFAULT_REWAKE_MS,
                         sweep: bool = True) -> QueuePass:
        check_pass(limits, now_ms, entry, limit, grace_ms, rewake_ms)
        return await self._db.writer.call(
            lambda conn: _pass(conn, limits, now_ms, entry, limit, grace_ms, rewake_ms, sweep))

    async def queue_delay(self: _Store, execution_id: str, eligible_at: int) -> bool:
        check_text(execution_id, "execution id")
        check_ms(eligible_at, "eligible_at")

        def job(conn: sqlite3.Connection) -> bool:
            return conn.execute("UPDATE fleet_queue_entries SET eligible_at = ? WHERE "
                                "execution_id = ? AND admitted_at IS NULL",
                                (eligible_at, execution_id)).rowcount == 1

        return await self._db.writer.call(job)

    async def queue_forget(self: _Store, execution_id: str) -> bool:
        check_text(execution_id, "execution id")

        def job(conn: sqlite3.Connection) -> bool:
            return conn.execute("DELETE FROM fleet_queue_entries WHERE execution_id = ?",
                                (execution_id,)).rowcount == 1

        return await self._db.writer.call(job)

    async def queue_depths(self: _Store, now_ms: int) -> list[QueueDepth]:
        check_ms(now_ms, "now_ms")

        def job(conn: sqlite3.Connection) -> list[QueueDepth]:
            limits = dict(conn.execute("SELECT name, limits FROM fleet_queues"))
            rows = {row[0]: row for row in conn.execute(_DEPTHS, {"now": now_ms})}
            return list(_depths(sorted(set(limits) | set(rows)), rows, limits, now_ms))

        return await self._db.reader.call(job)

    async def debounce_get(self: _Store, scope: str) -> DebounceClaim | None:
        check_scope(scope)

        def job(conn: sqlite3.Connection) -> DebounceClaim | None:
            row = conn.execute("SELECT execution_id, claimed_at FROM fleet_debounce "
                               "WHERE scope = ?", (scope,)).fetchone()
            return None if row is None else DebounceClaim(row[0], row[1])

        return await self._db.reader.call(job)

    async def debounce_claim(self: _Store, scope: str, execution_id: str, *, expect: str | None,
                             now_ms: int) -> bool:
        check_scope(scope)
        check_text(execution_id, "execution id")
        if expect is not None:
            check_text(expect, "expect")
        check_ms(now_ms, "now_ms")

        def job(conn: sqlite3.Connection) -> bool:
            if expect is None:
                return conn.execute(
                    "INSERT INTO fleet_debounce (scope, execution_id, claimed_at) VALUES "
                    "(?, ?, ?) ON CONFLICT (scope) DO NOTHING",
                    (scope, execution_id, now_ms)).rowcount == 1
            return conn.execute(
                "UPDATE fleet_debounce SET execution_id = ?, claimed_at = ? WHERE scope = ? "
                "AND execution_id = ?", (execution_id, now_ms, scope, expect)).rowcount == 1

        return await self._db.writer.call(job)


def _depths(names: list[str], rows: dict[str, Any], limits: dict[str, str],
            now: int) -> Iterator[QueueDepth]:
    for name in names:
        row = rows.get(name)
        if row is None:
            yield QueueDepth(name, 0, None, 0, 0, limits.get(name))
            continue
        _, waiting, oldest, running, delayed = row
        yield QueueDepth(name, int(waiting or 0), None if oldest is None else now - int(oldest),
                         int(running or 0), int(delayed or 0), limits.get(name))
