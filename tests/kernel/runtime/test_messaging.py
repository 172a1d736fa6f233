"""Messages from a flow, values and updates (issue 26 items 4, 5, 6 and 7d), on every store."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kernel_kit import FaultyStore, dumped, eventually, kinds, started
from refusals import hidden

from fleet import (
    AccessDeniedError,
    Context,
    DuplicateReplyError,
    ExecutionFailedError,
    ExecutionFinishedError,
    Principal,
    Runtime,
    SqliteEventStore,
    Update,
    UpdateFailedError,
    ValidationError,
    WaitTimeoutError,
    flow,
)
from fleet.kernel.store.spi import EventStore, SnapshotStore

Stores = tuple[EventStore, SnapshotStore]
ALICE = Principal("alice", tenant="acme")
BOB = Principal("bob", tenant="acme")


@flow("mailbox")
async def mailbox(ctx: Context, _: Any) -> Any:
    return await ctx.receive("note")


@flow("gatekeeper")
async def gatekeeper(ctx: Context, _: Any) -> Any:
    return await ctx.wait("open")


@flow("notifier")
async def notifier(ctx: Context, targets: dict[str, str]) -> str:
    await ctx.send(targets["mailbox"], "note", {"from": ctx.execution_id})
    await ctx.resume(targets["gate"], "open", "sesame")
    return "sent"


async def test_a_flow_sends_and_resumes_other_executions_as_its_owner(stores: Stores) -> None:
    store = stores[0]
    runtime = Runtime(store, flows=[mailbox, gatekeeper, notifier])
    box = await started(runtime, "mailbox", principal=ALICE)
    gate = await started(runtime, "gatekeeper", principal=ALICE)
    sender = await runtime.start("notifier", {"mailbox": box, "gate": gate}, principal=ALICE)
    assert await sender.result(timeout=10) == "sent"
    assert await runtime.result(box) == {"from": sender.execution_id}
    assert await runtime.result(gate) == "sesame"
    sent = [e.payload for e in await store.read(sender.execution_id)
            if e.type == "MESSAGE_SENT"]
    assert sent == [{"name": "send#0", "target": box, "key": "note"},
                    {"name": "resume#0", "target": gate, "gate": "open"}]
    received = [e.payload for e in await store.read(box) if e.type == "MESSAGE_RECEIVED"]
    assert received == [{"key": "note", "payload": {"from": sender.execution_id},
                         "sendId": f"{sender.execution_id}:send#0"}]
    await runtime.close()


async def test_a_sender_that_crashes_after_sending_does_not_send_twice(tmp_path: Any) -> None:
    inner = SqliteEventStore(str(tmp_path / "fleet.db"))
    faulty = FaultyStore(inner, lambda e: e.type == "MESSAGE_SENT")
    runtime = Runtime(faulty, flows=[mailbox, gatekeeper, notifier])  # type: ignore[arg-type]
    box = await started(runtime, "mailbox")
    gate = await started(runtime, "gatekeeper")
    sender = await runtime.start("notifier", {"mailbox": box, "gate": gate})
    outcome = await sender.outcome()
    assert outcome is not None
    assert outcome.kind == "aborted"  # the record of the send was lost, the send was not
    assert kinds(await inner.read(box)).count("MESSAGE_RECEIVED") == 1
    await runtime.close()
    faulty.armed = False
    again = Runtime(faulty, flows=[mailbox, gatekeeper, notifier])  # type: ignore[arg-type]
    await again.drive(sender.execution_id, wait=True)
    assert await again.result(sender.execution_id) == "sent"
    assert kinds(await inner.read(box)).count("MESSAGE_RECEIVED") == 1
    resumes = [e for e in await inner.read(gate) if e.type == "EXECUTION_RESUMED"]
    assert len(resumes) == 1
    assert await again.result(gate) == "sesame"
    await again.close()
    await inner.close()


async def test_a_send_the_rules_refuse_raises_in_the_flow_and_again_on_replay(
        stores: Stores) -> None:
    store = stores[0]
    seen: list[str] = []

    @flow("intruder")
    async def intruder(ctx: Context, target: str) -> str:
        try:
            await ctx.send(target, "note", "hi")
        except AccessDeniedError as refused:
            seen.append(refused.code)
        await ctx.wait("again")  # a park and a replay: the refusal is served from the log
        return "done"

    runtime = Runtime(store, flows=[mailbox, intruder])
    box = await started(runtime, "mailbox", principal=ALICE)
    before = dumped(await store.read(box))
    eid = await started(runtime, "intruder", box, principal=BOB)
    await runtime.resume(eid, "again", principal=BOB)
    assert await runtime.result(eid) == "done"
    assert seen == ["access_denied", "access_denied"]
    assert "MESSAGE_RECEIVED" not in kinds(await store.read(box))
    assert [e.type for e in await store.read(box)][:len(before)] == [b["type"] for b in before]
    await runtime.close()


async def test_continue_as_new_hands_unreceived_messages_and_later_ones_to_the_successor(
        stores: Stores) -> None:
    store = stores[0]

    @flow("rolling")
    async def rolling(ctx: Context, generation: int) -> Any:
        if generation == 0:
            await ctx.receive("go")  # the first message; the second is still queued
            await ctx.continue_as_new(1)
        first = await ctx.receive("go")
        second = await ctx.receive("go")
        return [generation, first, second]

    runtime = Runtime(store, flows=[rolling])
    eid = await started(runtime, "rolling", 0)
    # Both arrive before the run is driven: it takes "a" and continues with "b" queued.
    await runtime.send(eid, "go", "a", drive=False)
    await runtime.send(eid, "go", "b", drive=False)
    await runtime.drive(eid, wait=True)
    successor = f"{eid}~1"

    async def successor_parked() -> bool:
        state = await runtime.engine.fold(successor)
        return state.parked

    await eventually(successor_parked, timeout=10)
    await runtime.send(eid, "go", "c")  # the first run ended: its successor gets it
    assert await runtime.result(eid) == [1, "b", "c"]
    await runtime.close()


async def test_values_are_read_while_the_flow_runs_and_after_it_ends(stores: Stores) -> None:
    store = stores[0]

    @flow("progress")
    async def progress(ctx: Context, _: Any) -> str:
        await ctx.set_value("progress", 0.5)
        await ctx.wait("finish")
        await ctx.set_value("progress", 1.0)
        return "finished"

    runtime = Runtime(store, flows=[progress])
    eid = await started(runtime, "progress", principal=ALICE)
    before = dumped(await store.read(eid))
    assert await runtime.get_value(eid, "progress", principal=ALICE) == 0.5
    assert dumped(await store.read(eid)) == before  # a read writes nothing
    with pytest.raises(WaitTimeoutError, match="'done'"):
        await runtime.get_value(eid, "done", timeout=0.2)
    waiter = asyncio.ensure_future(runtime.get_value(eid, "later", timeout=5))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    waiter.cancel()
    await runtime.resume(eid, "finish", principal=ALICE)
    assert await runtime.result(eid) == "finished"
    assert await runtime.get_value(eid, "progress") == 1.0
    with pytest.raises(ExecutionFinishedError, match="without setting"):
        await runtime.get_value(eid, "never", timeout=5)
    with hidden():
        await runtime.get_value(eid, "progress", principal=Principal("eve", tenant="evil"))
    assert [e.payload["name"] for e in await store.read(eid) if e.type == "VALUE_SET"] == [
        "set#0", "set#1"]
    await runtime.close()


@flow("counter")
async def counter(ctx: Context, start: int) -> int:
    total = start
    while True:
        update = await ctx.receive("add")
        assert isinstance(update, Update)
        if update.payload == 0:
            await ctx.reply(update, total)
            return total
        if update.payload < 0:
            await ctx.reply(update, error=ValueError("cannot add a negative number"))
            continue
        total += update.payload
        await ctx.reply(update, total)


@counter.validator("add")
def _add_is_an_int(payload: Any) -> None:
    if not isinstance(payload, int):
        raise TypeError(f"add takes an int, got {type(payload).__name__}")


async def test_an_update_is_answered_by_the_flow_and_a_retry_gets_the_first_answer(
        stores: Stores) -> None:
    store = stores[0]
    runtime = Runtime(store, flows=[counter])
    eid = await started(runtime, "counter", 10)
    assert await runtime.update(eid, "add", 5, update_id="u-1", timeout=10) == 15
    assert await runtime.update(eid, "add", 5, update_id="u-1", timeout=10) == 15  # a retry
    assert kinds(await store.read(eid)).count("MESSAGE_RECEIVED") == 1
    with pytest.raises(UpdateFailedError, match="negative") as refused:
        await runtime.update(eid, "add", -1, timeout=10)
    assert refused.value.error["type"] == "ValueError"
    before = dumped(await store.read(eid))
    with pytest.raises(UpdateFailedError, match="validator") as invalid:
        await runtime.update(eid, "add", "seven", timeout=10)
    assert invalid.value.error["type"] == "TypeError"
    assert dumped(await store.read(eid)) == before  # refused before anything was written
    assert await runtime.update(eid, "add", 0, timeout=10) == 15
    assert await runtime.result(eid) == 15
    await runtime.close()


async def test_an_update_to_a_flow_that_fails_gets_the_flows_error(stores: Stores) -> None:
    store = stores[0]

    @flow("fragile")
    async def fragile(ctx: Context, _: Any) -> None:
        await ctx.receive("poke")
        raise RuntimeError("broke while handling the update")

    runtime = Runtime(store, flows=[fragile])
    eid = await started(runtime, "fragile")
    with pytest.raises(UpdateFailedError, match="broke while handling") as failed:
        await runtime.update(eid, "poke", 1, timeout=10)
    assert failed.value.error["type"] == "RuntimeError"
    with pytest.raises(ExecutionFailedError):
        await runtime.result(eid)
    await runtime.close()


async def test_replying_twice_or_to_a_plain_message_is_refused(stores: Stores) -> None:
    store = stores[0]

    @flow("double-reply")
    async def double(ctx: Context, what: str) -> Any:
        message = await ctx.receive("m")
        await ctx.reply(message, "first")
        await ctx.reply(message, "second")

    runtime = Runtime(store, flows=[double])
    eid = await started(runtime, "double-reply", "x")
    # The first reply answers the caller; the second fails the flow.
    assert await runtime.update(eid, "m", 1, timeout=10) == "first"
    with pytest.raises(ExecutionFailedError, match="replied to already"):
        await runtime.result(eid)
    state = await runtime.load_state(eid)
    assert state.error is not None
    assert state.error["type"] == DuplicateReplyError.__name__
    assert list(state.replies.values()) == [{"value": "first"}]

    plain = await started(runtime, "double-reply", "y")
    await runtime.send(plain, "m", "not an update")
    with pytest.raises(ExecutionFailedError, match="takes no reply"):
        await runtime.result(plain)
    await runtime.close()


async def test_bad_updates_and_value_reads_are_refused(stores: Stores) -> None:
    store = stores[0]
    runtime = Runtime(store, flows=[counter])
    eid = await started(runtime, "counter", 0)
    before = dumped(await store.read(eid))
    for call, match in (
            (runtime.update(eid, "", 1), "non-empty"),
            (runtime.update(eid, "__fleet_x", 1), "reserved"),
            (runtime.update(eid, "add", {1, 2}), "JSON"),
            (runtime.update(eid, "add", 1, timeout=-1), "0 or more"),
            (runtime.update(eid, "add", 1, update_id=""), "update_id"),
            (runtime.get_value(eid, "k", timeout=float("nan")), "finite")):
        with pytest.raises(ValidationError, match=match):
            await call
    assert dumped(await store.read(eid)) == before
    await runtime.close()
