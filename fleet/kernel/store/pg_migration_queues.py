"""Postgres schema version 10: queues and debounce pointers (decisions 0056, 0057).

Split from ``pg_migrations`` (which lists it) to keep modules small. Never edit
once released: a change is the next migration.

``fleet_queue_pass`` is one admission pass of one queue in one round trip: it
locks the queue's row (``FOR UPDATE``: passes of a queue are serialised across the
fleet, and each statement after the lock reads a fresh READ COMMITTED snapshot,
so it sees every admission and every ended run committed before it), enters the
entry it was given, counts the running entries (admitted, the execution not
ended; an entry with no log for ``p_grace`` ms), takes the rate window's last
admissions, admits the first eligible waiting entries in ``(priority, seq)`` order
(per key, only as many as the key has room for: a window rank over the keys not
full), each at the slot ``spi_queues.plan_admissions`` gives. A pass without an
entry that sweeps (the timer service's) then lists the admitted entries whose wake
is not in the log and prunes the entries of ended runs once they left the rate
window; a start's pass and a run's end's leave both to it, and stay short. A key is ``''`` when
none was given.
Its rows: ``('limits', NULL, NULL, <the row's limits before>)`` when they differ,
``('admitted', id, at, NULL)``, ``('rewake', id, at, NULL)``, and ``('entry', id,
at, 'entered' | 'existed')`` for the entry passed.
"""

from __future__ import annotations

from fleet.kernel.store.pg_sql import READ_COMMITTED

__all__ = ["MIGRATION_QUEUES"]

_ENDED = "('cancelled', 'completed', 'continued', 'failed')"
_LIVE = (f"(e.status NOT IN {_ENDED} OR (e.ekey IS NULL AND q.entered_at > p_now - p_grace))")
_WAITING = ("q.queue = p_queue AND q.admitted_at IS NULL AND q.eligible_at <= p_now "
            "AND ((e.status = 'parked' AND e.waiting_on = p_gate) "
            "OR (e.ekey IS NULL AND q.ekey = v_new))")
_GONE = (f"NOT EXISTS (SELECT 1 FROM executions AS e WHERE e.ekey = q.ekey "
         f"AND e.status NOT IN {_ENDED}) AND (q.entered_at <= p_now - p_grace OR EXISTS "
         "(SELECT 1 FROM executions AS e WHERE e.ekey = q.ekey)) "
         "AND q.ekey IS DISTINCT FROM p_ekey")

_TABLES = """
CREATE TABLE fleet_queues (
    name text COLLATE "C" PRIMARY KEY,
    limits text,
    updated_at bigint);

CREATE TABLE fleet_queue_entries (
    ekey bytea PRIMARY KEY,
    execution_id text COLLATE "C" NOT NULL,
    queue text COLLATE "C" NOT NULL,
    qkey text COLLATE "C" NOT NULL,
    priority integer NOT NULL,
    seq bigint GENERATED ALWAYS AS IDENTITY,
    entered_at bigint NOT NULL,
    eligible_at bigint NOT NULL,
    admitted_at bigint);
CREATE INDEX fleet_queue_waiting ON fleet_queue_entries (queue, priority, seq)
    WHERE admitted_at IS NULL;
CREATE INDEX fleet_queue_admitted ON fleet_queue_entries (queue, admitted_at)
    WHERE admitted_at IS NOT NULL;

CREATE TABLE fleet_debounce (
    scope text COLLATE "C" PRIMARY KEY,
    execution_id text NOT NULL,
    claimed_at bigint NOT NULL);
"""

