"""``fire_due_timers`` returns exactly what the call fired (issue 11 item 3).

It used to return a count and leave the ids in ``runtime.fired_timers``, which
a second, overlapping call overwrote, so the timer service could enqueue one
execution twice and another never. Each call now returns its own list.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kernel_kit import ManualClock, kinds, settle, started

from fleet import Context, Runtime, flow
from fleet.kernel.store.spi import EventStore
from fleet.kernel.timers import FiredTimer
from fleet.timers import TimerService

N = 8


@flow("claims-nap")
async def nap(ctx: Context, _: Any) -> str:
    await ctx.sleep(60)
    return "awake"


async def _due(store: EventStore, clock: ManualClock) -> tuple[Runtime, set[str]]:
    runtime = Runtime(store, flows=[nap], clock=clock, local_timers=False)
    ids = {await started(runtime, "claims-nap") for _ in range(N)}
    clock.advance(61)
    return runtime, ids


async def test_fire_due_timers_returns_exactly_what_each_of_two_overlapping_calls_fired(
        clocked_store: EventStore, clock: ManualClock) -> None:
    runtime, ids = await _due(clocked_store, clock)
    # Two ticks of the same runtime overlap (limit 5: each sees part of the backlog).
    first, second = await asyncio.gather(runtime.fire_due_timers(limit=5, drive=False),
                                         runtime.fire_due_timers(limit=5, drive=False))
    third = await runtime.fire_due_timers(limit=5, drive=False)
    calls = [first, second, third]
    fired = [f.execution_id for call in calls for f in call]
    assert sorted(fired) == sorted(ids)  # every timer fired by exactly one call
    assert all(f.timer_id == "sleep#0" for call in calls for f in call)
    for execution_id in ids:
        assert kinds(await clocked_store.read(execution_id)).count("TIMER_FIRED") == 1
    assert runtime.timers_fired == N
    assert await runtime.fire_due_timers(drive=False) == []


async def test_fire_due_timers_lists_what_it_fired_and_drove(clocked_store: EventStore,
                                                             clock: ManualClock) -> None:
    runtime, ids = await _due(clocked_store, clock)
    fired = await runtime.fire_due_timers()
    assert sorted(fired, key=lambda f: f.execution_id) == [
        FiredTimer(execution_id, "sleep#0") for execution_id in sorted(ids)]
    await settle(runtime)
    for execution_id in ids:
        assert await runtime.result(execution_id) == "awake"


async def test_overlapping_timer_service_ticks_enqueue_each_fired_execution_once(
        clocked_store: EventStore, clock: ManualClock) -> None:
    runtime, ids = await _due(clocked_store, clock)
    enqueued: list[str] = []

    async def enqueue(execution_id: str) -> None:
        await asyncio.sleep(0)  # let the other tick run in between
        enqueued.append(execution_id)

    service = TimerService(runtime, enqueue=enqueue, batch=3)
    for _ in range(N):  # overlapping pairs of ticks until the backlog is gone
        await asyncio.gather(service.tick(), service.tick())
        fired_so_far = [eid for eid in ids
                        if "TIMER_FIRED" in kinds(await clocked_store.read(eid))]
        # What was enqueued is exactly what fired: no execution twice, none missed.
        assert sorted(enqueued) == sorted(fired_so_far)
        if len(enqueued) == N:
            break
    assert sorted(enqueued) == sorted(ids)
    assert service.fired == service.enqueued == N
