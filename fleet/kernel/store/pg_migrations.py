"""The Postgres schema, as numbered migrations (see ``postgres.py`` for the why).

Each entry is applied once, in order, inside the migrating transaction, and
recorded in ``fleet_schema_version``. Never edit a released migration: add
the next number. Text is plain SQL, no user input is ever formatted into it.

Keys. Every table is keyed by ``ekey = sha256(utf-8 of the execution id)``
(``fleet_key(id)`` in SQL), not by the id itself: a btree entry holds at most
~2.7 KB, and execution ids, flow ids, tenants and gate names of 10 KB must be
stored and read back exactly. The readable columns are kept beside the key;
listing indexes use a 200-character prefix and order by the full value after
it (an incremental sort on ties), which is the same order for every string.
``COLLATE "C"`` makes that order the code-point order Python and SQLite use.

Every append rewrites its execution's index row (head, updated_at): no index
covers those columns, and the table leaves free space on each page, so that
rewrite is a HOT update that touches no index. (``updated_before`` /
``updated_after`` listings are therefore filters, not index ranges.)

Writes are server-side functions so a fenced append is one round trip. Every
one of them locks the execution's fence row ``FOR UPDATE`` first (ADR 0116):
an append, a conditional append, an acquire and a delete of one execution are
strictly ordered, and every check made after the lock (head, anchor, token,
existence) reads a fresh snapshot because the function runs at READ
COMMITTED, which it checks (``FL004``) rather than assumes.
"""

from __future__ import annotations

from fleet.kernel.store.pg_migration_backlog import MIGRATION_BACKLOG
from fleet.kernel.store.pg_migration_queues import MIGRATION_QUEUES
from fleet.kernel.store.pg_migration_v6 import MIGRATION_6
from fleet.kernel.store.pg_migration_v7 import migration_7
from fleet.kernel.store.pg_migration_v8 import MIGRATION_8, OLDEST_CODE_8
from fleet.kernel.store.pg_sql import CURRENT_TXID, READ_COMMITTED, RING, edit

__all__ = ["MIGRATIONS", "OLDEST_CODE", "SCHEMA_VERSION", "VERSION_TABLE", "VERSION_TABLE_COMPAT"]

# ``oldest_code``: the oldest code (by the schema version it knows) that may run
# against the database once this migration is applied (decision 0049). A database's
# requirement is the largest over its rows (a row without one counts as its own
# version), so older code reads it from the table without knowing the migration.
VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS fleet_schema_version (
    version integer PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now(),
    oldest_code integer)
"""
# A table made before decision 0049 gains the column (and the known values) on the
# next upgrade; nothing reads it but code that knows it.
VERSION_TABLE_COMPAT = """
ALTER TABLE fleet_schema_version ADD COLUMN IF NOT EXISTS oldest_code integer
"""


_V1_TABLES = """
CREATE FUNCTION fleet_key(id text) RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$ SELECT sha256(convert_to(id, 'UTF8')) $$;

CREATE TABLE events (
    ekey bytea NOT NULL,
    sequence bigint NOT NULL,
    type text NOT NULL,
    timestamp bigint NOT NULL,
    body text NOT NULL,
    PRIMARY KEY (ekey, sequence));

CREATE TABLE executions (
    ekey bytea PRIMARY KEY,
    execution_id text COLLATE "C" NOT NULL,
    flow_id text COLLATE "C" NOT NULL,
    tenant text COLLATE "C",
    owner text,
    status text NOT NULL,
    waiting_on text COLLATE "C",
    started_at bigint NOT NULL,
    updated_at bigint NOT NULL,
    head bigint NOT NULL,
    anchor text NOT NULL)
    WITH (fillfactor = 70);
CREATE INDEX executions_by_id ON executions (left(execution_id, 200));
CREATE INDEX executions_by_status ON executions (status, left(execution_id, 200));
CREATE INDEX executions_by_flow ON executions (left(flow_id, 200), left(execution_id, 200));
CREATE INDEX executions_by_tenant ON executions (left(tenant, 200), left(execution_id, 200));
CREATE INDEX executions_by_gate ON executions (left(waiting_on, 200), left(execution_id, 200))
    WHERE waiting_on IS NOT NULL;

CREATE TABLE fences (
    ekey bytea PRIMARY KEY,
    token bigint NOT NULL,
    holder text,
    lease_expires_at bigint)
    WITH (fillfactor = 70);

CREATE TABLE timers (
    ekey bytea NOT NULL,
    tkey bytea NOT NULL,
    execution_id text COLLATE "C" NOT NULL,
    timer_id text COLLATE "C" NOT NULL,
    due_at bigint NOT NULL,
    PRIMARY KEY (ekey, tkey));
CREATE INDEX timers_by_due ON timers (due_at);

