"""The store factory: the URL scheme picks the backend."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fleet.kernel.errors import ConfigurationError, MissingDependencyError
from fleet.kernel.store.factory import open_event_store, open_snapshot_store
from fleet.kernel.store.memory import MemoryEventStore, MemorySnapshotStore
from fleet.kernel.store.sqlite import SqliteEventStore
from fleet.kernel.store.sqlite_snapshots import SqliteSnapshotStore


async def test_memory() -> None:
    for url in ("memory:", "memory://"):
        assert isinstance(open_event_store(url), MemoryEventStore)
        assert isinstance(open_snapshot_store(url), MemorySnapshotStore)


async def test_sqlite_relative_and_absolute(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    relative = open_event_store("sqlite:///rel.db")
    absolute = open_event_store(f"sqlite:///{tmp_path / 'abs.db'}")  # "sqlite:////tmp/..."
    snapshots = open_snapshot_store("sqlite:///rel.db")
    try:
        assert isinstance(relative, SqliteEventStore)
        assert isinstance(absolute, SqliteEventStore)
        assert isinstance(snapshots, SqliteSnapshotStore)
        assert relative.path == str(tmp_path / "rel.db")
        assert absolute.path == str(tmp_path / "abs.db")
    finally:
        for store in (relative, absolute, snapshots):
            await store.close()
    assert (tmp_path / "rel.db").exists()
    assert (tmp_path / "abs.db").exists()


@pytest.mark.parametrize("url", ["sqlite:///:memory:", "sqlite:///", "sqlite:///file::memory:"])
def test_sqlite_in_memory_refused(url: str) -> None:
    with pytest.raises(ConfigurationError, match="memory:"):
        open_event_store(url)


@pytest.mark.parametrize("url", ["mysql://h/db", "sqlite://relative.db", "fleet.db", "",
                                 "redis://localhost"])
def test_unknown_scheme_lists_the_accepted_forms(url: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        open_event_store(url)
    for form in ("memory:", "sqlite:///", "postgresql://"):
        assert form in refused.value.message


def test_password_is_not_echoed() -> None:
    with pytest.raises(ConfigurationError) as refused:
        open_event_store("mysql://app:s3cret@db/fleet")
    assert "s3cret" not in refused.value.message


def test_postgres_without_asyncpg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "asyncpg", None)  # what a missing package looks like
    with pytest.raises(MissingDependencyError, match=r"pip install 'fleet-durable\[postgres\]'"):
        open_event_store("postgresql://localhost/fleet")
    with pytest.raises(MissingDependencyError):
        open_snapshot_store("postgres://localhost/fleet")


def test_postgres_backend_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fleet.kernel.store.postgres", None)
    with pytest.raises(ConfigurationError, match="not available"):
        open_event_store("postgresql://localhost/fleet")
