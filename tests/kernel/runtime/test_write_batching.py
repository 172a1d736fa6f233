"""How many store writes a run makes (decision 0002): barriers, and batching."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fleet import Context, Runtime, flow
from fleet.kernel.events import EventEnvelope
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import FenceGrant


class CountingStore(MemoryEventStore):
    """A real memory store that records the shape of every write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[list[str]] = []

    async def append(self, event: EventEnvelope, *, fence: int | None = None) -> None:
        await super().append(event, fence=fence)
        self.writes.append([event.type.value])

    async def append_batch(self, events: Sequence[EventEnvelope], *,
                           fence: int | None = None) -> None:
        await super().append_batch(events, fence=fence)
        self.writes.append([e.type.value for e in events])

    async def append_acquiring(self, events: Sequence[EventEnvelope], *, holder: str,
                               lease_ms: int, release: bool = False) -> FenceGrant | None:
        grant = await super().append_acquiring(events, holder=holder, lease_ms=lease_ms,
                                               release=release)
        self.writes.append(["acquire", *(e.type.value for e in events)])
        return grant

    async def append_releasing(self, events: Sequence[EventEnvelope], *, fence: int) -> None:
        await super().append_releasing(events, fence=fence)
        self.writes.append([*(e.type.value for e in events), "release"])


@flow("two", steps=["a", "b"])
async def two(ctx: Context, _: Any) -> str:
    await ctx.step("a", lambda: 1)
    await ctx.step("b", lambda: 2)
    return "ok"


async def test_without_on_event_a_completion_and_the_next_start_share_a_write() -> None:
    store = CountingStore()
    runtime = Runtime(store, flows=[two])
    handle = await runtime.start("two", None)
    assert await handle.result() == "ok"
    # Decision 0029: the start and the first STEP_STARTED take the fence in one write,
    # the end releases it in the last; 1 + one write per step.
    assert store.writes == [["acquire", "EXECUTION_STARTED", "STEP_STARTED"],
                            ["STEP_COMPLETED", "STEP_STARTED"],
                            ["STEP_COMPLETED", "EXECUTION_COMPLETED", "release"]]


async def test_with_on_event_the_past_is_durable_before_a_step_is_announced() -> None:
    store = CountingStore()
    live: list[int] = []
    runtime = Runtime(store, flows=[two], on_event=lambda e: live.append(e.sequence))
    handle = await runtime.start("two", None)
    assert await handle.result() == "ok"
    assert store.writes == [["acquire", "EXECUTION_STARTED"], ["STEP_STARTED"],
                            ["STEP_COMPLETED"], ["STEP_STARTED"],
                            ["STEP_COMPLETED", "EXECUTION_COMPLETED", "release"]]
    assert live == list(range(6))
