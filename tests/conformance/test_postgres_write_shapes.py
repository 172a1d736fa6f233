"""The Postgres store's cheaper write path (decision 0031, fourth round) keeps what it stores.

A write of up to ``INLINE_EVENTS`` events sends its events' fields as scalars
(``APPENDS[n]``, ``Write.params``), a larger one as arrays (``APPEND_SQL``,
``Write.args``): both must store the same bytes, the index alike. The store calls
the connection behind asyncpg's pool proxy: a proxy the pool took back must still
read as a lost connection, never as a crash.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import asyncpg
import pytest

from fleet.kernel.errors import StoreUnavailableError
from fleet.kernel.events import EventType
from fleet.kernel.store.conformance import make_event, started
from fleet.kernel.store.encoding import encode_event
from fleet.kernel.store.pg_connections import Connections, translate
from fleet.kernel.store.pg_queries import (
    APPEND_IF_SQL,
    APPEND_LEASED_SQL,
    APPEND_SQL,
    APPENDS,
    APPENDS_IF,
    APPENDS_LEASED,
    INLINE_EVENTS,
    Write,
)
from fleet.kernel.store.postgres import PostgresEventStore

pytestmark = pytest.mark.integration
E = EventType


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[PostgresEventStore]:
    store = await PostgresEventStore(database_url, schema=f"t_{secrets.token_hex(5)}",
                                     pool_max=2).open()
    yield store
    await store.close()


def test_the_array_statements_are_the_ones_before() -> None:
    assert APPENDS[0] == APPEND_SQL == (
        "SELECT code, detail FROM fleet_append($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, "
        "$12, $13, $14, $15, $16)")
    assert APPENDS_IF[0] == APPEND_IF_SQL == (
        "SELECT * FROM fleet_append_if($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, "
        "$14, $15, $16, $17, $18)")
    assert APPENDS_LEASED[0] == APPEND_LEASED_SQL == (
        "SELECT code, detail, o_now FROM fleet_append_leased_v7($1, $2, $3, $4, $5, $6, $7, $8, "
        "$9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21)")
    assert APPENDS[2] == (
        "SELECT code, detail FROM fleet_append($1, $2, $3, $4, ARRAY[$5::text, $6::text], "
        "ARRAY[$7::bigint, $8::bigint], ARRAY[$9::text, $10::text], $11, $12, $13, $14, $15, "
        "$16, $17, $18, $19)")


@pytest.mark.parametrize("n", [1, 2, INLINE_EVENTS, INLINE_EVENTS + 1])
def test_params_match_their_statement(n: int) -> None:
    events = [started("x"), *(make_event("x", i) for i in range(1, n))]
    write = Write.of("x", events, None)
    assert write.inline == (n if n <= INLINE_EVENTS else 0)
    params = write.params()
    # Every placeholder of the statement is sent, none more (3 leading: key, id, fence).
    assert f"${3 + len(params)}" in APPENDS[write.inline]
    assert f"${4 + len(params)}" not in APPENDS[write.inline]
    if write.inline:
        assert params[1:1 + 3 * n] == (*write.types, *write.timestamps, *write.bodies)
        assert params[1 + 3 * n:] == write.args()[4:]
    else:
        assert params == write.args()


@pytest.mark.parametrize("n", [1, 3, INLINE_EVENTS, INLINE_EVENTS + 1, 2 * INLINE_EVENTS])
async def test_either_shape_stores_the_same_bytes_and_index(store: PostgresEventStore,
                                                            n: int) -> None:
    eid = f"shape-{n}"
    events = [started(eid), *(make_event(eid, i) for i in range(1, n - 1))]
    if n > 1:
        events.append(make_event(eid, n - 1, E.TIMER_SCHEDULED,
                                 {"timerId": "t", "dueAt": 5}))
    await store.append_batch(events, fence=0)
    got = await store.read(eid)
    assert [encode_event(e, None) for e in got] == [encode_event(e, None) for e in events]
    summary = await store.get_execution(eid)
    assert summary is not None
    assert (summary.flow_id, summary.tenant, summary.owner, summary.head) == (
        "flow", "acme", "alice", n - 1)
    due = await store.due_timers(10)
    assert [(t.execution_id, t.timer_id) for t in due] == ([(eid, "t")] if n > 1 else [])
    # The next write of either shape follows it; a refused one still says why.
    tail = [make_event(eid, n + i) for i in range(n)]
    await store.append_batch(tail, fence=0)
    assert await store.head(eid) == 2 * n - 1


class _TakenBack:
    """A pool proxy after asyncpg took it back (its connection closed under it)."""

    _con = None

    def terminate(self) -> None:
        raise asyncpg.InterfaceError("cannot call Connection.terminate(): released")


async def test_a_proxy_taken_back_by_the_pool_is_a_lost_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    conns = Connections(pool=None, size=1)
    conns._held = 1
    monkeypatch.setattr(Connections, "_idle_one", lambda self: _TakenBack())
    with pytest.raises(asyncpg.InterfaceError, match="released back to the pool") as caught:
        await conns.run("fetchrow", "SELECT 1", ())
    assert conns._held == 0  # dropped, so a new connection may be checked out
    assert isinstance(translate(caught.value), StoreUnavailableError)


async def test_a_store_on_a_proxy_taken_back_raises_unavailable(
        store: PostgresEventStore, monkeypatch: pytest.MonkeyPatch) -> None:
    await store.append_batch([started("gone")], fence=0)
    monkeypatch.setattr(Connections, "_idle_one", lambda self: _TakenBack())
    with pytest.raises(StoreUnavailableError):
        await store.delete_execution("gone")
    monkeypatch.undo()
    assert await store.head("gone") == 0  # nothing was deleted; the store still works
