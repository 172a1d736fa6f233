"""What every command module of the CLI shares: the consoles, the options, the error
handling, running a coroutine, opening the store a command names.

The command modules import these names and nothing else from one another.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from fleet.config import FleetSettings
from fleet.host.kernel import open_store
from fleet.kernel.errors import ConfigurationError, FleetError
from fleet.kernel.events import EventEnvelope
from fleet.kernel.security import Principal
from fleet.kernel.store.factory import open_snapshot_store
from fleet.kernel.store.spi import EventStore, SnapshotStore

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

console = Console()
err_console = Console(stderr=True)

# Exceptions of these client libraries (a broker that does not answer) are a
# one-line message, not a traceback.
_CLIENT_MODULES = ("redis", "kombu", "amqp")


def run_async(coro_fn: Callable[[], Awaitable[T]]) -> T:
    """Run a command's coroutine; a ``FleetError`` is a one-line message and exit code 1."""
    try:
        return asyncio.run(coro_fn())  # type: ignore[arg-type]
    except FleetError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc


def fleet_errors(fn: F) -> F:
    """A FleetError, or a broker client that cannot connect, is a one-line message and
    exit code 1, not a traceback."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FleetError as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
        except Exception as exc:
            if isinstance(exc, OSError) or type(exc).__module__.startswith(_CLIENT_MODULES):
                raise click.ClickException(
                    f"the broker did not answer: {type(exc).__name__}: {exc}") from exc
            raise
    return wrapper  # type: ignore[return-value]


def store_url(db: str | None) -> str:
    """The store a command reads: ``--db``, else ``FLEET_DATABASE_URL`` (or its default)."""
    return db or FleetSettings().database_url


def open_store_at(url: str) -> EventStore:
    """The store at ``url``, with the rest of the settings (pool sizes, the event size
    limit, group commit) from ``FLEET_*``: every command opens it the way a fleet
    process does."""
    return open_store(FleetSettings(database_url=url))


def open_snapshots(url: str | None) -> SnapshotStore | None:
    """The snapshot store at ``url``; ``None`` (or ``"none"``): no snapshots."""
    if url is None or url == "none":
        return None
    return open_snapshot_store(url)


def load_callable(spec: str) -> Any:
    """``package.module:function``, imported; a ``ConfigurationError`` says what is wrong."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"{spec!r} must look like 'package.module:function'")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"cannot load {spec!r}: {exc}") from exc
    if not callable(target):
        raise ConfigurationError(f"{spec!r} is not callable")
    return target


def json_arg(value: str | None, option: str) -> Any:
    """An option's JSON value (``None`` stays ``None``)."""
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"{option} is not JSON: {exc}") from exc


def principal_from(actor: str | None, tenant: str | None) -> Principal | None:
    """The principal ``--actor`` / ``--tenant`` name (none without ``--actor``)."""
    if actor is None:
        if tenant is not None:
            raise click.BadParameter("--tenant needs --actor (a principal is an actor "
                                     "with an optional tenant)")
        return None
    return Principal(actor, tenant)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="[%(asctime)s: %(levelname)s/%(name)s] %(message)s")


def exit_with(code: int) -> None:
    """Exit with a process's non-zero exit code (return on 0)."""
    if code:
        sys.exit(code)


def log_table(title: str, events: list[EventEnvelope]) -> Table:
    """A log as a table: sequence, type, payload (cut at 160 characters)."""
    table = Table(title=title)
    table.add_column("seq", justify="right")
    table.add_column("type")
    table.add_column("payload", overflow="fold")
    for event in events:
        table.add_row(str(event.sequence), str(event.type),
                      json.dumps(event.payload, ensure_ascii=False)[:160])
    return table


def with_options(options: list[Callable[[F], F]]) -> Callable[[F], F]:
    """Apply several click options at once, in the order given."""
    def apply(fn: F) -> F:
        for option in reversed(options):
            fn = option(fn)
        return fn
    return apply


loglevel_option = click.option("--loglevel", "-l", default="INFO", show_default=True,
                               type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"],
                                                 case_sensitive=False))
principal_options = [
    click.option("--actor", default=None, help="who asks (the principal's actor)"),
    click.option("--tenant", default=None, help="the principal's tenant (with --actor)"),
]
json_option = click.option("--json", "as_json", is_flag=True, help="print JSON")
db_option = click.option("--db", default=None,
                         help="store URL (default: FLEET_DATABASE_URL or sqlite:///fleet.db)")
snapshots_option = click.option(
    "--snapshots", default=None,
    help="snapshot store URL holding checkpoints (default: the --db URL; 'none' for none)")


__all__ = ["console", "db_option", "err_console", "exit_with", "fleet_errors", "json_arg",
           "json_option", "load_callable", "log_table", "loglevel_option", "open_snapshots",
           "open_store_at", "principal_from", "principal_options", "run_async", "setup_logging",
           "snapshots_option", "store_url", "with_options"]
