"""The conformance kit on the group-commit decorator around the embedded backends.

(Around Postgres, where it commits a flush in one transaction, it runs in
``test_postgres_store.py``.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
from conftest import ManualClock

from fleet.kernel.errors import (
    DuplicateSequenceError,
    StaleFenceError,
    StoreError,
    ValidationError,
)
from fleet.kernel.store.coalescing import CoalescingEventStore
from fleet.kernel.store.conformance import EventStoreConformance, make_event, started
from fleet.kernel.store.conformance_backlog import BacklogConformance
from fleet.kernel.store.forwarding import ForwardingEventStore
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import (
    APPEND_LEASED,
    APPEND_MANY,
    APPEND_MANY_LEASED,
    AppendRequest,
    EventStore,
    FenceGrant,
    ManyAnswer,
    ManyRequest,
    capabilities_of,
)
from fleet.kernel.store.sqlite import SqliteEventStore

# A small max_event_bytes, so the kit's event at the limit is cheap to write.
SMALL_LIMIT = 64 * 1024


class TestCoalescedMemoryEventStore(EventStoreConformance, BacklogConformance):
    max_event_bytes = SMALL_LIMIT

    @pytest.fixture
    async def store(self, clock: ManualClock) -> AsyncIterator[EventStore]:
        self.clock = clock
        store = CoalescingEventStore(MemoryEventStore(clock=clock, max_event_bytes=SMALL_LIMIT),
                                     max_batch=8)
        yield store
        await store.close()

    async def pass_time(self, ms: int) -> None:
        self.clock.advance(ms)


class TestCoalescedSqliteEventStore(EventStoreConformance, BacklogConformance):
    max_event_bytes = SMALL_LIMIT

    @pytest.fixture
    async def store(self, tmp_path: Path, clock: ManualClock) -> AsyncIterator[EventStore]:
        self.clock = clock
        store = CoalescingEventStore(SqliteEventStore(tmp_path / "fleet.db", clock=clock,
                                                      max_event_bytes=SMALL_LIMIT),
                                     max_wait_ms=1)
        yield store
        await store.close()

    async def pass_time(self, ms: int) -> None:
        self.clock.advance(ms)


async def test_one_execution_keeps_its_order_within_a_flush() -> None:
    store = CoalescingEventStore(MemoryEventStore(), max_batch=100, max_wait_ms=5)
    await store.append(started("o"))
    # Queued together (not awaited one by one): still applied in call order.
    await asyncio.gather(*(store.append(make_event("o", s)) for s in range(1, 20)))
    assert [e.sequence for e in await store.read("o")] == list(range(20))
    grant = await store.acquire_fence("o", holder="w", lease_ms=60_000)
    results = await asyncio.gather(store.append(make_event("o", 20), fence=grant.token - 1),
                                   store.append(make_event("o", 20), fence=grant.token),
                                   return_exceptions=True)
    assert isinstance(results[0], StaleFenceError)
    assert results[1] is None
    await store.close()


async def test_bad_settings_and_closed_store_are_refused() -> None:
    with pytest.raises(ValidationError):
        CoalescingEventStore(MemoryEventStore(), max_batch=0)
    store = CoalescingEventStore(MemoryEventStore())
    await store.close()
    with pytest.raises(StoreError, match="closed"):
        await store.append(started("x"))


class _CountsCalls(MemoryEventStore):
    """A real memory store that notes the size of every many-call it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    async def append_many_leased(self, requests: Sequence[ManyRequest]) -> list[ManyAnswer]:
        self.calls.append(("append_many_leased", len(requests)))
        return await super().append_many_leased(requests)

    async def append_many(self, requests: Sequence[AppendRequest],
                          ) -> list[BaseException | None]:
        self.calls.append(("append_many", len(requests)))
        return await super().append_many(requests)


async def test_leased_writes_queue_with_appends_and_share_a_flush() -> None:
    """Decision 0029: a leased write made while the store is busy joins the next flush
    (one many-call of the inner store), judged as its single call; alone when idle."""
    inner = _CountsCalls()
    store = CoalescingEventStore(inner)
    grant = await store.append_acquiring([started("b")], holder="w", lease_ms=60_000)
    assert grant is not None
    assert inner.calls == []  # idle: straight to the inner store's single call
    assert (store.flushes, store.flushed) == (1, 1)
    held = await inner.acquire_fence("held", holder="other", lease_ms=60_000)
    answers = await asyncio.gather(
        store.append(started("first")),  # written alone: the rest queue behind it
        store.append_acquiring([started("a")], holder="w", lease_ms=60_000),
        store.append(make_event("b", 1), fence=grant.token),
        store.append_releasing([make_event("b", 2)], fence=grant.token),
        store.append_acquiring([started("held")], holder="w", lease_ms=60_000),
        store.append_releasing([make_event("first", 1)], fence=7),
        return_exceptions=True)
    assert inner.calls == [("append_many_leased", 5)]
    assert (store.flushes, store.flushed) == (3, 7)
    assert answers[0] is None
    assert isinstance(answers[1], FenceGrant)
    assert (answers[1].execution_id, answers[1].holder) == ("a", "w")
    assert answers[2:5] == [None, None, None]  # the last: a live lease is held
    assert isinstance(answers[5], StaleFenceError)
    assert await store.head("b") == 2
    assert await store.head("held") is None
    assert await store.head("first") == 0
    summary = await store.get_execution("b")
    assert summary is not None
    assert (summary.fence, summary.holder) == (grant.token, None)
    assert await inner.acquire_fence_if("held", holder="x", lease_ms=1) is None
    assert await inner.release_fence("held", held.token)
    await store.close()


class _WithoutManyLeased(ForwardingEventStore):
    """A decorator that declares the capabilities it had before ``append_many_leased``."""

    capabilities = frozenset({APPEND_MANY, APPEND_LEASED})


async def test_a_flush_of_leased_writes_over_a_store_without_them_keeps_the_answers() -> None:
    """An inner store without ``append_many_leased`` (a third party's decorator): the
    plain requests of a flush still share its ``append_many``, the leased ones go
    through its single calls, in order per execution, with the same answers."""
    counted = _CountsCalls()
    inner = _WithoutManyLeased(counted)
    assert APPEND_MANY_LEASED not in capabilities_of(inner)
    store = CoalescingEventStore(inner)
    await store.append(started("p"))
    grant = await store.append_acquiring([started("l")], holder="w", lease_ms=60_000)
    assert grant is not None
    answers = await asyncio.gather(
        store.append(started("z")),  # written alone: the rest queue behind it
        store.append(make_event("p", 1)),
        store.append_releasing([make_event("l", 1)], fence=grant.token),
        store.append_acquiring([started("n")], holder="w", lease_ms=60_000),
        store.append_acquiring([make_event("l", 1)], holder="w", lease_ms=60_000),
        store.append(started("q")),
        return_exceptions=True)
    assert answers[:3] == [None, None, None]
    assert isinstance(answers[3], FenceGrant)
    # After l's release in the same flush: free, but its slot is taken (the fence stays).
    assert isinstance(answers[4], DuplicateSequenceError)
    assert answers[5] is None
    assert counted.calls == [("append_many", 2)]  # p and q shared one round trip
    assert [e.sequence for e in await store.read("p")] == [0, 1]
    assert [e.sequence for e in await store.read("l")] == [0, 1]
    summary = await store.get_execution("l")
    assert summary is not None
    assert (summary.fence, summary.holder) == (grant.token, None)
    assert await store.head("q") == 0
    await store.close()
