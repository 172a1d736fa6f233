"""SQL fragments the Postgres store's migrations share (``pg_migrations``, ``pg_migration_v6``).

A migration's function text is written once and later versions are made from it
with ``edit`` (each replacement must match exactly once, so a released text that
changed under an edit fails at import, not on a server).
"""

from __future__ import annotations

__all__ = ["CURRENT_TXID", "READ_COMMITTED", "RING", "edit"]

READ_COMMITTED = """
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'fleet writes need READ COMMITTED; this transaction runs %',
            current_setting('transaction_isolation') USING ERRCODE = 'FL004';
    END IF;
"""

CURRENT_TXID = "pg_current_xact_id()::text::bigint"

# Rung at the end of every append that wrote something; FOR UPDATE SKIP LOCKED
# takes no lock while the bell is not armed, and lets one writer ring it.
RING = """
    PERFORM 1 FROM fleet_relay_doorbell WHERE armed FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        UPDATE fleet_relay_doorbell SET armed = false RETURNING channel INTO bell;
        PERFORM pg_notify(bell, '');
    END IF;
"""


def edit(sql: str, *edits: tuple[str, str]) -> str:
    """``sql`` (a released function) with each ``old`` replaced by ``new`` exactly once."""
    for old, new in edits:
        if sql.count(old) != 1:
            raise AssertionError(f"migration edit does not match once: {old!r}")
        sql = sql.replace(old, new)
    return sql
