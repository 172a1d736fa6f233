"""The kernel a fleet process hosts: its event store and its ``Runtime``, from settings.

Every fleet process builds them here, whatever its role: the dispatcher (a
client), a worker, the timer service, the recovery sweeper, the reward
attacher. ``fleet.assembly.roles`` adds what each role runs on top; so a
setting (``FLEET_DIVERGENCE``, ``FLEET_SHA256_FLOW_HASH``, the lease, the
store's pool) means the same thing in every process, the embedded fleet's
included.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from fleet.config import FleetSettings
from fleet.kernel.errors import ConfigurationError
from fleet.kernel.flows import Features, load_flows
from fleet.kernel.journal import EventObserver
from fleet.kernel.options import RuntimeOptions, parse_divergence
from fleet.kernel.runtime import Runtime
from fleet.kernel.security import AccessPolicy
from fleet.kernel.store.factory import open_event_store, open_postgres_event_store
from fleet.kernel.store.spi import EventStore

log = logging.getLogger("fleet.host")


def open_store(settings: FleetSettings) -> EventStore:
    """The event store ``settings.database_url`` names, with ``settings.store_options()``
    (Postgres pool sizes and event size limit, group commit)."""
    return open_event_store(settings.database_url, settings.store_options())


def open_store_to_read(settings: FleetSettings) -> EventStore:
    """The store ``settings.database_url`` names, for a reader: it never creates one.

    A SQLite file that does not exist is refused (opening it would create an
    empty database, and a wrong path would read as "no executions"); a Postgres
    schema is read as it is, never migrated (behind: ``SchemaVersionError``
    saying to run ``fleet db upgrade``).

    Raises:
        ConfigurationError: no SQLite database at the path.
    """
    url = settings.database_url
    if url.startswith(("postgresql://", "postgres://")):
        options = settings.store_options()
        sizes = {"pool_min": options.pool_min, "pool_max": options.pool_max,
                 "max_event_bytes": options.max_event_bytes}
        return open_postgres_event_store(
            url, migrate=False, **{k: v for k, v in sizes.items() if v is not None})
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///"):]
        if path and not os.path.exists(path):
            raise ConfigurationError(f"no fleet database at {path}; set FLEET_DATABASE_URL, "
                                     "or start a fleet that writes one")
    return open_store(settings)


def holder_name(role: str) -> str:
    """A fence holder unique to this process and call: ``<role>:<host>:<pid>:<random>``
    (the demo reads the pid back from it)."""
    return f"{role}:{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"


def build_runtime(settings: FleetSettings, store: EventStore, *, role: str,
                  on_durable_event: EventObserver | None = None,
                  on_warn: Callable[[str], Any] | None = None,
                  access_policy: AccessPolicy | None = None) -> Runtime:
    """A Runtime on ``store`` configured by ``settings``, with its flows loaded.

    Fleet runtimes never arm in-process timers: the timer service fires them (a
    worker that parks on a sleep lets go of it). Every role declares ``FLEET_QUEUES``
    (decision 0056): the dispatcher enters starts, workers admit the next run when one
    ends, the timer service passes every queue. ``access_policy``: the reward
    attacher's (a producer may ``annotate``); default the kernel's.
    """
    options = RuntimeOptions(
        access_policy=access_policy or AccessPolicy(), strict=settings.strict,
        divergence=parse_divergence(settings.divergence),
        features=Features(sha256_flow_hash=settings.sha256_flow_hash),
        lease_ms=settings.lease_ms, local_timers=False, holder=holder_name(role),
        on_durable_event=on_durable_event, on_warn=on_warn or log.warning,
        queues=settings.queue_declarations())
    return Runtime(store, flows=load_flows(settings.flows), options=options)


__all__ = ["build_runtime", "holder_name", "open_store", "open_store_to_read"]
