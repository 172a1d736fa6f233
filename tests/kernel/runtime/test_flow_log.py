"""``ctx.log`` writes a line once per live run, not once per drive (issue 26 7f)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from kernel_kit import FaultyStore, settle, started

from fleet import Context, Runtime, flow
from fleet.kernel.store.spi import EventStore


@flow("chatty")
async def chatty(ctx: Context, _: Any) -> str:
    ctx.log.info("starting")
    await ctx.step("one", lambda: 1)
    ctx.log.info("after step one")
    approval = await ctx.wait("approval")
    ctx.log.info("approved by %s", approval)
    await ctx.step("two", lambda: 2)
    ctx.log.warning("done")
    return "ok"


async def test_each_line_is_written_once_across_drives(store: EventStore,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fleet.flow.chatty")
    runtime = Runtime(store, flows=[chatty])
    eid = await started(runtime, "chatty")
    await runtime.resume(eid, "approval", "bob")
    assert await runtime.result(eid) == "ok"
    lines = [r.getMessage() for r in caplog.records if r.name == "fleet.flow.chatty"]
    assert lines == [f"[{eid}] starting", f"[{eid}] after step one",
                     f"[{eid}] approved by bob", f"[{eid}] done"]
    assert {getattr(r, "execution_id", None) for r in caplog.records
            if r.name == "fleet.flow.chatty"} == {eid}
    await runtime.close()


async def test_a_recovery_drive_is_silent_until_its_new_work(
        store: EventStore, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fleet.flow.chatty")
    faulty = FaultyStore(store, lambda e: e.type == "STEP_COMPLETED"
                         and e.payload.get("stepId") == "two")
    runtime = Runtime(faulty, flows=[chatty])  # type: ignore[arg-type]
    eid = await started(runtime, "chatty")
    await runtime.resume(eid, "approval", "bob")
    await settle(runtime)  # step two's result was lost: the run stopped there
    assert (await store.read(eid))[-1].type == "STEP_STARTED"
    faulty.armed = False
    caplog.clear()
    await runtime.drive(eid, wait=True)  # the recovery re-runs step two
    assert await runtime.result(eid) == "ok"
    lines = [r.getMessage() for r in caplog.records if r.name == "fleet.flow.chatty"]
    assert lines == [f"[{eid}] done"]
    await runtime.close()