CREATE TABLE snapshots (
    ekey bytea PRIMARY KEY,
    execution_id text NOT NULL,
    sequence bigint NOT NULL,
    state jsonb NOT NULL);
"""

# Lock (and with p_create, first create) the fence row. A row deleted while
# this call waited on it (a gone conditional append removing the token-0 row
# it made) reads as absent to the waiter, so the lookup loops.
_V1_LOCK = """
CREATE FUNCTION fleet_lock_fence(p_key bytea, p_create boolean,
    OUT o_token bigint, OUT o_holder text, OUT o_lease bigint, OUT o_created boolean)
LANGUAGE plpgsql AS $$
BEGIN
    o_created := false;
    LOOP
        SELECT f.token, f.holder, f.lease_expires_at INTO o_token, o_holder, o_lease
        FROM fences AS f WHERE f.ekey = p_key FOR UPDATE;
        IF FOUND OR NOT p_create THEN
            RETURN;
        END IF;
        INSERT INTO fences (ekey, token) VALUES (p_key, 0) ON CONFLICT (ekey) DO NOTHING;
        o_created := FOUND;
    END LOOP;
END $$;
"""

# Insert a checked batch at p_first and move the index. The caller holds the
# fence row and has proved p_first = head + 1. Status, waiting_on and the net
# timer changes were computed by the client with spi.index_change. Inlined in
# both appends (a nested plpgsql call costs as much as a statement).
_PLACE = """
    n := cardinality(p_types);
    INSERT INTO events (ekey, sequence, type, timestamp, body)
    SELECT p_key, p_first + u.o - 1, u.t, u.ts, u.b
    FROM unnest(p_types, p_ts, p_bodies) WITH ORDINALITY AS u(t, ts, b, o);
    IF p_first = 0 THEN
        INSERT INTO executions (ekey, execution_id, flow_id, tenant, owner, status,
                                waiting_on, started_at, updated_at, head, anchor)
        VALUES (p_key, p_id, p_flow, p_tenant, p_owner, p_status, p_waiting, p_ts[1],
                p_ts[n], p_first + n - 1, p_anchor);
    ELSIF p_status IS NULL THEN
        UPDATE executions SET head = p_first + n - 1, updated_at = p_ts[n]
        WHERE ekey = p_key;
    ELSE
        UPDATE executions SET head = p_first + n - 1, updated_at = p_ts[n],
                              status = p_status, waiting_on = p_waiting
        WHERE ekey = p_key;
    END IF;
    IF p_clear THEN
        DELETE FROM timers WHERE ekey = p_key;
    END IF;
    IF cardinality(p_timer_ids) > 0 THEN
        DELETE FROM timers AS t USING unnest(p_timer_ids, p_timer_dues) AS u(id, due)
        WHERE t.ekey = p_key AND u.due IS NULL AND t.tkey = fleet_key(u.id);
        INSERT INTO timers (ekey, tkey, execution_id, timer_id, due_at)
        SELECT p_key, fleet_key(u.id), p_id, u.id, u.due
        FROM unnest(p_timer_ids, p_timer_dues) AS u(id, due) WHERE u.due IS NOT NULL
        ON CONFLICT (ekey, tkey) DO UPDATE SET due_at = EXCLUDED.due_at;
    END IF;
"""

# The plain append. code: 0 appended, 1 stale fence (detail: current token),
# 2 slot taken (detail: head), 3 gap (detail: head, NULL for no log).
# p_fence NULL is an unfenced write; it still takes the row, so a delete or a
# conditional append of the same execution is ordered against it. The lock
# loop is fleet_lock_fence's, inlined.
_V1_APPEND = """
CREATE FUNCTION fleet_append(p_key bytea, p_id text, p_fence bigint, p_first bigint,
    p_types text[], p_ts bigint[], p_bodies text[], p_status text, p_waiting text,
    p_flow text, p_tenant text, p_owner text, p_anchor text, p_clear boolean,
    p_timer_ids text[], p_timer_dues bigint[], OUT code integer, OUT detail bigint)
LANGUAGE plpgsql AS $$
DECLARE
    held bigint;
    created boolean := false;
    h bigint;
    n integer;
BEGIN
""" + READ_COMMITTED + """
    LOOP
        SELECT f.token INTO held FROM fences AS f WHERE f.ekey = p_key FOR UPDATE;
        EXIT WHEN FOUND OR (p_fence IS NOT NULL AND p_fence <> 0);
        INSERT INTO fences (ekey, token) VALUES (p_key, 0) ON CONFLICT (ekey) DO NOTHING;
        created := FOUND;
    END LOOP;
    IF p_fence IS NOT NULL AND p_fence <> coalesce(held, 0) THEN
        code := 1;
        detail := coalesce(held, 0);
        RETURN;
    END IF;
    SELECT e.head INTO h FROM executions AS e WHERE e.ekey = p_key;
    IF p_first <> coalesce(h + 1, 0) THEN
        IF created THEN
            DELETE FROM fences WHERE ekey = p_key AND token = 0;
        END IF;
        code := CASE WHEN p_first < coalesce(h + 1, 0) THEN 2 ELSE 3 END;
        detail := h;
        RETURN;
    END IF;
