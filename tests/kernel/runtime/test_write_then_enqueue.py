"""drive=False: the dispatcher's shape (write first; a worker drives)."""

from __future__ import annotations

from typing import Any

import pytest
from kernel_kit import drove

from fleet import Context, ExecutionFinishedError, Runtime, flow
from fleet.kernel.store.spi import EventStore

calls: list[str] = []


@flow("relay")
async def relay(ctx: Context, _: Any) -> str:
    await ctx.step("a", calls.append, "a")
    note = await ctx.receive("note")
    answer = await ctx.wait("approval")
    return f"{note}/{answer}"


async def test_start_resume_send_without_driving(store: EventStore) -> None:
    calls.clear()
    dispatcher = Runtime(store, flows=[relay])
    worker = Runtime(store, flows=[relay])
    handle = await dispatcher.start("relay", None, drive=False)
    eid = handle.execution_id
    summary = await store.get_execution(eid)
    assert summary is not None
    assert (summary.status, summary.holder) == ("running", None)  # written, lease released
    assert calls == []  # nothing ran in the dispatcher
    assert await drove(worker, eid)
    await worker.close()
    assert (await worker.load_state(eid)).waiting == {
        "on": "__fleet_message__", "kind": "message", "correlationKey": "note"}
    assert await dispatcher.send(eid, "note", "hi", drive=False) is True
    assert (await worker.load_state(eid)).status == "running"
    assert await drove(worker, eid)
    await worker.close()
    await dispatcher.resume(eid, "approval", "yes", drive=False)
    assert dispatcher.active == 0
    assert await drove(worker, eid)
    assert await worker.result(eid) == "hi/yes"
    assert calls == ["a"]
    # A finished execution takes no message, and its log is untouched.
    before = [e.to_json() for e in await store.read(eid)]
    with pytest.raises(ExecutionFinishedError):
        await dispatcher.send(eid, "late", 1, drive=False)
    assert [e.to_json() for e in await store.read(eid)] == before


async def test_a_message_nobody_waits_for_is_buffered_and_wakes_nothing(
        store: EventStore) -> None:
    runtime = Runtime(store, flows=[relay])
    handle = await runtime.start("relay", None, drive=False)
    assert await runtime.send(handle.execution_id, "other", 1, drive=False) is False
    state = await runtime.load_state(handle.execution_id)
    assert state.messages == {"other": [1]}
    assert state.status == "running"
