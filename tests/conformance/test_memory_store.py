"""The conformance kit on the memory store, plus what is specific to it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from conftest import ManualClock

from fleet.kernel.store.conformance import (
    EventStoreConformance,
    SnapshotStoreConformance,
    make_event,
    started,
)
from fleet.kernel.store.conformance_backlog import BacklogConformance
from fleet.kernel.store.forwarding import ForwardingEventStore
from fleet.kernel.store.memory import MemoryEventStore, MemorySnapshotStore
from fleet.kernel.store.spi import (
    AcquiringAppend,
    AppendsManyLeased,
    EventStore,
    FenceGrant,
    SnapshotStore,
    append_many,
    capabilities_of,
)


class TestMemoryEventStore(EventStoreConformance, BacklogConformance):
    @pytest.fixture
    async def store(self, clock: ManualClock) -> AsyncIterator[EventStore]:
        self.clock = clock
        store = MemoryEventStore(clock=clock)
        yield store
        await store.close()

    async def pass_time(self, ms: int) -> None:
        self.clock.advance(ms)


class _Undeclared(ForwardingEventStore):
    """A decorator that declares no capability (as a store written before decision 0050)."""

    capabilities = frozenset()


class TestForwardedMemoryEventStore(EventStoreConformance, BacklogConformance):
    """Through a decorator that declares no capability: the kit's leased writes and its
    requests of one ``append_many`` are served by the ``spi`` helpers with the single
    calls (although the methods are there), and must get the same answers."""

    @pytest.fixture
    async def store(self, clock: ManualClock) -> AsyncIterator[EventStore]:
        self.clock = clock
        store = _Undeclared(MemoryEventStore(clock=clock))
        assert isinstance(store, AppendsManyLeased)  # it has the method, and declares it not
        assert not capabilities_of(store)
        yield store
        await store.close()

    async def pass_time(self, ms: int) -> None:
        self.clock.advance(ms)


class TestMemorySnapshotStore(SnapshotStoreConformance):
    @pytest.fixture
    async def snapshot_store(self) -> AsyncIterator[SnapshotStore]:
        store = MemorySnapshotStore()
        yield store
        await store.close()


def test_satisfies_the_protocols() -> None:
    assert isinstance(MemoryEventStore(), EventStore)
    assert isinstance(MemorySnapshotStore(), SnapshotStore)


async def test_default_clock_is_the_wall_clock() -> None:
    store = MemoryEventStore()
    before = time.time_ns() // 1_000_000
    grant = await store.acquire_fence("x", holder="w", lease_ms=50)
    assert before + 50 <= grant.lease_expires_at <= time.time_ns() // 1_000_000 + 50
    assert await store.acquire_fence_if("x", holder="v", lease_ms=50) is None
    await asyncio.sleep(0.12)
    taken = await store.acquire_fence_if("x", holder="v", lease_ms=50)
    assert taken is not None
    assert taken.token == grant.token + 1


async def test_every_call_yields_to_the_loop() -> None:
    # A store that never suspended would let one coroutine starve the others and
    # hide interleavings a real store produces; each call must give way once.
    store = MemoryEventStore()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    await store.append(started("y"))
    for sequence in range(1, 50):
        await store.append(make_event("y", sequence))
    task.cancel()
    assert ticks >= 50


async def test_read_returns_a_copy_of_the_log() -> None:
    store = MemoryEventStore()
    await store.append(started("c"))
    first = await store.read("c")
    first.clear()
    assert len(await store.read("c")) == 1


async def test_append_many_takes_a_plain_request_as_any_pair_beside_leased_ones() -> None:
    """A caller written before the leased kinds may pass ``[events, fence]`` lists: they
    stay plain requests, on a store with ``append_many_leased`` and on one without."""
    inner = MemoryEventStore()
    for n, store in enumerate((inner, _Undeclared(inner))):
        plain, leased = f"pair-{n}", f"leased-{n}"
        answers = await append_many(store, [
            [[started(plain)], 0],  # type: ignore[list-item]
            AcquiringAppend([started(leased)], "w", 60_000)])
        assert answers[0] is None
        assert isinstance(answers[1], FenceGrant)
        assert await store.head(plain) == 0
        assert await store.head(leased) == 0
