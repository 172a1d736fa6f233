"""Fencing: a runtime that lost the fence cannot write again."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kernel_kit import drove, dumped, kinds, settle

from fleet import Context, EventEnvelope, Runtime, StaleFenceError, flow
from fleet.kernel.store.spi import EventStore


async def test_a_superseded_runtime_is_refused_and_writes_nothing_more(
        store: EventStore) -> None:
    release, entered = asyncio.Event(), asyncio.Event()
    calls: list[str] = []

    async def effect() -> str:
        calls.append("call")
        if len(calls) == 1:
            entered.set()
            await release.wait()  # the zombie: stuck mid-step (a GC pause, a partition)
            return "zombie"
        return "successor"

    @flow("fenced")
    async def body(ctx: Context, _: Any) -> str:
        out = await ctx.step("effect", effect)
        await ctx.step("after", lambda: out)
        return str(out)

    zombie_durable: list[EventEnvelope] = []
    zombie = Runtime(store, flows=[body], on_durable_event=zombie_durable.append)
    handle = await zombie.start("fenced")
    eid = handle.execution_id
    await asyncio.wait_for(entered.wait(), 2)
    assert kinds(await store.read(eid)) == ["EXECUTION_STARTED", "STEP_STARTED"]
    zombie_result = asyncio.ensure_future(zombie.result(eid))
    await asyncio.sleep(0)

    successor = Runtime(store, flows=[body])
    await successor.drive(eid, wait=True)  # supersedes the zombie's fence
    assert await successor.result(eid) == "successor"
    settled = dumped(await store.read(eid))

    release.set()  # the zombie wakes and tries to record its step
    with pytest.raises(StaleFenceError):
        await asyncio.wait_for(zombie_result, 2)
    await settle(zombie)
    assert zombie.aborted == 1
    # Nothing it tried after losing the fence is on the log.
    assert dumped(await store.read(eid)) == settled
    assert [e["payload"].get("output") for e in settled
            if e["type"] == "STEP_COMPLETED"] == ["successor", "successor"]
    # Its durable observer saw only what it really wrote, before it lost.
    assert kinds(zombie_durable) == ["EXECUTION_STARTED", "STEP_STARTED"]
    await settle(successor)


async def test_a_stale_token_append_is_refused_by_the_store(store: EventStore) -> None:
    @flow("plain")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.wait("g")

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("plain")
    await settle(runtime)
    eid = handle.execution_id
    old = await store.acquire_fence(eid, holder="a", lease_ms=1000)
    new = await store.acquire_fence(eid, holder="b", lease_ms=1000)
    assert new.token > old.token
    head = await store.head(eid)
    assert head is not None
    from fleet import EventType

    event = EventEnvelope.make(eid, head + 1, EventType.EMITTED, 1,
                               {"type": "x", "payload": None}, kernel=False)
    before = dumped(await store.read(eid))
    with pytest.raises(StaleFenceError):
        await store.append(event, fence=old.token)
    assert dumped(await store.read(eid)) == before
    await store.append(event, fence=new.token)
    assert len(await store.read(eid)) == len(before) + 1


async def test_a_second_drive_while_the_first_holds_a_live_lease_steps_aside(
        store: EventStore) -> None:
    release, entered = asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        entered.set()
        await release.wait()
        return "ok"

    @flow("leased")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.step("slow", slow)

    first = Runtime(store, flows=[body])
    handle = await first.start("leased")
    await asyncio.wait_for(entered.wait(), 2)
    second = Runtime(store, flows=[body])
    assert await drove(second, handle.execution_id) is False
    release.set()
    assert await handle.result() == "ok"
    assert "RECOVERED" not in kinds(await store.read(handle.execution_id))
    await settle(first)
