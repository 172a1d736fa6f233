"""The conformance kit on the group-commit decorator around the embedded backends.

(Around Postgres, where it commits a flush in one transaction, it runs in
``test_postgres_store.py``.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import ManualClock

from fleet.kernel.errors import StaleFenceError, StoreError, ValidationError
from fleet.kernel.store.coalescing import CoalescingEventStore
from fleet.kernel.store.conformance import EventStoreConformance, make_event, started
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore
from fleet.kernel.store.sqlite import SqliteEventStore

# A small max_event_bytes, so the kit's event at the limit is cheap to write.
SMALL_LIMIT = 64 * 1024


class TestCoalescedMemoryEventStore(EventStoreConformance):
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


class TestCoalescedSqliteEventStore(EventStoreConformance):
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
