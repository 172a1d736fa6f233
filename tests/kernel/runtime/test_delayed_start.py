"""Delayed starts (decision 0055): the execution exists at once and first runs when its
reserved timer fires, through ``fire_due_timers`` (what the timer service calls).

Every embedded store, a manual clock (``local_timers=False``: the test fires timers).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kernel_kit import ManualClock

from fleet import Context, Principal, Runtime, flow
from fleet.kernel.errors import (
    ExecutionConflictError,
    GateMismatchError,
    UnstorableValueError,
    ValidationError,
)
from fleet.kernel.events import EventType
from fleet.kernel.start_plan import START_GATE
from fleet.kernel.store.spi import EventStore
from fleet.kernel.values import datetime_from_ms

RAN: list[Any] = []


def record(value: Any) -> Any:
    RAN.append(value)
    return value


@flow("later-greet")
async def greet(ctx: Context, name: str) -> dict[str, Any]:
    ran_at = round(ctx.now() * 1000)  # ms, as the log's times
    await ctx.step("greet", record, name)
    return {"hello": name, "at": ran_at}


@flow("later-listen")
async def listen(ctx: Context, _: Any) -> Any:
    return await ctx.receive("note")


ALICE = Principal("alice", tenant="acme")


def runtime(store: EventStore, clock: ManualClock, **kw: Any) -> Runtime:
    return Runtime(store, flows=[greet, listen], local_timers=False, clock=clock, **kw)


def at(clock: ManualClock, seconds: float) -> datetime:
    return datetime_from_ms(clock.now + int(seconds * 1000))


@pytest.fixture(autouse=True)
def _clear() -> None:
    RAN.clear()


async def test_a_delayed_start_exists_at_once_and_runs_when_its_timer_fires(
        clocked_store: EventStore, clock: ManualClock) -> None:
    rt = runtime(clocked_store, clock)
    due = at(clock, 3600)
    handle = await rt.start("later-greet", "ada", start_at=due, principal=ALICE)
    state = await rt.load_state(handle.execution_id, principal=ALICE)
    assert (state.status, state.waiting) == ("parked", {"on": START_GATE, "kind": "timer"})
    assert state.timers[START_GATE]["dueAt"] == clock.now + 3_600_000
    listed = await clocked_store.list_executions(waiting_on=START_GATE)
    assert [s.execution_id for s in listed] == [handle.execution_id]
    assert RAN == []
    assert await rt.fire_due_timers(at(clock, 3599)) == []  # not yet
    assert RAN == []
    clock.advance(3600)
    fired = await rt.fire_due_timers()
    assert [(f.execution_id, f.timer_id) for f in fired] == [(handle.execution_id, START_GATE)]
    result = await rt.result(handle.execution_id)
    assert result["hello"] == "ada"
    assert result["at"] >= clock.now
    assert RAN == ["ada"]
    assert await rt.fire_due_timers(at(clock, 10_000)) == []  # never twice
    await rt.close()


async def test_start_in_is_a_timedelta_from_now(clocked_store: EventStore,
                                                clock: ManualClock) -> None:
    rt = runtime(clocked_store, clock)
    handle = await rt.start("later-greet", "bo", start_in=timedelta(minutes=5))
    state = await rt.load_state(handle.execution_id)
    assert state.timers[START_GATE]["dueAt"] == clock.now + 300_000
    assert [f.execution_id for f in await rt.fire_due_timers(at(clock, 300))] == [
        handle.execution_id]
    assert (await rt.result(handle.execution_id))["hello"] == "bo"
    await rt.close()


async def test_a_start_at_up_to_a_minute_in_the_past_runs_at_once(
        clocked_store: EventStore, clock: ManualClock) -> None:
    rt = runtime(clocked_store, clock)
    for behind in (0, 1, 59.9):
        handle = await rt.start("later-greet", f"late-{behind}", start_at=at(clock, -behind))
        assert (await handle.result())["hello"] == f"late-{behind}"
        assert START_GATE not in (await rt.load_state(handle.execution_id)).timers
    assert len(RAN) == 3
    await rt.close()


async def test_bad_start_times_are_refused_and_nothing_is_written(
        clocked_store: EventStore, clock: ManualClock) -> None:
    rt = runtime(clocked_store, clock)
    naive = datetime(2030, 1, 1, 9, 0)
    cases: list[tuple[type[Exception], str, dict[str, Any]]] = [
        (ValidationError, "in the past", {"start_at": at(clock, -61)}),
        (ValidationError, "naive", {"start_at": naive}),
        (ValidationError, "aware datetime", {"start_at": 1_700_000_000}),
        (ValidationError, "not both", {"start_at": at(clock, 5),
                                       "start_in": timedelta(seconds=5)}),
        (ValidationError, "negative", {"start_in": timedelta(seconds=-1)}),
        (ValidationError, "timedelta", {"start_in": 30}),
        (UnstorableValueError, "9999", {"start_in": timedelta(days=3_000_000)}),
        (ValidationError, "give queue= or debounce=", {"key": "k"}),
    ]
    for error, words, kw in cases:
        with pytest.raises(error, match=words):
            await rt.start("later-greet", "x", execution_id="refused", **kw)
        assert await clocked_store.head("refused") is None, kw
    assert await clocked_store.list_executions() == []
    await rt.close()


async def test_a_delayed_start_can_be_cancelled_and_then_never_runs(
        clocked_store: EventStore, clock: ManualClock) -> None:
    rt = runtime(clocked_store, clock)
    handle = await rt.start("later-greet", "never", start_in=timedelta(hours=1))
    await rt.cancel(handle.execution_id, reason="changed my mind")
    assert (await rt.load_state(handle.execution_id)).status == "cancelled"
    assert await clocked_store.due_timers(clock.now + 7_200_000) == []
    assert await rt.fire_due_timers(at(clock, 7200)) == []
    assert RAN == []
    await rt.close()


async def test_a_delayed_start_is_idempotent_by_id_and_keeps_its_first_time(
        clocked_store: EventStore, clock: ManualClock) -> None:
    rt = runtime(clocked_store, clock)
    first = await rt.start("later-greet", "one", execution_id="report-7",
                           start_in=timedelta(hours=1), principal=ALICE)
    again = await rt.start("later-greet", "two", execution_id="report-7",
                           start_in=timedelta(hours=2), principal=ALICE)
    assert first.execution_id == again.execution_id == "report-7"
    state = await rt.load_state("report-7", principal=ALICE)
    assert (state.sequence, state.input, state.timers[START_GATE]["dueAt"]) == (
        2, "one", clock.now + 3_600_000)
    intruder = Principal("mallory", tenant="evil")
    with pytest.raises(ExecutionConflictError):
        await rt.start("later-greet", "x", execution_id="report-7",
                       start_in=timedelta(hours=1), principal=intruder)
    assert (await clocked_store.head("report-7")) == 2
    keyed = [await rt.start("later-greet", "k", idempotency_key="nightly",
                            start_in=timedelta(hours=1), principal=ALICE) for _ in range(2)]
    assert keyed[0].execution_id == keyed[1].execution_id
    await rt.close()


async def test_its_reserved_gate_is_not_resumable_and_a_message_waits_for_the_run(
        clocked_store: EventStore, clock: ManualClock) -> None:
    rt = runtime(clocked_store, clock)
    handle = await rt.start("later-listen", None, start_in=timedelta(minutes=1))
    with pytest.raises(GateMismatchError, match="timer"):
        await rt.resume(handle.execution_id, START_GATE, "early")
    assert await rt.send(handle.execution_id, "note", "kept") is False  # no early wake
    state = await rt.load_state(handle.execution_id)
    assert state.parked
    assert state.waiting == {"on": START_GATE, "kind": "timer"}
    await rt.fire_due_timers(at(clock, 60))
    assert await rt.result(handle.execution_id) == "kept"
    await rt.close()


async def test_fired_without_driving_a_worker_drives_it(
        clocked_store: EventStore, clock: ManualClock) -> None:
    dispatcher = runtime(clocked_store, clock)
    handle = await dispatcher.start("later-greet", "fleet", start_in=timedelta(seconds=30),
                                    drive=False)
    timers = runtime(clocked_store, clock)
    fired = await timers.fire_due_timers(at(clock, 30), drive=False)
    assert [f.execution_id for f in fired] == [handle.execution_id]
    assert RAN == []  # fired, not driven: the timer service enqueues the drive
    worker = runtime(clocked_store, clock)
    await worker.drive(handle.execution_id, if_free=True, wait=True)
    assert (await worker.result(handle.execution_id))["hello"] == "fleet"
    for rt in (dispatcher, timers, worker):
        await rt.close()


async def test_a_runtime_with_local_timers_runs_it_by_itself(store: EventStore) -> None:
    rt = Runtime(store, flows=[greet])
    handle = await rt.start("later-greet", "soon", start_in=timedelta(milliseconds=200))
    assert (await rt.load_state(handle.execution_id)).parked
    result = await asyncio.wait_for(handle.result(), 30)
    assert result["hello"] == "soon"
    # Not before its time (the loop's monotonic clock against the wall clock's ms: 5 ms).
    started_at = (await rt.load_state(handle.execution_id)).started_at
    assert started_at is not None
    assert result["at"] >= started_at + 200 - 5
    await rt.close()


async def test_its_log_is_the_start_the_timer_and_the_park_in_one_write(
        clocked_store: EventStore, clock: ManualClock) -> None:
    rt = runtime(clocked_store, clock)
    handle = await rt.start("later-greet", "log", start_at=at(clock, 10))
    events = await clocked_store.read(handle.execution_id)
    assert [e.type for e in events] == [EventType.EXECUTION_STARTED, EventType.TIMER_SCHEDULED,
                                        EventType.EXECUTION_SUSPENDED]
    assert len({e.timestamp for e in events}) == 1
    assert all(e.kernel for e in events)
    summary = await clocked_store.get_execution(handle.execution_id)
    assert summary is not None
    assert summary.holder is None
    assert datetime.now(UTC) - datetime_from_ms(summary.started_at) < timedelta(days=1)
    await rt.close()
