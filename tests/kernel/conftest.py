"""Fixtures of the kernel's behavioural tests (the ``store`` fixture is one level up)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kernel_kit import ManualClock

from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore
from fleet.kernel.store.sqlite import SqliteEventStore


@pytest.fixture
def clock() -> ManualClock:
    """A clock the test moves; give it to the store and the runtime alike."""
    return ManualClock()


@pytest.fixture(params=["memory", "sqlite"])
async def clocked_store(request: pytest.FixtureRequest, tmp_path: Path,
                        clock: ManualClock) -> AsyncIterator[EventStore]:
    """Like ``store``, but leases are judged by ``clock`` (lease expiry, denial audit)."""
    if request.param == "memory":
        s: EventStore = MemoryEventStore(clock=clock)
    else:
        s = SqliteEventStore(str(tmp_path / "fleet.db"), clock=clock)
    try:
        yield s
    finally:
        await s.close()