""" + _PLACE + """
    code := 0;
END $$;
"""

# Group commit: many appends (of many executions) in one statement, so one
# transaction and one WAL flush, judged set-wise: a handful of statements per
# flush, not per append. Items arrive sorted by key and the fence rows are locked
# in that order, so two flushes never deadlock. Each item is judged under its own
# fence lock before anything of it is written (codes as fleet_append), so a
# refused item writes nothing and its neighbours go on. Items of one execution
# carry rounds 1, 2, ...: round r is judged after round r - 1 was written.
_V1_APPEND_MANY = """
CREATE FUNCTION fleet_append_many(p_keys bytea[], p_ids text[], p_fences bigint[],
    p_firsts bigint[], p_heads bigint[], p_started bigint[], p_updated bigint[],
    p_statuses text[], p_waitings text[], p_flows text[], p_tenants text[], p_owners text[],
    p_anchors text[], p_clears boolean[], p_rounds integer[], p_event_items integer[],
    p_seqs bigint[], p_types text[], p_ts bigint[], p_bodies text[], p_timer_items integer[],
    p_timer_ids text[], p_timer_dues bigint[], OUT codes integer[], OUT details bigint[])
LANGUAGE plpgsql AS $$
DECLARE
    n integer := coalesce(cardinality(p_keys), 0);
    rounds integer;
    keys bytea[];
    created bytea[];
    missing bigint;
    ri bigint[];
    rc integer[];
    rdet bigint[];
