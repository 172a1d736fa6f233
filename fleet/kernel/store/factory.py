"""Pick a store backend from a URL.

Accepted forms::

    memory:                        in process memory (also ``memory://``)
    sqlite:///relative/path.db     a file relative to the working directory
    sqlite:////absolute/path.db    an absolute path (four slashes, as SQLAlchemy)
    postgresql://user@host/db      Postgres via asyncpg (``pip install 'fleet-durable[postgres]'``)

``sqlite:///:memory:`` is refused: the SQLite store runs a writer and a reader
connection, and two connections cannot share one in-memory database; use
``memory:`` for a throwaway store.

The Postgres backend is imported only when a ``postgresql://`` URL asks for
it, so asyncpg stays an optional extra.

``open_event_store(url, options)`` takes a ``StoreOptions`` for what a URL does not
say: the Postgres pool sizes and event size limit, and group commit (the store
wrapped in ``CoalescingEventStore``; on by default for Postgres). The kernel reads
no application settings: ``fleet.config.FleetSettings.store_options()`` turns
``FLEET_*`` into these.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from fleet.kernel.errors import ConfigurationError, MissingDependencyError
from fleet.kernel.store.coalescing import CoalescingEventStore
from fleet.kernel.store.memory import MemoryEventStore, MemorySnapshotStore
from fleet.kernel.store.spi import (
    DEFAULT_MAX_EVENT_BYTES,
    DEFAULT_MAX_LEASE_MS,
    EventStore,
    SnapshotStore,
)
from fleet.kernel.store.sqlite import SqliteEventStore
from fleet.kernel.store.sqlite_snapshots import SqliteSnapshotStore

if TYPE_CHECKING:
    from fleet.kernel.store.postgres import PostgresEventStore

__all__ = [
    "ACCEPTED_FORMS",
    "GroupCommit",
    "StoreOptions",
    "open_event_store",
    "open_postgres_event_store",
    "open_snapshot_store",
    "open_store",
    "postgres_event_store_class",
]

ACCEPTED_FORMS = ("memory:", "sqlite:///relative/path.db", "sqlite:////absolute/path.db",
                  "postgresql://user:password@host:5432/database")

_POSTGRES_SCHEMES = ("postgresql://", "postgres://")


@dataclass(frozen=True, slots=True)
class GroupCommit:
    """Batch appends of many executions into one transaction per flush
    (``CoalescingEventStore``): at most ``max_batch`` appends, each waiting at most
    ``max_wait_ms`` for others to join, ``max_inflight`` flushes at once."""

    max_batch: int = 256
    max_wait_ms: float = 0.0
    max_inflight: int = 4


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """What a store URL does not say.

    Attributes:
        pool_min: Postgres connections kept open (None: the URL's
            ``?pool_min=`` or the store's default).
        pool_max: Most Postgres connections (None: the URL's ``?pool_max=`` or
            the store's default).
        max_event_bytes: The largest event (JSON bytes) the store takes, any
            backend (None: 16 MiB; decision 0023).
        group_commit: Wrap the store (any backend) in ``CoalescingEventStore``
            with these bounds (True: the default bounds); False: every append is
            its own transaction; None: the backend's default, which is group
            commit on Postgres (a flush shares one commit among concurrent runs'
            appends; decision 0029) and off on memory and SQLite.
        max_lease_ms: The longest lease the store grants or honours, any backend
            (None: ``spi.DEFAULT_MAX_LEASE_MS``; decision 0044).
    """

    pool_min: int | None = None
    pool_max: int | None = None
    max_event_bytes: int | None = None
    group_commit: GroupCommit | bool | None = None
    max_lease_ms: int | None = None


def open_event_store(url: str, options: StoreOptions | None = None, *,
                     clock: Callable[[], int] | None = None) -> EventStore:
    """Open the event store ``url`` names.

    Args:
        url: One of the forms in this module's docstring.
        options: Pool sizes and the event size limit (Postgres only; set pool
            sizes win over the URL's), group commit (any backend).
        clock: Milliseconds since the epoch for leases (memory, SQLite: the store's
            clock; Postgres: replaces the server's, for tests only).

    Raises:
        ConfigurationError: the URL has an unknown scheme or an unusable path.
        MissingDependencyError: Postgres was asked for and asyncpg is missing.
    """
    options = options or StoreOptions()
    kind, target = _parse(url)
    store: EventStore
    limit = options.max_event_bytes if options.max_event_bytes is not None \
        else DEFAULT_MAX_EVENT_BYTES
    lease = options.max_lease_ms if options.max_lease_ms is not None else DEFAULT_MAX_LEASE_MS
    if kind == "memory":
        store = MemoryEventStore(clock=clock, max_event_bytes=limit, max_lease_ms=lease)
    elif kind == "sqlite":
        store = SqliteEventStore(target, clock=clock, max_event_bytes=limit, max_lease_ms=lease)
    else:
        pg: dict[str, Any] = {"pool_min": options.pool_min, "pool_max": options.pool_max,
                              "max_event_bytes": limit, "max_lease_ms": lease}
        store = cast(EventStore, _postgres().PostgresEventStore(target, clock=clock, **pg))
    batching = options.group_commit
    if batching is None:
        batching = kind == "postgres"  # the fast configuration is the default
    if batching is False:
        return store
    if batching is True:
        batching = GroupCommit()
    return CoalescingEventStore(store, max_batch=batching.max_batch,
                                max_wait_ms=batching.max_wait_ms,
                                max_inflight=batching.max_inflight)


def open_store(url: str, *, group_commit: GroupCommit | bool | None = None,
               pool_min: int | None = None, pool_max: int | None = None,
               max_event_bytes: int | None = None) -> EventStore:
    """Open the event store ``url`` names, configured for production (``fleet.open_store``).

    The one way the docs show to open a store (decision 0050): on Postgres it is the
    fast configuration, the store behind group commit (concurrent runs' appends share
    one transaction per flush; decision 0029), which ``PostgresEventStore(url)`` built
    directly is not.

    Args:
        url: ``memory:``, ``sqlite:///path.db`` or ``postgresql://user@host/db`` (the
            query may carry ``schema``, ``pool_min``, ``pool_max``).
        group_commit: ``None``: on for Postgres, off for memory and SQLite; ``False``:
            every append its own transaction; ``True`` or a ``GroupCommit``: on.
        pool_min: Postgres connections kept open (default: the URL's, else 1).
        pool_max: Most Postgres connections (default: the URL's, else 10).
        max_event_bytes: The largest event the store takes (default 16 MiB).

    Raises:
        ConfigurationError: the URL has an unknown scheme or an unusable path.
        MissingDependencyError: Postgres was asked for and asyncpg is missing
            (``pip install 'fleet-durable[postgres]'``).
    """
    return open_event_store(url, StoreOptions(pool_min=pool_min, pool_max=pool_max,
                                              max_event_bytes=max_event_bytes,
                                              group_commit=group_commit))


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
                                     "pip install 'fleet-durable[postgres]'")
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
