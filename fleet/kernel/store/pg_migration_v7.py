"""Postgres schema version 7: leases on the server's clock, bounded (decision 0044).

Split from ``pg_migrations`` (which lists it as migration 7) to keep modules small.

Until version 6 the client computed a lease's expiry on its own clock and sent it,
and judged a held lease against its own ``now``: two workers whose clocks differ
judge one lease differently (issue 25 item 9), and an expiry set far ahead by a
skewed or forged clock was honoured until that time came (item 8). From version 7
the server's clock decides:

- ``fleet_now_ms()`` is the server's clock (``clock_timestamp()``, ms);
- the new functions take the lease's *length* and the store's bound
  (``p_lease_ms``, ``p_max_ms``) and set ``expiry = now + length`` with ``now``
  read after the fence row is locked; a held lease is live while
  ``now < expiry <= now + p_max_ms`` (``spi.lease_live``), so an expiry further
  out is taken over; each returns the ``now`` it used (``o_now``), so the grant
  the client hands back carries the expiry the server set;
- ``p_now`` (NULL in production) replaces the server's clock for tests that move
  time by hand (``PostgresEventStore(clock=...)``).

The functions of earlier versions keep their text and arguments: a process of
version 6 keeps calling them, with its own clock, until it is replaced (a rolling
upgrade; CHANGELOG). Renewals are a plain statement (``postgres.RENEW_SQL``).
"""

from __future__ import annotations

from fleet.kernel.store.pg_migration_v6 import APPEND_MANY_LEASED_V6
from fleet.kernel.store.pg_sql import READ_COMMITTED, edit

__all__ = ["migration_7"]

_NOW = """
CREATE FUNCTION fleet_now_ms() RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$ SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint $$;
"""

# acquire_fence (p_conditional false) and acquire_fence_if (true): the token, or NULL
# while a live lease is held; the expiry the server set.
_ACQUIRE = """
CREATE FUNCTION fleet_acquire_v7(p_key bytea, p_holder text, p_lease_ms bigint,
    p_conditional boolean, p_max_ms bigint, p_now bigint,
    OUT o_token bigint, OUT o_expires bigint)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    f record;
    now_ms bigint;
BEGIN
""" + READ_COMMITTED + """
    SELECT * INTO f FROM fleet_lock_fence(p_key, true);
    now_ms := coalesce(p_now, fleet_now_ms());
    IF p_conditional AND f.o_lease > now_ms AND f.o_lease <= now_ms + p_max_ms THEN
        RETURN;  -- acquire_fence_if: a live lease is held
    END IF;
    o_expires := now_ms + p_lease_ms;
    UPDATE fences SET token = token + 1, holder = p_holder, lease_expires_at = o_expires
    WHERE ekey = p_key RETURNING token INTO o_token;
END $$;
"""


def migration_7(append_leased_v4: str) -> str:
    """Version 7's SQL; ``append_leased_v4`` is version 4's ``fleet_append_leased``."""
    append_leased = edit(
        append_leased_v4,
        ("CREATE FUNCTION fleet_append_leased(p_key bytea, p_id text, p_fence bigint, "
         "p_holder text,\n    p_expires bigint, p_now bigint, p_release boolean, "
         "p_first bigint,\n",
         "CREATE FUNCTION fleet_append_leased_v7(p_key bytea, p_id text, p_fence bigint,\n"
         "    p_holder text, p_lease_ms bigint, p_max_ms bigint, p_now bigint,\n"
         "    p_release boolean, p_first bigint,\n"),
        ("OUT code integer, OUT detail bigint)\nLANGUAGE plpgsql AS $$",
         "OUT code integer, OUT detail bigint,\n    OUT o_now bigint)\n"
         "LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$"),
        ("        IF f.o_lease IS NOT NULL AND f.o_lease > p_now THEN\n",
         "        o_now := coalesce(p_now, fleet_now_ms());\n"
         "        IF f.o_lease > o_now AND f.o_lease <= o_now + p_max_ms THEN\n"),
        ("lease_expires_at = p_expires\n", "lease_expires_at = o_now + p_lease_ms\n"),
    )
    append_many_leased = edit(
        APPEND_MANY_LEASED_V6,
        ("CREATE OR REPLACE FUNCTION fleet_append_many_leased(",
         "CREATE FUNCTION fleet_append_many_leased_v7("),
        ("p_holders text[], p_expires bigint[],\n"
         "    p_releases boolean[], p_now bigint, OUT codes integer[], OUT details bigint[])",
         "p_holders text[], p_lease_ms bigint[],\n"
         "    p_releases boolean[], p_max_ms bigint, p_now bigint, OUT codes integer[],\n"
         "    OUT details bigint[], OUT o_now bigint)"),
        ("    codes := array_fill(NULL::integer, ARRAY[n]);\n",
         "    o_now := coalesce(p_now, fleet_now_ms());\n"
         "    codes := array_fill(NULL::integer, ARRAY[n]);\n"),
        ("CASE WHEN u.h IS NOT NULL AND fe.lease_expires_at > p_now THEN 5\n",
         "CASE WHEN u.h IS NOT NULL AND fe.lease_expires_at > o_now\n"
         "                               AND fe.lease_expires_at <= o_now + p_max_ms THEN 5\n"),
        ("CASE WHEN u.h IS NOT NULL AND fe.lease_expires_at > p_now\n",
         "CASE WHEN u.h IS NOT NULL AND fe.lease_expires_at > o_now\n"
         "                               AND fe.lease_expires_at <= o_now + p_max_ms\n"),
        ("lease_expires_at = u.x\n", "lease_expires_at = o_now + u.x\n"),
        ("FROM unnest(p_keys, p_holders, p_expires, p_rounds, codes)",
         "FROM unnest(p_keys, p_holders, p_lease_ms, p_rounds, codes)"),
    )
    return _NOW + _ACQUIRE + append_leased + append_many_leased
