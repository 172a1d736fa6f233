"""Fences held with ``async with`` (issue 11 item 2, decision 0004).

``Lease`` releases on every exit (return, exception, cancellation), and does
not release after a write whose fate is unknown (interrupted: it may have
landed) nor after being fenced out (the lease is not ours any more). A write
the store refused outright wrote nothing, so that lease is released.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from kernel_kit import FaultyStore, ManualClock, kinds, settle

from fleet import Context, EventEnvelope, EventType, Runtime, flow
from fleet.kernel.errors import (
    DuplicateSequenceError,
    StaleFenceError,
    StoreUnavailableError,
)
from fleet.kernel.lease import Lease, keeps_lease
from fleet.kernel.observers import Warner
from fleet.kernel.store.faults import FaultInjectingEventStore
from fleet.kernel.store.forwarding import ForwardingEventStore
from fleet.kernel.store.spi import EventStore
from fleet.kernel.writes import LogWriter

HOLDER = "test-holder"


class CountsReleases(ForwardingEventStore):
    """A real store that remembers every release it was asked for."""

    def __init__(self, inner: EventStore) -> None:
        super().__init__(inner)
        self.releases: list[tuple[str, int]] = []

    async def release_fence(self, execution_id: str, token: int) -> bool:
        self.releases.append((execution_id, token))
        return await self.inner.release_fence(execution_id, token)

    async def append_releasing(self, events: Sequence[EventEnvelope], *, fence: int) -> None:
        """A release made by the last write (decision 0029) counts as one."""
        await super().append_releasing(events, fence=fence)
        self.releases.append((events[0].execution_id, fence))


async def free(store: EventStore, execution_id: str) -> bool:
    """Whether another holder could take the fence now (no live lease)."""
    grant = await store.acquire_fence_if(execution_id, holder="probe", lease_ms=60_000)
    if grant is None:
        return False
    await store.release_fence(execution_id, grant.token)
    return True


async def take(store: EventStore, execution_id: str) -> Lease:
    return await Lease.take(store, execution_id, holder=HOLDER, lease_ms=60_000,
                            warner=Warner(None))


def started(execution_id: str, sequence: int = 0) -> EventEnvelope:
    return EventEnvelope.make(execution_id, sequence, EventType.EXECUTION_STARTED, 1,
                              {"flowId": "f", "flowVersion": 1, "input": None})


async def test_lease_releases_when_the_block_returns(store: EventStore) -> None:
    async with await take(store, "l1") as lease:
        assert not await free(store, "l1")
        assert not lease.released
    assert lease.released
    assert await free(store, "l1")


async def test_lease_releases_when_the_block_raises(store: EventStore) -> None:
    with pytest.raises(KeyError):
        async with await take(store, "l2"):
            raise KeyError("the work failed")
    assert await free(store, "l2")


async def test_lease_releases_when_the_task_is_cancelled(store: EventStore) -> None:
    inside = asyncio.Event()

    async def work() -> None:
        async with await take(store, "l3"):
            inside.set()
            await asyncio.Event().wait()

    task = asyncio.ensure_future(work())
    await inside.wait()
    assert not await free(store, "l3")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await free(store, "l3")


async def test_lease_is_kept_after_an_interrupted_write(store: EventStore) -> None:
    faulty = FaultyStore(store, lambda e: True)
    writer = LogWriter(faulty, None)  # type: ignore[arg-type]
    with pytest.raises(StoreUnavailableError):
        async with await take(store, "l4") as lease:
            await writer.write(lease, [started("l4")])
    assert isinstance(lease.kept, StoreUnavailableError)
    assert not await free(store, "l4")  # left to expire: the write may have landed


async def test_lease_is_kept_after_a_write_cancelled_in_flight(store: EventStore) -> None:
    hanging = FaultInjectingEventStore(store, hang_when=lambda events: True)
    writer = LogWriter(hanging, None)
    leases: list[Lease] = []

    async def work() -> None:
        async with await take(store, "l5") as lease:
            leases.append(lease)
            await writer.write(lease, [started("l5")])

    task = asyncio.ensure_future(work())
    for _ in range(100):
        if hanging.injected:
            break
        await asyncio.sleep(0.001)
    assert [f.kind for f in hanging.injected] == ["hung"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert isinstance(leases[0].kept, asyncio.CancelledError)
    assert not await free(store, "l5")


async def test_a_fenced_out_lease_does_not_release(store: EventStore) -> None:
    counting = CountsReleases(store)
    writer = LogWriter(counting, None)
    zombie = await take(counting, "l6")
    # A successor takes the execution over while the zombie still works.
    successor = await counting.acquire_fence("l6", holder="successor", lease_ms=60_000)

    async def zombie_writes() -> None:
        async with zombie:
            await writer.write(zombie, [started("l6")])

    with pytest.raises(StaleFenceError):
        await zombie_writes()
    assert isinstance(zombie.kept, StaleFenceError)
    assert counting.releases == []  # the zombie never asked
    assert not await free(store, "l6")  # the successor's lease stands
    assert await counting.release_fence("l6", successor.token)


async def test_lease_releases_after_a_write_refused_outright(store: EventStore) -> None:
    await store.append(started("l7"))
    writer = LogWriter(store, None)
    with pytest.raises(DuplicateSequenceError):
        async with await take(store, "l7") as lease:
            await writer.write(lease, [started("l7")])  # slot 0 is taken: nothing written
    assert lease.kept is None
    assert await free(store, "l7")


async def test_a_lease_passed_on_is_released_by_its_new_owner_only(store: EventStore) -> None:
    async with await take(store, "l8") as lease:
        heir = lease.pass_on()
    assert lease.released
    assert not await free(store, "l8")  # the first block let go of nothing
    async with heir:
        pass
    assert await free(store, "l8")


def test_which_failed_writes_keep_the_lease() -> None:
    assert keeps_lease(StaleFenceError("fenced out"))
    assert keeps_lease(StoreUnavailableError("connection reset"))
    assert keeps_lease(asyncio.CancelledError())
    assert keeps_lease(TimeoutError())
    assert not keeps_lease(DuplicateSequenceError("slot taken"))


# -- the lease of a run ------------------------------------------------------------------

@flow("lease-two-steps")
async def two_steps(ctx: Context, _: Any) -> int:
    await ctx.step("one", lambda: 1)
    return int(await ctx.step("two", lambda: 2))


async def test_a_run_that_ends_releases_its_lease(store: EventStore) -> None:
    counting = CountsReleases(store)
    runtime = Runtime(counting, flows=[two_steps])
    handle = await runtime.start("lease-two-steps", None)
    assert await handle.result() == 2
    await settle(runtime)
    assert len(counting.releases) == 1
    assert await free(store, handle.execution_id)


async def test_a_run_whose_write_was_interrupted_keeps_its_lease_until_it_expires(
        clocked_store: EventStore, clock: ManualClock) -> None:
    counting = CountsReleases(clocked_store)
    faulty = FaultyStore(counting, lambda e: e.type is EventType.STEP_COMPLETED)
    runtime = Runtime(faulty, flows=[two_steps], clock=clock,  # type: ignore[arg-type]
                      lease_ms=1_000)
    handle = await runtime.start("lease-two-steps", None)
    outcome = await handle.outcome()
    assert outcome is not None
    assert outcome.kind == "aborted"
    assert isinstance(outcome.cause, StoreUnavailableError)
    assert counting.releases == []
    assert not await free(clocked_store, handle.execution_id)
    clock.advance(1.001)
    assert await free(clocked_store, handle.execution_id)  # it expired on its own


async def test_a_run_cancelled_from_outside_releases_its_lease(store: EventStore) -> None:
    @flow("lease-waits")
    async def waits(ctx: Context, _: Any) -> None:
        await ctx.step("forever", asyncio.Event().wait)

    runtime = Runtime(store, flows=[waits])
    handle = await runtime.start("lease-waits", None)
    for _ in range(200):
        if kinds(await store.read(handle.execution_id))[-1:] == ["STEP_STARTED"]:
            break
        await asyncio.sleep(0.002)
    run = runtime._runs[handle.execution_id]
    assert run.task is not None
    run.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handle.outcome()  # not an outcome: the kernel did not stop it
    await settle(runtime)
    assert await free(store, handle.execution_id)
