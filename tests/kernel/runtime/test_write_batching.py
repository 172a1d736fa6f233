"""How many store writes a run makes (decision 0002): barriers, and batching."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fleet import Context, Runtime, flow
from fleet.kernel.events import EventEnvelope
from fleet.kernel.store.memory import MemoryEventStore


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
    assert store.writes == [["EXECUTION_STARTED"], ["STEP_STARTED"],
                            ["STEP_COMPLETED", "STEP_STARTED"],
                            ["STEP_COMPLETED", "EXECUTION_COMPLETED"]]


async def test_with_on_event_the_past_is_durable_before_a_step_is_announced() -> None:
    store = CountingStore()
    live: list[int] = []
    runtime = Runtime(store, flows=[two], on_event=lambda e: live.append(e.sequence))
    handle = await runtime.start("two", None)
    assert await handle.result() == "ok"
    assert store.writes == [["EXECUTION_STARTED"], ["STEP_STARTED"], ["STEP_COMPLETED"],
                            ["STEP_STARTED"], ["STEP_COMPLETED", "EXECUTION_COMPLETED"]]
    assert live == list(range(6))