BEGIN
""" + READ_COMMITTED + """
    codes := array_fill(NULL::integer, ARRAY[n]);
    details := array_fill(NULL::bigint, ARRAY[n]);
    SELECT coalesce(max(x), 0) INTO rounds FROM unnest(p_rounds) AS x;
    FOR r IN 1 .. rounds LOOP
        SELECT array_agg(u.k ORDER BY u.k) INTO keys
        FROM unnest(p_keys, p_rounds) AS u(k, rd) WHERE u.rd = r;
        created := '{}';
        LOOP  -- a token-0 row deleted under us (see fleet_lock_fence) is made again
            WITH made AS (
                INSERT INTO fences (ekey, token)
                SELECT u.k, 0 FROM unnest(p_keys, p_fences, p_rounds) AS u(k, f, rd)
                WHERE u.rd = r AND (u.f IS NULL OR u.f = 0) ORDER BY u.k
                ON CONFLICT (ekey) DO NOTHING RETURNING ekey)
            SELECT created || coalesce(array_agg(made.ekey), '{}') INTO created FROM made;
            PERFORM 1 FROM fences AS f WHERE f.ekey = ANY (keys) ORDER BY f.ekey FOR UPDATE;
            SELECT count(*) INTO missing FROM unnest(p_keys, p_fences, p_rounds) AS u(k, f, rd)
            WHERE u.rd = r AND (u.f IS NULL OR u.f = 0)
              AND NOT EXISTS (SELECT 1 FROM fences AS f WHERE f.ekey = u.k);
            EXIT WHEN missing = 0;
        END LOOP;
        -- Judged after the locks, in a fresh statement: a fresh snapshot.
        SELECT array_agg(jd.i), array_agg(jd.code), array_agg(jd.detail) INTO ri, rc, rdet
        FROM (SELECT u.i,
                     CASE WHEN u.f IS NOT NULL AND u.f <> coalesce(fe.token, 0) THEN 1
                          WHEN u.first < coalesce(x.head + 1, 0) THEN 2
                          WHEN u.first > coalesce(x.head + 1, 0) THEN 3
                          ELSE 0 END AS code,
                     CASE WHEN u.f IS NOT NULL AND u.f <> coalesce(fe.token, 0)
                          THEN coalesce(fe.token, 0) ELSE x.head END AS detail
              FROM unnest(p_keys, p_fences, p_firsts, p_rounds)
                   WITH ORDINALITY AS u(k, f, first, rd, i)
              LEFT JOIN fences AS fe ON fe.ekey = u.k
              LEFT JOIN executions AS x ON x.ekey = u.k
              WHERE u.rd = r) AS jd;
        FOR j IN 1 .. coalesce(cardinality(ri), 0) LOOP
            codes[ri[j]] := rc[j];
            details[ri[j]] := rdet[j];
        END LOOP;
        INSERT INTO events (ekey, sequence, type, timestamp, body)
        SELECT p_keys[e.item], e.seq, e.t, e.ts, e.b
        FROM unnest(p_event_items, p_seqs, p_types, p_ts, p_bodies) AS e(item, seq, t, ts, b)
        WHERE p_rounds[e.item] = r AND codes[e.item] = 0;
        INSERT INTO executions (ekey, execution_id, flow_id, tenant, owner, status,
                                waiting_on, started_at, updated_at, head, anchor)
        SELECT u.k, u.id, u.flow, u.tenant, u.owner, u.status, u.waiting, u.started,
               u.updated, u.head, u.anchor
        FROM unnest(p_keys, p_ids, p_flows, p_tenants, p_owners, p_statuses, p_waitings,
                    p_started, p_updated, p_heads, p_anchors, p_firsts, p_rounds)
             WITH ORDINALITY AS u(k, id, flow, tenant, owner, status, waiting, started,
                                  updated, head, anchor, first, rd, i)
        WHERE u.rd = r AND u.first = 0 AND codes[u.i] = 0;
        UPDATE executions AS x
        SET head = u.head, updated_at = u.updated, status = coalesce(u.status, x.status),
            waiting_on = CASE WHEN u.status IS NULL THEN x.waiting_on ELSE u.waiting END
        FROM unnest(p_keys, p_statuses, p_waitings, p_updated, p_heads, p_firsts, p_rounds)
             WITH ORDINALITY AS u(k, status, waiting, updated, head, first, rd, i)
        WHERE x.ekey = u.k AND u.rd = r AND u.first > 0 AND codes[u.i] = 0;
        IF true = ANY (p_clears) THEN
            DELETE FROM timers AS t
            USING unnest(p_keys, p_clears, p_rounds) WITH ORDINALITY AS u(k, c, rd, i)
            WHERE t.ekey = u.k AND u.c AND u.rd = r AND codes[u.i] = 0;
        END IF;
        IF cardinality(p_timer_items) > 0 THEN
            DELETE FROM timers AS t
            USING unnest(p_timer_items, p_timer_ids, p_timer_dues) AS m(item, id, due)
            WHERE m.due IS NULL AND p_rounds[m.item] = r AND codes[m.item] = 0
              AND t.ekey = p_keys[m.item] AND t.tkey = fleet_key(m.id);
            INSERT INTO timers (ekey, tkey, execution_id, timer_id, due_at)
            SELECT p_keys[m.item], fleet_key(m.id), p_ids[m.item], m.id, m.due
            FROM unnest(p_timer_items, p_timer_ids, p_timer_dues) AS m(item, id, due)
            WHERE m.due IS NOT NULL AND p_rounds[m.item] = r AND codes[m.item] = 0
            ON CONFLICT (ekey, tkey) DO UPDATE SET due_at = EXCLUDED.due_at;
        END IF;
        IF cardinality(created) > 0 THEN  -- a refused item leaves no token-0 row it made
            DELETE FROM fences AS f
            USING unnest(p_keys, p_rounds) WITH ORDINALITY AS u(k, rd, i)
            WHERE f.ekey = u.k AND u.rd = r AND codes[u.i] <> 0 AND f.token = 0
              AND f.ekey = ANY (created);
        END IF;
    END LOOP;
END $$;
"""

# ADR 0116 Q1. Returns the reason (NULL = appended) and the tip it judged.
_V1_APPEND_IF = """
CREATE FUNCTION fleet_append_if(p_key bytea, p_expect_head bigint, p_expect_fence bigint,
    p_expect_anchor text, p_id text, p_first bigint, p_types text[], p_ts bigint[],
    p_bodies text[], p_status text, p_waiting text, p_flow text, p_tenant text,
    p_owner text, p_anchor text, p_clear boolean, p_timer_ids text[], p_timer_dues bigint[],
    OUT o_reason text, OUT o_head bigint, OUT o_token bigint, OUT o_anchor text,
    OUT o_holder text, OUT o_lease bigint)
LANGUAGE plpgsql AS $$
DECLARE
    f record;
    n integer;
BEGIN
""" + READ_COMMITTED + """
    SELECT * INTO f FROM fleet_lock_fence(p_key, false);
    IF f.o_token IS NULL THEN
        -- No fence row: without a log there is nothing to lock and nothing is made.
        PERFORM 1 FROM executions AS e WHERE e.ekey = p_key;
        IF NOT FOUND THEN
            o_reason := 'gone';
            o_token := 0;
            RETURN;
        END IF;
        SELECT * INTO f FROM fleet_lock_fence(p_key, true);
    END IF;
    o_token := f.o_token;
    o_holder := f.o_holder;
    o_lease := f.o_lease;
    SELECT e.head, e.anchor INTO o_head, o_anchor FROM executions AS e WHERE e.ekey = p_key;
    IF o_head IS NULL THEN
        IF f.o_created THEN  -- leave no token-0 row behind; a real token stays (tombstone)
            DELETE FROM fences WHERE ekey = p_key AND token = 0;
            o_token := 0;
        END IF;
        o_reason := 'gone';
        RETURN;
    END IF;
    IF o_head IS DISTINCT FROM p_expect_head OR o_token IS DISTINCT FROM p_expect_fence
            OR o_anchor IS DISTINCT FROM p_expect_anchor OR p_first <> o_head + 1 THEN
        o_reason := 'moved';
        RETURN;
    END IF;
