"""Hypothesis-driven flushes on schema version 5 and on the current one: the same answers.

Migration 6 rewrote ``fleet_append_many`` and ``fleet_append_many_leased`` for
less server work (decision 0029, "Server cost per flush") under the promise that
their arguments and answers did not change: a process of version 5 keeps calling
them during a rolling upgrade. Each example sends the same flushes (several
executions, repeated ones in later rounds, stale, missing and current fences,
gaps and taken slots, takes of free and of live leases, releases) to a schema
made by migrations 1-5 and to one made by all of them, and compares every
answer and every row left behind: fences, the index, the events and the feed's
order. Migration 7 added ``fleet_append_many_leased_v7`` (the lease's length, the
server's clock: decision 0044); the same flushes through it, at the same ``now``,
answer and write the same again.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any, cast

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pg_flush_kit import V6_MANY_LEASED_SQL, V6Op, v6_lease_columns

from fleet.kernel.store.conformance import T0, make_event, started
from fleet.kernel.store.pg_migrations import MIGRATIONS, VERSION_TABLE
from fleet.kernel.store.pg_queries import (
    APPEND_MANY_LEASED_SQL,
    APPEND_MANY_SQL,
    LeaseOp,
    Write,
    lease_columns,
    many_columns,
)
from fleet.kernel.store.spi import DEFAULT_MAX_LEASE_MS

pytestmark = pytest.mark.integration

# (execution, sequence, op, fence): op "plain" carries the fence, "take" takes the
# fence (none carried) until a lease that is live or past at T0, "release" ends it.
_ITEM = st.one_of(
    st.tuples(st.sampled_from("abc"), st.integers(0, 3), st.just("plain"),
              st.sampled_from([None, 0, 1, 2])),
    st.tuples(st.sampled_from("abc"), st.integers(0, 3),
              st.sampled_from(["take-live", "take-past"]), st.none()),
    st.tuples(st.sampled_from("abc"), st.integers(1, 3), st.just("release"),
              st.sampled_from([1, 2])),
)
_FLUSHES = st.lists(st.lists(_ITEM, min_size=1, max_size=5), min_size=1, max_size=6)


async def _schema(conn: asyncpg.Connection, migrations: int) -> None:
    schema = f"f_{secrets.token_hex(5)}"
    await conn.execute(f'CREATE SCHEMA "{schema}"; SET search_path = "{schema}"')
    await conn.execute(VERSION_TABLE)
    for _, sql in MIGRATIONS[:migrations]:
        await conn.execute(sql)


@pytest.fixture
async def pair(database_url: str) -> AsyncIterator[tuple[asyncpg.Connection, ...]]:
    """A connection on a version-5 schema and two on current schemas."""
    conns = [await asyncpg.connect(database_url, server_settings={
        "default_transaction_isolation": "read committed"}) for _ in range(3)]
    try:
        await _schema(conns[0], 5)
        await _schema(conns[1], len(MIGRATIONS))
        await _schema(conns[2], len(MIGRATIONS))
        yield tuple(conns)
    finally:
        for conn in conns:
            await conn.close()


async def _run(conn: asyncpg.Connection, prefix: str,
               flushes: list[list[tuple[str, int, str, int | None]]], *,
               v7: bool = False) -> list[Any]:
    seen: list[Any] = []
    for flush in flushes:
        prepared, ops, v6 = [], {}, {}
        for i, (x, sequence, op, fence) in enumerate(flush):
            xid = prefix + x
            event = started(xid) if sequence == 0 else make_event(xid, sequence)
            prepared.append((i, Write.of(xid, [event], None), fence))
            if op.startswith("take"):
                # A live take's lease outlasts T0; a past one's ended before it (the raw
                # call takes a negative length, which the store's own checks refuse).
                length = 1_000 if op == "take-live" else -1
                ops[i] = LeaseOp(holder=f"h{i}", lease_ms=length)
                v6[i] = (f"h{i}", T0 + length)
            elif op == "release":
                ops[i] = LeaseOp(release=True)
                v6[i] = "release"
        columns = many_columns(prepared)
        if ops and v7:
            row = await conn.fetchrow(APPEND_MANY_LEASED_SQL, *columns, *lease_columns(
                prepared, ops, DEFAULT_MAX_LEASE_MS, T0))
        elif ops:
            row = await conn.fetchrow(V6_MANY_LEASED_SQL, *columns,
                                      *v6_lease_columns(prepared, cast(dict[int, V6Op], v6), T0))
        else:
            row = await conn.fetchrow(APPEND_MANY_SQL, *columns)
        seen.append((list(row["codes"]), list(row["details"])))
    seen.append([tuple(r) for r in await conn.fetch(
        "SELECT ekey, token, holder, lease_expires_at FROM fences ORDER BY ekey")])
    seen.append([tuple(r) for r in await conn.fetch(
        "SELECT ekey, execution_id, flow_id, tenant, owner, status, waiting_on, started_at, "
        "updated_at, head, anchor FROM executions ORDER BY ekey")])
    seen.append([tuple(r) for r in await conn.fetch(
        "SELECT ekey, sequence, type, timestamp, body FROM events ORDER BY txid, pos")])
    return seen


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flushes=_FLUSHES)
async def test_version_6_and_7_flushes_answer_and_write_as_version_5(
        pair: tuple[asyncpg.Connection, ...],
        flushes: list[list[tuple[str, int, str, int | None]]]) -> None:
    prefix = secrets.token_hex(3) + "-"  # the same ids on every schema, new per example
    before, after = [await _run(conn, prefix, flushes) for conn in pair[:2]]
    assert after == before
    assert await _run(pair[2], prefix, flushes, v7=True) == before
