"""Shared fixtures: every kernel test runs on each embedded backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore
from fleet.kernel.store.sqlite import SqliteEventStore


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[EventStore]:
    """A fresh event store of each embedded kind."""
    if request.param == "memory":
        s: EventStore = MemoryEventStore()
    else:
        s = SqliteEventStore(str(tmp_path / "fleet.db"))
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def memory_store() -> AsyncIterator[MemoryEventStore]:
    s = MemoryEventStore()
    yield s
    await s.close()