_PASS = f"""
CREATE FUNCTION fleet_queue_pass(p_queue text, p_limits text, p_now bigint, p_conc bigint,
    p_per_key bigint, p_rate_n integer, p_rate_ms bigint, p_limit integer, p_grace bigint,
    p_rewake bigint, p_gate text, p_ekey bytea, p_id text, p_key text, p_priority integer,
    p_eligible bigint, p_sweep boolean)
RETURNS TABLE (o_kind text, o_id text, o_at bigint, o_text text)
LANGUAGE plpgsql AS $$
DECLARE
    v_before text;
    v_new bytea;
    v_running bigint;
    v_free bigint;
    v_times bigint[] := '{{}}';
    v_slot bigint;
    v_fresh bytea[] := '{{}}';
    v_cur refcursor;
    c_ekey bytea;
    c_id text;
BEGIN{READ_COMMITTED}
    -- Its commit need not wait for the disk: whatever acts on a pass (the start's log
    -- write, a wake) is a synchronous commit after it, and the WAL is flushed in order,
    -- so that flush makes the pass durable too; a pass lost in a crash before any such
    -- write was acted on by nobody (decision 0056).
    PERFORM set_config('synchronous_commit', 'off', true);
    INSERT INTO fleet_queues (name, limits, updated_at) VALUES (p_queue, p_limits, p_now)
        ON CONFLICT (name) DO NOTHING;
    SELECT fq.limits INTO v_before FROM fleet_queues AS fq WHERE fq.name = p_queue FOR UPDATE;
    IF v_before IS DISTINCT FROM p_limits THEN
        UPDATE fleet_queues SET limits = p_limits, updated_at = p_now WHERE name = p_queue;
        o_kind := 'limits'; o_id := NULL; o_at := NULL; o_text := v_before;
        RETURN NEXT;
    END IF;
    IF p_id IS NOT NULL THEN
        INSERT INTO fleet_queue_entries (ekey, execution_id, queue, qkey, priority, entered_at,
                                         eligible_at)
        VALUES (p_ekey, p_id, p_queue, p_key, p_priority, p_now, p_eligible)
        ON CONFLICT (ekey) DO NOTHING;
        IF FOUND THEN
            v_new := p_ekey;
        END IF;
    END IF;
    SELECT count(*) INTO v_running FROM fleet_queue_entries AS q
        LEFT JOIN executions AS e ON e.ekey = q.ekey
        WHERE q.queue = p_queue AND q.admitted_at IS NOT NULL AND {_LIVE};
    v_free := CASE WHEN p_conc IS NULL THEN p_limit ELSE least(p_limit, p_conc - v_running) END;
    IF p_rate_n IS NOT NULL THEN
        SELECT coalesce(array_agg(r.a ORDER BY r.a), '{{}}') INTO v_times FROM (
            SELECT q.admitted_at AS a FROM fleet_queue_entries AS q
            WHERE q.queue = p_queue AND q.admitted_at > p_now - p_rate_ms
            ORDER BY q.admitted_at DESC LIMIT p_rate_n) AS r;
    END IF;
    IF v_free > 0 THEN
        IF p_per_key IS NULL THEN
            OPEN v_cur FOR
                SELECT q.ekey, q.execution_id FROM fleet_queue_entries AS q
                LEFT JOIN executions AS e ON e.ekey = q.ekey
                WHERE {_WAITING}
                ORDER BY q.priority, q.seq LIMIT v_free;
        ELSE
            OPEN v_cur FOR
                WITH act AS (
                    SELECT q.qkey AS qkey, count(*) AS k FROM fleet_queue_entries AS q
                    LEFT JOIN executions AS e ON e.ekey = q.ekey
                    WHERE q.queue = p_queue AND q.admitted_at IS NOT NULL AND {_LIVE}
                    GROUP BY q.qkey),
                cand AS (
                    SELECT q.ekey, q.execution_id, q.qkey, q.priority, q.seq,
                           row_number() OVER (PARTITION BY q.qkey
                                              ORDER BY q.priority, q.seq) AS rn
                    FROM fleet_queue_entries AS q
                    LEFT JOIN executions AS e ON e.ekey = q.ekey
                    WHERE {_WAITING}
                      AND q.qkey NOT IN (SELECT a.qkey FROM act AS a WHERE a.k >= p_per_key))
                SELECT cand.ekey, cand.execution_id FROM cand
                LEFT JOIN act ON act.qkey = cand.qkey
                WHERE cand.rn <= p_per_key - coalesce(act.k, 0)
                ORDER BY cand.priority, cand.seq LIMIT v_free;
        END IF;
        LOOP
            FETCH v_cur INTO c_ekey, c_id;
            EXIT WHEN NOT FOUND;
            v_slot := p_now;
            IF p_rate_n IS NOT NULL THEN
                IF cardinality(v_times) >= p_rate_n THEN
                    v_slot := greatest(p_now,
                                       v_times[cardinality(v_times) - p_rate_n + 1] + p_rate_ms);
                END IF;
                EXIT WHEN v_slot > p_now + p_rate_ms;
                v_times := v_times || v_slot;
            END IF;
            UPDATE fleet_queue_entries SET admitted_at = v_slot WHERE ekey = c_ekey;
            v_fresh := v_fresh || c_ekey;
            o_kind := 'admitted'; o_id := c_id; o_at := v_slot; o_text := NULL;
            RETURN NEXT;
        END LOOP;
        CLOSE v_cur;
    END IF;
    IF p_id IS NOT NULL THEN  -- a start's pass: what it entered, and nothing more
        SELECT q.admitted_at INTO v_slot FROM fleet_queue_entries AS q WHERE q.ekey = p_ekey;
        o_kind := 'entry'; o_id := p_id; o_at := v_slot;
        o_text := CASE WHEN v_new IS NULL THEN 'existed' ELSE 'entered' END;
        RETURN NEXT;
        RETURN;
    END IF;
    IF NOT p_sweep THEN  -- a run's end: admit, and leave the sweep to the timer service
        RETURN;
    END IF;
    RETURN QUERY
        SELECT 'rewake'::text, q.execution_id::text, q.admitted_at, NULL::text
        FROM fleet_queue_entries AS q JOIN executions AS e ON e.ekey = q.ekey
        WHERE q.queue = p_queue AND q.admitted_at IS NOT NULL
          AND q.admitted_at <= p_now - p_rewake
          AND e.status = 'parked' AND e.waiting_on = p_gate
          AND NOT (q.ekey = ANY (v_fresh))
          AND NOT EXISTS (SELECT 1 FROM timers AS t WHERE t.ekey = q.ekey
                          AND t.tkey = fleet_key(p_gate))
        ORDER BY q.admitted_at, q.seq LIMIT p_limit;
    DELETE FROM fleet_queue_entries AS q
    WHERE q.queue = p_queue AND q.admitted_at IS NOT NULL
      AND q.admitted_at <= p_now - coalesce(p_rate_ms, 0) AND {_GONE};
    DELETE FROM fleet_queue_entries AS q WHERE q.ekey IN (
        SELECT q.ekey FROM fleet_queue_entries AS q
        WHERE q.queue = p_queue AND q.admitted_at IS NULL AND {_GONE} LIMIT 1000);
END $$;
"""

MIGRATION_QUEUES = _TABLES + _PASS
