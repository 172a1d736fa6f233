"""Queues and debounce pointers in the Postgres store (``spi_queues.HoldsQueues``).

A mixin of ``PostgresEventStore``. A pass is one statement calling
``fleet_queue_pass`` (``pg_migration_queues``, schema version 7): one round trip
and one transaction, serialised per queue by the queue's row lock. It is not
retried on a lost link (the pass may have committed: its admissions are then
found by a later pass's ``rewake``).
"""

from __future__ import annotations

from typing import Any, Protocol

from fleet.kernel.store.pg_queries import execution_key
from fleet.kernel.store.spi_queues import (
    DEFAULT_GRACE_MS,
    DEFAULT_REWAKE_MS,
    QUEUE_GATE_PREFIX,
    Admission,
    DebounceClaim,
    QueueDepth,
    QueueEntry,
    QueueLimits,
    QueuePass,
    check_pass,
    check_scope,
)
from fleet.kernel.values import check_ms, check_text

__all__ = ["PostgresQueues"]

_PASS_SQL = ("SELECT o_kind, o_id, o_at, o_text FROM fleet_queue_pass($1, $2, $3, $4, $5, $6, "
             "$7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)")
_ENDED = "('cancelled', 'completed', 'continued', 'failed')"
_IS_WAITING = (f"q.admitted_at IS NULL AND e.status = 'parked' AND e.waiting_on = "
               f"'{QUEUE_GATE_PREFIX}' || q.queue")
_DEPTHS_SQL = f"""
SELECT q.queue,
       count(*) FILTER (WHERE {_IS_WAITING} AND q.eligible_at <= $1) AS waiting,
       min(greatest(q.entered_at, q.eligible_at))
           FILTER (WHERE {_IS_WAITING} AND q.eligible_at <= $1) AS oldest,
       count(*) FILTER (WHERE q.admitted_at IS NOT NULL AND e.status NOT IN {_ENDED})
           AS running,
       count(*) FILTER (WHERE {_IS_WAITING} AND q.eligible_at > $1) AS delayed
FROM fleet_queue_entries AS q LEFT JOIN executions AS e ON e.ekey = q.ekey
GROUP BY q.queue
"""


class _Store(Protocol):
    """What the mixin uses of ``PostgresEventStore``: its one way to the server."""

    async def _call(self, method: str, query: str, *args: Any, idempotent: bool) -> Any: ...


class PostgresQueues:
    """``HoldsQueues`` through a Postgres store's ``_call``."""

    async def queue_pass(self: _Store, limits: QueueLimits, now_ms: int, *,
                         entry: QueueEntry | None = None, limit: int = 100,
                         grace_ms: int = DEFAULT_GRACE_MS,
                         rewake_ms: int = DEFAULT_REWAKE_MS,
                         sweep: bool = True) -> QueuePass:
        check_pass(limits, now_ms, entry, limit, grace_ms, rewake_ms)
        ekey = None if entry is None else execution_key(entry.execution_id)
        rows = await self._call(
            "fetch", _PASS_SQL, limits.name, limits.to_json(), now_ms, limits.concurrency,
            limits.per_key, limits.rate_n, limits.rate_ms, limit, grace_ms, rewake_ms,
            limits.gate, ekey, None if entry is None else entry.execution_id,
            None if entry is None else entry.key or "",
            0 if entry is None else entry.priority,
            0 if entry is None else entry.eligible_at, sweep, idempotent=False)
        admitted: list[Admission] = []
        rewake: list[Admission] = []
        entry_at: int | None = None
        entered = False
        before: str | None = None
        for row in rows:
            kind = row["o_kind"]
            if kind == "admitted":
                admitted.append(Admission(row["o_id"], int(row["o_at"])))
            elif kind == "rewake":
                rewake.append(Admission(row["o_id"], int(row["o_at"])))
            elif kind == "entry":
                entry_at = None if row["o_at"] is None else int(row["o_at"])
                entered = row["o_text"] == "entered"
            elif kind == "limits":
                before = row["o_text"]
        return QueuePass(tuple(admitted), tuple(rewake), entry_at, entered, before)

    async def queue_delay(self: _Store, execution_id: str, eligible_at: int) -> bool:
        key = execution_key(execution_id)
        check_ms(eligible_at, "eligible_at")
        status = await self._call(
            "execute", "UPDATE fleet_queue_entries SET eligible_at = $2 WHERE ekey = $1 AND "
            "admitted_at IS NULL", key, eligible_at, idempotent=True)
        return str(status).endswith(" 1")

    async def queue_forget(self: _Store, execution_id: str) -> bool:
        key = execution_key(execution_id)
        status = await self._call("execute", "DELETE FROM fleet_queue_entries WHERE ekey = $1",
                                  key, idempotent=False)
        return str(status).endswith(" 1")

    async def queue_depths(self: _Store, now_ms: int) -> list[QueueDepth]:
        check_ms(now_ms, "now_ms")
        rows = {row["queue"]: row for row in await self._call(
            "fetch", _DEPTHS_SQL, now_ms, idempotent=True)}
        limits = {row["name"]: row["limits"] for row in await self._call(
            "fetch", "SELECT name, limits FROM fleet_queues", idempotent=True)}
        out = []
        for name in sorted(set(rows) | set(limits)):
            row = rows.get(name)
            if row is None:
                out.append(QueueDepth(name, 0, None, 0, 0, limits.get(name)))
                continue
            oldest = row["oldest"]
            out.append(QueueDepth(name, int(row["waiting"]),
                                  None if oldest is None else now_ms - int(oldest),
                                  int(row["running"]), int(row["delayed"]), limits.get(name)))
        return out

    async def debounce_get(self: _Store, scope: str) -> DebounceClaim | None:
        check_scope(scope)
        row = await self._call("fetchrow", "SELECT execution_id, claimed_at FROM fleet_debounce "
                               "WHERE scope = $1", scope, idempotent=True)
        return None if row is None else DebounceClaim(row["execution_id"],
                                                      int(row["claimed_at"]))

    async def debounce_claim(self: _Store, scope: str, execution_id: str, *, expect: str | None,
                             now_ms: int) -> bool:
        check_scope(scope)
        check_text(execution_id, "execution id")
        if expect is not None:
            check_text(expect, "expect")
        check_ms(now_ms, "now_ms")
        if expect is None:
            status = await self._call(
                "execute", "INSERT INTO fleet_debounce (scope, execution_id, claimed_at) "
                "VALUES ($1, $2, $3) ON CONFLICT (scope) DO NOTHING", scope, execution_id,
                now_ms, idempotent=False)
        else:
            status = await self._call(
                "execute", "UPDATE fleet_debounce SET execution_id = $2, claimed_at = $3 "
                "WHERE scope = $1 AND execution_id = $4", scope, execution_id, now_ms, expect,
                idempotent=False)
        return str(status).endswith(" 1")
