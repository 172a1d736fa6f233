"""Durable timers: short sleeps inline, long sleeps park until fire_due_timers."""

from __future__ import annotations

import asyncio
from typing import Any

from kernel_kit import FaultyStore, ManualClock, eventually, kinds, settle, started

from fleet import Context, Runtime, flow
from fleet.kernel.store.spi import EventStore
from fleet.kernel.timers import FiredTimer
from fleet.kernel.values import datetime_from_ms


@flow("napper")
async def napper(ctx: Context, seconds: float) -> str:
    await ctx.sleep(seconds)
    return "awake"


async def test_short_sleep_runs_inline_without_parking(store: EventStore) -> None:
    runtime = Runtime(store, flows=[napper], local_timers=False)
    handle = await runtime.start("napper", 0.01)
    assert await handle.result(timeout=2) == "awake"
    log = await store.read(handle.execution_id)
    assert kinds(log) == ["EXECUTION_STARTED", "TIMER_SCHEDULED", "TIMER_FIRED",
                          "EXECUTION_COMPLETED"]
    assert log[1].payload["dueAt"] == log[1].timestamp + 10
    assert log[2].timestamp >= log[1].payload["dueAt"]
    assert runtime.parked == 0


async def test_long_sleep_parks_and_fires_when_due(clocked_store: EventStore,
                                                   clock: ManualClock) -> None:
    store = clocked_store
    runtime = Runtime(store, flows=[napper], clock=clock, local_timers=False)
    eid = await started(runtime, "napper", 3600)
    log = await store.read(eid)
    assert kinds(log) == ["EXECUTION_STARTED", "TIMER_SCHEDULED", "EXECUTION_SUSPENDED"]
    due = log[1].payload["dueAt"]
    assert due == clock.now + 3_600_000
    assert log[2].payload["condition"] == {"on": "sleep#0", "kind": "timer"}
    state = await runtime.load_state(eid)
    assert state.status == "parked"

    # Not early: a sweep a millisecond before the due time fires nothing.
    assert await runtime.fire_due_timers(datetime_from_ms(due - 1)) == []
    assert len(await store.read(eid)) == 3

    clock.now = due
    assert await runtime.fire_due_timers(datetime_from_ms(due)) == [FiredTimer(eid, "sleep#0")]
    await settle(runtime)
    assert await runtime.result(eid) == "awake"
    log = await store.read(eid)
    assert kinds(log) == ["EXECUTION_STARTED", "TIMER_SCHEDULED", "EXECUTION_SUSPENDED",
                          "TIMER_FIRED", "EXECUTION_COMPLETED"]
    assert runtime.timers_fired == 1


async def test_a_timer_fires_once_however_often_it_is_swept(clocked_store: EventStore,
                                                            clock: ManualClock) -> None:
    store = clocked_store
    gate_reached = []

    @flow("sleep-then-wait")
    async def body(ctx: Context, _: Any) -> Any:
        await ctx.sleep(60)
        gate_reached.append(1)
        return await ctx.wait("after")

    runtime = Runtime(store, flows=[body], clock=clock, local_timers=False)
    other = Runtime(store, flows=[body], clock=clock, local_timers=False)
    eid = await started(runtime, "sleep-then-wait")
    clock.advance(61)
    # Two sweepers (two replicas of the timer service) race for the same timer.
    fired = await asyncio.gather(runtime.fire_due_timers(), other.fire_due_timers())
    await settle(runtime)
    await settle(other)
    assert sorted(len(f) for f in fired) == [0, 1]
    # And a later sweep finds nothing due.
    assert await runtime.fire_due_timers() == []
    log = await store.read(eid)
    assert kinds(log).count("TIMER_FIRED") == 1
    assert kinds(log)[-1] == "EXECUTION_SUSPENDED"
    assert log[-1].payload["condition"]["on"] == "after"
    assert len(gate_reached) == 1


async def test_replay_serves_a_fired_timer(clocked_store: EventStore,
                                           clock: ManualClock) -> None:
    store = clocked_store

    @flow("sleep-twice")
    async def body(ctx: Context, _: Any) -> float:
        before = ctx.now()
        await ctx.sleep(100)
        await ctx.sleep(200)
        return ctx.now() - before

    runtime = Runtime(store, flows=[body], clock=clock, local_timers=False)
    eid = await started(runtime, "sleep-twice")
    clock.advance(100)
    assert await runtime.fire_due_timers() == [FiredTimer(eid, "sleep#0")]
    await settle(runtime)
    # The first sleep is served from the log: the second one parks, not the first.
    state = await runtime.load_state(eid)
    assert state.waiting == {"on": "sleep#1", "kind": "timer"}
    clock.advance(200)
    assert await runtime.fire_due_timers() == [FiredTimer(eid, "sleep#1")]
    assert await runtime.result(eid) == 300.0
    assert kinds(await store.read(eid)).count("TIMER_SCHEDULED") == 2


async def test_local_timer_fires_a_parked_sleep_by_itself(store: EventStore) -> None:
    # inline_sleep_max=0 makes even a short sleep park; the runtime's own timer wakes it.
    runtime = Runtime(store, flows=[napper], inline_sleep_max=0)
    handle = await runtime.start("napper", 0.02)
    assert await handle.result(timeout=2) == "awake"
    assert kinds(await store.read(handle.execution_id)) == [
        "EXECUTION_STARTED", "TIMER_SCHEDULED", "EXECUTION_SUSPENDED", "TIMER_FIRED",
        "EXECUTION_COMPLETED"]
    await runtime.close()


async def test_a_local_timer_that_cannot_fire_is_reported_through_on_warn(
        store: EventStore) -> None:
    """Decision 0010, left open (corrected): a locally armed timer whose firing fails (a
    store fault here; a code refusal goes the same way) is reported through on_warn,
    not only as asyncio's "Task exception was never retrieved"."""
    warnings: list[str] = []
    faulty = FaultyStore(store, lambda e: str(e.type) == "TIMER_FIRED")
    runtime = Runtime(faulty, flows=[napper], inline_sleep_max=0,  # type: ignore[arg-type]
                      on_warn=warnings.append)
    handle = await runtime.start("napper", 0.02)
    await eventually(lambda: any("could not fire" in w for w in warnings))
    [warning] = [w for w in warnings if "could not fire" in w]
    assert handle.execution_id in warning
    assert "StoreUnavailableError" in warning
    assert kinds(await store.read(handle.execution_id))[-1] == "EXECUTION_SUSPENDED"
    await runtime.close()
