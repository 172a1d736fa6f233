"""The conformance kit on the SQLite store, plus what is specific to SQLite."""

from __future__ import annotations

import asyncio
import itertools
import os
import sqlite3
import sys
import textwrap
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import ManualClock

from fleet.kernel.errors import (
    ConfigurationError,
    CorruptLogError,
    DuplicateSequenceError,
    SchemaVersionError,
    StaleFenceError,
    StoreError,
)
from fleet.kernel.events import EventType
from fleet.kernel.store.conformance import (
    T0,
    EventStoreConformance,
    SnapshotStoreConformance,
    make_event,
    started,
)
from fleet.kernel.store.conformance_backlog import BacklogConformance
from fleet.kernel.store.spi import EventStore, Snapshot, SnapshotStore
from fleet.kernel.store.sqlite import SqliteEventStore
from fleet.kernel.store.sqlite_snapshots import SqliteSnapshotStore

# A small max_event_bytes, so the kit's event at the limit is cheap to write.
SMALL_LIMIT = 64 * 1024


class TestSqliteEventStore(EventStoreConformance, BacklogConformance):
    max_event_bytes = SMALL_LIMIT

    @pytest.fixture
    async def store(self, tmp_path: Path, clock: ManualClock) -> AsyncIterator[EventStore]:
        self.clock = clock
        store = SqliteEventStore(tmp_path / "fleet.db", clock=clock,
                                 max_event_bytes=SMALL_LIMIT)
        yield store
        await store.close()

    async def pass_time(self, ms: int) -> None:
        self.clock.advance(ms)


class TestSqliteSnapshotStore(SnapshotStoreConformance):
    @pytest.fixture
    async def snapshot_store(self, tmp_path: Path) -> AsyncIterator[SnapshotStore]:
        store = SqliteSnapshotStore(tmp_path / "fleet.db")
        yield store
        await store.close()


async def test_satisfies_the_protocols(tmp_path: Path) -> None:
    events, snapshots = SqliteEventStore(tmp_path / "p.db"), SqliteSnapshotStore(tmp_path / "p.db")
    try:
        assert isinstance(events, EventStore)
        assert isinstance(snapshots, SnapshotStore)
    finally:
        await events.close()
        await snapshots.close()


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[SqliteEventStore]:
    store = SqliteEventStore(tmp_path / "fleet.db")
    yield store
    await store.close()


