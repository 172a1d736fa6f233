"""Postgres schema version 6: less server work per group-commit flush (issue 16).

Split from ``pg_migrations`` (which lists it as migration 6) to keep modules small.
"""

from __future__ import annotations

from fleet.kernel.store.pg_sql import CURRENT_TXID, READ_COMMITTED, RING, edit

__all__ = ["APPEND_MANY_LEASED_V6", "MIGRATION_6"]

# -- version 6: less server work per group-commit flush (issue 16) -------------------
#
# The same two functions, same arguments, same answers, fewer and cheaper
# statements per round (a process of version 5 keeps calling them during a rolling
# upgrade):
# - the keys of the round and those that need a fence row are gathered by one
#   statement; the insert of missing fence rows runs only when some item needs one
#   (an item carrying a token never makes a row), and the "is every needed row
#   locked" check is made on the rows the lock statement returned (an array
#   containment, no query), not by a third statement;
# - the judge writes ``codes``/``details`` whole in one statement (an item of another
#   round keeps its answer), not through a plpgsql loop over per-round arrays, and the
#   item-aligned writes filter on ``codes`` unnested beside the other columns;
# - the events and executions rows of a round are written by one statement (the
#   inserts as data-modifying CTEs: they touch disjoint rows), the events' ``txid``
#   given once from a variable instead of a per-row default (``pos`` stays the
#   sequence default: one number per row, in order). The txid is taken after the
#   fence rows are locked (a lock has assigned it by then), so a flush that locks
#   nothing still assigns no transaction id, as before;
# - every append function plans its statements once per connection
#   (``plan_cache_mode = force_generic_plan``, PostgreSQL 12+): the arguments are
#   arrays whose sizes the planner cannot see in a custom plan either, and every
#   lookup is by primary key, so the generic plan is the custom one without a
#   planning pass per statement per call.
_V6_JUDGE_CODE = """
                     CASE WHEN u.f IS NOT NULL AND u.f <> coalesce(fe.token, 0) THEN 1
                          WHEN u.first < coalesce(x.head + 1, 0) THEN 2
                          WHEN u.first > coalesce(x.head + 1, 0) THEN 3
                          WHEN tx IS NULL OR x.last_txid > tx THEN 4
                          ELSE 0 END"""
_V6_JUDGE_DETAIL = """
                     CASE WHEN u.f IS NOT NULL AND u.f <> coalesce(fe.token, 0)
                          THEN coalesce(fe.token, 0) ELSE x.head END"""

