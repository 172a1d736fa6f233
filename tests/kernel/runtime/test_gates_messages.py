"""Gates (wait / resume) and messages (receive / send)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kernel_kit import dumped, kinds, settle, started

from fleet import (
    Context,
    ExecutionFinishedError,
    ExecutionNotFoundError,
    ExecutionNotParkedError,
    ExecutionStateError,
    GateMismatchError,
    ReservedNameError,
    Runtime,
    flow,
)
from fleet.kernel.store.spi import EventStore
from fleet.kernel.values import datetime_from_ms


@flow("approval")
async def approval(ctx: Context, _: Any) -> Any:
    answer = await ctx.wait("approve")
    return {"approved": answer}


async def test_wait_parks_and_resume_returns_the_payload(store: EventStore) -> None:
    runtime = Runtime(store, flows=[approval])
    eid = await started(runtime, "approval")
    state = await runtime.load_state(eid)
    assert state.status == "parked"
    assert state.waiting == {"on": "approve", "kind": "gate"}
    summary = await store.get_execution(eid)
    assert summary is not None
    assert (summary.status, summary.waiting_on) == ("parked", "approve")

    handle = await runtime.resume(eid, "approve", {"by": "ops", "ok": True})
    assert await handle.result() == {"approved": {"by": "ops", "ok": True}}
    resumed = [e for e in await store.read(eid) if str(e.type) == "EXECUTION_RESUMED"]
    assert [e.payload for e in resumed] == [{"gate": "approve",
                                             "payload": {"by": "ops", "ok": True}}]


async def test_the_same_gate_twice_gets_each_answer_in_turn(store: EventStore) -> None:
    @flow("two-answers")
    async def body(ctx: Context, _: Any) -> list[Any]:
        return [await ctx.wait("vote"), await ctx.wait("vote")]

    runtime = Runtime(store, flows=[body])
    eid = await started(runtime, "two-answers")
    await runtime.resume(eid, "vote", "first")
    await settle(runtime)
    assert (await runtime.load_state(eid)).waiting == {"on": "vote", "kind": "gate"}
    await runtime.resume(eid, "vote", "second")
    assert await runtime.result(eid) == ["first", "second"]


async def test_resume_of_another_gate_is_refused_and_the_log_unchanged(
        store: EventStore) -> None:
    runtime = Runtime(store, flows=[approval])
    eid = await started(runtime, "approval")
    before = dumped(await store.read(eid))
    with pytest.raises(GateMismatchError, match="waits on 'approve', not 'reject'"):
        await runtime.resume(eid, "reject", True)
    assert dumped(await store.read(eid)) == before
    # The right gate still works afterwards.
    await runtime.resume(eid, "approve", 1)
    assert await runtime.result(eid) == {"approved": 1}


async def test_resume_of_a_running_execution_is_refused(store: EventStore) -> None:
    release, entered = asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        entered.set()
        await release.wait()
        return "done"

    @flow("busy")
    async def body(ctx: Context, _: Any) -> Any:
        await ctx.step("slow", slow)
        return await ctx.wait("approve")

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("busy")
    await asyncio.wait_for(entered.wait(), 2)
    before = dumped(await store.read(handle.execution_id))
    assert before[-1]["type"] == "STEP_STARTED"
    with pytest.raises(ExecutionNotParkedError, match=r"running \(.*\), not parked"):
        await runtime.resume(handle.execution_id, "approve", True)
    assert dumped(await store.read(handle.execution_id)) == before
    release.set()
    await settle(runtime)
    await runtime.resume(handle.execution_id, "approve", True)
    assert await handle.result() is True


async def test_resume_of_a_finished_execution_is_refused(store: EventStore) -> None:
    runtime = Runtime(store, flows=[approval])
    eid = await started(runtime, "approval")
    await runtime.resume(eid, "approve", "yes")
    await runtime.result(eid)
    await settle(runtime)
    before = dumped(await store.read(eid))
    with pytest.raises(ExecutionFinishedError, match="already ended"):
        await runtime.resume(eid, "approve", "again")
    assert dumped(await store.read(eid)) == before


async def test_resume_of_an_unknown_execution_is_refused(store: EventStore) -> None:
    runtime = Runtime(store, flows=[approval])
    with pytest.raises(ExecutionNotFoundError):
        await runtime.resume("nope", "approve", 1)
    assert await store.read("nope") == []


@pytest.mark.parametrize("gate", ["__fleet_indoubt__", "__fleet_diverged__", "__fleet_x"])
async def test_reserved_gate_names_are_refused_by_wait(store: EventStore, gate: str) -> None:
    @flow("reserved")
    async def body(ctx: Context, _: Any) -> str:
        try:
            await ctx.wait(gate)
        except ReservedNameError as exc:
            return exc.message
        return "parked"

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("reserved")
    assert "reserved" in await handle.result()
    assert "EXECUTION_SUSPENDED" not in kinds(await store.read(handle.execution_id))


async def test_a_message_sent_before_receive_is_buffered(store: EventStore) -> None:
    @flow("buffered")
    async def body(ctx: Context, _: Any) -> list[Any]:
        await ctx.wait("go")
        return [await ctx.receive("order"), await ctx.receive("order")]

    runtime = Runtime(store, flows=[body])
    eid = await started(runtime, "buffered")
    await runtime.send(eid, "order", {"n": 1})
    await runtime.send(eid, "order", {"n": 2})
    # Still parked on its gate: a message does not wake a gate.
    state = await runtime.load_state(eid)
    assert state.waiting == {"on": "go", "kind": "gate"}
    assert state.messages == {"order": [{"n": 1}, {"n": 2}]}
    await runtime.resume(eid, "go", None)
    assert await runtime.result(eid) == [{"n": 1}, {"n": 2}]
    log = await store.read(eid)
    assert kinds(log).count("MESSAGE_RECEIVED") == 2
    assert "EXECUTION_SUSPENDED" not in kinds(log)[kinds(log).index("EXECUTION_RESUMED"):]


async def test_receive_parks_and_send_wakes_it(store: EventStore) -> None:
    @flow("receiver")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.receive("reply")

    runtime = Runtime(store, flows=[body])
    eid = await started(runtime, "receiver")
    state = await runtime.load_state(eid)
    assert state.status == "parked"
    assert state.waiting == {"on": "__fleet_message__", "kind": "message",
                             "correlationKey": "reply"}
    # A message under another key is buffered and does not wake it.
    await runtime.send(eid, "other", 0)
    await settle(runtime)
    assert (await runtime.load_state(eid)).status == "parked"

    await runtime.send(eid, "reply", {"text": "hi"})
    assert await runtime.result(eid) == {"text": "hi"}
    tail = kinds(await store.read(eid))[-3:]
    assert tail == ["MESSAGE_RECEIVED", "EXECUTION_RESUMED", "EXECUTION_COMPLETED"]


async def test_send_to_a_finished_execution_is_refused(store: EventStore) -> None:
    runtime = Runtime(store, flows=[approval])
    eid = await started(runtime, "approval")
    await runtime.resume(eid, "approve", 1)
    await runtime.result(eid)
    await settle(runtime)
    before = dumped(await store.read(eid))
    with pytest.raises(ExecutionFinishedError):
        await runtime.send(eid, "late", 1)
    assert dumped(await store.read(eid)) == before


async def test_a_timer_or_a_receive_cannot_be_resumed_like_a_gate(store: EventStore) -> None:
    @flow("not-gates")
    async def body(ctx: Context, _: Any) -> Any:
        await ctx.sleep(3600)
        return await ctx.receive("k")

    runtime = Runtime(store, flows=[body], local_timers=False)
    eid = await started(runtime, "not-gates")
    before = dumped(await store.read(eid))
    with pytest.raises(GateMismatchError, match="waits on a timer"):
        await runtime.resume(eid, "sleep#0", "skip it")
    assert dumped(await store.read(eid)) == before
    await runtime.fire_due_timers(datetime_from_ms(before[1]["payload"]["dueAt"]))
    await settle(runtime)
    before = dumped(await store.read(eid))
    with pytest.raises(GateMismatchError, match=r"waits on a message.*runtime\.send"):
        await runtime.resume(eid, "__fleet_message__", "x")
    assert dumped(await store.read(eid)) == before


async def test_send_to_a_running_execution_goes_through_its_run(store: EventStore) -> None:
    release, entered = asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        entered.set()
        await release.wait()
        return "slow"

    @flow("busy-receiver")
    async def body(ctx: Context, _: Any) -> list[Any]:
        first = await ctx.step("slow", slow)
        return [first, await ctx.receive("k")]

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("busy-receiver")
    await asyncio.wait_for(entered.wait(), 2)
    await runtime.send(handle.execution_id, "k", "early")
    # Durable before send returns, while the step is still running.
    assert kinds(await store.read(handle.execution_id))[-1] == "MESSAGE_RECEIVED"
    release.set()
    assert await handle.result() == ["slow", "early"]
    # It never had to park for the message.
    assert "EXECUTION_SUSPENDED" not in kinds(await store.read(handle.execution_id))


async def test_two_concurrent_resumes_of_one_gate_append_one_answer(store: EventStore) -> None:
    runtime = Runtime(store, flows=[approval])
    other = Runtime(store, flows=[approval])
    eid = await started(runtime, "approval")
    outcomes = await asyncio.gather(runtime.resume(eid, "approve", "a"),
                                    other.resume(eid, "approve", "b"), return_exceptions=True)
    await settle(runtime)
    await settle(other)
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(errors) == 1
    assert isinstance(errors[0], ExecutionStateError)
    log = await store.read(eid)
    assert kinds(log).count("EXECUTION_RESUMED") == 1
    assert kinds(log)[-1] == "EXECUTION_COMPLETED"


async def test_result_sees_an_end_written_by_another_runtime(store: EventStore) -> None:
    client = Runtime(store, flows=[approval])
    worker = Runtime(store, flows=[approval])
    eid = await started(client, "approval")
    waiting = asyncio.ensure_future(client.result(eid))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    # Another process (a worker) answers the gate and finishes the run.
    await worker.resume(eid, "approve", "elsewhere")
    await settle(worker)
    assert await asyncio.wait_for(waiting, 3) == {"approved": "elsewhere"}
