"""The SQLite schema, its versions, and the committed-feed query (``sqlite.py`` runs them).

``PRAGMA user_version`` holds the schema version. A new file gets the whole
schema at once; an older file is brought forward step by step inside one
``BEGIN IMMEDIATE`` transaction, which re-reads the version under the write
lock, so two processes opening the same old file migrate it once.

Version 2 adds the committed feed (decision 0020): every event row carries a
``position``, taken from ``fleet_counters`` inside the write transaction that
inserts it. SQLite runs one write transaction at a time (for every process on
the file), so positions are handed out in commit order, and a reader that
asks for ``position > after`` can never miss a row that commits later. The
counter only grows, so a position is never reused after a deletion.

Version 3 adds the queues and debounce pointers (decision 0056, ``sqlite_queues``):
``fleet_queues`` (a row per queue: the limits its last pass judged with),
``fleet_queue_entries`` (one per queued execution; ``seq`` never reused, the
enqueue order) and ``fleet_debounce``.
"""

from __future__ import annotations

import sqlite3

from fleet.kernel.errors import SchemaVersionError

__all__ = ["BACKLOG_SQL", "FEED_SQL", "SCHEMA_VERSION", "migrate", "next_positions"]

SCHEMA_VERSION = 3

_V1 = """
CREATE TABLE IF NOT EXISTS events (
    execution_id TEXT NOT NULL, sequence INTEGER NOT NULL, type TEXT NOT NULL,
    timestamp INTEGER NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (execution_id, sequence)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS executions (
    execution_id TEXT PRIMARY KEY, flow_id TEXT NOT NULL, tenant TEXT, owner TEXT,
    status TEXT NOT NULL, waiting_on TEXT, started_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL, head INTEGER NOT NULL, anchor TEXT NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS executions_by_status ON executions (status, execution_id);
CREATE INDEX IF NOT EXISTS executions_by_flow ON executions (flow_id, execution_id);
CREATE INDEX IF NOT EXISTS executions_by_tenant ON executions (tenant, execution_id);
CREATE INDEX IF NOT EXISTS executions_by_gate ON executions (waiting_on, execution_id)
    WHERE waiting_on IS NOT NULL;
CREATE INDEX IF NOT EXISTS executions_by_updated ON executions (updated_at);
CREATE TABLE IF NOT EXISTS fences (
    execution_id TEXT PRIMARY KEY, token INTEGER NOT NULL, holder TEXT,
    lease_expires_at INTEGER) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS timers (
    execution_id TEXT NOT NULL, timer_id TEXT NOT NULL, due_at INTEGER NOT NULL,
    PRIMARY KEY (execution_id, timer_id)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS timers_by_due ON timers (due_at, execution_id, timer_id);
CREATE TABLE IF NOT EXISTS snapshots (
    execution_id TEXT PRIMARY KEY, sequence INTEGER NOT NULL, state TEXT NOT NULL)
    WITHOUT ROWID;
"""

# Rows written before version 2 get positions in an order that keeps every
# execution's sequence order (the running maximum of its timestamps, so a clock
# step inside one log cannot put a later event first) and roughly follows time.
_V2 = """
ALTER TABLE events ADD COLUMN position INTEGER;
CREATE TEMP TABLE fleet_backfill (
    execution_id TEXT NOT NULL, sequence INTEGER NOT NULL, n INTEGER NOT NULL,
    PRIMARY KEY (execution_id, sequence)) WITHOUT ROWID;
INSERT INTO fleet_backfill
SELECT execution_id, sequence, row_number() OVER (ORDER BY mts, execution_id, sequence)
FROM (SELECT execution_id, sequence,
             max(timestamp) OVER (PARTITION BY execution_id ORDER BY sequence) AS mts
      FROM events);
UPDATE events SET position = (SELECT b.n FROM fleet_backfill AS b
                              WHERE b.execution_id = events.execution_id
                                AND b.sequence = events.sequence);
CREATE TABLE fleet_counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
INSERT INTO fleet_counters VALUES ('position', (SELECT coalesce(max(n), 0) FROM fleet_backfill));
DROP TABLE fleet_backfill;
CREATE UNIQUE INDEX events_by_position ON events (position);
"""

_V3 = """
CREATE TABLE IF NOT EXISTS fleet_queues (
    name TEXT PRIMARY KEY, limits TEXT, updated_at INTEGER) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS fleet_queue_entries (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, execution_id TEXT NOT NULL UNIQUE,
    queue TEXT NOT NULL, qkey TEXT NOT NULL, priority INTEGER NOT NULL, entered_at INTEGER NOT NULL,
    eligible_at INTEGER NOT NULL, admitted_at INTEGER);
CREATE INDEX IF NOT EXISTS fleet_queue_waiting ON fleet_queue_entries (queue, priority, seq)
    WHERE admitted_at IS NULL;
CREATE INDEX IF NOT EXISTS fleet_queue_admitted ON fleet_queue_entries (queue, admitted_at)
    WHERE admitted_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS fleet_debounce (
    scope TEXT PRIMARY KEY, execution_id TEXT NOT NULL, claimed_at INTEGER NOT NULL)
    WITHOUT ROWID;
"""

FEED_SQL = """
SELECT e.position, e.execution_id, e.sequence, e.type, e.body, x.tenant
FROM events AS e LEFT JOIN executions AS x ON x.execution_id = e.execution_id
WHERE e.position > ? ORDER BY e.position LIMIT ?
"""


def migrate(conn: sqlite3.Connection, path: str) -> None:
    """Bring the file to ``SCHEMA_VERSION`` (refusing a newer one), atomically."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(f"{path} has schema {version}; this fleet reads up to "
                                 f"{SCHEMA_VERSION}: upgrade fleet")
    if version == SCHEMA_VERSION:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        # Again under the write lock: another process may have migrated meanwhile.
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        # Statement by statement: executescript would commit the transaction first.
        for step, script in ((1, _V1), (2, _V2), (3, _V3)):
            if version < step:
                for statement in _statements(script):
                    conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";\n") if s.strip()]


def next_positions(conn: sqlite3.Connection, count: int) -> int:
    """Take ``count`` positions from the counter (inside the caller's write); the first."""
    (last,) = conn.execute("UPDATE fleet_counters SET value = value + ? WHERE name = "
                           "'position' RETURNING value", (count,)).fetchone()
    return int(last) - count + 1


#: The backlog (``SqliteEventStore.backlog``; decision 0046): runnable executions with no
#: live lease at ``:now`` and since when the oldest waits, and the timers due, per flow
#: and tenant; the running rows by ``executions_by_status``, the timers by
#: ``timers_by_due``.
BACKLOG_SQL = """
SELECT e.flow_id, e.tenant, count(*), min(max(e.updated_at, coalesce(f.lease_expires_at, 0))),
       0, NULL
FROM executions AS e LEFT JOIN fences AS f ON f.execution_id = e.execution_id
WHERE e.status = 'running' AND (f.lease_expires_at IS NULL OR f.lease_expires_at <= :now)
GROUP BY e.flow_id, e.tenant
UNION ALL
SELECT e.flow_id, e.tenant, 0, NULL, count(*), min(t.due_at)
FROM timers AS t JOIN executions AS e ON e.execution_id = t.execution_id
WHERE t.due_at <= :now
GROUP BY e.flow_id, e.tenant
"""