_V6_APPEND_MANY = """
CREATE OR REPLACE FUNCTION fleet_append_many(p_keys bytea[], p_ids text[], p_fences bigint[],
    p_firsts bigint[], p_heads bigint[], p_started bigint[], p_updated bigint[],
    p_statuses text[], p_waitings text[], p_flows text[], p_tenants text[], p_owners text[],
    p_anchors text[], p_clears boolean[], p_rounds integer[], p_event_items integer[],
    p_seqs bigint[], p_types text[], p_ts bigint[], p_bodies text[], p_timer_items integer[],
    p_timer_ids text[], p_timer_dues bigint[], OUT codes integer[], OUT details bigint[])
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    n integer := coalesce(cardinality(p_keys), 0);
    rounds integer;
    keys bytea[];
    need bytea[];
    locked bytea[];
    created bytea[];
    tx bigint;
    bell text;
BEGIN
""" + READ_COMMITTED + """
    codes := array_fill(NULL::integer, ARRAY[n]);
    details := array_fill(NULL::bigint, ARRAY[n]);
    SELECT coalesce(max(x), 0) INTO rounds FROM unnest(p_rounds) AS x;
    FOR r IN 1 .. rounds LOOP
        SELECT array_agg(u.k ORDER BY u.k),
               array_agg(u.k ORDER BY u.k) FILTER (WHERE u.f IS NULL OR u.f = 0)
        INTO keys, need
        FROM unnest(p_keys, p_fences, p_rounds) AS u(k, f, rd) WHERE u.rd = r;
        created := '{}';
        LOOP  -- a token-0 row deleted under us (see fleet_lock_fence) is made again
            IF need IS NOT NULL THEN
                WITH made AS (
                    INSERT INTO fences (ekey, token)
                    SELECT k, 0 FROM unnest(need) AS k ORDER BY k
                    ON CONFLICT (ekey) DO NOTHING RETURNING ekey)
                SELECT created || coalesce(array_agg(made.ekey), '{}') INTO created FROM made;
            END IF;
            SELECT array_agg(l.ekey) INTO locked
            FROM (SELECT f.ekey FROM fences AS f WHERE f.ekey = ANY (keys)
                  ORDER BY f.ekey FOR UPDATE) AS l;
            EXIT WHEN need IS NULL OR need <@ locked;
        END LOOP;
        IF tx IS NULL AND locked IS NOT NULL THEN  -- the lock assigned it: no new id
            tx := """ + CURRENT_TXID + """;
        END IF;
        -- Judged after the locks, in a fresh statement: a fresh snapshot. No row
        -- locked means every item of the round is refused (stale: code 1) before
        -- tx is needed; the tx IS NULL arm only makes that explicit.
        SELECT array_agg(CASE WHEN u.rd = r THEN""" + _V6_JUDGE_CODE + """
                         ELSE u.c END ORDER BY u.i),
               array_agg(CASE WHEN u.rd = r THEN""" + _V6_JUDGE_DETAIL + """
                         ELSE u.d END ORDER BY u.i)
        INTO codes, details
        FROM unnest(p_keys, p_fences, p_firsts, p_rounds, codes, details)
             WITH ORDINALITY AS u(k, f, first, rd, c, d, i)
        LEFT JOIN LATERAL (SELECT f.token, f.lease_expires_at FROM fences AS f
                           WHERE f.ekey = u.k AND u.rd = r LIMIT 1) AS fe ON true
        LEFT JOIN LATERAL (SELECT e.head, e.last_txid FROM executions AS e
                           WHERE e.ekey = u.k AND u.rd = r LIMIT 1) AS x ON true;
        WITH ev AS (
            INSERT INTO events (ekey, sequence, type, timestamp, body, txid)
            SELECT p_keys[e.item], e.seq, e.t, e.ts, e.b, tx
            FROM unnest(p_event_items, p_seqs, p_types, p_ts, p_bodies)
                 AS e(item, seq, t, ts, b)
            WHERE p_rounds[e.item] = r AND codes[e.item] = 0),
        made AS (
            INSERT INTO executions (ekey, execution_id, flow_id, tenant, owner, status,
                                    waiting_on, started_at, updated_at, head, anchor,
                                    last_txid)
            SELECT u.k, u.id, u.flow, u.tenant, u.owner, u.status, u.waiting, u.started,
                   u.updated, u.head, u.anchor, tx
            FROM unnest(p_keys, p_ids, p_flows, p_tenants, p_owners, p_statuses,
                        p_waitings, p_started, p_updated, p_heads, p_anchors, p_firsts,
                        p_rounds, codes)
                 AS u(k, id, flow, tenant, owner, status, waiting, started, updated, head,
                      anchor, first, rd, c)
            WHERE u.rd = r AND u.first = 0 AND u.c = 0)
        UPDATE executions AS x
        SET head = u.head, updated_at = u.updated, status = coalesce(u.status, x.status),
            waiting_on = CASE WHEN u.status IS NULL THEN x.waiting_on ELSE u.waiting END,
            last_txid = tx
        FROM unnest(p_keys, p_statuses, p_waitings, p_updated, p_heads, p_firsts, p_rounds,
                    codes) AS u(k, status, waiting, updated, head, first, rd, c)
        WHERE x.ekey = u.k AND u.rd = r AND u.first > 0 AND u.c = 0;
        IF true = ANY (p_clears) THEN
            DELETE FROM timers AS t
            USING unnest(p_keys, p_clears, p_rounds, codes) AS u(k, cl, rd, c)
            WHERE t.ekey = u.k AND u.cl AND u.rd = r AND u.c = 0;
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
            USING unnest(p_keys, p_rounds, codes) AS u(k, rd, c)
            WHERE f.ekey = u.k AND u.rd = r AND u.c <> 0 AND f.token = 0
              AND f.ekey = ANY (created);
        END IF;
    END LOOP;
    IF 0 = ANY (codes) THEN""" + RING + """    END IF;
END $$;
"""

