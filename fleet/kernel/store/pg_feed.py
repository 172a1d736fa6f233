"""The Postgres committed feed: the query, its rows, and the commit signal (no driver here).

Why the query never skips an event (decision 0020, schema version 3 in
``pg_migrations``): each row carries the id of the transaction that inserted
it (``txid``) and a sequence number (``pos``); the query returns rows in
(txid, pos) order and only those whose transaction is below the xmin of the
query's own snapshot. Every transaction below that xmin has ended, so no row
with such a txid can still appear; a transaction that is running, or that
starts later, has a txid at or above it. A reader resuming after the last
(txid, pos) it got therefore finds every later commit above its position. The
price is lag, never loss: a transaction left open anywhere on the server holds
xmin back, and the feed waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fleet.kernel.events import EventEnvelope
from fleet.kernel.store.spi import CommittedEvent, Position

__all__ = ["PostgresCommitSignal", "channel_for", "committed", "feed_query"]

_BIGINT_MAX = 2**63 - 1

_FEED = """
SELECT e.txid, e.pos, e.sequence, e.type, e.body, x.execution_id, x.tenant
FROM events AS e LEFT JOIN executions AS x ON x.ekey = e.ekey
WHERE (e.txid, e.pos) > ($1::bigint, $2::bigint)
  AND e.txid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint
ORDER BY e.txid, e.pos
LIMIT $3
"""

# With a byte bound: the first rows (in order) whose running size stays under
# the bound, plus the one that crosses it; at least one row. Sizes are the
# stored text's (octet_length reads the TOAST header, not the value).
_FEED_BYTES = f"""
SELECT txid, pos, sequence, type, body, execution_id, tenant
FROM (SELECT p.*, sum(octet_length(p.body)) OVER (ORDER BY p.txid, p.pos)
                  - octet_length(p.body) AS before
      FROM ({_FEED}) AS p) AS f
WHERE f.before < $4
ORDER BY txid, pos
"""


def feed_query(after: Position, limit: int, max_bytes: int | None) -> tuple[str, list[Any]]:
    """The SQL and arguments of one ``read_committed`` page."""
    major = min(after.major, _BIGINT_MAX)
    minor = min(after.minor, _BIGINT_MAX)
    if max_bytes is None:
        return _FEED, [major, minor, limit]
    return _FEED_BYTES, [major, minor, limit, max_bytes]


def committed(rows: Sequence[Any]) -> list[CommittedEvent]:
    """The rows as committed events carrying the stored text (parsed only on demand)."""
    out: list[CommittedEvent] = []
    for row in rows:
        body = row["body"]
        execution_id = row["execution_id"]
        if execution_id is None:  # no index row (deleted since): the envelope says whose
            execution_id = EventEnvelope.from_json(body).execution_id
        out.append(CommittedEvent(Position(int(row["txid"]), int(row["pos"])),
                                  tenant=row["tenant"], json=body, execution_id=execution_id,
                                  sequence=int(row["sequence"]), type=row["type"]))
    return out


def channel_for(schema: str | None) -> str:
    """The NOTIFY channel of one schema's relay (a short identifier, whatever the schema)."""
    digest = hashlib.sha256((schema or "").encode("utf-8", "surrogatepass")).hexdigest()
    return f"fleet_feed_{digest[:16]}"


_ARM_SQL = ("INSERT INTO fleet_relay_doorbell (id, armed, channel) VALUES (true, true, $1) "
            "ON CONFLICT (id) DO UPDATE SET armed = true, channel = EXCLUDED.channel")


class PostgresCommitSignal:
    """A ``CommitSignal`` on LISTEN/NOTIFY and the doorbell (decision 0020).

    One connection of its own (outside the pool: a LISTEN belongs to a session)
    listens on ``channel``; ``arm`` sets the doorbell so that the next append
    that commits NOTIFYs it. A lost connection makes ``arm`` answer False (the
    reader polls) and is opened again on the next ``arm``.
    """

    def __init__(self, connect: Callable[[], Awaitable[Any]], channel: str) -> None:
        self._connect = connect
        self.channel = channel
        self._conn: Any = None
        self._heard = asyncio.Event()
        self._armed = False
        self.armings = 0
        self.signals = 0
        self.failures = 0

    async def arm(self) -> bool:
        if self._armed and self._conn is not None and not self._conn.is_closed():
            return True  # nobody rang since the last arming: the bell is still armed
        try:
            if self._conn is None or self._conn.is_closed():
                await self._drop()
                conn = await self._connect()
                await conn.add_listener(self.channel, self._on_notify)
                conn.add_termination_listener(self._on_lost)
                self._conn = conn
            self._heard.clear()
            await self._conn.execute(_ARM_SQL, self.channel)
            self._armed = True
            self.armings += 1
            return True
        except Exception:  # noqa: BLE001 - no signal is a fallback to polling, not an error
            self.failures += 1
            await self._drop()
            return False

    async def wait(self, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._heard.wait(), timeout)
            return True
        return False

    async def close(self) -> None:
        await self._drop()

    def _on_notify(self, *_: Any) -> None:
        self.signals += 1
        self._armed = False  # a writer disarmed it to ring
        self._heard.set()

    def _on_lost(self, *_: Any) -> None:
        self._armed = False
        self._heard.set()  # wake the reader: it re-arms on a new connection

    async def _drop(self) -> None:
        self._armed = False
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 2.0)
