"""A start retried after a store outage never answers for an execution that does not exist.

The outage the fleet's restart test (tests/integration/test_restarts.py) runs
into: a start takes the fence, then its EXECUTION_STARTED write and its
release are both lost. The caller retries with the same execution id (starts
are idempotent by it), within the lease. The retry used to see the live lease,
take it for a concurrent start and return the id at once: the execution never
came to exist, and its drive found nothing. Now it waits for the log, or for
the lease to lapse and writes it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from fleet import Context, Runtime, flow
from fleet.kernel.errors import StoreUnavailableError
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import FenceGrant

LEASE_MS = 300


@flow("outage-start", steps=["one"])
async def one_step(ctx: Context, n: int) -> int:
    return int(await ctx.step("one", lambda: n + 1))


class LosesOneStart(MemoryEventStore):
    """Loses the next event write and the next fence release (the link went down)."""

    def __init__(self) -> None:
        super().__init__()
        self.lose_write = self.lose_release = True

    async def append(self, event: EventEnvelope, *, fence: int | None = None) -> None:
        if self.lose_write:
            self.lose_write = False
            raise StoreUnavailableError("the link went down before the write")
        await super().append(event, fence=fence)

    async def append_batch(self, events: Sequence[EventEnvelope], *,
                           fence: int | None = None) -> None:
        if self.lose_write:
            self.lose_write = False
            raise StoreUnavailableError("the link went down before the write")
        await super().append_batch(events, fence=fence)

    async def append_acquiring(self, events: Sequence[EventEnvelope], *, holder: str,
                               lease_ms: int, release: bool = False) -> FenceGrant | None:
        """As a store whose leased write is two calls (``spi.append_acquiring``'s
        fallback) loses the link between them: the fence is taken, the write lost."""
        if self.lose_write:
            self.lose_write = False
            await self.acquire_fence_if(events[0].execution_id, holder=holder,
                                        lease_ms=lease_ms)
            raise StoreUnavailableError("the link went down before the write")
        return await super().append_acquiring(events, holder=holder, lease_ms=lease_ms,
                                              release=release)

    async def release_fence(self, execution_id: str, token: int) -> bool:
        if self.lose_release:
            self.lose_release = False
            raise StoreUnavailableError("the link went down before the release")
        return await super().release_fence(execution_id, token)


async def test_a_retried_start_waits_out_the_lost_attempts_lease_and_writes_it() -> None:
    store = LosesOneStart()
    runtime = Runtime(store, flows=[one_step], lease_ms=LEASE_MS)
    try:
        with pytest.raises(StoreUnavailableError):
            await runtime.start("outage-start", 1, execution_id="o1", drive=False)
        assert await store.head("o1") is None  # nothing written, the lease still held

        began = time.monotonic()
        handle = await runtime.start("outage-start", 1, execution_id="o1", drive=False)
        assert time.monotonic() - began >= LEASE_MS / 1000 * 0.5  # it waited for the lease
        log = await store.read("o1")
        assert [e.type for e in log] == [EventType.EXECUTION_STARTED]

        await runtime.drive(handle.execution_id, wait=True)
        assert await handle.result(timeout=5) == 2
    finally:
        await runtime.close()