def _raw(path: str | Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


async def test_wal_and_synchronous_normal(db: SqliteEventStore) -> None:
    await db.append(started("w"))
    raw = _raw(db.path)
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        raw.close()
    synchronous = await db._db.writer.call(
        lambda conn: conn.execute("PRAGMA synchronous").fetchone()[0])
    assert synchronous == 1  # NORMAL


@pytest.mark.parametrize(("body", "why"), [
    ("not json {", "not JSON"),
    ('{"id": "a-1"}', "not a valid envelope"),
    ('{"id":"a-1","executionId":"a","sequence":1,"type":"STEP_COMPLETED","timestamp":1,'
     '"payload":{"attempt":1},"metadata":{}}', "payload is invalid"),
    ('{"id":"a-0","executionId":"a","sequence":0,"type":"STEP_COMPLETED","timestamp":1,'
     '"payload":{"stepId":"s","attempt":1},"metadata":{}}', "holds the envelope of"),
])
async def test_corrupt_row_raises_and_neighbours_still_read(
        db: SqliteEventStore, body: str, why: str) -> None:
    await db.append_batch([started("a"), make_event("a", 1), make_event("a", 2)])
    kept = [started("b"), make_event("b", 1)]
    await db.append_batch(kept)
    raw = _raw(db.path)
    try:
        raw.execute("UPDATE events SET body = ? WHERE execution_id = 'a' AND sequence = 1",
                    (body,))
    finally:
        raw.close()
    with pytest.raises(CorruptLogError) as corrupt:
        await db.read("a")
    assert "'a'" in corrupt.value.message
    assert "sequence 1" in corrupt.value.message
    assert why in corrupt.value.message
    assert corrupt.value.details == {"execution_id": "a", "sequence": 1}
    assert [e.sequence for e in await db.read("a", after=1)] == [2]  # the rest is readable
    assert await db.read("b") == kept
    await db.append(make_event("b", 2))  # and writable
    # The feed hands the stored text on as it is; parsing it says what is wrong.
    (row,) = [c for c in await db.read_committed() if (c.execution_id, c.sequence) == ("a", 1)]
    assert row.json == body
    with pytest.raises(CorruptLogError) as feed_corrupt:
        _ = row.event
    assert feed_corrupt.value.details == {"execution_id": "a", "sequence": 1}


async def test_corrupt_snapshot_raises(tmp_path: Path) -> None:
    snapshots = SqliteSnapshotStore(tmp_path / "fleet.db")
    try:
        await snapshots.save(Snapshot("s", 1, {"ok": True}))
        raw = _raw(tmp_path / "fleet.db")
        raw.execute("UPDATE snapshots SET state = '[1, 2' WHERE execution_id = 's'")
        raw.close()
        with pytest.raises(CorruptLogError, match="'s'"):
            await snapshots.load("s")
    finally:
        await snapshots.close()


async def test_data_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "fleet.db"
    store = SqliteEventStore(path)
    events = [started("p", flow_id="f", tenant="t"), make_event("p", 1),
              make_event("p", 2, EventType.TIMER_SCHEDULED, {"timerId": "t", "dueAt": T0})]
    await store.append_batch(events)
    grant = await store.acquire_fence("p", holder="w", lease_ms=60_000)
    await store.close()
    with pytest.raises(StoreError, match="closed"):
        await store.head("p")

    store = SqliteEventStore(path)
    try:
        assert await store.read("p") == events
        summary = await store.get_execution("p")
        assert summary is not None
        assert (summary.flow_id, summary.tenant, summary.head, summary.fence) == (
            "f", "t", 2, grant.token)
        assert [t.timer_id for t in await store.due_timers(T0)] == ["t"]
        with pytest.raises(StaleFenceError):
            await store.append(make_event("p", 3), fence=grant.token - 1)
        await store.append(make_event("p", 3), fence=grant.token)
    finally:
        await store.close()


async def test_in_memory_database_is_refused(tmp_path: Path) -> None:
    for path in (":memory:", "", "file::memory:?cache=shared"):
        with pytest.raises(ConfigurationError, match="memory"):
            SqliteEventStore(path)


async def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    raw = _raw(path)
    raw.execute("PRAGMA user_version = 99")
    raw.close()
    with pytest.raises(SchemaVersionError, match="99"):
        SqliteEventStore(path)


async def test_unopenable_file_is_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="cannot open"):
        SqliteEventStore(tmp_path / "no" / "such" / "dir" / "fleet.db")


async def test_group_commit_isolates_a_failing_request(db: SqliteEventStore) -> None:
    for x in ("g0", "g1", "g2", "g3"):
        await db.append(started(x))
    grant = await db.acquire_fence("g1", holder="w", lease_ms=60_000)
    writes = [db.append(make_event("g0", 1)),
              db.append(make_event("g1", 1), fence=grant.token - 1),  # stale
              db.append(make_event("g2", 0)),                         # taken slot
              db.append_batch([make_event("g3", 1), make_event("g3", 2)])]
    writes += [db.append(started(f"n{i}")) for i in range(40)]
    results = await asyncio.gather(*writes, return_exceptions=True)
    assert isinstance(results[1], StaleFenceError)
    assert isinstance(results[2], DuplicateSequenceError)
    assert [r for i, r in enumerate(results) if i not in (1, 2)] == [None] * 42
    assert [await db.head(x) for x in ("g0", "g1", "g2", "g3")] == [1, 0, 0, 2]
    assert len(await db.list_executions(limit=1000)) == 44
    # Requests were grouped: fewer transactions than writes.
    assert db._db.writer.transactions < db._db.writer.requests


async def test_a_request_failing_midway_leaves_nothing(db: SqliteEventStore) -> None:
    # A row behind the index's back (hand-inserted at sequence 2) makes a batch
    # fail on its second insert; its savepoint must undo the first insert while
    # the requests grouped with it still commit.
    await db.append(started("mid"))
    stray = make_event("mid", 2)
    raw = _raw(db.path)
    try:
        raw.execute("INSERT INTO events (execution_id, sequence, type, timestamp, body) "
                    "VALUES ('mid', 2, ?, ?, ?)",
                    (stray.type.value, stray.timestamp, stray.to_json()))
        results = await asyncio.gather(
            db.append_batch([make_event("mid", 1), make_event("mid", 2)]),
            *(db.append(started(f"ok{i}")) for i in range(10)), return_exceptions=True)
        assert isinstance(results[0], DuplicateSequenceError)
        assert results[1:] == [None] * 10
        rows = raw.execute("SELECT sequence FROM events WHERE execution_id = 'mid' "
                           "ORDER BY sequence").fetchall()
        assert rows == [(0,), (2,)]
    finally:
        raw.close()
    assert await db.head("mid") == 0
    assert all([await db.head(f"ok{i}") == 0 for i in range(10)])


