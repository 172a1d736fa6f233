"""The committed feed on a real Postgres: late commits, rollbacks, racing writers.

Transactions are held open by hand on plain connections (``BEGIN``, then the
store's own append function, then a wait) so a later transaction commits
first: the case a ``position > last`` tail gets wrong. Every test has its own
schema in a database this module creates and drops.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import AsyncIterator

import asyncpg
import pytest

from fleet.kernel.events import EventEnvelope
from fleet.kernel.store.conformance import make_event, started
from fleet.kernel.store.conformance_feed import check_feed, settled_feed
from fleet.kernel.store.pg_queries import APPEND_SQL, Write
from fleet.kernel.store.postgres import PostgresEventStore
from fleet.kernel.store.spi import ORIGIN, CommittedEvent, Position

pytestmark = pytest.mark.integration


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[PostgresEventStore]:
    store = await PostgresEventStore(database_url, schema=f"f_{secrets.token_hex(5)}",
                                     pool_max=6).open()
    yield store
    await store.close()


async def connect(store: PostgresEventStore, url: str) -> asyncpg.Connection:
    return await asyncpg.connect(url, server_settings={
        "search_path": f'"{store.schema}"', "default_transaction_isolation": "read committed"})


async def append_in(conn: asyncpg.Connection, events: list[EventEnvelope]) -> int:
    """The store's own append function on ``conn`` (inside whatever transaction it has)."""
    write = Write.of(events[0].execution_id, events, None)
    row = await conn.fetchrow(APPEND_SQL, write.key, write.execution_id, None, *write.args())
    return int(row["code"])


async def naive_tail(conn: asyncpg.Connection, after: int) -> list[tuple[int, str]]:
    """What a ``position > last`` reader sees: rows by the sequence number alone."""
    rows = await conn.fetch("SELECT e.pos, x.execution_id FROM events AS e JOIN executions "
                            "AS x ON x.ekey = e.ekey WHERE e.pos > $1 ORDER BY e.pos", after)
    return [(int(r["pos"]), r["execution_id"]) for r in rows]


async def test_a_late_commit_is_lost_by_a_naive_tail_and_kept_by_the_feed(
        db: PostgresEventStore, database_url: str) -> None:
    slow, tail = await connect(db, database_url), await connect(db, database_url)
    try:
        slow_tx = slow.transaction()
        await slow_tx.start()
        assert await append_in(slow, [started("late")]) == 0  # takes the lower number...
        late_pos = await slow.fetchval("SELECT pos FROM events")
        await db.append(started("early"))                     # ...this one commits first
        early_pos = await tail.fetchval("SELECT pos FROM events")
        assert late_pos < early_pos

        seen = await naive_tail(tail, 0)
        assert seen == [(early_pos, "early")]
        assert await db.read_committed() == []  # the feed waits for the open transaction
        await slow_tx.commit()

        assert await naive_tail(tail, seen[-1][0]) == []  # the naive tail lost "late"
        feed = await settled_feed(db, 2)
        assert [c.event.execution_id for c in feed] == ["late", "early"]
    finally:
        await slow.close()
        await tail.close()


async def test_a_rolled_back_append_never_reaches_the_feed(
        db: PostgresEventStore, database_url: str) -> None:
    conn = await connect(db, database_url)
    try:
        tx = conn.transaction()
        await tx.start()
        assert await append_in(conn, [started("ghost")]) == 0
        await db.append(started("real"))
        await tx.rollback()
    finally:
        await conn.close()
    feed = await settled_feed(db, 1)
    assert [c.event.execution_id for c in feed] == ["real"]


