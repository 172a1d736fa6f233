"""Postgres schema version 7: timers claimed in batches (issue 28, decision 0048).

Split from ``pg_migrations`` (which lists it as migration 7) to keep modules small.

``fleet_claim_timers(now, limit, holder, expires, clock)`` takes, in one
statement, the fences of up to ``limit`` executions that have a timer due at
``now``, are parked (``status = 'parked'``: a pending timer of a parked execution is
one its park waits on, alone or among a race's waits; never the flow's deadline
timer: the rule ``claims.timer_waited_on`` states in Python) and hold no live lease at
``clock`` (the store's clock, as ``fleet_acquire``), earliest due first. Each
fence row is locked ``FOR UPDATE SKIP LOCKED``: a row another claim (or any
write, which locks it the same way) holds is passed over, not waited for, so
timer-service replicas divide the due timers instead of queueing on the same
ones. A row updated by a claim that committed meanwhile is re-checked on its new
version (its lease is live now) and dropped. The token moves as
``acquire_fence_if`` moves it; the client then appends every ``TIMER_FIRED``
under its token in one ``fleet_append_many_leased`` call, whose own checks (the
token, ``head + 1``) refuse a timer whose execution moved since.

It only adds a function: code of version 6 runs against this schema unchanged
(``OLDEST_CODE``).
"""

from __future__ import annotations

from fleet.kernel.store.pg_sql import READ_COMMITTED

__all__ = ["MIGRATION_7", "OLDEST_CODE_7"]

#: The oldest code (schema version it knows) that runs against version 7.
OLDEST_CODE_7 = 6

MIGRATION_7 = """
CREATE FUNCTION fleet_claim_timers(p_now bigint, p_limit integer, p_holder text,
    p_expires bigint, p_clock bigint)
RETURNS TABLE (execution_id text, timer_id text, due_at bigint, token bigint, head bigint,
               flow_id text, tenant text)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
BEGIN
""" + READ_COMMITTED + """
    RETURN QUERY
    WITH claim AS (
        SELECT f.ekey, t.execution_id AS id, t.timer_id AS tid, t.due_at AS due,
               x.head AS h, x.flow_id AS flow, x.tenant AS ten
        FROM timers AS t
        JOIN executions AS x ON x.ekey = t.ekey
        JOIN fences AS f ON f.ekey = t.ekey
        WHERE t.due_at <= p_now AND x.status = 'parked'
          AND t.timer_id <> '__fleet_deadline__'
          AND (f.lease_expires_at IS NULL OR f.lease_expires_at <= p_clock)
        ORDER BY t.due_at
        LIMIT p_limit
        FOR UPDATE OF f SKIP LOCKED)
    UPDATE fences AS f SET token = f.token + 1, holder = p_holder, lease_expires_at = p_expires
    FROM claim WHERE f.ekey = claim.ekey
    RETURNING claim.id, claim.tid, claim.due, f.token, claim.h, claim.flow, claim.ten;
END $$;
"""
