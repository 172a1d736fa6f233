"""What only a real Postgres server can show: races between connections and processes,
isolation under a hostile server default, hostile strings, and index use.

Every test uses its own schema in a database this module creates and drops.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest
from postgres_server import throwaway_database

from fleet import Context, Runtime, flow
from fleet.kernel.errors import StaleFenceError
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.store.coalescing import CoalescingEventStore
from fleet.kernel.store.conformance import T0, make_event, started
from fleet.kernel.store.pg_queries import DUE_TIMERS_SQL, listing_sql
from fleet.kernel.store.postgres import PostgresEventStore
from fleet.kernel.store.spi import Snapshot

pytestmark = pytest.mark.integration
E = EventType


@pytest.fixture(scope="module")
def repeatable_read_url() -> Iterator[str]:
    # A database whose default isolation is REPEATABLE READ: the store must not care.
    with throwaway_database(settings={"default_transaction_isolation": "repeatable read"}) as url:
        yield url


def schema() -> str:
    return f"c_{secrets.token_hex(5)}"


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[PostgresEventStore]:
    store = await PostgresEventStore(database_url, schema=schema(), pool_max=4).open()
    yield store
    await store.close()


async def raw(store: PostgresEventStore, url: str) -> asyncpg.Connection:
    """A plain connection on the store's schema, at the database's default isolation."""
    return await asyncpg.connect(url, server_settings={"search_path": f'"{store.schema}"'})


async def orphans(conn: asyncpg.Connection) -> int:
    """Event rows without an index row, or token-0 fence rows without a log."""
    events = await conn.fetchval("SELECT count(*) FROM events AS e WHERE NOT EXISTS "
                                 "(SELECT 1 FROM executions AS x WHERE x.ekey = e.ekey)")
    fences = await conn.fetchval("SELECT count(*) FROM fences AS f WHERE f.token = 0 AND "
                                 "NOT EXISTS (SELECT 1 FROM executions AS x "
                                 "WHERE x.ekey = f.ekey)")
    return int(events) + int(fences)


# ---------------------------------------------------------------- two processes

_RACER = textwrap.dedent("""
    import asyncio, json, sys
    from fleet.kernel.errors import StaleFenceError, DuplicateSequenceError
    from fleet.kernel.store.conformance import make_event
    from fleet.kernel.store.postgres import PostgresEventStore

    def say(**kw):
        print(json.dumps(kw), flush=True)

    async def main(url, schema, me):
        store = await PostgresEventStore(url, schema=schema, pool_max=2).open()
        loop = asyncio.get_running_loop()
        say(ready=True)
        await loop.run_in_executor(None, sys.stdin.readline)            # "go"
        grant = await store.acquire_fence_if("x", holder=me, lease_ms=60_000)
        won = grant is not None
        say(won=won, token=grant and grant.token)
        if not won:
            await loop.run_in_executor(None, sys.stdin.readline)        # "take over"
            grant = await store.acquire_fence("x", holder=me, lease_ms=60_000)
            say(took=grant.token)
        landed, refused = [], 0
        # The first holder writes until it has been refused 20 times; the
        # one that took over writes 400 events.
        while (refused < 20) if won else (len(landed) < 400):
            head = await store.head("x")
            event = make_event("x", head + 1, payload={"stepId": me, "output": grant.token})
            try:
                await store.append(event, fence=grant.token)
                landed.append(head + 1)
                if won and len(landed) == 30:
                    say(progress=True)
            except StaleFenceError:
                refused += 1
            except DuplicateSequenceError:
                pass
        say(landed=landed, refused=refused)
        await store.close()

    asyncio.run(main(*sys.argv[1:]))
