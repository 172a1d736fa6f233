"""Schedules on a runtime (issue 27 item 1, decision 0058), driven by a manual clock.

Ticks are fired by ``fire_due_timers(now=)``, the call the timer service makes: each
tick runs once under ``<id>@<tick>`` and reads it as ``ctx.scheduled_at``; the overlap
policies, catch-up after an outage, pause/resume, trigger, backfill and delete; the
same settings again are accepted and others refused, nothing written; another tenant
can neither see nor steer a schedule; a start of the schedule flow by other means,
or a malformed control message, starts nothing.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kernel_kit import ManualClock, settle
from refusals import hidden

from fleet import (
    ConfigurationError,
    Context,
    ExecutionConflictError,
    ExecutionNotFoundError,
    FlowNotFoundError,
    MemoryEventStore,
    Principal,
    Runtime,
    ScheduleInfo,
    ValidationError,
    flow,
)
from fleet.kernel.schedule_flow import CONTROL, TICKS_PER_RUN
from fleet.kernel.schedule_spec import SCHEDULE_FLOW_ID
from fleet.kernel.store.spi import EventStore, SnapshotStore

Stores = tuple[EventStore, SnapshotStore]
ALICE = Principal("alice", tenant="acme")
MALLORY = Principal("mallory", tenant="evil")
T0 = 1_750_000_000_000 // 3_600_000 * 3_600_000  # on the hour
SEEN: list[tuple[str, datetime | None, Any]] = []


@flow("job")
async def job(ctx: Context, x: Any) -> str:
    SEEN.append((ctx.execution_id, ctx.scheduled_at, x))
    return "done"


@flow("long-job")
async def long_job(ctx: Context, x: Any) -> Any:
    SEEN.append((ctx.execution_id, ctx.scheduled_at, x))
    return await ctx.wait("go")  # parked: still running for the overlap policy


def runtime(store: EventStore, clock: ManualClock) -> Runtime:
    return Runtime(store, flows=[job, long_job], clock=clock, local_timers=False)


async def advance(rt: Runtime, clock: ManualClock, seconds: float) -> int:
    """Move the clock and fire what is due, as the timer service would; the timers fired."""
    clock.advance(seconds)
    fired = await rt.fire_due_timers()
    await settle(rt)
    return len(fired)


async def runs(store: EventStore, flow_id: str = "job") -> list[str]:
    return sorted(r.execution_id for r in await store.list_executions(flow_id=flow_id,
                                                                     limit=10_000))


async def only(rt: Runtime, principal: Principal | None = None) -> ScheduleInfo:
    infos = await rt.schedules(principal=principal)
    assert len(infos) == 1, infos
    return infos[0]


def at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def tick(sid: str, ms: int) -> str:
    return f"{sid}@{at(ms).strftime('%Y-%m-%dT%H:%M:%SZ')}"


@pytest.fixture(autouse=True)
def _clear() -> None:
    SEEN.clear()


async def test_each_tick_runs_once_under_its_id_and_knows_its_tick(stores: Stores) -> None:
    store, clock = stores[0], ManualClock(T0 + 5_000)
    rt = runtime(store, clock)
    info = await rt.schedule("report", job, {"n": 1}, every=timedelta(minutes=1),
                             principal=ALICE)
    assert info.next_tick == at(T0 + 60_000)
    assert info.execution_id == "__fleet_schedule__:report/1"
    await settle(rt)
    assert await advance(rt, clock, 30) == 0  # not due yet: nothing fires
    for _ in range(3):
        assert await advance(rt, clock, 60) == 1
    assert await runs(store) == [tick("report", T0 + k * 60_000) for k in (1, 2, 3)]
    assert [(eid, when) for eid, when, _ in SEEN] == [
        (tick("report", T0 + k * 60_000), at(T0 + k * 60_000)) for k in (1, 2, 3)]
    assert {x["n"] for _, _, x in SEEN} == {1}
    # A second replica firing at the same moment fires nothing: each tick once.
    other = runtime(store, clock)
    assert await other.fire_due_timers() == []
    state = await rt.load_state(tick("report", T0 + 60_000), principal=ALICE)
    assert state.owner == {"actor": "alice", "tenant": "acme"}  # the runs are Alice's
    info = await only(rt, ALICE)
    assert (info.runs, info.missed, info.overlapped) == (3, 0, 0)
    assert info.last_run == tick("report", T0 + 180_000)
    assert info.last_run_status == "completed"
    assert info.next_tick == at(T0 + 240_000)
    await rt.close()
    await other.close()


async def test_a_plain_start_has_no_scheduled_at() -> None:
    rt = Runtime(MemoryEventStore(), flows=[job])
    assert await (await rt.start("job", 1)).result(timeout=5) == "done"
    assert SEEN[-1][1] is None
    await rt.close()


async def test_two_replicas_firing_side_by_side_run_each_tick_once() -> None:
    store, clock = MemoryEventStore(), ManualClock(T0)
    a, b = runtime(store, clock), runtime(store, clock)
    await a.schedule("twin", job, every=timedelta(seconds=10), overlap="allow")
    await settle(a)
    for _ in range(20):
        clock.advance(10)
        fired = [*await a.fire_due_timers(), *await b.fire_due_timers()]
        assert len(fired) == 1
        await settle(a)
        await settle(b)
    assert await runs(store) == [tick("twin", T0 + k * 10_000) for k in range(1, 21)]
    assert len(SEEN) == 20
    await a.close()
    await b.close()


async def test_skip_counts_a_run_parked_on_a_gate_as_running() -> None:
    store, clock = MemoryEventStore(), ManualClock(T0)
    rt = runtime(store, clock)
    await rt.schedule("skipper", long_job, every=timedelta(minutes=1))
    await settle(rt)
    await advance(rt, clock, 60)
    first = tick("skipper", T0 + 60_000)
    assert (await rt.load_state(first)).parked
    # Three ticks fall while it waits on its gate: none runs (the schedule only wakes for
    # the backstop that looks at the run in case its end notice was lost).
    for n in range(1, 4):
        await advance(rt, clock, 60)
        assert await runs(store, "long-job") == [first]
        # What an operator reads counts them as they fall, and the next tick from now.
        live = await only(rt)
        assert (live.overlapped, live.last_run_status) == (n, "parked")
        assert live.next_tick == at(T0 + (n + 2) * 60_000)
    clock.advance(10)
    await rt.resume(first, "go", "ok")
    await settle(rt)
    info = await only(rt)
    assert (info.runs, info.overlapped, info.last_run_status) == (1, 3, "completed")
    assert await advance(rt, clock, 50) == 1  # the next tick after its end runs
    assert await runs(store, "long-job") == [first, tick("skipper", T0 + 300_000)]
    await rt.close()


async def test_buffer_one_runs_the_first_tick_that_fell_during_the_run_after_it() -> None:
    store, clock = MemoryEventStore(), ManualClock(T0)
    rt = runtime(store, clock)
    await rt.schedule("buffered", long_job, every=timedelta(minutes=1), overlap="buffer_one")
    await settle(rt)
    await advance(rt, clock, 60)
    first = tick("buffered", T0 + 60_000)
    clock.advance(200)  # ticks at +2, +3 and +4 minutes fall while it runs
    await rt.resume(first, "go")
    await settle(rt)
    buffered = tick("buffered", T0 + 120_000)
    assert await runs(store, "long-job") == [first, buffered]
    assert SEEN[-1][1] == at(T0 + 120_000)  # it runs late, knowing its tick
    info = await only(rt)
    assert (info.runs, info.overlapped) == (2, 2)
    await rt.close()


async def test_allow_lets_runs_overlap() -> None:
    store, clock = MemoryEventStore(), ManualClock(T0)
    rt = runtime(store, clock)
    await rt.schedule("overlapping", long_job, every=timedelta(minutes=1), overlap="allow")
    await settle(rt)
    for _ in range(3):
        assert await advance(rt, clock, 60) == 1
    parked = [eid for eid in await runs(store, "long-job")
              if (await rt.load_state(eid)).parked]
    assert len(parked) == 3
    await rt.close()


@pytest.mark.parametrize(("catchup", "ran", "missed"), [
    (timedelta(0), 1, 9), (timedelta(minutes=3), 3, 7), (timedelta(hours=1), 10, 0)])
async def test_after_an_outage_the_ticks_within_catchup_run_once_each(
        catchup: timedelta, ran: int, missed: int) -> None:
    store, clock = MemoryEventStore(), ManualClock(T0)
    rt = runtime(store, clock)
    await rt.schedule("outage", job, every=timedelta(minutes=1), overlap="allow",
                      catchup=catchup)
    await settle(rt)
    assert await advance(rt, clock, 600 + 20) == 1  # ten minutes with no timer service
    expected = [tick("outage", T0 + k * 60_000) for k in range(11 - ran, 11)]
    assert await runs(store) == expected
    info = await only(rt)
    assert (info.runs, info.missed, info.skipped) == (ran, missed, missed)
    # Back to normal: the next tick runs on time.
    assert await advance(rt, clock, 40) == 1
    assert len(await runs(store)) == ran + 1
    await rt.close()


async def test_a_skip_schedule_catching_up_runs_only_the_first_of_its_missed_ticks() -> None:
    store, clock = MemoryEventStore(), ManualClock(T0)
    rt = runtime(store, clock)
    await rt.schedule("careful", long_job, every=timedelta(minutes=1),
                      catchup=timedelta(hours=1))
    await settle(rt)
    await advance(rt, clock, 300)  # 5 ticks due at once, the first still runs at the 2nd
    assert await runs(store, "long-job") == [tick("careful", T0 + 60_000)]
    info = await only(rt)
    assert (info.runs, info.overlapped) == (1, 4)
    await rt.close()


async def test_pause_stops_the_ticks_and_resume_starts_from_now() -> None:
    store, clock = MemoryEventStore(), ManualClock(T0)
    rt = runtime(store, clock)
    await rt.schedule("pausable", job, every=timedelta(minutes=1), principal=ALICE)
    await settle(rt)
    await rt.pause_schedule("pausable", principal=ALICE)
    await settle(rt)
    info = await only(rt)
    assert info.paused
    assert info.next_tick is None
    assert await advance(rt, clock, 600) == 0  # no tick timer while paused
    assert await runs(store) == []
    await rt.resume_schedule("pausable", principal=ALICE)
    await settle(rt)
    info = await only(rt)
    assert not info.paused
    assert info.next_tick == at(T0 + 660_000)  # the ticks of the pause are not owed
    assert await advance(rt, clock, 60) == 1
    assert await runs(store) == [tick("pausable", T0 + 660_000)]
    assert info.missed == 0
    await rt.close()


async def test_trigger_runs_now_even_while_a_skip_run_is_in_flight() -> None:
    store, clock = MemoryEventStore(), ManualClock(T0 + 1_234)
    rt = runtime(store, clock)
    await rt.schedule("manual", long_job, every=timedelta(hours=1))
    await settle(rt)
    first = await rt.trigger_schedule("manual")
    await settle(rt)
    assert first == "manual@" + at(T0 + 1_234).strftime("%Y-%m-%dT%H:%M:%S.234Z")
    clock.advance(5)
    second = await rt.trigger_schedule("manual")
    await settle(rt)
    assert await runs(store, "long-job") == sorted([first, second])
    assert SEEN[0][1] == at(T0 + 1_234)
    await rt.close()


async def test_backfill_runs_a_past_window_once(stores: Stores) -> None:
    store, clock = stores[0], ManualClock(T0 + 10 * 3_600_000)
    rt = runtime(store, clock)
    await rt.schedule("hourly", job, every=timedelta(hours=1), principal=ALICE)
    await settle(rt)
    ids = await rt.backfill_schedule("hourly", at(T0), at(T0 + 3 * 3_600_000),
                                     principal=ALICE)
    await settle(rt)
    assert ids == [tick("hourly", T0 + k * 3_600_000) for k in range(4)]
    assert await runs(store) == ids
    assert sorted(when for _, when, _ in SEEN if when) == [
        at(T0 + k * 3_600_000) for k in range(4)]
    # Again, overlapping: the ticks that ran are refused by the store, the new one runs.
    await rt.backfill_schedule("hourly", at(T0 + 3_600_000), at(T0 + 4 * 3_600_000),
                               principal=ALICE)
    await settle(rt)
    assert len(await runs(store)) == 5
    info = await only(rt, ALICE)
    assert (info.runs, info.duplicates) == (5, 3)
    await rt.close()


@pytest.mark.parametrize(("start", "end", "field"), [
    (T0, T0 + 11 * 3_600_000, "end"),                        # in the future
    (T0 + 3_600_000, T0, "end"),                             # before start
    (T0 - 2_000 * 3_600_000, T0, "end"),                     # over 1,000 ticks
    (None, T0, "start"),                                     # naive
])
async def test_a_bad_backfill_window_is_refused_and_nothing_written(
        start: int | None, end: int, field: str) -> None:
    store, clock = MemoryEventStore(), ManualClock(T0 + 10 * 3_600_000)
    rt = runtime(store, clock)
    await rt.schedule("hourly", job, every=timedelta(hours=1))
    await settle(rt)
    eid = (await only(rt)).execution_id
    before = await store.read(eid)
    first = datetime(2025, 1, 1) if start is None else at(start)  # naive: refused
    with pytest.raises(ValidationError) as refused:
        await rt.backfill_schedule("hourly", first, at(end))
    assert refused.value.details["field"] == field
    assert await store.read(eid) == before
    assert await runs(store) == []
    await rt.close()


async def test_the_same_settings_again_are_accepted_and_other_settings_refused() -> None:
    store, clock = MemoryEventStore(), ManualClock(T0)
    rt = runtime(store, clock)
    first = await rt.schedule("nightly", job, {"a": 1}, cron="0 3 * * *",
                              timezone="Europe/Riga", principal=ALICE)
    await settle(rt)
    log = await store.read(first.execution_id)
    again = await rt.schedule("nightly", "job", {"a": 1}, cron="0  3 * * *",
                              timezone="Europe/Riga", principal=ALICE)
    assert again.execution_id == first.execution_id
    assert again.next_tick == first.next_tick
    for change, field in (({"cron": "0 4 * * *"}, "cron"), ({"overlap": "allow"}, "overlap"),
                          ({"input": {"a": 2}}, "input"),
                          ({"timezone": "UTC"}, "timezone"),
                          ({"catchup": timedelta(minutes=1)}, "catchup")):
        settings: dict[str, Any] = {"input": {"a": 1}, "cron": "0 3 * * *",
                                    "timezone": "Europe/Riga", **change}
        with pytest.raises(ConfigurationError) as refused:
            await rt.schedule("nightly", job, settings.pop("input"), principal=ALICE,
                              **settings)
        assert refused.value.details["field"] == field
        assert field in str(refused.value)
    assert await store.read(first.execution_id) == log
    assert len(await store.list_executions(limit=100)) == 1
    await rt.close()


async def test_bad_input_is_refused_before_anything_is_written() -> None:
    store = MemoryEventStore()
    rt = runtime(store, ManualClock(T0))
    for kwargs, field in (({"cron": "61 * * * *"}, "cron"),
                          ({"every": timedelta(0)}, "every"),
                          ({"every": timedelta(hours=1), "overlap": "parallel"}, "overlap"),
                          ({"cron": "0 3 * * *", "timezone": "Nowhere/Town"}, "timezone")):
        with pytest.raises(ValidationError) as refused:
            await rt.schedule("bad", job, **kwargs)
        assert refused.value.details["field"] == field
    with pytest.raises(FlowNotFoundError):
        await rt.schedule("bad", "no-such-flow", every=timedelta(hours=1))
    with pytest.raises(FlowNotFoundError):
        await rt.schedule("bad", SCHEDULE_FLOW_ID, every=timedelta(hours=1))
    with pytest.raises(ValidationError):
        await rt.schedule("bad", job, object(), every=timedelta(hours=1))  # not JSON
    assert await store.list_executions(limit=10) == []
    await rt.close()


async def test_delete_ends_the_schedule_its_runs_go_on_and_the_id_is_free_again() -> None:
    store, clock = MemoryEventStore(), ManualClock(T0)
    rt = runtime(store, clock)
    await rt.schedule("temp", long_job, every=timedelta(minutes=1), principal=ALICE)
    await settle(rt)
    await advance(rt, clock, 60)
    running = tick("temp", T0 + 60_000)
    with hidden():
        await rt.delete_schedule("temp", principal=MALLORY)
    await rt.delete_schedule("temp", principal=ALICE)
    assert await rt.schedules() == []
    assert (await rt.load_state(running)).parked  # abandoned, not cancelled
    assert await advance(rt, clock, 600) == 0
    for call in (rt.pause_schedule("temp"), rt.resume_schedule("temp"),
                 rt.trigger_schedule("temp"), rt.delete_schedule("temp")):
        with pytest.raises(ExecutionNotFoundError):
            await call
    again = await rt.schedule("temp", job, every=timedelta(hours=1), principal=ALICE)
    assert again.execution_id == "__fleet_schedule__:temp/2"
    assert [i.schedule_id for i in await rt.schedules()] == ["temp"]
    await rt.close()


async def test_a_schedule_continues_as_new_and_keeps_its_counts() -> None:
    store, clock = MemoryEventStore(), ManualClock(T0)
    rt = runtime(store, clock)
    await rt.schedule("busy", job, every=timedelta(seconds=10), overlap="allow")
    await settle(rt)
    for _ in range(TICKS_PER_RUN // 2 + 5):  # each tick: a wake and a run
        assert await advance(rt, clock, 10) == 1
    info = await only(rt)
    assert info.execution_id == "__fleet_schedule__:busy/1~1"
    assert info.runs == TICKS_PER_RUN // 2 + 5
    first = await store.read("__fleet_schedule__:busy/1")
    assert str(first[-1].type) == "EXECUTION_CONTINUED"
    await rt.pause_schedule("busy")  # reaches the newest run
    await settle(rt)
    assert (await only(rt)).paused
    await rt.close()


async def test_a_schedule_survives_a_restart_of_its_runtime(tmp_path: Any) -> None:
    from fleet import SqliteEventStore

    clock = ManualClock(T0)
    store = SqliteEventStore(str(tmp_path / "fleet.db"))
    rt = runtime(store, clock)
    await rt.schedule("durable", job, every=timedelta(minutes=1))
    await settle(rt)
    await advance(rt, clock, 60)
    await rt.close()
    await store.close()
    store = SqliteEventStore(str(tmp_path / "fleet.db"))
    rt = runtime(store, clock)
    assert await advance(rt, clock, 60) == 1
    assert await runs(store) == [tick("durable", T0 + k * 60_000) for k in (1, 2)]
    await rt.close()
    await store.close()


async def test_another_tenant_can_neither_see_nor_steer_nor_take_a_schedule(stores: Stores) -> None:
    store, clock = stores[0], ManualClock(T0)
    rt = runtime(store, clock)
    await rt.schedule("private", job, every=timedelta(minutes=1), principal=ALICE)
    await settle(rt)
    eid = (await only(rt, ALICE)).execution_id
    log = await store.read(eid)
    assert await rt.schedules(principal=MALLORY) == []
    for call in (rt.pause_schedule("private", principal=MALLORY),
                 rt.trigger_schedule("private", principal=MALLORY),
                 rt.backfill_schedule("private", at(T0 - 3_600_000), at(T0),
                                      principal=MALLORY)):
        with hidden():
            await call
    with pytest.raises(ExecutionConflictError):
        await rt.schedule("private", job, every=timedelta(minutes=1), principal=MALLORY)
    assert await store.read(eid) == log
    await rt.close()


async def test_a_forged_start_of_the_schedule_flow_starts_nothing(stores: Stores) -> None:
    store, clock = stores[0], ManualClock(T0)
    rt = runtime(store, clock)
    forged = {"spec": {"id": "victim", "flow": "job", "input": None, "cron": None,
                       "everyMs": 1000, "timezone": "UTC", "overlap": "allow",
                       "catchupMs": 3_600_000},
              "progress": {"last": T0 - 3_600_000, "generation": 1}}
    handle = await rt.start(SCHEDULE_FLOW_ID, forged, principal=MALLORY)
    await settle(rt)
    state = await rt.load_state(handle.execution_id)
    assert state.status == "failed"
    assert (state.error or {}).get("type") == "ReservedNameError"
    assert await runs(store) == []  # no run under the victim's tick ids
    await rt.close()


async def test_a_malformed_control_message_is_counted_and_changes_nothing(stores: Stores) -> None:
    store, clock = stores[0], ManualClock(T0)
    rt = runtime(store, clock)
    await rt.schedule("sturdy", job, every=timedelta(minutes=1))
    await settle(rt)
    eid = (await only(rt)).execution_id
    for garbage in ("pause", {"op": "trigger", "at": "now"}, {"op": "backfill"},
                    {"op": "explode"}, None, [1, 2]):
        await rt.send(eid, CONTROL, garbage)
        await settle(rt)
    info = await only(rt)
    assert not info.paused
    assert await runs(store) == []
    assert await advance(rt, clock, 60) == 1
    state = await rt.load_state(info.execution_id)
    assert state.published["schedule"]["refused"] == 6
    await rt.close()
