"""Pick a store backend from a URL.

Accepted forms::

    memory:                        in process memory (also ``memory://``)
    sqlite:///relative/path.db     a file relative to the working directory
    sqlite:////absolute/path.db    an absolute path (four slashes, as SQLAlchemy)
    postgresql://user@host/db      Postgres via asyncpg (``pip install 'fleet[postgres]'``)

``sqlite:///:memory:`` is refused: the SQLite store runs a writer and a reader
connection, and two connections cannot share one in-memory database; use
``memory:`` for a throwaway store.

The Postgres backend is imported only when a ``postgresql://`` URL asks for
it, so asyncpg stays an optional extra.

``open_event_store_from_settings`` opens the store a ``FleetSettings`` names,
with its Postgres pool sizes and event size limit, wrapped in
``CoalescingEventStore`` when group commit is on.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from fleet.kernel.errors import ConfigurationError, MissingDependencyError
from fleet.kernel.store.memory import MemoryEventStore, MemorySnapshotStore
from fleet.kernel.store.spi import EventStore, SnapshotStore

if TYPE_CHECKING:
    from fleet.config import FleetSettings
    from fleet.kernel.store.postgres import PostgresEventStore

__all__ = ["ACCEPTED_FORMS", "open_event_store", "open_event_store_from_settings",
           "open_postgres_event_store", "open_snapshot_store", "postgres_event_store_class"]

ACCEPTED_FORMS = ("memory:", "sqlite:///relative/path.db", "sqlite:////absolute/path.db",
                  "postgresql://user:password@host:5432/database")

_POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def open_event_store(url: str, *, clock: Callable[[], int] | None = None) -> EventStore:
    """Open the event store ``url`` names.

    Args:
        url: One of the forms in this module's docstring.
        clock: Milliseconds since the epoch for leases.

    Raises:
        ConfigurationError: the URL has an unknown scheme or an unusable path.
        MissingDependencyError: Postgres was asked for and asyncpg is missing.
    """
    kind, target = _parse(url)
    if kind == "memory":
        return MemoryEventStore(clock=clock)
    if kind == "sqlite":
        from fleet.kernel.store.sqlite import SqliteEventStore

        return SqliteEventStore(target, clock=clock)
    return cast(EventStore, _postgres().PostgresEventStore(target, clock=clock))


def open_event_store_from_settings(settings: FleetSettings, *,
                                   clock: Callable[[], int] | None = None) -> EventStore:
    """Open the event store ``settings.database_url`` names, configured by ``settings``.

    On Postgres, ``pg_pool_min`` / ``pg_pool_max`` (when set, they win over the
    URL's ``?pool_min=&pool_max=``) and ``max_event_bytes`` (unset: the store's
    16 MiB) apply. With ``group_commit`` on, the store (of any backend) is
    wrapped in ``CoalescingEventStore`` with the ``group_commit_*`` bounds.

    Raises:
        ConfigurationError: the URL is not accepted (see ``open_event_store``).
        MissingDependencyError: Postgres was asked for and asyncpg is missing.
    """
    kind, target = _parse(settings.database_url)
    if kind == "postgres":
        options: dict[str, Any] = {"pool_min": settings.pg_pool_min,
                                   "pool_max": settings.pg_pool_max}
        if settings.max_event_bytes is not None:
            options["max_event_bytes"] = settings.max_event_bytes
        store = cast(EventStore, _postgres().PostgresEventStore(target, clock=clock, **options))
    else:
        store = open_event_store(settings.database_url, clock=clock)
    if not settings.group_commit:
        return store
    from fleet.kernel.store.coalescing import CoalescingEventStore

    return CoalescingEventStore(store, max_batch=settings.group_commit_max_batch,
                                max_wait_ms=settings.group_commit_max_wait_ms,
                                max_inflight=settings.group_commit_max_inflight)


def open_postgres_event_store(url: str, **options: Any) -> PostgresEventStore:
    """A ``PostgresEventStore`` for a ``postgresql://`` URL (``fleet db`` manages its schema).

    Raises:
        ConfigurationError: the URL names another backend (memory and SQLite
            apply their schema themselves when opened) or is not accepted.
        MissingDependencyError: asyncpg is missing.
    """
    kind, target = _parse(url)
    if kind != "postgres":
        raise ConfigurationError(f"{_redact(url)!r} is not a Postgres URL: only the Postgres "
                                 "store has versioned migrations (memory: and sqlite:/// "
                                 "apply their schema when opened)")
    return cast("PostgresEventStore", _postgres().PostgresEventStore(target, **options))


def open_snapshot_store(url: str) -> SnapshotStore:
    """Open the snapshot store ``url`` names (same forms as ``open_event_store``)."""
    kind, target = _parse(url)
    if kind == "memory":
        return MemorySnapshotStore()
    if kind == "sqlite":
        from fleet.kernel.store.sqlite import SqliteSnapshotStore

        return SqliteSnapshotStore(target)
    return cast(SnapshotStore, _postgres().PostgresSnapshotStore(target))


def _parse(url: str) -> tuple[str, str]:
    if url in ("memory:", "memory://"):
        return "memory", ""
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///"):]
        if path in ("", ":memory:") or path.startswith("file:"):
            raise ConfigurationError(
                f"{url!r} names no file: the SQLite store needs a file it can open twice "
                "(a writer and a reader connection). Use `memory:` for a throwaway store "
                "or `sqlite:///path/to/fleet.db`.")
        return "sqlite", path
    if url.startswith(_POSTGRES_SCHEMES):
        return "postgres", url
    raise ConfigurationError(f"unknown store URL {_redact(url)!r}; accepted forms: "
                             + ", ".join(ACCEPTED_FORMS))


def postgres_event_store_class() -> type[EventStore]:
    """``PostgresEventStore``, imported on demand (``fleet.PostgresEventStore`` uses it)."""
    return cast(type[EventStore], _postgres().PostgresEventStore)


def _postgres() -> ModuleType:
    if importlib.util.find_spec("asyncpg") is None:
        raise MissingDependencyError("the Postgres store needs asyncpg: "
                                     "pip install 'fleet[postgres]'")
    try:
        return importlib.import_module("fleet.kernel.store.postgres")
    except ModuleNotFoundError as exc:
        if exc.name != "fleet.kernel.store.postgres":
            raise
        raise ConfigurationError("the Postgres store is not available in this build of "
                                 "fleet (fleet.kernel.store.postgres is missing); use "
                                 "`sqlite:///...` or `memory:`") from exc


def _redact(url: str) -> str:
    """Hide a password before a URL goes into an error message or a log."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    credentials, _, host = rest.rpartition("@")
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in credentials else url
