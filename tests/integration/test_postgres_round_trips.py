"""How many round trips a 3-step execution costs on a real Postgres (decision 0029).

Counted at the asyncpg boundary: every query the store sends goes through its
pool, wrapped here in a counter of ``run`` (and ``fetch``/``fetchrow``/``fetchval``/``execute``)
calls (the pool and the server are real; the counter only forwards). A start
that drives here takes the fence with its first write and releases it with its
last: 1 + one per step, 4 for three steps (7 before: acquire, start, four
batches, release).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fleet import Context, Runtime, flow
from fleet.kernel.store.coalescing import CoalescingEventStore
from fleet.kernel.store.postgres import PostgresEventStore
from fleet.kernel.store.spi import EventStore

pytestmark = pytest.mark.integration

_CALLS = ("fetch", "fetchrow", "fetchval", "execute", "executemany")


class CountingPool:
    """Forwards to a real asyncpg pool; notes the first words of every query it sends."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.sent: list[str] = []

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.pool, name)
        if name not in _CALLS:
            return target

        async def call(query: str, *args: Any, **kw: Any) -> Any:
            self.sent.append(" ".join(query.split()[:4]))
            return await target(query, *args, **kw)

        return call

    async def run(self, method: str, query: str, args: tuple[Any, ...]) -> Any:
        """The store's one call per query (``Connections.run``)."""
        self.sent.append(" ".join(query.split()[:4]))
        return await self.pool.run(method, query, args)


@pytest.fixture
async def counted(database_url: str) -> AsyncIterator[tuple[PostgresEventStore, CountingPool]]:
    store = await PostgresEventStore(database_url, schema=f"rt_{secrets.token_hex(5)}",
                                     pool_max=4).open()
    # The store's one pool (``open`` made it): every query of the store passes here.
    pool = CountingPool(store._db.pool)  # the boundary, counted
    store._db.pool = pool
    yield store, pool
    await store.close()


@flow("rt3", steps=["a", "b", "c"])
async def three_steps(ctx: Context, n: int) -> int:
    n = await ctx.step("a", lambda: n + 1)
    n = await ctx.step("b", lambda: n + 1)
    return int(await ctx.step("c", lambda: n + 1))


async def _one(store: EventStore, pool: CountingPool) -> list[str]:
    runtime = Runtime(store, flows=[three_steps])
    try:
        await (await runtime.start("rt3", 0)).result(timeout=10)  # warm: pool, plans
        pool.sent.clear()
        handle = await runtime.start("rt3", 1)
        assert await handle.result(timeout=10) == 4
        sent = list(pool.sent)
        log = await store.read(handle.execution_id)
        summary = await store.get_execution(handle.execution_id)
    finally:
        await runtime.close()
    assert [str(e.type) for e in log] == [
        "EXECUTION_STARTED", "STEP_STARTED", "STEP_COMPLETED", "STEP_STARTED",
        "STEP_COMPLETED", "STEP_STARTED", "STEP_COMPLETED", "EXECUTION_COMPLETED"]
    # The lease was ended by the last write: nobody holds it, the token stays.
    assert summary is not None
    assert (summary.status, summary.holder, summary.lease_expires_at) == ("completed", None,
                                                                          None)
    assert summary.fence >= 1
    return sent


async def test_a_three_step_execution_is_four_round_trips(
        counted: tuple[PostgresEventStore, CountingPool]) -> None:
    store, pool = counted
    sent = await _one(store, pool)
    assert len(sent) <= 4, sent
    # What each is for: take the fence + start + first STEP_STARTED; a step's
    # completion + the next STEP_STARTED (twice); the last completion + the end +
    # the release.
    # (The leased ones answer the server's now too: leases on its clock, decision 0044.)
    assert sent == ["SELECT code, detail, o_now", "SELECT code, detail FROM",
                    "SELECT code, detail FROM", "SELECT code, detail, o_now"], sent


async def test_behind_group_commit_it_is_four_round_trips_too(
        counted: tuple[PostgresEventStore, CountingPool]) -> None:
    store, pool = counted
    sent = await _one(CoalescingEventStore(store), pool)
    assert len(sent) <= 4, sent


async def test_at_32_at_once_behind_group_commit_flushes_carry_the_leased_writes_too(
        counted: tuple[PostgresEventStore, CountingPool]) -> None:
    """The four writes of 32 executions run at once share flushes: the one that takes
    the fence and the one that ends it as well as the two between (decision 0029,
    "Leased writes in group commit"). Counted, not timed: statements and flushes."""
    store, pool = counted
    grouped = CoalescingEventStore(store)
    runtime = Runtime(grouped, flows=[three_steps])
    try:
        await (await runtime.start("rt3", 0)).result(timeout=10)  # warm: pool, plans
        pool.sent.clear()
        flushes, flushed = grouped.flushes, grouped.flushed
        handles = await asyncio.gather(*(runtime.start("rt3", n) for n in range(32)))
        results = await asyncio.gather(*(h.result(timeout=30) for h in handles))
        sent = list(pool.sent)
        flushes, flushed = grouped.flushes - flushes, grouped.flushed - flushed
    finally:
        await runtime.close()
    assert results == [n + 3 for n in range(32)]
    for handle in handles:
        summary = await store.get_execution(handle.execution_id)
        assert summary is not None
        assert (summary.status, summary.head, summary.holder) == ("completed", 7, None)
    assert flushed == 4 * 32  # every write went through a flush: the counters are true
    assert flushed / flushes > 4, (flushes, flushed)  # leased writes share them too
    # One statement per flush (one commit), and far fewer than 4 per execution. (A
    # result read back from the log, when a run ended before its handle was awaited,
    # is a read: not counted.)
    writes = [q for q in sent if q in ("SELECT code, detail FROM", "SELECT codes, details FROM",
                                       "SELECT code, detail, o_now",
                                       "SELECT codes, details, o_now")]
    assert len(writes) == flushes, sent
    assert len(writes) <= 32, sent
