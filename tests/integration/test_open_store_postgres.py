"""``fleet.open_store`` on a real Postgres (issue 29.1 and 29.2, decision 0050).

``open_store(url)``, the way the README opens a store, is the fast configuration:
the Postgres store behind group commit. A user's decorator over it that overrides
only ``append`` / ``append_batch`` sees every write of a run.
"""

from __future__ import annotations

import asyncio
import secrets

import pytest

from fleet import Context, PostgresEventStore, Runtime, flow, open_store
from fleet.kernel.store.coalescing import CoalescingEventStore
from fleet.kernel.store.conformance import WriteWitness
from fleet.kernel.store.spi import APPEND_LEASED, APPEND_MANY_LEASED, capabilities_of

pytestmark = pytest.mark.integration


def _inc(n: int) -> int:
    return n + 1


@flow("os3", steps=["a", "b", "c"])
async def three_steps(ctx: Context, n: int) -> int:
    n = await ctx.step("a", _inc, n)
    n = await ctx.step("b", _inc, n)
    return int(await ctx.step("c", _inc, n))


def _url(database_url: str) -> str:
    return f"{database_url}?schema=os_{secrets.token_hex(4)}"


async def test_open_store_on_postgres_is_group_committed(database_url: str) -> None:
    store = open_store(_url(database_url))
    try:
        assert isinstance(store, CoalescingEventStore)
        assert isinstance(store.inner, PostgresEventStore)
        assert {APPEND_LEASED, APPEND_MANY_LEASED} <= capabilities_of(store)
        runtime = Runtime(store, flows=[three_steps])
        handles = [await runtime.start("os3", i) for i in range(16)]
        assert await asyncio.gather(*(h.result(timeout=30) for h in handles)) == [
            i + 3 for i in range(16)]
        assert store.flushed >= 16 * 4  # every write went through the flushes
        await runtime.close()
    finally:
        await store.close()
    plain = open_store(_url(database_url), group_commit=False)
    try:
        assert isinstance(plain, PostgresEventStore)
    finally:
        await plain.close()


async def test_a_decorator_over_open_store_sees_every_write(database_url: str) -> None:
    inner = open_store(_url(database_url))
    witness = WriteWitness(inner)
    runtime = Runtime(witness, flows=[three_steps])
    try:
        handles = [await runtime.start("os3", i) for i in range(8)]
        await asyncio.gather(*(h.result(timeout=30) for h in handles))
        stored = [e.id for h in handles for e in await inner.read(h.execution_id)]
    finally:
        await runtime.close()
        await witness.close()  # the runtime does not own its store
    assert len(stored) == 8 * 8
    assert sorted(witness.seen) == sorted(stored)


async def test_fork_on_postgres_reuses_the_prefix(database_url: str) -> None:
    """Issue 29.4 on the production store: the fork's copy is one leased write."""
    store = open_store(_url(database_url))
    runtime = Runtime(store, flows=[three_steps])
    try:
        source = await runtime.start("os3", 10)
        assert await source.result(timeout=30) == 13
        forked = await runtime.fork(source.execution_id, from_step="b")
        assert await forked.result(timeout=30) == 13
        log = await store.read(forked.execution_id)
        assert log[0].payload["forkedFrom"]["executionId"] == source.execution_id
        summary = await store.get_execution(forked.execution_id)
        assert summary is not None
        assert (summary.status, summary.holder) == ("completed", None)
    finally:
        await runtime.close()
        await store.close()
