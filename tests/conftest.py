"""Shared fixtures: every kernel test runs on each embedded backend."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from fleet.kernel.store.memory import MemoryEventStore, MemorySnapshotStore
from fleet.kernel.store.spi import EventStore, SnapshotStore
from fleet.kernel.store.sqlite import SqliteEventStore, SqliteSnapshotStore


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


@pytest.fixture(scope="session")
def pg_database_url() -> Iterator[str]:
    """One throwaway database for the session; each test takes its own schema in it."""
    from postgres_server import throwaway_database

    with throwaway_database() as url:
        yield url


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def stores(request: pytest.FixtureRequest,
                 tmp_path: Path) -> AsyncIterator[tuple[EventStore, SnapshotStore]]:
    """An event store and its snapshot store, of each of the three backends."""
    if request.param == "memory":
        pair: tuple[EventStore, SnapshotStore] = (MemoryEventStore(), MemorySnapshotStore())
    elif request.param == "sqlite":
        path = str(tmp_path / "fleet.db")
        pair = (SqliteEventStore(path), SqliteSnapshotStore(path))
    else:
        import secrets

        from fleet.kernel.store.postgres import PostgresEventStore

        url = request.getfixturevalue("pg_database_url")
        events = PostgresEventStore(url, schema=f"t_{secrets.token_hex(5)}", pool_max=4)
        pair = (events, events.snapshot_store())
    try:
        yield pair
    finally:
        await pair[1].close()
        await pair[0].close()
