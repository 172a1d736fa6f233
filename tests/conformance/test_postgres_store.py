"""The conformance kit on the Postgres store (a real server), plus what is specific to it.

Each test gets its own schema in a database this module creates and drops.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import asyncpg
import pytest
from conftest import ManualClock
from pg_flush_kit import V6_MANY_LEASED_SQL, V6Op, v6_lease_columns

from fleet.kernel.errors import (
    ConfigurationError,
    CorruptLogError,
    DuplicateSequenceError,
    PayloadTooLargeError,
    SchemaVersionError,
    StaleFenceError,
    StoreError,
    StoreUnavailableError,
)
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.store.coalescing import CoalescingEventStore
from fleet.kernel.store.conformance import (
    T0,
    EventStoreConformance,
    SnapshotStoreConformance,
    make_event,
    started,
)
from fleet.kernel.store.conformance_backlog import BacklogConformance
from fleet.kernel.store.conformance_feed import settled_feed
from fleet.kernel.store.factory import (
    StoreOptions,
    open_event_store,
    open_snapshot_store,
    postgres_event_store_class,
)
from fleet.kernel.store.pg_migrations import MIGRATIONS, SCHEMA_VERSION, VERSION_TABLE
from fleet.kernel.store.pg_queries import (
    APPEND_MANY_SQL,
    APPEND_SQL,
    Write,
    execution_key,
    many_columns,
)
from fleet.kernel.store.postgres import PostgresEventStore, PostgresSnapshotStore
from fleet.kernel.store.spi import (
    AcquiringAppend,
    EventStore,
    ReleasingAppend,
    Snapshot,
    SnapshotStore,
)

pytestmark = pytest.mark.integration
E = EventType
# A small max_event_bytes, so the kit's event at the limit is cheap to write.
SMALL_LIMIT = 64 * 1024


def fresh_schema() -> str:
    return f"t_{secrets.token_hex(5)}"


class TestPostgresEventStore(EventStoreConformance, BacklogConformance):
    max_event_bytes = SMALL_LIMIT

    @pytest.fixture
    async def store(self, database_url: str, clock: ManualClock) -> AsyncIterator[EventStore]:
        self.clock = clock
        store = PostgresEventStore(database_url, schema=fresh_schema(), pool_max=4, clock=clock,
                                   max_event_bytes=SMALL_LIMIT)
        yield store
        await store.close()

    async def pass_time(self, ms: int) -> None:
        self.clock.advance(ms)


class TestCoalescedPostgresEventStore(EventStoreConformance, BacklogConformance):
    max_event_bytes = SMALL_LIMIT

    @pytest.fixture
    async def store(self, database_url: str, clock: ManualClock) -> AsyncIterator[EventStore]:
        self.clock = clock
        inner = PostgresEventStore(database_url, schema=fresh_schema(), pool_max=4, clock=clock,
                                   max_event_bytes=SMALL_LIMIT)
        store = CoalescingEventStore(inner, max_batch=16, max_wait_ms=1)
        yield store
        await store.close()

    async def pass_time(self, ms: int) -> None:
        self.clock.advance(ms)


class TestPostgresSnapshotStore(SnapshotStoreConformance):
    @pytest.fixture
    async def snapshot_store(self, database_url: str) -> AsyncIterator[SnapshotStore]:
        store = PostgresSnapshotStore(database_url, schema=fresh_schema(), pool_max=2)
        yield store
        await store.close()


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[PostgresEventStore]:
    store = await PostgresEventStore(database_url, schema=fresh_schema(), pool_max=4).open()
    yield store
    await store.close()


async def _raw(store: PostgresEventStore, database_url: str) -> asyncpg.Connection:
    return await asyncpg.connect(database_url,
                                 server_settings={"search_path": f'"{store.schema}"'})


async def test_schema_version_is_recorded_and_a_newer_one_refused(
        db: PostgresEventStore, database_url: str) -> None:
    raw = await _raw(db, database_url)
    try:
        assert await raw.fetchval("SELECT max(version) FROM fleet_schema_version") == (
            SCHEMA_VERSION)
        await raw.execute("INSERT INTO fleet_schema_version (version) VALUES ($1)",
                          SCHEMA_VERSION + 1)
    finally:
        await raw.close()
    again = PostgresEventStore(database_url, schema=db.schema, pool_max=1)
    with pytest.raises(SchemaVersionError, match=str(SCHEMA_VERSION + 1)):
        await again.head("x")
    await again.close()

async def _old_schema(database_url: str, schema: str, version: int) -> asyncpg.Connection:
    """A connection into ``schema`` as a fleet of schema ``version`` left it (migrations
    1..version applied and recorded), for the upgrade tests; the caller closes it."""
    raw = await asyncpg.connect(database_url, server_settings={
        "default_transaction_isolation": "read committed"})
    try:
        await raw.execute(f'CREATE SCHEMA "{schema}"; SET search_path = "{schema}"')
        await raw.execute(VERSION_TABLE)
        for number, sql in MIGRATIONS[:version]:
            await raw.execute(sql)
            await raw.execute("INSERT INTO fleet_schema_version (version) VALUES ($1)", number)
    except BaseException:
        await raw.close()
        raise
    return raw


async def test_an_older_schema_is_upgraded_on_first_use(database_url: str) -> None:
    # A schema made by version 1 alone (what an old fleet left), holding logs
    # written by its own functions: the store brings it to the newest version,
    # and the rows written before the feed existed join it, each log in order.
    schema = fresh_schema()
    raw = await _old_schema(database_url, schema, 1)
    try:
        for x, stamps in (("u", (30, 10, 50)), ("v", (20, 40))):  # a clock step inside u
            events = [started(x, timestamp=T0 + stamps[0])] + [
                make_event(x, s, timestamp=T0 + t) for s, t in enumerate(stamps[1:], 1)]
            write = Write.of(x, events, None)
            row = await raw.fetchrow(APPEND_SQL, write.key, x, None, *write.args())
            assert row["code"] == 0
    finally:
        await raw.close()
    again = PostgresEventStore(database_url, schema=schema, pool_max=1)
    try:
        feed = await settled_feed(again, 5)  # another client's open transaction may hold it
        assert [(c.event.execution_id, c.event.sequence) for c in feed] == [
            ("v", 0), ("u", 0), ("u", 1), ("v", 1), ("u", 2)]
        await again.append(make_event("v", 2))  # the new functions write under the feed
        newest = await settled_feed(again, 1, after=feed[-1].position)
        assert [(c.event.execution_id, c.event.sequence) for c in newest] == [("v", 2)]
        assert await again.compact_through("u", 1) == 1
        assert [e.sequence for e in await again.read("u")] == [0, 2]
    finally:
        await again.close()
    raw = await asyncpg.connect(database_url, server_settings={"search_path": f'"{schema}"'})
    try:
        assert await raw.fetchval("SELECT max(version) FROM fleet_schema_version") == (
            SCHEMA_VERSION)
    finally:
        await raw.close()


_GENERIC_PLANNED = ("fleet_append", "fleet_append_if", "fleet_append_leased",
                    "fleet_append_many", "fleet_append_many_leased", "fleet_append_leased_v7",
                    "fleet_append_many_leased_v7")


async def _flush(raw: asyncpg.Connection, items: list[tuple[EventEnvelope, int | None]],
                 ops: dict[int, V6Op] | None = None) -> tuple[list[int], list[int | None]]:
    """One group-commit flush as a schema-6 client sends it (the leased flavour when
    ``ops``); its codes and details in the order of ``items``."""
    prepared = [(i, Write.of(e.execution_id, [e], None), fence)
                for i, (e, fence) in enumerate(items)]
    columns = many_columns(prepared)
    if ops is None:
        row = await raw.fetchrow(APPEND_MANY_SQL, *columns)
    else:
        row = await raw.fetchrow(V6_MANY_LEASED_SQL, *columns,
                                 *v6_lease_columns(prepared, ops, T0))
    codes: list[int] = [0] * len(items)
    details: list[int | None] = [None] * len(items)
    for (i, _, _), code, detail in zip(prepared, row["codes"], row["details"], strict=True):
        codes[i], details[i] = code, detail  # many_columns sorted the items by key
    return codes, details


async def _flushes(raw: asyncpg.Connection, p: str) -> list[object]:
    """The same flushes on logs named with prefix ``p``: their answers and what they left."""
    return [
        await _flush(raw, [(started(f"{p}a"), None), (started(f"{p}b"), None)],
                     {0: ("h", T0 + 60_000)}),
        # A fenced write that ends its lease, an unfenced one, a stale token on a log
        # with no fence row (refused, no row made), a gap and a taken slot (the second
        # request of b, judged after the first was written).
        await _flush(raw, [(make_event(f"{p}a", 1), 1), (make_event(f"{p}b", 1), None),
                           (started(f"{p}d"), 7), (make_event(f"{p}e", 2), None),
                           (make_event(f"{p}b", 1), None)], {0: "release"}),
        await _flush(raw, [(started(f"{p}a"), None)], {0: ("i", T0)}),
        await _flush(raw, [(make_event(f"{p}b", 2), None), (make_event(f"{p}b", 3), None)]),
        await _flush(raw, [(make_event(f"{p}b", 4), 3)]),  # stale: b's row holds token 0
        [tuple(r) for r in await raw.fetch(
            "SELECT f.token, f.holder, f.lease_expires_at, x.head, x.status FROM fences AS f "
            "FULL JOIN executions AS x USING (ekey) WHERE ekey = ANY ($1) ORDER BY 4",
            [execution_key(f"{p}{x}") for x in "abde"])],
    ]


async def test_a_version_5_schema_is_upgraded_to_6_and_its_calls_keep_their_answers(
        database_url: str) -> None:
    # Version 6 replaces the flush functions in place (same arguments, same
    # answers) and plans the append functions once per connection: a process of
    # version 5 sends the same calls before and after the upgrade.
    schema = fresh_schema()
    raw = await _old_schema(database_url, schema, 5)
    try:
        before = await _flushes(raw, "v5-")
    finally:
        await raw.close()
    assert before == [
        ([0, 0], [1, None]),
        ([0, 0, 1, 3, 2], [0, 0, 0, None, 1]),
        ([2], [1]),
        ([0, 0], [1, 2]),
        ([1], [0]),
        [(1, None, None, 1, "running"), (0, None, None, 3, "running")],
    ]
    store = PostgresEventStore(database_url, schema=schema, pool_max=1)
    try:
        assert await store.head("v5-a") == 1  # first use migrates
        raw = await _raw(store, database_url)
        try:
            # 6, and any later migration (7 leases on the server clock, 8 fleet_claim_timers,
            # 9 the backlog, 10 the queues).
            assert await raw.fetchval("SELECT max(version) FROM fleet_schema_version") == (
                SCHEMA_VERSION) >= 6
            configs = dict(await raw.fetch(
                "SELECT p.proname, p.proconfig FROM pg_proc AS p "
                "WHERE p.pronamespace = $1::regnamespace AND p.proname LIKE 'fleet_append%'",
                schema))
            assert configs == {name: ["plan_cache_mode=force_generic_plan"]
                               for name in _GENERIC_PLANNED}
            assert await _flushes(raw, "v6-") == before
        finally:
            await raw.close()
        for p in ("v5-", "v6-"):
            assert [e.sequence for e in await store.read(f"{p}a")] == [0, 1]
            assert [e.sequence for e in await store.read(f"{p}b")] == [0, 1, 2, 3]
            assert await store.head(f"{p}d") is None
        feed = await settled_feed(store, 12)
        assert [(c.event.execution_id, c.event.sequence) for c in feed] == [
            (f"{p}{x}", n) for p in ("v5-", "v6-")
            for x, n in (("a", 0), ("b", 0), ("a", 1), ("b", 1), ("b", 2), ("b", 3))]
    finally:
        await store.close()


async def test_migrate_false_refuses_an_empty_database(database_url: str) -> None:
    store = PostgresEventStore(database_url, schema=fresh_schema(), migrate=False, pool_max=1)
    with pytest.raises(SchemaVersionError, match="fleet db upgrade"):
        await store.open()
    await store.close()


async def test_two_stores_migrate_one_schema_concurrently(database_url: str) -> None:
    schema = fresh_schema()
    stores = [PostgresEventStore(database_url, schema=schema, pool_max=1) for _ in range(4)]
    try:
        await asyncio.gather(*(s.open() for s in stores))
        await stores[0].append(started("m"))
        assert await stores[3].head("m") == 0
    finally:
        for s in stores:
            await s.close()


async def test_corrupt_row_raises_and_neighbours_still_read(
        db: PostgresEventStore, database_url: str) -> None:
    await db.append_batch([started("a"), make_event("a", 1), make_event("a", 2)])
    raw = await _raw(db, database_url)
    try:
        await raw.execute("UPDATE events SET body = 'not json {' "
                          "WHERE ekey = fleet_key('a') AND sequence = 1")
    finally:
        await raw.close()
    with pytest.raises(CorruptLogError, match="sequence 1") as corrupt:
        await db.read("a")
    assert corrupt.value.details == {"execution_id": "a", "sequence": 1}
    assert [e.sequence for e in await db.read("a", after=1)] == [2]


async def test_payload_over_the_limit_is_refused_before_writing(database_url: str) -> None:
    store = PostgresEventStore(database_url, schema=fresh_schema(), pool_max=1,
                               max_event_bytes=4096)
    try:
        await store.append(started("big"))
        with pytest.raises(PayloadTooLargeError, match="4096"):
            await store.append(make_event("big", 1, payload={"output": "é" * 3000}))
        assert await store.head("big") == 0
        await store.append(make_event("big", 1, payload={"output": "x" * 1000}))
    finally:
        await store.close()


async def test_closed_store_refuses(db: PostgresEventStore) -> None:
    await db.close()
    with pytest.raises(StoreError, match="closed"):
        await db.head("x")


async def test_snapshot_store_shares_the_pool(db: PostgresEventStore) -> None:
    snapshots = db.snapshot_store()
    await snapshots.save(Snapshot("s", 3, {"n": 1}))
    await snapshots.close()
    assert await db.head("s") is None  # the event store still has its pool
    again = db.snapshot_store()
    assert await again.load("s") == Snapshot("s", 3, {"n": 1})
    await again.close()


async def test_factory_opens_postgres_urls(database_url: str) -> None:
    schema = fresh_schema()
    opened = open_event_store(f"{database_url}?schema={schema}&pool_max=2")
    snapshots = open_snapshot_store(f"{database_url}?schema={schema}&pool_max=2")
    # Group commit is the default on Postgres (decision 0029); the store is inside.
    assert isinstance(opened, CoalescingEventStore)
    store = opened.inner
    try:
        assert isinstance(store, PostgresEventStore)
        assert isinstance(snapshots, PostgresSnapshotStore)
        assert store.schema == schema
        assert isinstance(open_event_store(f"{database_url}?schema={schema}",
                                           StoreOptions(group_commit=False)),
                          PostgresEventStore)  # off when asked (never opened: no pool)
        await store.append(started("f"))
        await snapshots.save(Snapshot("f", 0, {}))
        assert await store.head("f") == 0
    finally:
        await store.close()
        await snapshots.close()
    assert postgres_event_store_class() is PostgresEventStore


def test_fleet_exports_the_class_lazily() -> None:
    import fleet

    assert fleet.PostgresEventStore is PostgresEventStore


async def test_unreachable_server_is_unavailable_and_retryable() -> None:
    from postgres_server import free_port

    store = PostgresEventStore(f"postgresql://postgres@127.0.0.1:{free_port()}/none",
                               connect_timeout=2)
    with pytest.raises(StoreError) as refused:
        await store.head("x")
    assert refused.value.retryable
    await store.close()


def test_bad_pool_sizes_are_refused() -> None:
    with pytest.raises(ConfigurationError):
        PostgresEventStore("postgresql://h/db", pool_min=5, pool_max=2)
    with pytest.raises(ConfigurationError, match="integers"):
        PostgresEventStore("postgresql://h/db?pool_max=lots")


async def test_append_many_judges_each_request_alone(db: PostgresEventStore,
                                                     database_url: str) -> None:
    await db.append(started("a"))
    await db.append(started("b"))
    await db.append_batch([started("c"), make_event("c", 1)])
    old = await db.acquire_fence("b", holder="w1", lease_ms=60_000)
    new = await db.acquire_fence("b", holder="w2", lease_ms=60_000)
    requests: list[tuple[list[EventEnvelope], int | None]] = [
        ([make_event("a", 1)], None),
        ([make_event("b", 1)], old.token),                     # stale
        ([make_event("c", 0)], None),                          # slot taken
        ([make_event("c", 5)], None),                          # gap
        ([started("n")], None),                                # a new log ...
        ([make_event("n", 1)], None),                          # ... and two more of it,
        ([make_event("n", 2, E.TIMER_SCHEDULED, {"timerId": "t", "dueAt": T0})], None),
        ([make_event("ghost", 1)], None),                      # no log: a gap
        ([make_event("b", 1), make_event("b", 2, E.EXECUTION_SUSPENDED)], new.token),
        ([], None),                                            # not a batch
    ]
    results = await db.append_many(requests)
    kinds = [type(r).__name__ if r else None for r in results]
    assert kinds == [None, "StaleFenceError", "DuplicateSequenceError", "SequenceGapError",
                     None, None, None, "SequenceGapError", None, "ValidationError"]
    assert [await db.head(x) for x in ("a", "b", "c", "n", "ghost")] == [1, 2, 1, 2, None]
    b = await db.get_execution("b")
    assert b is not None
    assert (b.status, b.waiting_on, b.fence) == ("parked", "approval", new.token)
    assert [(t.execution_id, t.timer_id) for t in await db.due_timers(T0)] == [("n", "t")]
    raw = await _raw(db, database_url)
    try:
        assert await raw.fetchval("SELECT count(*) FROM fences WHERE ekey = fleet_key('ghost')"
                                  ) == 0  # the refused request left no token-0 row
    finally:
        await raw.close()


async def test_coalescer_groups_and_isolates_a_failing_request(database_url: str) -> None:
    inner = PostgresEventStore(database_url, schema=fresh_schema(), pool_max=4)
    store = CoalescingEventStore(inner, max_batch=64)
    try:
        for x in ("g0", "g1", "g2", "g3"):
            await store.append(started(x))
        grant = await store.acquire_fence("g1", holder="w", lease_ms=60_000)
        flushes = store.flushes
        writes = [store.append(make_event("g0", 1)),
                  store.append(make_event("g1", 1), fence=grant.token - 1),  # stale
                  store.append(make_event("g2", 0)),                         # taken slot
                  store.append_batch([make_event("g3", 1), make_event("g3", 2)])]
        writes += [store.append(started(f"n{i}")) for i in range(40)]
        results = await asyncio.gather(*writes, return_exceptions=True)
        assert isinstance(results[1], StaleFenceError)
        assert isinstance(results[2], DuplicateSequenceError)
        assert [r for i, r in enumerate(results) if i not in (1, 2)] == [None] * 42
        assert [await store.head(x) for x in ("g0", "g1", "g2", "g3")] == [1, 0, 0, 2]
        assert len(await store.list_executions(limit=1000)) == 44
        assert store.flushes - flushes < 4  # 44 requests, a few transactions
    finally:
        await store.close()


async def _first(conn: asyncpg.Connection, query: str, *args: object) -> object:
    """The first answer of ``query`` that is not NULL, asked again until there is one."""
    for _ in range(3000):
        answer = await conn.fetchval(query, *args)
        if answer is not None:
            return answer
        await asyncio.sleep(0.01)
    raise AssertionError(f"no answer from {query!r}")


async def test_a_flush_whose_link_is_lost_gives_each_request_its_single_calls_verdict(
        db: PostgresEventStore, database_url: str) -> None:
    """The connection of a flush dies while the flush waits on a fence lock, so nothing
    of it committed. A plain request is settled by reading its slots back (absent: sent
    again, written); a releasing one whose bytes are not there and an acquiring one
    answer the lost link, as their single calls do: never written twice, no token
    taken blind (decision 0029, "Leased writes in group commit")."""
    await db.append(started("ll-plain"))
    grant = await db.append_acquiring([started("ll-rel")], holder="w", lease_ms=60_000)
    assert grant is not None
    blocker = await _raw(db, database_url)
    watcher = await _raw(db, database_url)
    try:
        await blocker.execute("BEGIN")
        await blocker.execute("SELECT 1 FROM fences WHERE ekey = fleet_key('ll-plain') "
                              "FOR UPDATE")
        flush = asyncio.create_task(db.append_many_leased([
            ([make_event("ll-plain", 1)], None),
            ReleasingAppend([make_event("ll-rel", 1)], grant.token),
            AcquiringAppend([started("ll-acq")], "w2", 60_000)]))
        waiting = ("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                   "AND pid <> pg_backend_pid() AND wait_event_type = 'Lock' "
                   "AND query LIKE '%fleet_append_many_leased%'")
        pid = await _first(watcher, waiting)
        assert await watcher.fetchval("SELECT pg_terminate_backend($1)", pid)
        await _first(watcher, "SELECT true WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity "
                     "WHERE pid = $1)", pid)  # gone before the lock it waits on is freed
        await blocker.execute("ROLLBACK")
        answers = await flush
        assert answers[0] is None, answers
        assert isinstance(answers[1], StoreUnavailableError), answers
        assert isinstance(answers[2], StoreUnavailableError), answers
        assert [await db.head(x) for x in ("ll-plain", "ll-rel", "ll-acq")] == [1, 0, None]
        row = await db.get_execution("ll-rel")
        assert row is not None
        assert (row.fence, row.holder) == (grant.token, "w")  # its lease was not ended
        assert await watcher.fetchval(
            "SELECT count(*) FROM fences WHERE ekey = fleet_key('ll-acq')") == 0
    finally:
        await blocker.close()
        await watcher.close()