""")


async def _spawn(url: str, schema_name: str, me: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", _RACER, url, schema_name, me, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE)


async def _line(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert line, "the racer died"
    return dict(json.loads(line))


async def test_two_processes_race_for_one_fence(db: PostgresEventStore,
                                                database_url: str) -> None:
    await db.append(started("x"))
    procs = [await _spawn(database_url, str(db.schema), name) for name in ("p1", "p2")]
    try:
        for proc in procs:
            assert (await _line(proc))["ready"]
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
        verdicts = [await _line(proc) for proc in procs]
        assert sorted(v["won"] for v in verdicts) == [False, True]  # exactly one holds it
        winner, loser = (procs if verdicts[0]["won"] else procs[::-1])
        win_name, lose_name = ("p1", "p2") if verdicts[0]["won"] else ("p2", "p1")
        assert (await _line(winner))["progress"]  # the holder is writing; now take over
        assert loser.stdin is not None
        loser.stdin.write(b"take over\n")
        await loser.stdin.drain()
        took = (await _line(loser))["took"]
        results = {win_name: await _line(winner), lose_name: await _line(loser)}
        for proc in procs:
            assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    log = await db.read("x")
    assert [e.sequence for e in log] == list(range(len(log)))
    writers = [(e.payload["stepId"], e.payload["output"]) for e in log[1:]]
    # The winner's events all precede the loser's first: nothing it wrote after
    # losing the fence is on the log, and the log holds exactly what each was told landed.
    first_of_loser = next(i for i, (w, _) in enumerate(writers) if w == lose_name)
    assert all(w == win_name for w, _ in writers[:first_of_loser])
    assert all(w == lose_name and token == took for w, token in writers[first_of_loser:])
    on_log = {name: [e.sequence for e in log[1:] if e.payload["stepId"] == name]
              for name in (win_name, lose_name)}
    assert on_log[win_name] == results[win_name]["landed"]
    assert on_log[lose_name] == results[lose_name]["landed"]
    assert results[win_name]["refused"] == 20  # it kept trying and was refused every time
    assert len(results[lose_name]["landed"]) == 400
    assert results[lose_name]["refused"] == 0


# ------------------------------------------------------- conditional appenders


async def test_eight_concurrent_conditional_appenders_one_wins_each_slot(
        db: PostgresEventStore, database_url: str) -> None:
    # Eight stores, eight pools: the race is between real server connections.
    stores = [await PostgresEventStore(database_url, schema=db.schema, pool_max=1).open()
              for _ in range(8)]
    try:
        await db.append(started("cc"))
        winners: list[int] = []
        for slot in range(1, 16):
            tips = await asyncio.gather(*(s.append_if_unchanged("cc", None) for s in stores))
            results = await asyncio.gather(*(
                s.append_if_unchanged("cc", make_event("cc", slot, E.OUTCOME_RECORDED,
                                                       {"key": f"k{i}"}), t.tip)
                for i, (s, t) in enumerate(zip(stores, tips, strict=True))))
            assert sum(r.appended for r in results) == 1, slot
            assert {r.reason for r in results if not r.appended} == {"moved"}
            winners.append(next(i for i, r in enumerate(results) if r.appended))
        log = await db.read("cc")
        assert [e.sequence for e in log] == list(range(16))
        assert [e.payload["key"] for e in log[1:]] == [f"k{w}" for w in winners]
    finally:
        for s in stores:
            await s.close()


async def test_delete_racing_a_conditional_append_leaves_no_orphan(
        db: PostgresEventStore, database_url: str) -> None:
    other = await PostgresEventStore(database_url, schema=db.schema, pool_max=2).open()
    rng = random.Random(3)
    outcomes: dict[str, int] = {}
    try:
        for i in range(40):
            x = f"del-{i}"
            await db.append_batch([started(x), make_event(x, 1)])
            if rng.random() < 0.5:
                await db.acquire_fence(x, holder="w", lease_ms=60_000)  # a real token
            tip = (await db.append_if_unchanged(x, None)).tip
            delay = rng.random() / 500

            async def delete(x: str = x, delay: float = delay) -> bool:
                await asyncio.sleep(delay)
                return await other.delete_execution(x)

            result, deleted = await asyncio.gather(
                db.append_if_unchanged(x, make_event(x, 2, E.OUTCOME_RECORDED), tip), delete())
            assert deleted
            outcomes[str(result.reason)] = outcomes.get(str(result.reason), 0) + 1
            assert await db.read(x) == []
            assert await db.get_execution(x) is None
        conn = await raw(db, database_url)
        try:
            assert await orphans(conn) == 0
        finally:
            await conn.close()
    finally:
        await other.close()
    assert sum(outcomes.values()) == 40


async def test_conditional_append_queued_behind_a_delete_is_gone(
        db: PostgresEventStore, database_url: str) -> None:
    # Deterministic order: the delete holds the fence row while the append waits on it.
    await db.append_batch([started("q"), make_event("q", 1)])
    tip = (await db.append_if_unchanged("q", None)).tip
    conn = await raw(db, database_url)
    try:
        async with conn.transaction():
            await conn.execute("SELECT fleet_delete(fleet_key('q'))")
            task = asyncio.create_task(
                db.append_if_unchanged("q", make_event("q", 2, E.OUTCOME_RECORDED), tip))
            await asyncio.sleep(0.2)
            assert not task.done()  # it waits on the fence row
        result = await task
        assert (result.appended, result.reason, result.tip.head) == (False, "gone", None)
        assert await orphans(conn) == 0
    finally:
        await conn.close()


# --------------------------------------------------- READ COMMITTED, explicitly


async def test_writes_see_what_committed_while_they_waited_under_repeatable_read(
        repeatable_read_url: str) -> None:
    """The database defaults to REPEATABLE READ. A write that waits on the fence
    row must judge what committed while it waited; at REPEATABLE READ it would
    judge its statement-start snapshot (or fail to serialise)."""
    store = await PostgresEventStore(repeatable_read_url, schema=schema(), pool_max=4).open()
    conn = await raw(store, repeatable_read_url)
    try:
        assert await conn.fetchval("SHOW default_transaction_isolation") == "repeatable read"

        # 1. A conditional append queued behind a delete: gone, no orphan.
        await store.append_batch([started("rc"), make_event("rc", 1)])
        await store.acquire_fence("rc", holder="w", lease_ms=60_000)
        tip = (await store.append_if_unchanged("rc", None)).tip
        async with conn.transaction(isolation="read_committed"):
            await conn.execute("SELECT fleet_delete(fleet_key('rc'))")
            pending = asyncio.create_task(
                store.append_if_unchanged("rc", make_event("rc", 2, E.OUTCOME_RECORDED), tip))
            await asyncio.sleep(0.2)
        result = await pending
        assert (result.appended, result.reason) == (False, "gone")
        assert await orphans(conn) == 0

        # 2. A fenced append queued behind a takeover: refused as stale.
        await store.append(started("tk"))
        grant = await store.acquire_fence("tk", holder="old", lease_ms=60_000)
        async with conn.transaction(isolation="read_committed"):
            await conn.execute("SELECT fleet_acquire_v7(fleet_key('tk'), 'new', 60000, false, "
                               "600000, NULL)")
            pending_append = asyncio.create_task(
                store.append(make_event("tk", 1), fence=grant.token))
            await asyncio.sleep(0.2)
        with pytest.raises(StaleFenceError):
            await pending_append
        assert await store.head("tk") == 0

        # 3. acquire_fence_if queued behind a holder that renewed its lease: refused.
        old = await store.acquire_fence("ls", holder="old", lease_ms=0)
        async with conn.transaction(isolation="read_committed"):
            await conn.execute("UPDATE fences SET lease_expires_at = fleet_now_ms() + 60000 "
                               "WHERE ekey = fleet_key('ls') AND token = $1", old.token)
            pending_acquire = asyncio.create_task(
                store.acquire_fence_if("ls", holder="new", lease_ms=1000))
            await asyncio.sleep(0.2)
        assert await pending_acquire is None
    finally:
        await conn.close()
        await store.close()


# -------------------------------------------------------------- hostile input

_HOSTILE = ("'; DROP TABLE executions; --", "\"); DELETE FROM events; --", "$1 $2 ::text",
            "a\\'b", "🚀 ünï 日本", "%_%", "tab\there")


async def test_hostile_and_incompressible_strings_round_trip(
        db: PostgresEventStore, database_url: str) -> None:
    rng = random.Random(7)
    # 10 KB of random characters does not compress: it must not reach a btree whole.
    noise = "".join(chr(rng.choice([rng.randrange(0x20, 0x7F), rng.randrange(0xA0, 0xD7FF),
                                    rng.randrange(0x10000, 0x10FFFF)])) for _ in range(10_240))
    snapshots = db.snapshot_store()
    try:
        for i, text in enumerate((*_HOSTILE, noise)):
            x, flow, tenant, gate, timer = (f"{text}{i}", f"f{text}", f"t{text}", f"g{text}",
                                            f"timer{text}")
            events = [started(x, flow_id=flow, tenant=tenant, owner=text),
                      make_event(x, 1, E.TIMER_SCHEDULED, {"timerId": timer, "dueAt": T0 + i}),
                      make_event(x, 2, E.EXECUTION_SUSPENDED, {"condition": {"on": gate}})]
            await db.append_batch(events)
            assert await db.read(x) == events
            for kw in ({"flow_id": flow}, {"tenant": tenant}, {"waiting_on": gate},
                       {"after_id": x[:-1]}):
                listed = await db.list_executions(**kw)  # type: ignore[arg-type]
                assert x in [s.execution_id for s in listed], kw
            assert (x, timer) in [(t.execution_id, t.timer_id)
                                  for t in await db.due_timers(T0 + 100)]
            await snapshots.save(Snapshot(x, 2, {"text": text}))
            assert await snapshots.load(x) == Snapshot(x, 2, {"text": text})
        conn = await raw(db, database_url)
        try:
            tables = {r["tablename"] for r in await conn.fetch(
                "SELECT tablename FROM pg_tables WHERE schemaname = $1", db.schema)}
            assert {"events", "executions", "fences", "timers", "snapshots"} <= tables
        finally:
            await conn.close()
        listed = await db.list_executions(limit=100)
        assert len(listed) == len(_HOSTILE) + 1
        ids = [s.execution_id for s in listed]
        assert ids == sorted(ids)  # code-point order, as memory and SQLite
    finally:
        await snapshots.close()


# ---------------------------------------------------------------- index use


def _index_names(plan: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(plan, dict):
        if "Index Name" in plan:
            found.add(plan["Index Name"])
        for value in plan.values():
            found |= _index_names(value)
    elif isinstance(plan, list):
        for value in plan:
            found |= _index_names(value)
    return found


async def test_each_listing_query_uses_an_index(db: PostgresEventStore,
                                                database_url: str) -> None:
    requests = []
    # Shaped like a fleet's index: most executions finished, a few running or parked.
    for i in range(3000):
        x = f"e{i:05d}"
        events = [started(x, flow_id=f"flow{i % 50}", tenant=f"tenant{i % 40}")]
        if i % 10 == 0:
            events.append(make_event(x, 1, E.EXECUTION_SUSPENDED,
                                     {"condition": {"on": f"gate{i % 30}"}}))
        elif i % 10 == 1:
            events.append(make_event(x, 1, E.TIMER_SCHEDULED,
                                     {"timerId": "t", "dueAt": T0 + i * 1000}))
        else:
            events.append(make_event(x, 1, E.EXECUTION_COMPLETED))
        requests.append((events, None))
    for start in range(0, len(requests), 500):
        assert set(await db.append_many(requests[start:start + 500])) == {None}
    conn = await raw(db, database_url)
    try:
        await conn.execute("ANALYZE")
        cases: list[tuple[dict[str, Any], str]] = [
            ({"status": "running"}, "executions_by_status"),
            ({"flow_id": "flow7"}, "executions_by_flow"),
            ({"tenant": "tenant3"}, "executions_by_tenant"),
            ({"status": "running", "lease_expired_at": T0}, "executions_by_status"),
            ({"waiting_on": "gate4"}, "executions_by_gate"),
        ]
        for filters, index in cases:
            sql, params = listing_sql(**{
                "status": None, "flow_id": None, "tenant": None, "waiting_on": None,
                "updated_before": None, "updated_after": None, "lease_expired_at": None,
                "after_id": None, "limit": 100, **filters})
            plan = json.loads(await conn.fetchval("EXPLAIN (FORMAT JSON) " + sql, *params))
            assert index in _index_names(plan), (filters, plan)
        # 300 timer rows fit in three pages, where a sequential scan and a sort is
        # the planner's right call; forbid it to show the index serves the query.
        await conn.execute("SET enable_seqscan = off")
        plan = json.loads(await conn.fetchval(
            "EXPLAIN (FORMAT JSON) " + DUE_TIMERS_SQL, T0 + 50_000, 100))
        assert "timers_by_due" in _index_names(plan), plan
    finally:
        await conn.close()


# ------------------------------------------------- runs on group commit


async def _double(n: int) -> int:
    await asyncio.sleep(0)
    return n * 2


@flow("three_steps", steps=["a", "b", "c"])
async def three_steps(ctx: Context, n: int) -> int:
    a = await ctx.step("a", _double, n)
    b = await ctx.step("b", _double, a)
    return int(await ctx.step("c", _double, b))


async def test_runs_on_group_commit_report_only_what_the_log_holds(
        database_url: str) -> None:
    inner = await PostgresEventStore(database_url, schema=schema(), pool_max=4).open()
    store = CoalescingEventStore(inner, max_batch=64)
    missing: list[str] = []
    reported: list[EventEnvelope] = []

    checks: list[asyncio.Task[Any]] = []

    async def durable(event: EventEnvelope) -> None:
        # Fired once the flush that carried the event committed: it is on the log.
        reported.append(event)
        checks.append(asyncio.current_task())  # type: ignore[arg-type]
        if (await inner.read(event.execution_id, after=event.sequence - 1))[:1] != [event]:
            missing.append(event.id)

    runtime = Runtime(store, flows=[three_steps], on_durable_event=durable)
    try:
        # Started at once, so their writes meet (group commit writes an append alone
        # when nothing else is queued or in flight: runs started one after another
        # may never share a commit).
        handles = await asyncio.gather(*(runtime.start("three_steps", n) for n in range(24)))
        results = await asyncio.gather(*(asyncio.wait_for(h.result(), 30) for h in handles))
        assert results == [n * 8 for n in range(24)]
        await asyncio.gather(*checks)
        assert missing == []
        assert len(reported) == sum([len(await inner.read(h.execution_id)) for h in handles])
        assert store.flushes < store.flushed  # appends of different runs shared commits
    finally:
        await runtime.close()
        await store.close()
