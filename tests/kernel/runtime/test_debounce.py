"""Debounced starts (decision 0057): the starts of one key inside the window are one run,
with the last input, once the window passed with no new start.

Every embedded store, a manual clock; the fleet's burst of 50 through real workers is in
``tests/integration/test_queues_fleet.py``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from kernel_kit import ManualClock

from fleet import AccessPolicy, Context, Principal, Queue, Runtime, flow
from fleet.kernel.errors import ExecutionConflictError, ValidationError
from fleet.kernel.events import EventType
from fleet.kernel.start_plan import START_GATE
from fleet.kernel.store.spi import EventStore
from fleet.kernel.values import datetime_from_ms

RAN: list[Any] = []


def record(value: Any) -> Any:
    RAN.append(value)
    return value


@flow("deb-digest")
async def digest(ctx: Context, data: Any) -> Any:
    return await ctx.step("send", record, data)


ALICE = Principal("alice", tenant="acme")
BOB = Principal("bob", tenant="acme")
WINDOW = timedelta(seconds=5)


def runtime(store: EventStore, clock: ManualClock, **kw: Any) -> Runtime:
    return Runtime(store, flows=[digest], local_timers=False, clock=clock, **kw)


@pytest.fixture(autouse=True)
def _clear() -> None:
    RAN.clear()


async def test_a_burst_inside_the_window_is_one_run_with_the_last_input(
        clocked_store: EventStore, clock: ManualClock) -> None:
    rt = runtime(clocked_store, clock)
    handles = []
    for i in range(10):
        handles.append(await rt.start("deb-digest", {"n": i}, debounce=WINDOW, key="user-7",
                                      principal=ALICE))
        clock.advance(1)  # each start inside the window of the one before
    (eid,) = {h.execution_id for h in handles}
    state = await rt.load_state(eid, principal=ALICE)
    assert state.parked
    assert state.input == {"n": 9}
    assert state.timers[START_GATE]["dueAt"] == clock.now - 1000 + 5000
    assert await rt.fire_due_timers(datetime_from_ms(clock.now + 3_000)) == []  # not yet
    clock.advance(4)
    assert [f.execution_id for f in await rt.fire_due_timers()] == [eid]
    assert await rt.result(eid) == {"n": 9}
    assert RAN == [{"n": 9}]
    kinds = [e.type for e in await clocked_store.read(eid)]
    assert kinds.count(EventType.EXECUTION_DEBOUNCED) == 9
    assert kinds.count(EventType.EXECUTION_STARTED) == 1
    await rt.close()


async def test_a_start_after_the_run_began_opens_a_new_window(
        clocked_store: EventStore, clock: ManualClock) -> None:
    rt = runtime(clocked_store, clock)
    first = await rt.start("deb-digest", "a", debounce=WINDOW, key="k")
    clock.advance(5)
    await rt.fire_due_timers()
    assert await rt.result(first.execution_id) == "a"
    second = await rt.start("deb-digest", "b", debounce=WINDOW, key="k")
    assert second.execution_id != first.execution_id
    third = await rt.start("deb-digest", "c", debounce=WINDOW, key="k")
    assert third.execution_id == second.execution_id
    clock.advance(5)
    await rt.fire_due_timers()
    assert await rt.result(second.execution_id) == "c"
    assert RAN == ["a", "c"]
    await rt.close()


async def test_windows_are_per_tenant_flow_and_key(clocked_store: EventStore,
                                                   clock: ManualClock) -> None:
    rt = runtime(clocked_store, clock)
    acme = await rt.start("deb-digest", 1, debounce=WINDOW, key="k", principal=ALICE)
    other = await rt.start("deb-digest", 2, debounce=WINDOW, key="k",
                           principal=Principal("eve", tenant="globex"))
    other_key = await rt.start("deb-digest", 3, debounce=WINDOW, key="k2", principal=ALICE)
    assert len({acme.execution_id, other.execution_id, other_key.execution_id}) == 3
    assert (await rt.load_state(acme.execution_id, principal=ALICE)).input == 1
    await rt.close()


async def test_a_principal_who_may_not_read_the_window_cannot_join_it(
        clocked_store: EventStore, clock: ManualClock) -> None:
    rt = runtime(clocked_store, clock, access_policy=AccessPolicy(rules={"read": "owner"}))
    mine = await rt.start("deb-digest", "alice's", debounce=WINDOW, key="k", principal=ALICE)
    before = [e.to_dict() for e in await clocked_store.read(mine.execution_id)]
    with pytest.raises(ExecutionConflictError):
        await rt.start("deb-digest", "bob's", debounce=WINDOW, key="k", principal=BOB)
    assert [e.to_dict() for e in await clocked_store.read(mine.execution_id)] == before
    await rt.close()


async def test_bad_debounces_are_refused_and_nothing_is_written(
        clocked_store: EventStore, clock: ManualClock) -> None:
    rt = runtime(clocked_store, clock)
    cases: list[tuple[str, dict[str, Any]]] = [
        ("pass key=", {"debounce": WINDOW}),
        ("positive", {"debounce": timedelta(0), "key": "k"}),
        ("positive", {"debounce": timedelta(seconds=-1), "key": "k"}),
        ("timedelta", {"debounce": 5, "key": "k"}),
        ("drop start_at", {"debounce": WINDOW, "key": "k", "start_in": WINDOW}),
        ("drop execution_id", {"debounce": WINDOW, "key": "k", "execution_id": "x"}),
        ("drop execution_id", {"debounce": WINDOW, "key": "k", "idempotency_key": "x"}),
    ]
    for words, kw in cases:
        with pytest.raises(ValidationError, match=words):
            await rt.start("deb-digest", 1, **kw)
    assert await clocked_store.list_executions() == []
    await rt.close()


async def test_a_debounced_queued_start_moves_its_eligibility_then_waits_for_a_slot(
        clocked_store: EventStore, clock: ManualClock) -> None:
    rt = runtime(clocked_store, clock, queues=[Queue("digests", concurrency=1)])
    ids = set()
    for i in range(3):
        ids.add((await rt.start("deb-digest", i, queue="digests", key="u",
                                debounce=WINDOW)).execution_id)
        clock.advance(2)
    (eid,) = ids
    assert (await rt.load_state(eid)).waiting == {"on": "__fleet_queue__:digests",
                                                  "kind": "timer", "queue": "digests",
                                                  "key": "u"}
    assert await rt.fire_due_timers() == []  # the last start moved it to now + 4 s
    clock.advance(4)
    assert [f.execution_id for f in await rt.fire_due_timers()] == [eid]
    assert await rt.result(eid) == 2
    assert RAN == [2]
    await rt.close()


async def test_a_timer_listed_as_due_is_not_fired_once_a_start_moved_it(
        clocked_store: EventStore, clock: ManualClock) -> None:
    """The timer service lists due timers, then claims each: a debounce in between moves
    the due time, and the claim (under the fence) sees it."""
    rt = runtime(clocked_store, clock)
    handle = await rt.start("deb-digest", "a", debounce=WINDOW, key="k")
    clock.advance(5)
    listed = await clocked_store.due_timers(clock.now)
    assert [t.execution_id for t in listed] == [handle.execution_id]
    await rt.start("deb-digest", "b", debounce=WINDOW, key="k")  # moves it to now + 5 s
    assert not await rt.timers.fire(handle.execution_id, START_GATE, now=clock.now)
    clock.advance(5)
    assert await rt.timers.fire(handle.execution_id, START_GATE, now=clock.now)
    assert await rt.result(handle.execution_id) == "b"
    await rt.close()
