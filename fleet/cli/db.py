"""``fleet db``: the Postgres schema (versioned migrations; a store also applies them on
first use)."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table

from fleet.cli.common import console, run_async
from fleet.config import FleetSettings
from fleet.kernel.store.factory import open_postgres_event_store


@click.group("db")
def db_group() -> None:
    """The Postgres schema (versioned migrations; a store also applies them on first use)."""


async def _schema_status(url: str | None, *, upgrade: bool) -> Any:
    store = open_postgres_event_store(url or FleetSettings().database_url, migrate=False)
    try:
        return await (store.upgrade_schema() if upgrade else store.schema_status())
    finally:
        await store.close()


def _print_schema_status(status: Any, as_json: bool) -> None:
    fields = {"version": status.version, "latest": status.latest, "state": status.state,
              "applied": list(status.applied), "pending": list(status.pending),
              "schema": status.schema, "oldest_code": status.oldest_code,
              "compatible": status.compatible}
    if as_json:
        click.echo(json.dumps(fields))
        return
    table = Table(title="fleet schema" + (f" in {status.schema}" if status.schema else ""))
    table.add_column("field")
    table.add_column("value", justify="right")
    for name, value in fields.items():
        shown = (", ".join(map(str, value)) if isinstance(value, list)
                 else ("yes" if value else "no") if isinstance(value, bool) else value)
        table.add_row(name, "" if shown is None else str(shown))
    console.print(table)


_db_url_option = click.option("--db", "url", default=None,
                              help="postgresql:// URL, ?schema= allowed "
                                   "(default: FLEET_DATABASE_URL)")


@db_group.command("upgrade")
@_db_url_option
@click.option("--json", "as_json", is_flag=True)
def db_upgrade(url: str | None, as_json: bool) -> None:
    """Apply the missing migrations and print the schema version."""
    _print_schema_status(run_async(lambda: _schema_status(url, upgrade=True)), as_json)


@db_group.command("status")
@_db_url_option
@click.option("--json", "as_json", is_flag=True)
@click.option("--check", is_flag=True,
              help="print nothing; exit 0 when this code may run against the database as "
                   "it is (current, or newer and declaring this code compatible), else 1 "
                   "with the reason (the pods' wait-for-schema gate)")
def db_status(url: str | None, as_json: bool, check: bool) -> None:
    """Print the schema version the database holds, what an upgrade would apply, and the
    oldest fleet code that may run against it (``oldest_code``; a rollback target must
    know at least that version)."""
    status = run_async(lambda: _schema_status(url, upgrade=False))
    if check:
        runnable = status.state == "current" or (status.state == "newer" and status.compatible)
        if not runnable:
            click.echo(f"fleet schema: version {status.version}, this code knows "
                       f"{status.latest} and needs it current"
                       + (f" (the database needs code of version {status.oldest_code})"
                          if status.state == "newer" else ""), err=True)
        raise SystemExit(0 if runnable else 1)
    _print_schema_status(status, as_json)


__all__ = ["db_group"]
