"""Postgres schema version 8: timers claimed in batches (issue 28, decision 0048).

Split from ``pg_migrations`` (which lists it as migration 8) to keep modules small.

``fleet_claim_timers(now, limit, holder, lease_ms, max_ms, clock)`` takes, in one
statement, the fences of up to ``limit`` executions that have a timer due at
``now``, are parked (``status = 'parked'``: a pending timer of a parked execution is
one its park waits on, alone or among a race's waits; never the flow's deadline
timer: the rule ``claims.timer_waited_on`` states in Python) and hold no live lease,
earliest due first. Whether a lease is live is judged as version 7's
``fleet_acquire_v7`` judges it (decision 0044): on the server's clock
(``fleet_now_ms()``; ``clock`` replaces it for tests), live while ``now < expiry <=
now + max_ms``; a claim's own lease ends ``lease_ms`` after that clock, and the
function returns the expiry it set. Each fence row is locked ``FOR UPDATE SKIP
LOCKED``: a row another claim (or any write, which locks it the same way) holds is
passed over, not waited for, so timer-service replicas divide the due timers instead
of queueing on the same ones. A row updated by a claim that committed meanwhile is
re-checked on its new version (its lease is live now) and dropped. The token moves
as ``acquire_fence_if`` moves it; the client then appends every ``TIMER_FIRED``
under its token in one ``fleet_append_many_leased_v7`` call, whose own checks (the
token, ``head + 1``) refuse a timer whose execution moved since.

It only adds a function: code of version 6 runs against this schema unchanged
(``OLDEST_CODE_8``); it needs version 7's ``fleet_now_ms()``.
"""

from __future__ import annotations

from fleet.kernel.store.pg_sql import READ_COMMITTED

__all__ = ["MIGRATION_8", "OLDEST_CODE_8"]

#: The oldest code (schema version it knows) that runs against version 8.
OLDEST_CODE_8 = 6

MIGRATION_8 = """
CREATE FUNCTION fleet_claim_timers(p_now bigint, p_limit integer, p_holder text,
    p_lease_ms bigint, p_max_ms bigint, p_clock bigint)
RETURNS TABLE (execution_id text, timer_id text, due_at bigint, token bigint, head bigint,
               flow_id text, tenant text, expires bigint)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    now_ms bigint := coalesce(p_clock, fleet_now_ms());
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
          AND (f.lease_expires_at IS NULL OR f.lease_expires_at <= now_ms
               OR f.lease_expires_at > now_ms + p_max_ms)
        ORDER BY t.due_at
        LIMIT p_limit
        FOR UPDATE OF f SKIP LOCKED)
    UPDATE fences AS f SET token = f.token + 1, holder = p_holder,
        lease_expires_at = now_ms + p_lease_ms
    FROM claim WHERE f.ekey = claim.ekey
    RETURNING claim.id, claim.tid, claim.due, f.token, claim.h, claim.flow, claim.ten,
              f.lease_expires_at;
END $$;
"""
