"""A Postgres schema migration: the backlog, read by one query (issue 28 item 1, decision 0046).

Split from ``pg_migrations`` (which gives it its number) to keep modules small. It only
adds three functions, which read ``executions``, ``fences`` and ``timers``: it depends
on no other migration after version 3, and none depends on it.

``fleet_backlog(p_now)`` answers, per flow and tenant, what waits for a worker and
for the timer service at ``p_now`` (ms): the runnable executions (status
``running``) with no live lease, and since when the oldest of them has waited
(its last write, or its lease's expiry if that is later); the scheduled timers
due and not fired, and the oldest one's due time. It reads the index rows of the
running executions (``executions_by_status``), their fence rows by primary key and
the due timers (``timers_by_due``): never a log, never a fold. The store's
``backlog`` calls it; so do the two functions below.

``fleet_scaler_unowned(queue, default queue, routes)`` and
``fleet_scaler_timers_due()`` are what KEDA's PostgreSQL scaler runs
(``deploy/k8s/components/keda``): one number each, on the database's clock. They
run with their owner's rights (``SECURITY DEFINER``, the search path fixed to the
schema they were made in), so the scaler's role needs EXECUTE and nothing else:
it can read no row, and learns no id, flow or tenant. The routes are
``FLEET_ROUTES`` as JSON; a row's queue is its flow's route, else its tenant's,
else the default queue (``fleet.dispatcher.routing.route_queue``).
"""

from __future__ import annotations

__all__ = ["MIGRATION_BACKLOG"]

_BACKLOG = """
CREATE FUNCTION fleet_backlog(p_now bigint)
RETURNS TABLE (flow_id text, tenant text, unowned bigint, unowned_since bigint,
               timers_due bigint, due_since bigint)
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT b.flow_id, b.tenant, sum(b.unowned)::bigint, min(b.since),
           sum(b.due)::bigint, min(b.due_at)
    FROM (
        SELECT e.flow_id, e.tenant, count(*) AS unowned,
               min(greatest(e.updated_at, coalesce(f.lease_expires_at, 0))) AS since,
               0 AS due, NULL::bigint AS due_at
        FROM executions AS e LEFT JOIN fences AS f ON f.ekey = e.ekey
        WHERE e.status = 'running'
          AND (f.lease_expires_at IS NULL OR f.lease_expires_at <= p_now)
        GROUP BY e.flow_id, e.tenant
        UNION ALL
        SELECT e.flow_id, e.tenant, 0, NULL, count(*), min(t.due_at)
        FROM timers AS t JOIN executions AS e ON e.ekey = t.ekey
        WHERE t.due_at <= p_now
        GROUP BY e.flow_id, e.tenant
    ) AS b
    GROUP BY b.flow_id, b.tenant
$$;

CREATE FUNCTION fleet_scaler_unowned(p_queue text, p_default text,
                                     p_routes jsonb DEFAULT '{}')
RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
    SELECT coalesce(sum(b.unowned), 0)::bigint
    FROM fleet_backlog((extract(epoch FROM clock_timestamp()) * 1000)::bigint) AS b
    WHERE coalesce(p_routes ->> ('flow:' || b.flow_id), p_routes ->> ('tenant:' || b.tenant),
                   p_default) = p_queue
$$;

CREATE FUNCTION fleet_scaler_timers_due()
RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
    SELECT coalesce(sum(b.timers_due), 0)::bigint
    FROM fleet_backlog((extract(epoch FROM clock_timestamp()) * 1000)::bigint) AS b
$$;
"""

MIGRATION_BACKLOG = _BACKLOG