async def test_an_older_transaction_cannot_append_after_a_newer_writer_of_its_log(
        db: PostgresEventStore, database_url: str) -> None:
    # B takes its transaction id first, A writes the log's next event and commits,
    # then B tries the event after A's: B's older id would put it before A's in the
    # feed, so the store refuses it (code 4, nothing written) and a new transaction
    # (the client retries in one) appends it in order.
    await db.append(started("x"))
    older, newer = await connect(db, database_url), await connect(db, database_url)
    try:
        tx = older.transaction()
        await tx.start()
        await older.fetchval("SELECT pg_current_xact_id()")  # the id is taken now
        assert await append_in(newer, [make_event("x", 1)]) == 0
        assert await append_in(older, [make_event("x", 2)]) == 4
        await tx.commit()
        assert await db.head("x") == 1
    finally:
        await older.close()
        await newer.close()
    await db.append(make_event("x", 2))
    feed = await settled_feed(db, 3)
    assert [c.event.sequence for c in feed] == [0, 1, 2]
    check_feed(feed)


async def test_many_writers_and_long_transactions_the_feed_misses_nothing(
        db: PostgresEventStore, database_url: str) -> None:
    rng = random.Random(12)
    committed: set[tuple[str, int]] = set()
    rolled_back: set[str] = set()
    stop = asyncio.Event()
    naive_lost: list[int] = []

    async def store_writer(w: int) -> None:
        for i in range(6):
            x = f"s{w}-{i}"
            events = [started(x)] + [make_event(x, s) for s in range(1, rng.randint(2, 5))]
            for event in events:
                await db.append(event)
                committed.add((x, event.sequence))

    async def slow_writer(w: int, conn: asyncpg.Connection) -> None:
        for i in range(4):
            x = f"slow{w}-{i}"
            events = [started(x), make_event(x, 1)]
            tx = conn.transaction()
            await tx.start()
            assert await append_in(conn, events) == 0
            await asyncio.sleep(rng.uniform(0.05, 0.3))  # commits after later ones
            if i == 3 and w == 0:
                await tx.rollback()
                rolled_back.add(x)
            else:
                await tx.commit()
                committed.update((x, e.sequence) for e in events)

    async def feed_reader() -> list[CommittedEvent]:
        seen: list[CommittedEvent] = []
        after = ORIGIN
        while True:
            finished = stop.is_set()
            batch = await db.read_committed(after=after, limit=17)
            seen += batch
            if batch:
                after = batch[-1].position
            elif finished:
                return seen
            else:
                await asyncio.sleep(0.003)

    async def naive_reader(conn: asyncpg.Connection) -> None:
        last, got = 0, set()
        while not stop.is_set():
            for pos, _ in await naive_tail(conn, last):
                got.add(pos)
                last = max(last, pos)
            await asyncio.sleep(0.003)
        every = {int(r["pos"]) for r in await conn.fetch("SELECT pos FROM events")}
        naive_lost.extend(sorted(every - got))

    slow_conns = [await connect(db, database_url) for _ in range(3)]
    tail_conn = await connect(db, database_url)
    try:
        reading = asyncio.ensure_future(feed_reader())
        naive = asyncio.ensure_future(naive_reader(tail_conn))
        await asyncio.gather(*(store_writer(w) for w in range(4)),
                             *(slow_writer(w, c) for w, c in enumerate(slow_conns)))
        await settled_feed(db, len(committed))  # another client's open transaction, if any
        stop.set()
        seen = await reading
        await naive
    finally:
        for conn in (*slow_conns, tail_conn):
            await conn.close()
    check_feed(seen)
    assert {(c.event.execution_id, c.event.sequence) for c in seen} == committed
    assert len(seen) == len(committed)
    assert not rolled_back & {c.event.execution_id for c in seen}
    # The naive tail did lose some of the late commits (the race this guards against).
    assert naive_lost, "no transaction committed late: the test did not test anything"


async def test_a_byte_bound_page_on_postgres_reads_only_what_it_returns(
        db: PostgresEventStore) -> None:
    await db.append(started("b"))
    await db.append_batch([make_event("b", s, payload={"output": "y" * 200_000})
                           for s in range(1, 40)])
    await settled_feed(db, 40)
    first = await db.read_committed(limit=1)
    page = await db.read_committed(after=first[0].position, max_bytes=500_000)
    assert [c.event.sequence for c in page] == [1, 2, 3]
    assert page[0].position > first[0].position
    assert isinstance(page[0].position, Position)
