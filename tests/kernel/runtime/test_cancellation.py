"""Cancellation the flow sees (issue 26 item 1, decision 0033), on every store.

``runtime.cancel`` records the request and drives the execution; the flow gets
``asyncio.CancelledError`` at the await it was parked or running on, may run
cleanup steps (journaled, run once even across drives), and ends ``cancelled``
when it lets the error out; ``force=True`` ends it at once. A park never runs an
effect while it unwinds (item 7c).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kernel_kit import dumped, kinds, settle, started
from refusals import hidden

from fleet import (
    Context,
    ExecutionCancelledError,
    ExecutionFailedError,
    ExecutionFinishedError,
    ExecutionNotFoundError,
    Principal,
    Runtime,
    ValidationError,
    flow,
)
from fleet.kernel.store.spi import EventStore, SnapshotStore

Stores = tuple[EventStore, SnapshotStore]
ALICE = Principal("alice", tenant="acme")


def _saga(calls: list[str]) -> Any:
    def charge() -> str:
        calls.append("charge")
        return "charged"

    def refund() -> str:
        calls.append("refund")
        return "refunded"

    @flow("saga")
    async def saga(ctx: Context, _: Any) -> str:
        await ctx.step("charge", charge)
        try:
            await ctx.wait("approval")
        except asyncio.CancelledError:
            await ctx.step("refund", refund)
            raise
        return "approved"

    return saga


async def test_a_parked_flow_gets_cancelled_error_runs_its_compensation_and_ends_cancelled(
        stores: Stores) -> None:
    store = stores[0]
    calls: list[str] = []
    runtime = Runtime(store, flows=[_saga(calls)])
    eid = await started(runtime, "saga", principal=ALICE)
    handle = await runtime.cancel(eid, reason="customer left", principal=ALICE)
    outcome = await handle.outcome()
    assert outcome is not None
    assert outcome.kind == "cancelled"
    with pytest.raises(ExecutionCancelledError):
        await runtime.result(eid)
    log = await store.read(eid)
    assert kinds(log)[3:] == ["EXECUTION_SUSPENDED", "CANCEL_REQUESTED", "CANCEL_DELIVERED",
                              "STEP_STARTED", "STEP_COMPLETED", "EXECUTION_CANCELLED"]
    assert log[4].payload == {"reason": "customer left", "by": "alice"}
    assert log[5].payload == {"at": "gate:approval#0", "branch": ""}
    assert log[-1].payload == {"reason": "customer left"}
    assert calls == ["charge", "refund"]
    state = await runtime.load_state(eid, principal=ALICE)
    assert (state.status, state.error) == ("cancelled", {"type": "Cancelled",
                                                          "message": "customer left"})
    assert runtime.stats.cancelled == 1
    await runtime.close()


async def test_a_swallowed_cancellation_goes_on_and_replays_without_running_cleanup_twice(
        stores: Stores) -> None:
    store = stores[0]
    calls: list[str] = []

    def undo() -> str:
        calls.append("undo")
        return "undone"

    @flow("forgiving")
    async def forgiving(ctx: Context, _: Any) -> str:
        try:
            await ctx.wait("go")
        except asyncio.CancelledError:
            await ctx.step("undo", undo)
            # The compensation waits for a person: the run parks, and its next drive
            # replays the cancellation at the same await, the undo from the log.
            ack = await ctx.wait("ack")
            return f"cancelled and acknowledged by {ack}"
        return "went"

    runtime = Runtime(store, flows=[forgiving])
    eid = await started(runtime, "forgiving")
    await (await runtime.cancel(eid)).outcome()
    state = await runtime.load_state(eid)
    assert state.parked
    assert (state.waiting or {}).get("on") == "ack"
    assert calls == ["undo"]
    await runtime.resume(eid, "ack", "bob")
    assert await runtime.result(eid) == "cancelled and acknowledged by bob"
    assert calls == ["undo"]  # the replay served it from the log
    assert kinds(await store.read(eid)).count("CANCEL_DELIVERED") == 1
    await runtime.close()


async def test_cancel_during_a_sleep_withdraws_its_timer(stores: Stores) -> None:
    store = stores[0]

    @flow("sleeper")
    async def sleeper(ctx: Context, _: Any) -> str:
        try:
            await ctx.sleep(timedelta(hours=2))
        except asyncio.CancelledError:
            return "woken by the cancel"
        return "slept"

    runtime = Runtime(store, flows=[sleeper], local_timers=False)
    eid = await started(runtime, "sleeper")
    assert len(await store.due_timers(2**62)) == 1
    await (await runtime.cancel(eid)).outcome()
    assert await runtime.result(eid) == "woken by the cancel"
    assert await store.due_timers(2**62) == []
    log = await store.read(eid)
    assert kinds(log)[-3:] == ["CANCEL_DELIVERED", "TIMER_CANCELLED", "EXECUTION_COMPLETED"]
    assert log[-3].payload["at"] == "timer:sleep#0"
    await runtime.close()


async def test_cancel_during_a_running_async_step_cancels_its_body_and_records_it_cancelled(
        stores: Stores) -> None:
    store = stores[0]
    entered = asyncio.Event()
    seen: list[str] = []

    async def slow() -> str:
        entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("step body cancelled")
            raise
        return "done"

    def cleanup() -> str:
        seen.append("cleanup")
        return "clean"

    @flow("busy")
    async def busy(ctx: Context, _: Any) -> str:
        try:
            return str(await ctx.step("slow", slow))
        finally:
            await ctx.step("cleanup", cleanup)

    runtime = Runtime(store, flows=[busy])
    handle = await runtime.start("busy")
    await asyncio.wait_for(entered.wait(), 5)
    await (await runtime.cancel(handle.execution_id)).outcome()
    with pytest.raises(ExecutionCancelledError):
        await runtime.result(handle.execution_id)
    assert seen == ["step body cancelled", "cleanup"]
    log = await store.read(handle.execution_id)
    assert kinds(log) == ["EXECUTION_STARTED", "STEP_STARTED", "CANCEL_REQUESTED",
                          "CANCEL_DELIVERED", "STEP_CANCELLED", "STEP_STARTED",
                          "STEP_COMPLETED", "EXECUTION_CANCELLED"]
    state = await runtime.load_state(handle.execution_id)
    assert state.frames["slow"].status == "cancelled"
    await runtime.close()


async def test_every_branch_of_a_parallel_scope_gets_the_cancellation(stores: Stores) -> None:
    store = stores[0]
    cleaned: list[str] = []

    def note(what: str) -> str:
        cleaned.append(what)
        return what

    async def gate_branch(ctx: Context) -> Any:
        try:
            return await ctx.wait("a")
        except asyncio.CancelledError:
            await ctx.step("undo-a", note, "a")
            raise

    async def message_branch(ctx: Context) -> Any:
        try:
            return await ctx.receive("b")
        except asyncio.CancelledError:
            await ctx.step("undo-b", note, "b")
            raise

    @flow("fan")
    async def fan(ctx: Context, _: Any) -> Any:
        try:
            return await ctx.parallel([gate_branch, message_branch])
        except asyncio.CancelledError:
            await ctx.step("undo-all", note, "all")
            raise

    runtime = Runtime(store, flows=[fan])
    eid = await started(runtime, "fan")
    await (await runtime.cancel(eid)).outcome()
    with pytest.raises(ExecutionCancelledError):
        await runtime.result(eid)
    assert sorted(cleaned[:2]) == ["a", "b"]
    assert cleaned[2:] == ["all"]
    deliveries = [e.payload for e in await store.read(eid) if e.type == "CANCEL_DELIVERED"]
    assert sorted((d["at"], d["branch"]) for d in deliveries) == [
        ("gate:a#0", "/0.0:"), ("msg:b#0", "/0.1:"), ("parallel:/0", "")]
    await runtime.close()


async def test_cancelling_twice_changes_nothing_and_a_finished_one_is_refused(
        stores: Stores) -> None:
    store = stores[0]
    calls: list[str] = []
    runtime = Runtime(store, flows=[_saga(calls)])
    eid = await started(runtime, "saga")
    first = await runtime.cancel(eid, drive=False, reason="first")
    assert await first.outcome() is None  # written, not driven: a worker drives it
    before = dumped(await store.read(eid))
    await runtime.cancel(eid, reason="second")
    assert dumped(await store.read(eid)) == before  # the first request stands
    await runtime.drive(eid, wait=True)
    with pytest.raises(ExecutionCancelledError):
        await runtime.result(eid)
    assert (await store.read(eid))[-1].payload == {"reason": "first"}
    ended = dumped(await store.read(eid))
    with pytest.raises(ExecutionFinishedError, match="already ended"):
        await runtime.cancel(eid)
    with pytest.raises(ExecutionFinishedError):
        await runtime.cancel(eid, force=True)
    assert dumped(await store.read(eid)) == ended
    await runtime.close()


async def test_two_cancels_at_once_deliver_one_and_run_the_cleanup_once(
        stores: Stores) -> None:
    """A parent's cancel and then its end both cancel a child, at once: the second must
    see the first's request, not take the fence from the drive delivering it mid-step
    (whose cleanup step would then run again, in doubt)."""
    store = stores[0]
    calls: list[str] = []

    async def refund() -> str:
        calls.append("refund")
        await asyncio.sleep(0.05)  # still running when a second canceller would take over
        return "refunded"

    @flow("slow-refund")
    async def body(ctx: Context, _: Any) -> str:
        try:
            return await ctx.wait("approval")
        except asyncio.CancelledError:
            await ctx.step("refund", refund)
            raise

    runtime = Runtime(store, flows=[body])
    eid = await started(runtime, "slow-refund")
    handles = await asyncio.gather(*(runtime.cancel(eid, reason=f"r{n}") for n in range(3)))
    await asyncio.gather(*(h.outcome() for h in handles))
    with pytest.raises(ExecutionCancelledError):
        await runtime.result(eid)
    assert calls == ["refund"]
    log = kinds(await store.read(eid))
    assert log.count("CANCEL_REQUESTED") == 1
    assert log.count("STEP_STARTED") == 1
    assert "EFFECT_INDOUBT" not in log
    await runtime.close()


async def test_force_after_a_graceful_request_ends_it_at_once(stores: Stores) -> None:
    store = stores[0]
    calls: list[str] = []
    runtime = Runtime(store, flows=[_saga(calls)])
    eid = await started(runtime, "saga")
    await runtime.cancel(eid, drive=False)
    await runtime.cancel(eid, force=True, reason="terminate")
    log = await store.read(eid)
    assert kinds(log)[-2:] == ["CANCEL_REQUESTED", "EXECUTION_CANCELLED"]
    assert calls == ["charge"]  # no cleanup ran
    await runtime.close()


async def test_bad_cancel_requests_are_refused_and_write_nothing(stores: Stores) -> None:
    store = stores[0]
    calls: list[str] = []
    runtime = Runtime(store, flows=[_saga(calls)])
    eid = await started(runtime, "saga", principal=ALICE)
    before = dumped(await store.read(eid))
    with pytest.raises(ValidationError, match="string"):
        await runtime.cancel(eid, reason=42, principal=ALICE)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="4000"):
        await runtime.cancel(eid, reason="x" * 4001, principal=ALICE)
    with pytest.raises(ValidationError, match="NUL"):
        await runtime.cancel(eid, reason="a\x00b", principal=ALICE)
    with pytest.raises(ExecutionNotFoundError):
        await runtime.cancel("no-such-execution")
    assert dumped(await store.read(eid)) == before
    with hidden():
        await runtime.cancel(eid, principal=Principal("mallory", tenant="evil"))
    assert "CANCEL_REQUESTED" not in kinds(await store.read(eid))
    await runtime.close()


async def test_a_flow_raising_cancelled_error_with_no_request_fails(stores: Stores) -> None:
    store = stores[0]

    @flow("self-cancelling")
    async def body(ctx: Context, _: Any) -> str:
        raise asyncio.CancelledError()

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("self-cancelling")
    with pytest.raises(ExecutionFailedError, match="no cancellation was requested"):
        await handle.result(timeout=5)
    await runtime.close()


# -- a park runs no effect while it unwinds (item 7c) ---------------------------------

async def test_a_park_does_not_run_the_flows_finally_steps(stores: Stores) -> None:
    store = stores[0]
    ran: list[str] = []

    def cleanup() -> str:
        ran.append("cleanup")
        return "clean"

    @flow("finally")
    async def body(ctx: Context, _: Any) -> Any:
        try:
            return await ctx.wait("g")
        finally:
            await ctx.step("cleanup", cleanup)
            await ctx.emit("app.cleaned", {})
            ctx.now()

    runtime = Runtime(store, flows=[body])
    eid = await started(runtime, "finally")
    log = await store.read(eid)
    assert kinds(log) == ["EXECUTION_STARTED", "EXECUTION_SUSPENDED"]
    assert ran == []
    await runtime.resume(eid, "g", "answer")
    assert await runtime.result(eid) == "answer"
    assert ran == ["cleanup"]  # once the wait returned, the finally ran for real
    await runtime.close()


async def test_a_body_that_swallows_its_park_is_parked_all_the_same(stores: Stores) -> None:
    store = stores[0]

    @flow("greedy")
    async def body(ctx: Context, _: Any) -> str:
        try:
            await ctx.wait("g")
        except BaseException:  # noqa: BLE001 - the careless flow this test is about
            return "escaped"
        return "answered"

    runtime = Runtime(store, flows=[body])
    eid = await started(runtime, "greedy")
    state = await runtime.load_state(eid)
    assert state.parked
    assert state.output is None
    assert kinds(await store.read(eid)) == ["EXECUTION_STARTED", "EXECUTION_SUSPENDED"]
    await runtime.resume(eid, "g")
    assert await runtime.result(eid) == "answered"
    await runtime.close()


async def test_a_park_in_one_branch_lets_the_other_branch_finish_its_work(
        stores: Stores) -> None:
    store = stores[0]
    ran: list[str] = []

    def work(n: int) -> int:
        ran.append(f"work-{n}")
        return n

    async def waiting(ctx: Context) -> Any:
        return await ctx.wait("g")

    async def working(ctx: Context) -> int:
        total = 0
        for n in range(3):
            total += await ctx.step(f"work-{n}", work, n)
        return total

    @flow("mixed")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.parallel([waiting, working])

    runtime = Runtime(store, flows=[body])
    eid = await started(runtime, "mixed")
    assert ran == ["work-0", "work-1", "work-2"]
    assert (await runtime.load_state(eid)).parked
    await runtime.resume(eid, "g", "x")
    assert await runtime.result(eid) == ["x", 3]
    assert ran == ["work-0", "work-1", "work-2"]
    await settle(runtime)
    await runtime.close()


async def test_a_deadline_is_a_timer_every_store_keeps_and_fires(stores: Stores) -> None:
    store = stores[0]

    @flow("deadline-anywhere", deadline=3600)
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.wait("never")

    runtime = Runtime(store, flows=[body], local_timers=False)
    eid = await started(runtime, "deadline-anywhere")
    due = [(d.execution_id, d.timer_id) for d in await store.due_timers(2**62)]
    assert due == [(eid, "__fleet_deadline__")]
    # Early, the timer is refused by the execution's own deadline; late, it ends it.
    assert await runtime.fire_due_timers() == []
    late = datetime.now(UTC) + timedelta(hours=2)
    runtime.engine.clock = lambda: int(late.timestamp() * 1000)  # the runtime's clock moves
    fired = await runtime.fire_due_timers(late)
    assert [(f.execution_id, f.timer_id) for f in fired] == [(eid, "__fleet_deadline__")]
    with pytest.raises(ExecutionFailedError, match="DeadlineExceeded"):
        await runtime.result(eid)
    assert await store.due_timers(2**62) == []
    await runtime.close()


async def test_a_cancel_from_another_runtime_stops_the_step_body_where_it_runs(
        tmp_path: Any) -> None:
    """The holder in another process learns from its next lease renewal that the fence
    was taken, and its async step body is cancelled then, not when the step returns."""
    from fleet import SqliteEventStore

    path = str(tmp_path / "fleet.db")
    entered, stopped = asyncio.Event(), asyncio.Event()

    async def long_call() -> str:
        entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            stopped.set()
            raise
        return "done"

    @flow("remote-step")
    async def body(ctx: Context, _: Any) -> str:
        return str(await ctx.step("long", long_call))

    holder_store, canceller_store = SqliteEventStore(path), SqliteEventStore(path)
    holder = Runtime(holder_store, flows=[body], lease_ms=300)
    canceller = Runtime(canceller_store, flows=[body], lease_ms=300)
    handle = await holder.start("remote-step")
    await asyncio.wait_for(entered.wait(), 5)
    await (await canceller.cancel(handle.execution_id, reason="from afar")).outcome()
    await asyncio.wait_for(stopped.wait(), 5)  # within a renewal, not 30 s
    outcome = await handle.outcome()
    assert outcome is not None
    assert outcome.kind == "fenced_out"
    with pytest.raises(ExecutionCancelledError):
        await canceller.result(handle.execution_id)
    await holder.close()
    await canceller.close()
    await holder_store.close()
    await canceller_store.close()
