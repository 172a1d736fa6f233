"""Child flows (issue 26 item 3, decision 0033), on every store.

A child starts exactly once (replays and crashes), runs as its parent's owner, ends
into the parent (``CHILD_ENDED``, waking it), fails into ``ChildFailedError``, and is
cancelled when its parent is, unless it was started with ``on_parent_close="abandon"``.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from kernel_kit import FaultyStore, ManualClock, eventually, kinds, started

from fleet import (
    ChildFailedError,
    Context,
    ExecutionCancelledError,
    ExecutionConflictError,
    ExecutionFailedError,
    MemoryEventStore,
    Principal,
    ReservedNameError,
    Runtime,
    SqliteEventStore,
    flow,
)
from fleet.kernel.store.spi import EventStore, SnapshotStore

Stores = tuple[EventStore, SnapshotStore]
ALICE = Principal("alice", tenant="acme")
CHARGES: list[int] = []


def charge(amount: int) -> int:
    CHARGES.append(amount)
    return amount * 2


@flow("payment")
async def payment(ctx: Context, amount: int) -> dict[str, Any]:
    doubled = await ctx.step("charge", charge, amount)
    if amount < 0:
        raise ValueError(f"refused amount {amount}")
    return {"paid": doubled}


@flow("slow-payment")
async def slow_payment(ctx: Context, amount: int) -> Any:
    try:
        return await ctx.wait("confirm")
    except asyncio.CancelledError:
        await ctx.step("void", charge, -amount)
        raise


@flow("order")
async def order(ctx: Context, amount: int) -> Any:
    result = await ctx.child(payment, amount)
    return {"order": amount, "payment": result}


async def test_a_child_runs_once_as_its_parent_and_its_result_reaches_the_parent(
        stores: Stores) -> None:
    store = stores[0]
    CHARGES.clear()
    runtime = Runtime(store, flows=[order, payment])
    handle = await runtime.start("order", 5, principal=ALICE)
    assert await handle.result(timeout=10) == {"order": 5, "payment": {"paid": 10}}
    assert CHARGES == [5]
    parent = await runtime.load_state(handle.execution_id, principal=ALICE)
    child_id = f"{handle.execution_id}/child#0"
    assert parent.children["child#0"]["childId"] == child_id
    child = await runtime.load_state(child_id, principal=ALICE)
    assert child.owner == {"actor": "alice", "tenant": "acme"}
    assert child.parent == {"executionId": handle.execution_id, "name": "child#0",
                            "onParentClose": "cancel"}
    log = kinds(await store.read(handle.execution_id))
    assert "CHILD_STARTED" in log
    assert "CHILD_ENDED" in log
    await runtime.close()


async def test_a_failed_child_raises_child_failed_error_in_the_parent(stores: Stores) -> None:
    store = stores[0]

    @flow("careful-order")
    async def careful(ctx: Context, amount: int) -> Any:
        try:
            return await ctx.child("payment", amount)
        except ChildFailedError as failed:
            return {"failed": failed.child_id, "type": failed.error.get("type")}

    runtime = Runtime(store, flows=[careful, payment])
    handle = await runtime.start("careful-order", -1)
    result = await handle.result(timeout=10)
    assert result == {"failed": f"{handle.execution_id}/child#0", "type": "ValueError"}
    await runtime.close()


async def test_a_parent_waiting_on_a_child_is_parked_and_woken_by_its_end(
        stores: Stores) -> None:
    store = stores[0]

    @flow("waiting-order")
    async def waiting(ctx: Context, amount: int) -> Any:
        handle = await ctx.start_child(slow_payment, amount, id=f"pay-{amount}")
        return {"child": handle.execution_id, "result": await handle.result()}

    runtime = Runtime(store, flows=[waiting, slow_payment], local_timers=False)
    eid = await started(runtime, "waiting-order", 7)
    parent = await runtime.load_state(eid)
    assert parent.parked
    assert parent.waiting is not None
    assert parent.waiting["on"] == "child:child#0"
    assert (await runtime.load_state("pay-7")).parked
    await runtime.resume("pay-7", "confirm", "ok")
    assert await runtime.result(eid) == {"child": "pay-7", "result": "ok"}
    # The backstop timer was withdrawn once the child's end arrived.
    assert await store.due_timers(2**62) == []
    await runtime.close()


async def test_cancelling_a_parent_cancels_its_children_unless_abandoned(stores: Stores) -> None:
    store = stores[0]
    CHARGES.clear()

    @flow("two-children")
    async def two(ctx: Context, _: Any) -> Any:
        kept = await ctx.start_child(slow_payment, 1, on_parent_close="abandon")
        doomed = await ctx.start_child(slow_payment, 2)
        return await ctx.first(kept.result(), doomed.result())

    runtime = Runtime(store, flows=[two, slow_payment], local_timers=False)
    eid = await started(runtime, "two-children")
    await (await runtime.cancel(eid)).outcome()
    with pytest.raises(ExecutionCancelledError):
        await runtime.result(eid)
    kept, doomed = f"{eid}/child#0", f"{eid}/child#1"

    async def doomed_cancelled() -> bool:
        return (await runtime.load_state(doomed)).status == "cancelled"

    await eventually(doomed_cancelled, timeout=10)
    assert CHARGES == [-2]  # the doomed child's cleanup ran; the kept one was left alone
    assert (await runtime.load_state(kept)).parked
    await runtime.close()


async def test_a_parent_that_ends_cancels_its_running_children(stores: Stores) -> None:
    store = stores[0]

    @flow("impatient")
    async def impatient(ctx: Context, _: Any) -> str:
        await ctx.start_child(slow_payment, 3)
        return "done without waiting"

    runtime = Runtime(store, flows=[impatient, slow_payment], local_timers=False)
    handle = await runtime.start("impatient")
    assert await handle.result(timeout=10) == "done without waiting"
    child = f"{handle.execution_id}/child#0"

    async def child_cancelled() -> bool:
        return (await runtime.load_state(child)).status == "cancelled"

    await eventually(child_cancelled, timeout=10)
    await runtime.close()


async def test_a_child_is_started_exactly_once_when_the_parent_crashes_between(
        tmp_path: Any) -> None:
    inner = SqliteEventStore(str(tmp_path / "fleet.db"))
    faulty = FaultyStore(inner, lambda e: e.type == "CHILD_STARTED")
    CHARGES.clear()
    runtime = Runtime(faulty, flows=[order, payment])  # type: ignore[arg-type]
    handle = await runtime.start("order", 4)
    outcome = await handle.outcome()
    assert outcome is not None
    assert outcome.kind == "aborted"  # its CHILD_STARTED write was lost
    child_id = f"{handle.execution_id}/child#0"
    assert (await inner.head(child_id)) is not None  # the child exists (and ran)
    await runtime.close()
    faulty.armed = False
    again = Runtime(faulty, flows=[order, payment])  # type: ignore[arg-type]
    await again.drive(handle.execution_id, wait=True)
    assert await again.result(handle.execution_id) == {"order": 4, "payment": {"paid": 8}}
    assert CHARGES == [4]
    state = await again.load_state(handle.execution_id)
    assert list(state.children) == ["child#0"]
    await again.close()
    await inner.close()


async def test_a_lost_end_notice_is_found_by_the_parent_and_its_backstop(tmp_path: Any) -> None:
    clock = ManualClock()
    store = MemoryEventStore(clock=clock)

    @flow("patient")
    async def patient(ctx: Context, _: Any) -> Any:
        handle = await ctx.start_child(slow_payment, 9, id="pay-9")
        return await handle.result()

    runtime = Runtime(store, flows=[patient, slow_payment], clock=clock, local_timers=False)
    runtime.engine.on_ended = None  # as if the child's process died before telling
    eid = await started(runtime, "patient")
    await runtime.resume("pay-9", "confirm", "late ok")
    assert await runtime.result("pay-9") == "late ok"
    await asyncio.sleep(0.05)
    assert (await runtime.load_state(eid)).parked  # no notice came
    clock.advance(61)
    fired = await runtime.fire_due_timers()
    assert [(f.execution_id, f.timer_id) for f in fired] == [(eid, "child#0:check#0")]
    assert await runtime.result(eid) == "late ok"
    await runtime.close()


async def test_a_child_id_taken_by_another_execution_fails_the_parent(stores: Stores) -> None:
    store = stores[0]

    @flow("squatted")
    async def squatted(ctx: Context, _: Any) -> Any:
        return await ctx.child(payment, 1, id="taken-id")

    runtime = Runtime(store, flows=[squatted, payment])
    await (await runtime.start("payment", 1, execution_id="taken-id")).result(timeout=10)
    handle = await runtime.start("squatted")
    with pytest.raises(ExecutionFailedError, match="taken-id"):
        await handle.result(timeout=10)
    state = await runtime.load_state(handle.execution_id)
    assert state.error is not None
    assert state.error["type"] == ExecutionConflictError.__name__
    await runtime.close()


async def test_bad_child_requests_are_refused_before_anything_is_written(store: EventStore) -> None:
    @flow("bad-child")
    async def bad(ctx: Context, what: str) -> Any:
        if what == "unknown":
            return await ctx.child("no-such-flow", 1)
        if what == "policy":
            return await ctx.start_child(payment, 1, on_parent_close="orphan")
        if what == "reserved":
            return await ctx.start_child(payment, 1, id="x/child#3")
        return await ctx.child(payment, {1, 2})

    runtime = Runtime(store, flows=[bad, payment])
    for what, error in (("unknown", "FlowNotFoundError"), ("policy", "ValidationError"),
                        ("reserved", ReservedNameError.__name__),
                        ("input", "NotSerializableError")):
        handle = await runtime.start("bad-child", what)
        with pytest.raises(ExecutionFailedError):
            await handle.result(timeout=10)
        log = await store.read(handle.execution_id)
        assert kinds(log) == ["EXECUTION_STARTED", "EXECUTION_FAILED"], what
        assert log[-1].payload["error"]["type"] == error
    await runtime.close()


async def test_a_child_in_a_race_with_a_timer(clocked_store: EventStore,
                                              clock: ManualClock) -> None:
    @flow("deadline-order")
    async def racing(ctx: Context, _: Any) -> Any:
        handle = await ctx.start_child(slow_payment, 5, id="race-pay")
        index, _ = await ctx.first(handle.result(), ctx.sleep(timedelta(minutes=5)))
        return "paid" if index == 0 else "gave up"

    runtime = Runtime(clocked_store, flows=[racing, slow_payment], clock=clock,
                      local_timers=False)
    eid = await started(runtime, "deadline-order")
    clock.advance(301)
    # The child's backstop (due first) wakes the parent, whose race finds its own
    # timer due: the timer wins (it fires in the run).
    fired = await runtime.fire_due_timers()
    assert {f.timer_id for f in fired} <= {"child#0:check#0", "sleep#0"}
    assert await runtime.result(eid) == "gave up"
    races = [e.payload for e in await clocked_store.read(eid) if e.type == "FIRST_RESOLVED"]
    assert races == [{"name": "first#0", "index": 1}]
    # The parent ended: its child was cancelled (the default on_parent_close).
    async def child_cancelled() -> bool:
        return (await runtime.load_state("race-pay")).status == "cancelled"

    await eventually(child_cancelled, timeout=10)
    await runtime.close()


async def test_a_child_that_ends_after_its_parents_cancel_request_does_not_answer_the_parent(
        stores: Stores) -> None:
    """The parent's await on the child was pending when its cancellation was asked for:
    the cancellation comes first, though the child (cancelled along with it) ended
    before the parent's drive."""
    store = stores[0]

    @flow("waits-on-child")
    async def waits(ctx: Context, _: Any) -> Any:
        return await ctx.child(slow_payment, 8, id="pay-8")

    runtime = Runtime(store, flows=[waits, slow_payment], local_timers=False)
    eid = await started(runtime, "waits-on-child")
    await runtime.cancel(eid, drive=False)  # written; its drive comes later

    async def child_told() -> bool:
        return "status" in (await runtime.load_state(eid)).children.get("child#0", {})

    await eventually(child_told, timeout=10)  # the child was cancelled and told its parent
    await runtime.drive(eid, wait=True)
    with pytest.raises(ExecutionCancelledError):
        await runtime.result(eid)
    log = await store.read(eid)
    assert [e.payload["at"] for e in log if e.type == "CANCEL_DELIVERED"] == ["child:child#0"]
    await runtime.close()


async def test_replay_check_of_a_parent_waiting_on_its_child_is_ok(store: EventStore) -> None:
    from fleet.kernel.replay import replay_check

    @flow("checked-parent")
    async def checked(ctx: Context, _: Any) -> Any:
        return await ctx.child(slow_payment, 1, id="checked-pay")

    runtime = Runtime(store, flows=[checked, slow_payment], local_timers=False)
    eid = await started(runtime, "checked-parent")
    verdict = await replay_check(await store.read(eid), [checked, slow_payment])
    assert verdict.status == "ok", verdict
    await runtime.close()