""" + _PLACE + """
    o_head := p_first;
END $$;
"""

_V1_FENCES = """
CREATE FUNCTION fleet_acquire(p_key bytea, p_holder text, p_expires bigint, p_now bigint)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    f record;
    t bigint;
BEGIN
""" + READ_COMMITTED + """
    SELECT * INTO f FROM fleet_lock_fence(p_key, true);
    IF p_now IS NOT NULL AND f.o_lease IS NOT NULL AND f.o_lease > p_now THEN
        RETURN NULL;  -- acquire_fence_if: a live lease is held
    END IF;
    UPDATE fences SET token = token + 1, holder = p_holder, lease_expires_at = p_expires
    WHERE ekey = p_key RETURNING token INTO t;
    RETURN t;
END $$;

CREATE FUNCTION fleet_delete(p_key bytea) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
BEGIN
""" + READ_COMMITTED + """
    PERFORM 1 FROM fences WHERE ekey = p_key FOR UPDATE;
    DELETE FROM events WHERE ekey = p_key;
    GET DIAGNOSTICS n = ROW_COUNT;
    DELETE FROM executions WHERE ekey = p_key;
    DELETE FROM timers WHERE ekey = p_key;
    DELETE FROM fences WHERE ekey = p_key AND token = 0;
    RETURN n > 0;
