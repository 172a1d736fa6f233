"""Waits with a timeout, the first of several, and durations as timedelta/datetime
(issue 26 items 2 and 8, decision 0033), on every store.

Each race is durable: whichever of payload or timer came first is in the log
(``FIRST_RESOLVED``), a replay gives the same answer, a timer that lost leaves the
timer index, and a gate or message that lost keeps its answer for the next wait.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kernel_kit import ManualClock, dumped, kinds, settle, started

from fleet import (
    Context,
    GateMismatchError,
    MemoryEventStore,
    Runtime,
    SqliteEventStore,
    ValidationError,
    flow,
)
from fleet.kernel.store.spi import EventStore, SnapshotStore

Stores = tuple[EventStore, SnapshotStore]


@flow("approve")
async def approve(ctx: Context, _: Any) -> str:
    try:
        answer = await ctx.wait("approval", timeout=timedelta(hours=1))
    except TimeoutError:
        return "timed out"
    return f"approved by {answer}"


@flow("inbox")
async def inbox(ctx: Context, _: Any) -> Any:
    try:
        first = await ctx.receive("order", timeout=30)
    except TimeoutError:
        first = None
    second = await ctx.receive("order")
    return [first, second]


def _clocked(stores: Stores, clock: ManualClock, tmp_path: Any) -> EventStore:
    """The store of ``stores`` for Postgres (its own clock), else a clocked embedded one."""
    store = stores[0]
    if isinstance(store, MemoryEventStore):
        return MemoryEventStore(clock=clock)
    if isinstance(store, SqliteEventStore):
        return SqliteEventStore(str(tmp_path / "clocked.db"), clock=clock)
    return store


async def test_a_payload_before_the_timeout_wins_and_withdraws_the_timer(stores: Stores,
                                                                         tmp_path: Any) -> None:
    clock = ManualClock()
    store = _clocked(stores, clock, tmp_path)
    runtime = Runtime(store, flows=[approve], clock=clock, local_timers=False)
    eid = await started(runtime, "approve")
    state = await runtime.load_state(eid)
    assert state.parked
    assert state.waiting is not None
    assert state.waiting["kind"] == "first"
    assert [w["kind"] for w in state.waiting["waits"]] == ["gate", "timer"]
    assert len(await store.due_timers(clock.now + 3_600_000)) == 1
    await runtime.resume(eid, "approval", "bob")
    assert await runtime.result(eid) == "approved by bob"
    log = await store.read(eid)
    assert kinds(log)[-4:] == ["EXECUTION_RESUMED", "FIRST_RESOLVED", "TIMER_CANCELLED",
                               "EXECUTION_COMPLETED"]
    assert log[-3].payload == {"name": "first#0", "index": 0}
    clock.advance(7200)
    assert await store.due_timers(clock.now) == []
    assert await runtime.fire_due_timers() == []
    await runtime.close()
    if store is not stores[0]:
        await store.close()


async def test_the_timer_before_the_payload_raises_timeout_error(stores: Stores,
                                                                 tmp_path: Any) -> None:
    clock = ManualClock()
    store = _clocked(stores, clock, tmp_path)
    runtime = Runtime(store, flows=[approve], clock=clock, local_timers=False)
    eid = await started(runtime, "approve")
    clock.advance(3601)
    fired = await runtime.fire_due_timers()
    assert [(f.execution_id, f.timer_id) for f in fired] == [(eid, "timeout#0")]
    assert await runtime.result(eid) == "timed out"
    log = await store.read(eid)
    assert kinds(log)[-3:] == ["TIMER_FIRED", "FIRST_RESOLVED", "EXECUTION_COMPLETED"]
    assert log[-2].payload == {"name": "first#0", "index": 1}
    ended = dumped(log)
    with pytest.raises(Exception, match="already ended"):
        await runtime.resume(eid, "approval", "too late")
    assert dumped(await store.read(eid)) == ended
    await runtime.close()
    if store is not stores[0]:
        await store.close()


async def test_a_message_that_came_before_the_race_wins_at_once(stores: Stores) -> None:
    store = stores[0]

    @flow("late-reader")
    async def body(ctx: Context, _: Any) -> Any:
        await ctx.wait("go")
        return await ctx.first(ctx.receive("m"), ctx.sleep(timedelta(days=1)))

    runtime = Runtime(store, flows=[body], local_timers=False)
    eid = await started(runtime, "late-reader")
    await runtime.send(eid, "m", {"n": 1})  # queued: the run waits on a gate
    await runtime.resume(eid, "go")
    assert await runtime.result(eid) == [0, {"n": 1}]
    assert await store.due_timers(2**62) == []
    await runtime.close()


async def test_a_losing_message_wait_consumes_nothing(stores: Stores) -> None:
    store = stores[0]
    runtime = Runtime(store, flows=[inbox], local_timers=False)
    eid = await started(runtime, "inbox")
    # Fire the 30 s timeout early: the first receive times out...
    fired = await runtime.fire_due_timers(datetime.now(UTC) + timedelta(minutes=1))
    assert [f.timer_id for f in fired] == ["timeout#0"]
    await settle(runtime)
    # ...and the message sent after it goes to the second receive.
    await runtime.send(eid, "order", "o-1")
    assert await runtime.result(eid) == [None, "o-1"]
    await runtime.close()


async def test_first_of_gate_message_and_timer_replays_the_recorded_winner(
        stores: Stores) -> None:
    store = stores[0]
    seen: list[Any] = []

    @flow("race")
    async def body(ctx: Context, _: Any) -> Any:
        index, value = await ctx.first(ctx.wait("a"), ctx.receive("b"),
                                       ctx.sleep(timedelta(hours=1)))
        seen.append((index, value))
        later = await ctx.receive("b")  # the message that lost is still there
        return [index, value, later]

    runtime = Runtime(store, flows=[body], local_timers=False)
    eid = await started(runtime, "race")
    await runtime.resume(eid, "a", "A")
    await settle(runtime)
    assert (await runtime.load_state(eid)).parked  # now on the second receive
    await runtime.send(eid, "b", "B")
    assert await runtime.result(eid) == [0, "A", "B"]
    # The drive after the message replayed the race from the log: the gate again,
    # though the log now also holds a message for "b".
    assert seen == [(0, "A"), (0, "A")]
    assert [e.payload for e in await store.read(eid) if e.type == "FIRST_RESOLVED"] == [
        {"name": "first#0", "index": 0}]
    await runtime.close()


async def test_sleep_takes_a_timedelta_and_sleep_until_a_datetime(clocked_store: EventStore,
                                                                  clock: ManualClock) -> None:
    when = datetime.fromtimestamp(clock.now / 1000, UTC) + timedelta(days=2)

    @flow("naps")
    async def body(ctx: Context, _: Any) -> str:
        await ctx.sleep(timedelta(minutes=90))
        await ctx.sleep_until(when)
        await ctx.sleep_until(when - timedelta(days=30))  # past: at once
        return "rested"

    runtime = Runtime(clocked_store, flows=[body], clock=clock, local_timers=False)
    eid = await started(runtime, "naps")
    timers = (await runtime.load_state(eid)).timers
    assert timers["sleep#0"]["dueAt"] == clock.now + 90 * 60_000
    clock.advance(90 * 60)
    await runtime.fire_due_timers()
    await settle(runtime)
    timers = (await runtime.load_state(eid)).timers
    assert timers["sleep#1"]["dueAt"] == int(when.timestamp() * 1000)
    clock.advance(2 * 86_400)
    await runtime.fire_due_timers()
    assert await runtime.result(eid) == "rested"
    await runtime.close()


async def test_a_race_with_a_short_timer_waits_in_the_run(store: EventStore) -> None:
    @flow("quick-race")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.first(ctx.wait("never"), ctx.sleep(0.05))

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("quick-race")
    assert await handle.result(timeout=5) == [1, None]
    assert "EXECUTION_SUSPENDED" not in kinds(await store.read(handle.execution_id))
    await runtime.close()


async def test_a_parked_race_is_fired_by_the_local_timer(store: EventStore) -> None:
    @flow("local-race")
    async def body(ctx: Context, _: Any) -> Any:
        try:
            return await ctx.receive("reply", timeout=1.5)
        except TimeoutError:
            return "no reply"

    runtime = Runtime(store, flows=[body], inline_sleep_max=0.5)
    handle = await runtime.start("local-race")
    assert await handle.result(timeout=10) == "no reply"
    await runtime.close()


async def test_resume_of_a_gate_the_race_does_not_wait_on_is_refused(store: EventStore) -> None:
    runtime = Runtime(store, flows=[approve], local_timers=False)
    eid = await started(runtime, "approve")
    before = dumped(await store.read(eid))
    with pytest.raises(GateMismatchError, match="approval"):
        await runtime.resume(eid, "other", 1)
    assert dumped(await store.read(eid)) == before
    await runtime.close()


@pytest.mark.parametrize(("timeout", "match"), [
    (-1, "0 or more"), (float("nan"), "finite"), (float("inf"), "finite"),
    ("10", "seconds"), (True, "seconds"), (timedelta(seconds=-5), "0 or more")])
async def test_a_bad_timeout_is_refused_before_anything_is_written(
        store: EventStore, timeout: Any, match: str) -> None:
    @flow("bad-timeout")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.wait("g", timeout=timeout)

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("bad-timeout")
    with pytest.raises(Exception, match=match):
        await handle.result(timeout=5)
    log = await store.read(handle.execution_id)
    assert kinds(log) == ["EXECUTION_STARTED", "EXECUTION_FAILED"]
    assert log[-1].payload["error"]["type"] == "ValidationError"
    await runtime.close()


async def test_first_refuses_what_is_not_a_wait(store: EventStore) -> None:
    async def not_a_wait() -> int:
        return 1

    @flow("bad-first")
    async def body(ctx: Context, kind: str) -> Any:
        if kind == "empty":
            return await ctx.first()
        return await ctx.first(ctx.wait("g"), not_a_wait())

    runtime = Runtime(store, flows=[body])
    for kind, match in (("empty", "at least one"), ("coroutine", "argument 1 is a coroutine")):
        handle = await runtime.start("bad-first", kind)
        with pytest.raises(Exception, match=match):
            await handle.result(timeout=5)
        assert kinds(await store.read(handle.execution_id)) == ["EXECUTION_STARTED",
                                                                "EXECUTION_FAILED"]
    await runtime.close()


async def test_sleep_refuses_what_is_not_a_duration(store: EventStore) -> None:
    @flow("bad-sleep")
    async def body(ctx: Context, value: Any) -> Any:
        await ctx.sleep("soon" if value == "text" else float("inf"))

    runtime = Runtime(store, flows=[body])
    for value in ("text", "inf"):
        handle = await runtime.start("bad-sleep", value)
        with pytest.raises(Exception, match="sleep"):
            await handle.result(timeout=5)
        log = await store.read(handle.execution_id)
        assert kinds(log) == ["EXECUTION_STARTED", "EXECUTION_FAILED"]
        assert log[-1].payload["error"]["code"] == ValidationError.code
    await runtime.close()


async def test_waiting_inline_on_a_manual_clock_does_not_spin(clocked_store: EventStore,
                                                              clock: ManualClock) -> None:
    @flow("inline")
    async def body(ctx: Context, _: Any) -> str:
        await ctx.sleep(0.05)
        return "slept"

    runtime = Runtime(clocked_store, flows=[body], clock=clock)
    handle = await runtime.start("inline")
    assert await asyncio.wait_for(handle.result(), 5) == "slept"
    await runtime.close()


async def test_parallel_branches_parked_on_a_gate_and_a_timer_wait_on_both(
        clocked_store: EventStore, clock: ManualClock) -> None:
    """The run parks on every branch's wait at once: the timer of one branch wakes it,
    though another branch waits on a gate (a pending timer of a parked execution is one
    its park waits on: the timer service may fire it)."""
    async def gate_branch(ctx: Context) -> Any:
        return await ctx.wait("a")

    async def sleepy_branch(ctx: Context) -> str:
        await ctx.sleep(timedelta(minutes=10))
        return "slept"

    @flow("two-waits")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.parallel([gate_branch, sleepy_branch])

    runtime = Runtime(clocked_store, flows=[body], clock=clock, local_timers=False)
    eid = await started(runtime, "two-waits")
    waiting = (await runtime.load_state(eid)).waiting
    assert waiting is not None
    assert (waiting["on"], waiting["kind"]) == ("parallel:/0", "first")
    assert [(w["kind"], w["on"]) for w in waiting["waits"]] == [("gate", "a"),
                                                               ("timer", "/0.1:sleep#0")]
    clock.advance(601)
    fired = await runtime.fire_due_timers()
    assert [f.timer_id for f in fired] == ["/0.1:sleep#0"]
    await settle(runtime)
    state = await runtime.load_state(eid)
    assert state.parked
    assert state.waiting == {"on": "a", "kind": "gate"}  # the sleeper is done
    await runtime.resume(eid, "a", "A")
    assert await runtime.result(eid) == ["A", "slept"]
    await runtime.close()
