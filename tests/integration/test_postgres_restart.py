"""A Postgres restart under a live store and under running flows.

These tests restart the server, so they never use a shared one: the module
starts its own cluster (initdb + pg_ctl from the local binaries, in a
temporary directory) and stops it at the end.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from postgres_server import OwnServer

from fleet import Context, Runtime, flow
from fleet.kernel.errors import RunAborted, StoreUnavailableError
from fleet.kernel.events import EventType
from fleet.kernel.store.conformance import make_event, started
from fleet.kernel.store.postgres import PostgresEventStore
from fleet.kernel.store.spi import Snapshot

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def server() -> Iterator[OwnServer]:
    own = OwnServer()
    try:
        yield own
    finally:
        own.stop()


def schema() -> str:
    return f"r_{secrets.token_hex(5)}"


async def test_reads_and_appends_survive_a_restart(server: OwnServer) -> None:
    store = await PostgresEventStore(server.url, schema=schema(), pool_min=3,
                                     pool_max=3).open()
    try:
        await store.append(started("s"))
        grant = await store.acquire_fence("s", holder="w", lease_ms=600_000)
        await store.append(make_event("s", 1), fence=grant.token)
        await asyncio.to_thread(server.restart)
        # Every pooled connection is dead now. A read is retried on a fresh one;
        # an append finds its slot empty and is sent again; a snapshot write too.
        assert await store.head("s") == 1
        for sequence in range(2, 6):
            await store.append(make_event("s", sequence), fence=grant.token)
        snapshots = store.snapshot_store()
        await asyncio.to_thread(server.restart)
        await snapshots.save(Snapshot("s", 5, {"ok": True}))
        await snapshots.close()
        assert [e.sequence for e in await store.read("s")] == list(range(6))
    finally:
        await store.close()


async def test_an_acquire_across_a_restart_is_typed_and_retryable(server: OwnServer) -> None:
    store = await PostgresEventStore(server.url, schema=schema(), pool_min=1,
                                     pool_max=1).open()
    try:
        await store.append(started("a"))
        await asyncio.to_thread(server.restart)
        # The pool may notice the dead connection first and reconnect; if the
        # call meets it, the acquire is not retried (a bump may hide behind a
        # lost answer) and surfaces typed and retryable.
        refusals: list[StoreUnavailableError] = []
        try:
            grant = await store.acquire_fence("a", holder="w", lease_ms=60_000)
        except StoreUnavailableError as lost:
            refusals.append(lost)
            grant = await store.acquire_fence("a", holder="w", lease_ms=60_000)
        assert all(r.retryable for r in refusals)
        await store.append(make_event("a", 1), fence=grant.token)
        assert await store.head("a") == 1
    finally:
        await store.close()


async def _work(n: int, step: str) -> str:
    await asyncio.sleep(0.03)
    return f"{step}{n}"


@flow("restartable", steps=["a", "b", "c", "d"])
async def restartable(ctx: Context, n: int) -> list[str]:
    return [await ctx.step(step, _work, n, step) for step in ("a", "b", "c", "d")]


async def test_a_restart_during_runs_leaves_every_execution_resumable(
        server: OwnServer) -> None:
    store = await PostgresEventStore(server.url, schema=schema(), pool_max=4).open()
    runtime = Runtime(store, flows=[restartable], lease_ms=60_000)
    try:
        handles = [await runtime.start("restartable", n) for n in range(8)]
        await asyncio.sleep(0.05)
        await asyncio.to_thread(server.restart)
        outcomes: list[Any] = await asyncio.gather(
            *(asyncio.wait_for(h.result(), 30) for h in handles), return_exceptions=True)
        interrupted = [h.execution_id for h, o in zip(handles, outcomes, strict=True)
                       if isinstance(o, BaseException)]
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                cause = outcome.cause if isinstance(outcome, RunAborted) else outcome
                assert isinstance(cause, StoreUnavailableError), repr(outcome)
        # Re-drive what the restart interrupted (as the fleet's sweeper does).
        for execution_id in interrupted:
            for attempt in range(3):
                try:
                    await runtime.drive(execution_id, wait=True)
                    break
                except StoreUnavailableError:
                    assert attempt < 2
        for n, handle in enumerate(handles):
            assert await asyncio.wait_for(handle.result(), 30) == [
                f"{s}{n}" for s in ("a", "b", "c", "d")]
            log = await store.read(handle.execution_id)
            assert [e.sequence for e in log] == list(range(len(log)))  # nothing half-written
            assert log[-1].type is EventType.EXECUTION_COMPLETED
            done = [e.payload["stepId"] for e in log if e.type is EventType.STEP_COMPLETED]
            assert sorted(done) == ["a", "b", "c", "d"]
    finally:
        await runtime.close()
        await store.close()
