"""on_event (immediate) and on_durable_event (truth), ADR 0147, in one process.

The subprocess reproduction of the record's tables lives elsewhere; these pin
the basics: order, only what the log holds, isolation of a broken consumer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kernel_kit import FaultyStore, eventually, kinds, settle, started

import fleet
import fleet.kernel.options as options
from fleet import Context, EventEnvelope, Runtime, flow
from fleet.kernel.store.spi import EventStore


@flow("observed")
async def observed(ctx: Context, _: Any) -> Any:
    await ctx.step("one", lambda: 1)
    await ctx.emit("app.note", {"n": 1})
    return await ctx.step("two", lambda: 2)


async def test_both_observers_see_every_event_in_order_live_first(store: EventStore) -> None:
    timeline: list[tuple[str, int]] = []
    runtime = Runtime(store, flows=[observed],
                      on_event=lambda e: timeline.append(("live", e.sequence)),
                      on_durable_event=lambda e: timeline.append(("durable", e.sequence)))
    handle = await runtime.start("observed")
    assert await handle.result() == 2
    await settle(runtime)
    log = await store.read(handle.execution_id)
    live = [seq for kind, seq in timeline if kind == "live"]
    durable = [seq for kind, seq in timeline if kind == "durable"]
    assert live == durable == [e.sequence for e in log]
    # Each event is reported live before it is reported durable.
    for seq in durable:
        assert timeline.index(("live", seq)) < timeline.index(("durable", seq))


async def test_a_rejected_write_is_never_reported_durable_nor_anything_after(
        store: EventStore) -> None:
    live: list[EventEnvelope] = []
    durable: list[EventEnvelope] = []
    faulty = FaultyStore(store, lambda e: str(e.type) == "STEP_COMPLETED")
    runtime = Runtime(faulty, flows=[observed],  # type: ignore[arg-type]
                      on_event=live.append, on_durable_event=durable.append)
    handle = await runtime.start("observed")
    await settle(runtime)
    log = await store.read(handle.execution_id)
    # LIVE reported the step as done, and what the body did next before the
    # write failed; DURABLE reports exactly the log.
    assert kinds(live) == ["EXECUTION_STARTED", "STEP_STARTED", "STEP_COMPLETED", "EMITTED"]
    assert kinds(durable) == kinds(log) == ["EXECUTION_STARTED", "STEP_STARTED"]
    assert [e.to_dict() for e in durable] == [e.to_dict() for e in log]


async def test_a_write_that_never_resolves_is_never_reported_durable(
        store: EventStore) -> None:
    stuck = asyncio.Event()

    class HangingStore(FaultyStore):
        async def append(self, event: EventEnvelope, *, fence: int | None = None) -> None:
            if str(event.type) == "STEP_COMPLETED":
                await stuck.wait()
                raise ConnectionResetError("the write never landed")
            await self.inner.append(event, fence=fence)

        async def append_batch(self, events: Sequence[EventEnvelope], *,
                               fence: int | None = None) -> None:
            if any(str(e.type) == "STEP_COMPLETED" for e in events):
                await stuck.wait()
                raise ConnectionResetError("the write never landed")
            await self.inner.append_batch(events, fence=fence)

    live: list[EventEnvelope] = []
    durable: list[EventEnvelope] = []
    runtime = Runtime(HangingStore(store, lambda e: False),  # type: ignore[arg-type]
                      flows=[observed], on_event=live.append, on_durable_event=durable.append)
    handle = await runtime.start("observed")
    await eventually(lambda: len(live) == 4)
    await asyncio.sleep(0.01)  # give a (wrong) durable report the chance to arrive
    assert kinds(live) == ["EXECUTION_STARTED", "STEP_STARTED", "STEP_COMPLETED", "EMITTED"]
    assert kinds(durable) == ["EXECUTION_STARTED", "STEP_STARTED"]
    stuck.set()  # let the write fail so the run ends
    await settle(runtime)
    assert kinds(durable) == kinds(await store.read(handle.execution_id))


async def test_only_this_runtimes_writes_are_reported(store: EventStore) -> None:
    @flow("gate")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.wait("g")

    mine: list[EventEnvelope] = []
    theirs: list[EventEnvelope] = []
    first = Runtime(store, flows=[body], on_durable_event=mine.append)
    second = Runtime(store, flows=[body], on_durable_event=theirs.append)
    eid = await started(first, "gate")
    await second.resume(eid, "g", 1)
    assert await second.result(eid) == 1
    await settle(second)
    assert kinds(mine) == ["EXECUTION_STARTED", "EXECUTION_SUSPENDED"]
    # The resume was appended outside a journal; it is still reported, after its write.
    assert kinds(theirs) == ["EXECUTION_RESUMED", "EXECUTION_COMPLETED"]
    assert [e.sequence for e in mine + theirs] == list(range(4))


async def test_appends_outside_a_journal_are_reported_durable(store: EventStore) -> None:
    @flow("mailbox")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.wait("g")

    durable: list[EventEnvelope] = []
    runtime = Runtime(store, flows=[body], on_durable_event=durable.append)
    eid = await started(runtime, "mailbox")
    await runtime.send(eid, "note", "hi")
    await runtime.cancel(eid, force=True)  # written outside a run, at once
    assert kinds(durable) == ["EXECUTION_STARTED", "EXECUTION_SUSPENDED", "MESSAGE_RECEIVED",
                              "EXECUTION_CANCELLED"]
    assert kinds(durable) == kinds(await store.read(eid))


async def test_a_throwing_consumer_never_reaches_the_run_and_is_warned_once(
        store: EventStore) -> None:
    warnings: list[str] = []

    def broken(event: EventEnvelope) -> None:
        raise RuntimeError(f"projection failed at {event.sequence}")

    runtime = Runtime(store, flows=[observed], on_event=broken, on_durable_event=broken,
                      on_warn=warnings.append)
    for _ in range(3):
        handle = await runtime.start("observed")
        assert await handle.result() == 2
    await settle(runtime)
    # Eighteen throws per observer, one warning each: at most once a minute per observer.
    assert len(warnings) == 2
    assert any(w.startswith("on_event raised RuntimeError") for w in warnings)
    assert any(w.startswith("on_durable_event raised RuntimeError") for w in warnings)


async def test_an_async_consumer_that_rejects_is_warned(store: EventStore) -> None:
    warnings: list[str] = []
    seen: list[int] = []

    async def rejects(event: EventEnvelope) -> None:
        seen.append(event.sequence)
        raise ValueError("sink unavailable")

    runtime = Runtime(store, flows=[observed], on_durable_event=rejects,
                      on_warn=warnings.append)
    handle = await runtime.start("observed")
    assert await handle.result() == 2
    await settle(runtime)
    log = await store.read(handle.execution_id)
    # Async consumers are not awaited by the run: their failures arrive later.
    await eventually(lambda: len(seen) == len(log) and len(warnings) == 1)
    assert "sink unavailable" in warnings[0]


async def test_observers_unset_cost_nothing_and_change_nothing(store: EventStore) -> None:
    runtime = Runtime(store, flows=[observed])
    handle = await runtime.start("observed")
    assert await handle.result() == 2
    assert kinds(await store.read(handle.execution_id)) == [
        "EXECUTION_STARTED", "STEP_STARTED", "STEP_COMPLETED", "EMITTED", "STEP_STARTED",
        "STEP_COMPLETED", "EXECUTION_COMPLETED"]


def test_on_event_is_documented_as_able_to_report_what_never_became_durable() -> None:
    """ADR 0147's consequence (issue 13 item 8): wherever ``on_event`` is documented
    (the option, the Runtime, the README, the operations guide) it says it can report
    an event that never became durable and points to ``on_durable_event``."""
    root = Path(fleet.__file__).resolve().parents[1]
    places = {"RuntimeOptions": options.__doc__ or "", "Runtime": Runtime.__doc__ or "",
              "README.md": (root / "README.md").read_text(),
              "docs/operations.md": (root / "docs" / "operations.md").read_text()}
    for name, text in places.items():
        flat = " ".join(text.split()).lower()
        assert "never became durable" in flat, name
        assert "on_durable_event" in flat, name
