"""Shared fixtures: every kernel test runs on each embedded backend."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

# The helper kits, flow modules and server helpers every test folder imports by name
# (``from kernel_kit import ...``): tests/kits, on the path before any test is collected.
sys.path.insert(0, str(Path(__file__).resolve().parent / "kits"))

from fleet.kernel import runtime as _runtime
from fleet.kernel.store.memory import MemoryEventStore, MemorySnapshotStore
from fleet.kernel.store.spi import EventStore, SnapshotStore
from fleet.kernel.store.sqlite import SqliteEventStore
from fleet.kernel.store.sqlite_snapshots import SqliteSnapshotStore

# What the package ships, read before any test can change it.
_SHIPPED_DIVERGENCE = _runtime.DEFAULT_DIVERGENCE


# Every divergence the detector reported during a forced run: (test, mode, skipped).
_DIVERGED: list[tuple[str, str, list[str]]] = []


@pytest.fixture(autouse=True)
def _divergence_default(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """``FLEET_TEST_DIVERGENCE=fail`` runs the whole suite with that runtime default
    (ADR 0113 note 10: nothing healthy may be refused) and lists, at the end, every
    divergence reported and in which test. Unset: the shipped default."""
    forced = os.environ.get("FLEET_TEST_DIVERGENCE")
    if not forced:
        return
    if forced not in ("off", "warn", "fail"):
        raise pytest.UsageError(f"FLEET_TEST_DIVERGENCE must be off, warn or fail, got {forced!r}")
    monkeypatch.setattr(_runtime, "DEFAULT_DIVERGENCE", forced)
    diverged = _runtime.Run._diverged

    def reported(run: _runtime.Run, skipped: list[str]) -> None:
        mode = run.detector.mode if run.detector is not None else "?"
        _DIVERGED.append((request.node.nodeid, mode, list(skipped)))
        diverged(run, skipped)
    monkeypatch.setattr(_runtime.Run, "_diverged", reported)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not os.environ.get("FLEET_TEST_DIVERGENCE"):
        return
    terminalreporter.section(
        f"divergences reported (FLEET_TEST_DIVERGENCE={os.environ['FLEET_TEST_DIVERGENCE']})")
    for nodeid, mode, skipped in _DIVERGED:
        terminalreporter.write_line(f"{nodeid}: {mode}: skipped {skipped}")
    tests = {n for n, _, _ in _DIVERGED}
    terminalreporter.write_line(f"{len(_DIVERGED)} report(s) in {len(tests)} test(s)")


@pytest.fixture
def shipped_divergence_default() -> str:
    """The divergence default the package ships (whatever this run forces)."""
    return _SHIPPED_DIVERGENCE


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


@pytest.fixture(scope="module")
def database_url() -> Iterator[str]:
    """A throwaway database of the module's own (its tests may count its commits, restart
    its server's connections or drop schemas without touching another module's)."""
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