END $$;
"""

# Compaction (spi.compact_through): drop events 1..p_through, which a checkpoint
# now holds. The head in the index is the high-water mark and stays, so a
# dropped slot is never written again. The fence row orders it against a
# delete (and a re-created log of the same id) and every append.
_V2_COMPACT = """
CREATE FUNCTION fleet_compact(p_key bytea, p_through bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
BEGIN
""" + READ_COMMITTED + """
    PERFORM 1 FROM fences WHERE ekey = p_key FOR UPDATE;
    DELETE FROM events WHERE ekey = p_key AND sequence >= 1 AND sequence <= p_through;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;
"""

# -- version 3: the committed feed (decision 0020) ---------------------------------
#
# Every event row records the id of the transaction that inserted it (``txid``,
# 64-bit, never wraps) and a number from one sequence (``pos``), both column
# defaults: the insert statement is unchanged and nothing is added to the round
# trip. ``read_committed`` returns rows in (txid, pos) order and only those whose
# transaction is below the xmin of its own snapshot: every transaction below
# xmin has ended, and any transaction that commits later has a txid >= that
# xmin, so a reader that resumes after the last (txid, pos) it returned never
# skips a row that committed late. ``pos`` orders the rows of one transaction
# (a sequence hands out increasing numbers within one backend).
#
# One execution's later sequence must sit at a later position. A writer takes
# its txid when it first locks a row, which can be before the previous writer
# of the same execution committed; so every append compares its txid with the
# execution's ``last_txid`` (read under the fence lock it holds anyway) and,
# when it is older, writes nothing and answers code 4 (``o_reason = 'retry'``):
# the client calls again in a new transaction, whose txid is newer than any
# committed one. That race needs two writers of one execution at once; the
# common path pays one more column on a row it already reads and rewrites.
#
# The doorbell: a relay that has caught up arms ``fleet_relay_doorbell``; the
# first append that commits after that disarms it and NOTIFYs the relay's
# channel. Appends skip the NOTIFY otherwise, because a NOTIFY makes its
# transaction take a lock that serialises the commits of every notifying
# transaction of the server. The table is UNLOGGED (no WAL for the flips; a
# crash empties it, and the relay arms it again with an upsert).
_V3_FEED = """
CREATE SEQUENCE fleet_event_position CACHE 32;
ALTER TABLE events ADD COLUMN txid bigint, ADD COLUMN pos bigint;
UPDATE events AS e SET txid = pg_current_xact_id()::text::bigint, pos = o.n
FROM (SELECT s.ekey, s.sequence, row_number() OVER (ORDER BY s.mts, s.ekey, s.sequence) AS n
      FROM (SELECT ekey, sequence,
                   max(timestamp) OVER (PARTITION BY ekey ORDER BY sequence) AS mts
            FROM events) AS s) AS o
WHERE e.ekey = o.ekey AND e.sequence = o.sequence;
SELECT setval('fleet_event_position', coalesce((SELECT max(pos) FROM events), 0) + 1, false);
ALTER TABLE events
    ALTER COLUMN txid SET DEFAULT (pg_current_xact_id()::text::bigint),
    ALTER COLUMN txid SET NOT NULL,
    ALTER COLUMN pos SET DEFAULT nextval('fleet_event_position'),
    ALTER COLUMN pos SET NOT NULL;
CREATE UNIQUE INDEX events_by_position ON events (txid, pos);
ALTER TABLE executions ADD COLUMN last_txid bigint;
CREATE UNLOGGED TABLE fleet_relay_doorbell (
    id boolean PRIMARY KEY DEFAULT true CHECK (id),
    armed boolean NOT NULL DEFAULT false,
    channel text NOT NULL);
"""


_PLACE_V3 = edit(
    _PLACE,
    ("p_ts[n], p_first + n - 1, p_anchor);",
     f"p_ts[n], p_first + n - 1, p_anchor, {CURRENT_TXID});"),
    ("waiting_on, started_at, updated_at, head, anchor)\n        VALUES",
     "waiting_on, started_at, updated_at, head, anchor,\n"
     "                                last_txid)\n        VALUES"),
    ("UPDATE executions SET head = p_first + n - 1, updated_at = p_ts[n]\n",
     f"UPDATE executions SET head = p_first + n - 1, updated_at = p_ts[n],\n"
     f"                              last_txid = {CURRENT_TXID}\n"),
    ("status = p_status, waiting_on = p_waiting\n",
     f"status = p_status, waiting_on = p_waiting,\n"
     f"                              last_txid = {CURRENT_TXID}\n"),
) + RING

_V3_APPEND = edit(
    _V1_APPEND,
    ("CREATE FUNCTION fleet_append(", "CREATE OR REPLACE FUNCTION fleet_append("),
    ("    n integer;\nBEGIN", "    n integer;\n    lx bigint;\n    bell text;\nBEGIN"),
    ("SELECT e.head INTO h FROM executions AS e WHERE e.ekey = p_key;",
     "SELECT e.head, e.last_txid INTO h, lx FROM executions AS e WHERE e.ekey = p_key;"),
    ("        detail := h;\n        RETURN;\n    END IF;\n",
     "        detail := h;\n        RETURN;\n    END IF;\n"
     f"    IF lx > {CURRENT_TXID} THEN  -- the log's last writer is newer: retry\n"
     "        code := 4;\n        detail := h;\n        RETURN;\n    END IF;\n"),
    (_PLACE, _PLACE_V3),
)

_V3_APPEND_IF = edit(
    _V1_APPEND_IF,
    ("CREATE FUNCTION fleet_append_if(", "CREATE OR REPLACE FUNCTION fleet_append_if("),
    ("    n integer;\nBEGIN", "    n integer;\n    lx bigint;\n    bell text;\nBEGIN"),
    ("SELECT e.head, e.anchor INTO o_head, o_anchor FROM executions AS e WHERE e.ekey = p_key;",
     "SELECT e.head, e.anchor, e.last_txid INTO o_head, o_anchor, lx\n"
     "    FROM executions AS e WHERE e.ekey = p_key;"),
    ("        o_reason := 'moved';\n        RETURN;\n    END IF;\n",
     "        o_reason := 'moved';\n        RETURN;\n    END IF;\n"
     f"    IF lx > {CURRENT_TXID} THEN  -- the log's last writer is newer: retry\n"
     "        o_reason := 'retry';\n        RETURN;\n    END IF;\n"),
    (_PLACE, _PLACE_V3),
)

_V3_APPEND_MANY = edit(
    _V1_APPEND_MANY,
    ("CREATE FUNCTION fleet_append_many(", "CREATE OR REPLACE FUNCTION fleet_append_many("),
    ("    rdet bigint[];\nBEGIN", "    rdet bigint[];\n    bell text;\nBEGIN"),
    ("                          WHEN u.first > coalesce(x.head + 1, 0) THEN 3\n",
     "                          WHEN u.first > coalesce(x.head + 1, 0) THEN 3\n"
     f"                          WHEN x.last_txid > {CURRENT_TXID} THEN 4\n"),
    ("                                waiting_on, started_at, updated_at, head, anchor)\n"
     "        SELECT u.k, u.id, u.flow, u.tenant, u.owner, u.status, u.waiting, u.started,\n"
     "               u.updated, u.head, u.anchor\n",
     "                                waiting_on, started_at, updated_at, head, anchor,\n"
     "                                last_txid)\n"
     "        SELECT u.k, u.id, u.flow, u.tenant, u.owner, u.status, u.waiting, u.started,\n"
     f"               u.updated, u.head, u.anchor, {CURRENT_TXID}\n"),
    ("            waiting_on = CASE WHEN u.status IS NULL THEN x.waiting_on ELSE u.waiting END\n",
     "            waiting_on = CASE WHEN u.status IS NULL THEN x.waiting_on ELSE u.waiting END,\n"
     f"            last_txid = {CURRENT_TXID}\n"),
    ("    END LOOP;\nEND $$;", "    END LOOP;\n    IF 0 = ANY (codes) THEN" + RING
     + "    END IF;\nEND $$;"),
)

# Leased writes (decision 0029): an append that takes the fence when it is free
# (p_holder set: acquire_fence_if's rule, then the append under the new token) and
# one that ends the lease it wrote under (p_release), each one statement. Every
# check of the append is made before the token moves, so a refused append leaves
# the fence as it was; then fleet_append (whose checks now pass: this call holds
# the row) writes. code 5: a live lease is held (detail: its token); on success
# with p_holder, detail is the new token.
_V4_APPEND_LEASED = """
CREATE FUNCTION fleet_append_leased(p_key bytea, p_id text, p_fence bigint, p_holder text,
    p_expires bigint, p_now bigint, p_release boolean, p_first bigint,
    p_types text[], p_ts bigint[], p_bodies text[], p_status text, p_waiting text,
    p_flow text, p_tenant text, p_owner text, p_anchor text, p_clear boolean,
    p_timer_ids text[], p_timer_dues bigint[], OUT code integer, OUT detail bigint)
LANGUAGE plpgsql AS $$
DECLARE
    f record;
    h bigint;
    lx bigint;
    t bigint := p_fence;
BEGIN
""" + READ_COMMITTED + """
    IF p_holder IS NOT NULL THEN
        SELECT * INTO f FROM fleet_lock_fence(p_key, true);
        IF f.o_lease IS NOT NULL AND f.o_lease > p_now THEN
            code := 5;
            detail := f.o_token;
            RETURN;
        END IF;
        SELECT e.head, e.last_txid INTO h, lx FROM executions AS e WHERE e.ekey = p_key;
        IF p_first <> coalesce(h + 1, 0) OR lx > """ + CURRENT_TXID + """ THEN
            IF f.o_created THEN
                DELETE FROM fences WHERE ekey = p_key AND token = 0;
            END IF;
            code := CASE WHEN p_first < coalesce(h + 1, 0) THEN 2
                         WHEN p_first > coalesce(h + 1, 0) THEN 3 ELSE 4 END;
            detail := h;
            RETURN;
        END IF;
        UPDATE fences SET token = token + 1, holder = p_holder, lease_expires_at = p_expires
        WHERE ekey = p_key RETURNING token INTO t;
    END IF;
    SELECT a.code, a.detail INTO code, detail
    FROM fleet_append(p_key, p_id, t, p_first, p_types, p_ts, p_bodies, p_status, p_waiting,
                      p_flow, p_tenant, p_owner, p_anchor, p_clear, p_timer_ids,
                      p_timer_dues) AS a;
    IF code <> 0 THEN
        IF p_holder IS NOT NULL THEN
            RAISE EXCEPTION 'fleet_append_leased: the append was refused after its checks '
                            '(code %)', code;
        END IF;
        RETURN;
    END IF;
    IF p_holder IS NOT NULL THEN
        detail := t;
    END IF;
    IF p_release AND t > 0 THEN
        UPDATE fences SET lease_expires_at = NULL, holder = NULL
        WHERE ekey = p_key AND token = t;
    END IF;
END $$;
"""

# Leased writes in group commit (decision 0029): fleet_append_many whose items may
# also take the fence (p_holders[i] set, with p_fences[i] NULL: acquire_fence_if's
# rule, code 5 = a live lease is held, detail its token; on success detail is the new
# token) or end the lease they wrote under (p_releases[i]), as fleet_append_leased
# judges one. Everything else is fleet_append_many's, so each item is still judged
# alone under its fence lock, fence rows are still locked in key order, and a refused
# item writes nothing and moves no token: the token of an acquiring item moves only
# once it is judged (code 0), and the token-0 row it made is removed if it is refused.
# fleet_append_many stays as it was (a flush with no leased item still calls it, and
# a process of the previous version keeps calling it during a rolling upgrade).
_V5_APPEND_MANY_LEASED = edit(
    _V3_APPEND_MANY,
    ("CREATE OR REPLACE FUNCTION fleet_append_many(",
     "CREATE FUNCTION fleet_append_many_leased("),
    ("    p_timer_ids text[], p_timer_dues bigint[], OUT codes integer[], OUT details bigint[])",
     "    p_timer_ids text[], p_timer_dues bigint[], p_holders text[], p_expires bigint[],\n"
     "    p_releases boolean[], p_now bigint, OUT codes integer[], OUT details bigint[])"),
    ("    bell text;\nBEGIN",
     "    bell text;\n"
     "    acquires boolean := cardinality(array_remove(p_holders, NULL)) > 0;\n"
     "    releases boolean := true = ANY (p_releases);\nBEGIN"),
    ("                     CASE WHEN u.f IS NOT NULL AND u.f <> coalesce(fe.token, 0) THEN 1\n",
     "                     CASE WHEN u.h IS NOT NULL AND fe.lease_expires_at > p_now THEN 5\n"
     "                          WHEN u.f IS NOT NULL AND u.f <> coalesce(fe.token, 0) THEN 1\n"),
    ("                     CASE WHEN u.f IS NOT NULL AND u.f <> coalesce(fe.token, 0)\n"
     "                          THEN coalesce(fe.token, 0) ELSE x.head END AS detail\n"
     "              FROM unnest(p_keys, p_fences, p_firsts, p_rounds)\n"
     "                   WITH ORDINALITY AS u(k, f, first, rd, i)\n",
     "                     CASE WHEN u.h IS NOT NULL AND fe.lease_expires_at > p_now\n"
     "                          THEN fe.token\n"
     "                          WHEN u.f IS NOT NULL AND u.f <> coalesce(fe.token, 0)\n"
     "                          THEN coalesce(fe.token, 0) ELSE x.head END AS detail\n"
     "              FROM unnest(p_keys, p_fences, p_firsts, p_rounds, p_holders)\n"
     "                   WITH ORDINALITY AS u(k, f, first, rd, h, i)\n"),
    ("            details[ri[j]] := rdet[j];\n        END LOOP;\n",
     "            details[ri[j]] := rdet[j];\n        END LOOP;\n"
     "        IF acquires THEN  -- an acquiring item judged free takes the next token\n"
     "            WITH g AS (\n"
     "                UPDATE fences AS f SET token = f.token + 1, holder = u.h,\n"
     "                                       lease_expires_at = u.x\n"
     "                FROM unnest(p_keys, p_holders, p_expires, p_rounds)\n"
     "                     WITH ORDINALITY AS u(k, h, x, rd, i)\n"
     "                WHERE f.ekey = u.k AND u.rd = r AND u.h IS NOT NULL AND codes[u.i] = 0\n"
     "                RETURNING u.i, f.token)\n"
     "            SELECT array_agg(g.i), array_agg(g.token) INTO ri, rdet FROM g;\n"
     "            FOR j IN 1 .. coalesce(cardinality(ri), 0) LOOP\n"
     "                details[ri[j]] := rdet[j];\n"
     "            END LOOP;\n"
     "        END IF;\n"),
    ("        IF cardinality(created) > 0 THEN",
     "        IF releases THEN  -- written, and its lease ends (the token stays)\n"
     "            UPDATE fences AS f SET lease_expires_at = NULL, holder = NULL\n"
     "            FROM unnest(p_keys, p_releases, p_rounds) WITH ORDINALITY AS u(k, rel, rd, i)\n"
     "            WHERE f.ekey = u.k AND u.rd = r AND u.rel AND codes[u.i] = 0\n"
     "              AND f.token > 0;\n"
     "        END IF;\n"
     "        IF cardinality(created) > 0 THEN"),
)

MIGRATIONS: tuple[tuple[int, str], ...] = (
    (1, _V1_TABLES + _V1_LOCK + _V1_APPEND + _V1_APPEND_MANY + _V1_APPEND_IF
     + _V1_FENCES),
    (2, _V2_COMPACT),
    (3, _V3_FEED + _V3_APPEND + _V3_APPEND_IF + _V3_APPEND_MANY),
    (4, _V4_APPEND_LEASED),
    (5, _V5_APPEND_MANY_LEASED),
    (6, MIGRATION_6),
    (7, migration_7(_V4_APPEND_LEASED)),
    (8, MIGRATION_8),
    (9, MIGRATION_BACKLOG),  # the backlog (decision 0046)
    (10, MIGRATION_QUEUES),  # queues and debounce pointers (decision 0056)
)

#: Per migration, the oldest code that runs against it (decision 0049). 5 and 6 only
#: add or rewrite functions that version 4 and 5 code keep calling (their comments
#: say so); 7 adds functions beside those 6 calls, 8 one function, 9 three that read
#: (the backlog), 10 tables and a function only queues use. The older ones are their
#: own: never proved otherwise.
OLDEST_CODE: dict[int, int] = {1: 1, 2: 2, 3: 3, 4: 4, 5: 4, 6: 5, 7: 6, 8: OLDEST_CODE_8,
                               9: 6, 10: 6}

SCHEMA_VERSION = MIGRATIONS[-1][0]