async def test_stores_on_one_file_share_connections(tmp_path: Path) -> None:
    events = SqliteEventStore(tmp_path / "fleet.db")
    snapshots = SqliteSnapshotStore(str(tmp_path / "." / "fleet.db"))
    try:
        assert events._db is snapshots._db
        await events.append(started("s"))
        await snapshots.save(Snapshot("s", 0, {"n": 1}))
        await snapshots.close()
        assert await events.head("s") == 0  # the other user keeps the threads alive
    finally:
        await snapshots.close()
        await events.close()
    again = SqliteSnapshotStore(tmp_path / "fleet.db")
    try:
        assert await again.load("s") == Snapshot("s", 0, {"n": 1})
    finally:
        await again.close()


async def test_real_clock_leases(db: SqliteEventStore) -> None:
    grant = await db.acquire_fence("rc", holder="w", lease_ms=50)
    assert await db.acquire_fence_if("rc", holder="v", lease_ms=50) is None
    await asyncio.sleep(0.15)
    taken = await db.acquire_fence_if("rc", holder="v", lease_ms=50)
    assert taken is not None
    assert taken.token == grant.token + 1


async def test_a_cancelled_caller_does_not_wedge_the_writer(db: SqliteEventStore) -> None:
    await db.append(started("cx"))
    task = asyncio.create_task(db.append(make_event("cx", 1)))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    # A write queued behind the cancelled one answers only after it ran, so the
    # head is settled: the write may or may not have landed, never half of it.
    await db.acquire_fence("elsewhere", holder="w", lease_ms=1)
    head = await db.head("cx")
    assert head in (0, 1)
    await db.append(make_event("cx", head + 1))
    assert await db.head("cx") == head + 1


_OTHER_PROCESS = textwrap.dedent("""
    import asyncio, sys
    from fleet.kernel.errors import DuplicateSequenceError
    from fleet.kernel.store.conformance import make_event
    from fleet.kernel.store.sqlite import SqliteEventStore

    async def main():
        store = SqliteEventStore(sys.argv[1])
        landed = 0
        while landed < 300:
            head = await store.head("shared")
            try:
                await store.append(make_event("shared", head + 1, payload={"stepId": "other"}))
                landed += 1
            except DuplicateSequenceError:
                pass
        await store.close()

    asyncio.run(main())
""")


async def test_two_processes_share_one_log(db: SqliteEventStore) -> None:
    # The checks and the insert run under BEGIN IMMEDIATE, so another process on
    # the same file can never slip an event into a slot this one checked.
    await db.append(started("shared"))
    other = await asyncio.create_subprocess_exec(sys.executable, "-c", _OTHER_PROCESS,
                                                 str(db.path))
    while await db.head("shared") == 0:  # noqa: ASYNC110 - start once the other one writes
        await asyncio.sleep(0.005)
    landed = 0
    while landed < 300:
        head = await db.head("shared")
        assert head is not None
        try:
            await db.append(make_event("shared", head + 1, payload={"stepId": "this"}))
            landed += 1
        except DuplicateSequenceError:
            pass
    assert await other.wait() == 0
    log = await db.read("shared")
    assert [e.sequence for e in log] == list(range(601))
    writers = [e.payload["stepId"] for e in log[1:]]
    assert sorted(writers) == ["other"] * 300 + ["this"] * 300
    assert sum(a != b for a, b in itertools.pairwise(writers)) > 2  # they did interleave


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # 3.12+ frowns on fork with threads
async def test_a_forked_child_opens_its_own_connections(db: SqliteEventStore) -> None:
    # A prefork worker inherits the parent's open-file registry but not its threads.
    await db.append(started("parent"))

    async def child_work() -> None:
        store = SqliteEventStore(db.path)
        await store.append(started("child"))
        await store.close()

    pid = os.fork()
    if pid == 0:  # the child: a fresh thread has no running loop to trip over
        worker = threading.Thread(target=lambda: asyncio.run(child_work()))
        worker.start()
        worker.join(timeout=20)
        os._exit(1 if worker.is_alive() else 0)
    _, status = await asyncio.to_thread(os.waitpid, pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert await db.head("child") == 0