# The leased flavour, from the plain one as version 5 made it from version 3's.
_V6_APPEND_MANY_LEASED = edit(
    _V6_APPEND_MANY,
    ("CREATE OR REPLACE FUNCTION fleet_append_many(",
     "CREATE OR REPLACE FUNCTION fleet_append_many_leased("),
    ("    p_timer_ids text[], p_timer_dues bigint[], OUT codes integer[], OUT details bigint[])",
     "    p_timer_ids text[], p_timer_dues bigint[], p_holders text[], p_expires bigint[],\n"
     "    p_releases boolean[], p_now bigint, OUT codes integer[], OUT details bigint[])"),
    ("    bell text;\nBEGIN",
     "    bell text;\n"
     "    ri bigint[];\n"
     "    rdet bigint[];\n"
     "    acquires boolean := cardinality(array_remove(p_holders, NULL)) > 0;\n"
     "    releases boolean := true = ANY (p_releases);\nBEGIN"),
    ("                     CASE WHEN u.f IS NOT NULL AND u.f <> coalesce(fe.token, 0) THEN 1\n",
     "                     CASE WHEN u.h IS NOT NULL AND fe.lease_expires_at > p_now THEN 5\n"
     "                          WHEN u.f IS NOT NULL AND u.f <> coalesce(fe.token, 0) THEN 1\n"),
    ("                     CASE WHEN u.f IS NOT NULL AND u.f <> coalesce(fe.token, 0)\n"
     "                          THEN coalesce(fe.token, 0) ELSE x.head END\n",
     "                     CASE WHEN u.h IS NOT NULL AND fe.lease_expires_at > p_now\n"
     "                          THEN fe.token\n"
     "                          WHEN u.f IS NOT NULL AND u.f <> coalesce(fe.token, 0)\n"
     "                          THEN coalesce(fe.token, 0) ELSE x.head END\n"),
    ("        FROM unnest(p_keys, p_fences, p_firsts, p_rounds, codes, details)\n"
     "             WITH ORDINALITY AS u(k, f, first, rd, c, d, i)\n",
     "        FROM unnest(p_keys, p_fences, p_firsts, p_rounds, codes, details, p_holders)\n"
     "             WITH ORDINALITY AS u(k, f, first, rd, c, d, h, i)\n"),
    ("                           WHERE e.ekey = u.k AND u.rd = r LIMIT 1) AS x ON true;\n",
     "                           WHERE e.ekey = u.k AND u.rd = r LIMIT 1) AS x ON true;\n"
     "        IF acquires THEN  -- an acquiring item judged free takes the next token\n"
     "            WITH g AS (\n"
     "                UPDATE fences AS f SET token = f.token + 1, holder = u.h,\n"
     "                                       lease_expires_at = u.x\n"
     "                FROM unnest(p_keys, p_holders, p_expires, p_rounds, codes)\n"
     "                     WITH ORDINALITY AS u(k, h, x, rd, c, i)\n"
     "                WHERE f.ekey = u.k AND u.rd = r AND u.h IS NOT NULL AND u.c = 0\n"
     "                RETURNING u.i, f.token)\n"
     "            SELECT array_agg(g.i), array_agg(g.token) INTO ri, rdet FROM g;\n"
     "            FOR j IN 1 .. coalesce(cardinality(ri), 0) LOOP\n"
     "                details[ri[j]] := rdet[j];\n"
     "            END LOOP;\n"
     "        END IF;\n"),
    ("        IF cardinality(created) > 0 THEN",
     "        IF releases THEN  -- written, and its lease ends (the token stays)\n"
     "            UPDATE fences AS f SET lease_expires_at = NULL, holder = NULL\n"
     "            FROM unnest(p_keys, p_releases, p_rounds, codes) AS u(k, rel, rd, c)\n"
     "            WHERE f.ekey = u.k AND u.rd = r AND u.rel AND u.c = 0 AND f.token > 0;\n"
     "        END IF;\n"
     "        IF cardinality(created) > 0 THEN"),
)

# The single-request functions keep their text; they plan once per connection too.
_V6_GENERIC_PLANS = """
ALTER FUNCTION fleet_append(bytea, text, bigint, bigint, text[], bigint[], text[], text, text,
    text, text, text, text, boolean, text[], bigint[]) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION fleet_append_if(bytea, bigint, bigint, text, text, bigint, text[], bigint[],
    text[], text, text, text, text, text, text, boolean, text[], bigint[])
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION fleet_append_leased(bytea, text, bigint, text, bigint, bigint, boolean, bigint,
    text[], bigint[], text[], text, text, text, text, text, text, boolean, text[], bigint[])
    SET plan_cache_mode = force_generic_plan;
"""

MIGRATION_6 = _V6_APPEND_MANY + _V6_APPEND_MANY_LEASED + _V6_GENERIC_PLANS
# Version 7 makes fleet_append_many_leased_v7 from it (pg_migration_v7).
APPEND_MANY_LEASED_V6 = _V6_APPEND_MANY_LEASED
