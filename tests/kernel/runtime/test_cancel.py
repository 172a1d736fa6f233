"""Cancellation of parked and running executions; deadlines."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kernel_kit import ManualClock, dumped, kinds, settle, started

from fleet import (
    Context,
    ExecutionCancelledError,
    ExecutionFailedError,
    ExecutionFinishedError,
    Runtime,
    flow,
)
from fleet.kernel.store.spi import EventStore


async def test_cancel_a_parked_execution(store: EventStore) -> None:
    @flow("parked")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.wait("never")

    runtime = Runtime(store, flows=[body])
    eid = await started(runtime, "parked")
    waiting = asyncio.ensure_future(runtime.result(eid))
    await asyncio.sleep(0)
    await runtime.cancel(eid, reason="customer left")
    with pytest.raises(ExecutionCancelledError):
        await asyncio.wait_for(waiting, 2)
    log = await store.read(eid)
    assert kinds(log)[-1] == "EXECUTION_CANCELLED"
    assert log[-1].payload == {"reason": "customer left"}
    assert "STEP_CANCELLED" not in kinds(log)
    summary = await store.get_execution(eid)
    assert summary is not None
    assert summary.status == "cancelled"


async def _running(store: EventStore, swallowed: list[str],
                   reached_after: list[str]) -> tuple[Runtime, str, asyncio.Event]:
    entered = asyncio.Event()

    async def long_step() -> str:
        entered.set()
        try:
            await asyncio.sleep(30)
        except Exception:  # noqa: BLE001 - a careless step must not swallow the cancel
            swallowed.append("swallowed")
        return "finished"

    @flow("running")
    async def body(ctx: Context, _: Any) -> str:
        try:
            await ctx.step("long", long_step)
        except Exception:  # noqa: BLE001 - nor a careless flow
            swallowed.append("flow swallowed")
        reached_after.append("after")
        return "done"

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("running")
    await asyncio.wait_for(entered.wait(), 2)
    return runtime, handle.execution_id, entered


async def test_cancel_a_running_execution_cancels_its_step(store: EventStore) -> None:
    swallowed: list[str] = []
    reached_after: list[str] = []
    runtime, eid, _ = await _running(store, swallowed, reached_after)
    await runtime.cancel(eid, reason="stop")
    with pytest.raises(ExecutionCancelledError):
        await runtime.result(eid)
    await settle(runtime)
    log = await store.read(eid)
    # The step body was cancelled where it was; the new drive delivered the
    # cancellation at the step instead of running it again, recorded it cancelled.
    assert kinds(log) == ["EXECUTION_STARTED", "STEP_STARTED", "CANCEL_REQUESTED",
                          "CANCEL_DELIVERED", "STEP_CANCELLED", "EXECUTION_CANCELLED"]
    assert log[3].payload == {"at": "step:long", "branch": ""}
    assert log[4].payload["stepId"] == "long"
    assert log[-1].payload == {"reason": "stop"}
    assert swallowed == []
    assert reached_after == []
    state = await runtime.load_state(eid)
    assert state.frames["long"].status == "cancelled"


async def test_force_cancel_ends_a_running_execution_at_once(store: EventStore) -> None:
    swallowed: list[str] = []
    reached_after: list[str] = []
    runtime, eid, _ = await _running(store, swallowed, reached_after)
    await runtime.cancel(eid, force=True)
    with pytest.raises(ExecutionCancelledError):
        await runtime.result(eid)
    await settle(runtime)
    log = await store.read(eid)
    assert kinds(log) == ["EXECUTION_STARTED", "STEP_STARTED", "STEP_CANCELLED",
                          "EXECUTION_CANCELLED"]
    assert log[2].payload["stepId"] == "long"
    assert swallowed == []
    assert reached_after == []


async def test_cancel_a_finished_execution_is_refused(store: EventStore) -> None:
    @flow("quick")
    async def body(ctx: Context, _: Any) -> str:
        return "done"

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("quick")
    assert await handle.result() == "done"
    await settle(runtime)
    before = dumped(await store.read(handle.execution_id))
    with pytest.raises(ExecutionFinishedError, match="already ended"):
        await runtime.cancel(handle.execution_id)
    assert dumped(await store.read(handle.execution_id)) == before
    assert await handle.result() == "done"


async def test_cancelled_is_final_resume_and_send_are_refused(store: EventStore) -> None:
    @flow("gate")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.wait("g")

    runtime = Runtime(store, flows=[body])
    eid = await started(runtime, "gate")
    await (await runtime.cancel(eid)).outcome()
    with pytest.raises(ExecutionFinishedError, match="cancelled"):
        await runtime.resume(eid, "g", 1)
    with pytest.raises(ExecutionFinishedError):
        await runtime.send(eid, "k", 1)
    with pytest.raises(ExecutionFinishedError):
        await runtime.cancel(eid)


async def test_cancel_a_sleeping_execution_disarms_its_timer(clocked_store: EventStore,
                                                             clock: ManualClock) -> None:
    store = clocked_store

    @flow("sleeper")
    async def body(ctx: Context, _: Any) -> str:
        await ctx.sleep(60)
        return "woke"

    runtime = Runtime(store, flows=[body], clock=clock, local_timers=False)
    eid = await started(runtime, "sleeper")
    await (await runtime.cancel(eid)).outcome()
    clock.advance(120)
    assert await store.due_timers(clock.now) == []
    assert await runtime.fire_due_timers() == []
    assert kinds(await store.read(eid))[-3:] == ["CANCEL_DELIVERED", "TIMER_CANCELLED",
                                                 "EXECUTION_CANCELLED"]


async def test_a_flow_past_its_deadline_fails_on_its_next_drive(clocked_store: EventStore,
                                                                clock: ManualClock) -> None:
    store = clocked_store

    @flow("deadlined", deadline=60)
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.wait("late")

    runtime = Runtime(store, flows=[body], clock=clock)
    eid = await started(runtime, "deadlined")
    assert (await store.read(eid))[0].payload["deadlineAt"] == clock.now + 60_000
    clock.advance(61)
    await runtime.resume(eid, "late", "too late")
    with pytest.raises(ExecutionFailedError, match="DeadlineExceeded") as info:
        await runtime.result(eid)
    assert info.value.error["type"] == "DeadlineExceeded"
    assert kinds(await store.read(eid))[-2:] == ["EXECUTION_RESUMED", "EXECUTION_FAILED"]


async def test_a_flow_within_its_deadline_completes(clocked_store: EventStore,
                                                    clock: ManualClock) -> None:
    store = clocked_store

    @flow("in-time", deadline=60)
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.wait("gate")

    runtime = Runtime(store, flows=[body], clock=clock)
    eid = await started(runtime, "in-time")
    clock.advance(59)
    await runtime.resume(eid, "gate", "in time")
    assert await runtime.result(eid) == "in time"


async def test_a_parked_flow_is_ended_by_its_deadline_timer(clocked_store: EventStore,
                                                            clock: ManualClock) -> None:
    store = clocked_store

    @flow("deadline-parked", deadline=60)
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.wait("never")

    runtime = Runtime(store, flows=[body], clock=clock, local_timers=False)
    eid = await started(runtime, "deadline-parked")
    due = await store.due_timers(clock.now + 60_000)
    assert [(d.execution_id, d.timer_id, d.due_at) for d in due] == [
        (eid, "__fleet_deadline__", clock.now + 60_000)]
    clock.advance(30)
    assert await runtime.fire_due_timers() == []  # not due yet: nothing happens
    assert (await runtime.load_state(eid)).parked
    clock.advance(31)
    fired = await runtime.fire_due_timers()
    assert [(f.execution_id, f.timer_id) for f in fired] == [(eid, "__fleet_deadline__")]
    with pytest.raises(ExecutionFailedError, match="DeadlineExceeded"):
        await runtime.result(eid)
    assert kinds(await store.read(eid))[-1] == "EXECUTION_FAILED"
    assert await store.due_timers(clock.now + 10**9) == []
    await runtime.close()


async def test_a_run_in_flight_is_stopped_at_its_deadline(store: EventStore) -> None:
    entered = asyncio.Event()

    async def forever() -> None:
        entered.set()
        await asyncio.sleep(60)

    @flow("deadline-running", deadline=0.3)
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.step("forever", forever)

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("deadline-running")
    await asyncio.wait_for(entered.wait(), 5)
    with pytest.raises(ExecutionFailedError, match="DeadlineExceeded"):
        await handle.result(timeout=10)
    log = await store.read(handle.execution_id)
    assert kinds(log)[-2:] == ["STEP_CANCELLED", "EXECUTION_FAILED"]
    assert log[-2].payload == {"stepId": "forever", "reason": "deadline"}
    await runtime.close()


async def test_a_flow_that_ends_in_time_leaves_no_deadline_timer(clocked_store: EventStore,
                                                                 clock: ManualClock) -> None:
    @flow("deadline-quick", deadline=60)
    async def body(ctx: Context, _: Any) -> str:
        return "quick"

    runtime = Runtime(clocked_store, flows=[body], clock=clock)
    handle = await runtime.start("deadline-quick")
    assert await handle.result(timeout=5) == "quick"
    assert await clocked_store.due_timers(clock.now + 10**9) == []
    await runtime.close()
