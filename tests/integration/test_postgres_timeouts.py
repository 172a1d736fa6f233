"""A stuck Postgres session holds the fleet up for a bounded time (issue 25 item 10).

A transaction left open anywhere on the server holds the committed feed back, so the
relay's tail stood still for as long as it stayed open (decision 0020); a row lock
it held stalled every write of that execution, renewals included, for ever. Now
fleet's connections carry ``idle_in_transaction_session_timeout``,
``statement_timeout`` and ``lock_timeout`` (``pg_connections.SESSION_TIMEOUTS``; a URL
may set its own), and deploy/postgres/roles.sql ends any session of the database that
sits idle in a transaction (``-v idle_timeout=``, 60 s by default; 2 s here).

Against a real Postgres server and a real Redis. The sessions held open here hold
the server's feed back for a second or two, no longer.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest
import redis.asyncio as aioredis
from k8s_kit import ROOT
from postgres_server import psql, run_async, server_url, throwaway_database
from redis_server import prefix
from redis_server import server_url as redis_url
from relay_kit import stream_events, wait_published

from fleet.kernel.errors import StoreUnavailableError
from fleet.kernel.store.conformance import make_event, started
from fleet.kernel.store.pg_connections import SESSION_TIMEOUTS, Database
from fleet.kernel.store.postgres import PostgresEventStore
from fleet.streams.relay import EventRelay

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROLES_SQL = ROOT / "deploy" / "postgres" / "roles.sql"
IDLE_S = 2


@pytest.fixture(scope="module")
def prepared() -> Iterator[str]:
    """A throwaway database that deploy/postgres/roles.sql prepared (idle limit 2 s)."""
    token = secrets.token_hex(4)
    names = (f"fleet_mig_{token}", f"fleet_rt_{token}")
    try:
        with throwaway_database() as admin:
            done = subprocess.run(
                [psql(), admin, "-X", "-q", "-v", f"migrator={names[0]}", "-v",
                 f"runtime={names[1]}", "-v", f"idle_timeout={IDLE_S}s", "-f",
                 str(ROLES_SQL)], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            yield admin
    finally:
        async def drop() -> None:
            conn = await asyncpg.connect(server_url())
            try:
                for name in names:
                    await conn.execute(f'DROP ROLE IF EXISTS "{name}"')
            finally:
                await conn.close()
        run_async(drop)


def with_query(url: str, query: str) -> str:
    return url + ("&" if "?" in url else "?") + query


def test_fleets_connections_ask_for_the_limits_unless_the_url_sets_them() -> None:
    url = "postgresql://fleet@db.example/fleet"
    assert {k: Database(url, pool_min=0, pool_max=1, schema=None, connect_timeout=1,
                        migrate=False).server_settings()[k] for k in SESSION_TIMEOUTS} == {
        "idle_in_transaction_session_timeout": "60s", "statement_timeout": "60s",
        "lock_timeout": "10s"}
    own = Database(with_query(url, "lock_timeout=2s&statement_timeout=0"), pool_min=0,
                   pool_max=1, schema=None, connect_timeout=1, migrate=False)
    assert set(own.server_settings()) & {"lock_timeout", "statement_timeout"} == set()
    assert own.server_settings()["idle_in_transaction_session_timeout"] == "60s"


async def test_a_row_lock_held_by_an_idle_transaction_fails_a_write_fast_then_it_lands(
        database_url: str) -> None:
    schema = f"to_{secrets.token_hex(4)}"
    store = await PostgresEventStore(with_query(database_url, "lock_timeout=500ms"),
                                     schema=schema, pool_max=2).open()
    holder = await asyncpg.connect(database_url, server_settings={"search_path": schema})
    try:
        await store.append(started("locked"))
        grant = await store.acquire_fence("locked", holder="w", lease_ms=60_000)
        # Someone's session locks the execution's fence row and goes idle (a psql left
        # after BEGIN; SELECT ... FOR UPDATE).
        await holder.execute("BEGIN")
        await holder.execute("SELECT 1 FROM fences WHERE ekey = fleet_key('locked') FOR UPDATE")
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(StoreUnavailableError, match="55P03") as refused:
            await store.append(make_event("locked", 1), fence=grant.token)
        assert refused.value.retryable
        with pytest.raises(StoreUnavailableError, match="55P03"):
            await store.renew_lease("locked", grant.token, lease_ms=60_000)
        assert loop.time() - began < 30  # bounded by lock_timeout, not by the holder
        assert await store.head("locked") == 0  # nothing written
        await holder.execute("ROLLBACK")
        await store.append(make_event("locked", 1), fence=grant.token)
        assert await store.head("locked") == 1
    finally:
        await holder.close()
        await store.close()


@pytest.fixture
async def redis() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url())
    yield client
    await client.aclose()


async def test_the_relays_tail_moves_on_past_an_idle_transaction(
        prepared: str, redis: aioredis.Redis) -> None:
    stream = f"{prefix()}events"
    store = await PostgresEventStore(prepared, schema=f"to_{secrets.token_hex(4)}",
                                     pool_max=4).open()
    relay = EventRelay(store, redis, stream=stream, poll_s=0.05, signal=store.commit_signal())
    watcher = await asyncpg.connect(prepared)
    idle = await asyncpg.connect(prepared)  # as the superuser: the database's limit holds
    try:
        await relay.start()
        await store.append(started("before"))
        await wait_published(redis, stream, store)

        # A session opens a transaction, takes a transaction id and sits idle in it.
        await idle.execute("BEGIN")
        await idle.fetchval("SELECT pg_current_xact_id()")
        pid = idle.get_server_pid()
        await store.append_batch([started("after"), make_event("after", 1)])

        async def state() -> str | None:
            value = await watcher.fetchval("SELECT state FROM pg_stat_activity WHERE pid = $1",
                                           pid)
            return None if value is None else str(value)

        # While it is open the feed holds the new events back (decision 0020) ...
        held_before = await state()
        feed = await store.read_committed(after=(await stream_events(redis, stream))[-1]
                                          .position)
        if held_before == "idle in transaction" and await state() == "idle in transaction":
            assert feed == []
        # ... until the server ends the session; then the relay's tail moves on.
        await wait_published(redis, stream, store, timeout=60)
        published = [(c.event.execution_id, c.event.sequence)
                     for c in await stream_events(redis, stream)]
        assert published == [("before", 0), ("after", 0), ("after", 1)]
        assert await state() is None  # the server ended it
        with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError)):
            await idle.fetchval("SELECT 1")
    finally:
        await relay.stop()
        await redis.delete(stream)
        await watcher.close()
        await idle.close(timeout=5)
        await store.close()
