"""The ``fleet`` command. It parses arguments and calls the library."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from fleet.config import FleetSettings
from fleet.kernel.errors import ConfigurationError, FleetError
from fleet.kernel.events import EventEnvelope
from fleet.kernel.flows import FlowDefinition
from fleet.kernel.store.spi import EventStore

T = TypeVar("T")
console = Console()


def _run(coro_fn: Callable[[], Awaitable[T]]) -> T:
    try:
        return asyncio.run(coro_fn())  # type: ignore[arg-type]
    except FleetError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc


def load_flow(spec: str) -> FlowDefinition:
    """``module:attribute`` → the FlowDefinition it names."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"flow {spec!r} must look like 'package.module:flow_name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r}: {exc}") from exc
    definition = getattr(module, attr, None)
    if not isinstance(definition, FlowDefinition):
        raise ConfigurationError(f"{spec!r} is not a flow declared with @flow(...)")
    return definition


def _open(url: str) -> EventStore:
    from fleet.kernel.store.factory import open_event_store

    return open_event_store(url)


def _log_table(title: str, events: list[EventEnvelope]) -> Table:
    table = Table(title=title)
    table.add_column("seq", justify="right")
    table.add_column("type")
    table.add_column("payload", overflow="fold")
    for event in events:
        table.add_row(str(event.sequence), str(event.type),
                      json.dumps(event.payload, ensure_ascii=False)[:160])
    return table


@click.group()
@click.version_option(package_name="fleet")
def main() -> None:
    """fleet: durable execution for Python."""


@main.command()
@click.option("--flow", "flow_spec", default="fleet.examples.onboarding:onboard",
              show_default=True, help="module:flow to run")
@click.option("--input", "input_json", default='"u-1"', show_default=True,
              help="the flow input, as JSON")
@click.option("--db", default=None, help="store URL (default: FLEET_DATABASE_URL or "
              "sqlite:///fleet.db)")
@click.option("--json", "as_json", is_flag=True, help="print the log as JSON lines")
def run(flow_spec: str, input_json: str, db: str | None, as_json: bool) -> None:
    """Run a flow to completion here and print its log."""
    try:
        data = json.loads(input_json)
    except ValueError as exc:
        raise click.BadParameter(f"--input is not JSON: {exc}") from exc
    url = db or FleetSettings().database_url

    async def go() -> tuple[Any, list[EventEnvelope]]:
        from fleet.kernel.runtime import Runtime

        definition = load_flow(flow_spec)
        store = _open(url)
        try:
            runtime = Runtime(store, flows=[definition])
            handle = await runtime.start(definition.flow_id, data)
            output = await handle.result(timeout=60)
            await runtime.close()
            return output, await store.read(handle.execution_id)
        finally:
            await store.close()

    output, events = _run(go)
    if as_json:
        for event in events:
            click.echo(event.to_json())
        return
    console.print(_log_table(f"{flow_spec} on {url}", events))
    console.print(f"[bold]result:[/bold] {json.dumps(output, ensure_ascii=False)}")


@main.command()
@click.argument("execution_id")
@click.option("--db", default=None, help="store URL")
@click.option("--json", "as_json", is_flag=True)
def log(execution_id: str, db: str | None, as_json: bool) -> None:
    """Print one execution's log."""
    url = db or FleetSettings().database_url

    async def go() -> list[EventEnvelope]:
        store = _open(url)
        try:
            return await store.read(execution_id)
        finally:
            await store.close()

    events = _run(go)
    if not events:
        raise click.ClickException(f"no execution {execution_id!r} in {url}")
    if as_json:
        for event in events:
            click.echo(event.to_json())
        return
    console.print(_log_table(execution_id, events))


@main.command("list")
@click.option("--db", default=None, help="store URL")
@click.option("--status", default=None, help="running, parked, completed, failed, ...")
@click.option("--flow", "flow_id", default=None)
@click.option("--limit", default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def list_(db: str | None, status: str | None, flow_id: str | None, limit: int,
          as_json: bool) -> None:
    """List executions from the store's index."""
    url = db or FleetSettings().database_url

    async def go() -> list[Any]:
        store = _open(url)
        try:
            return await store.list_executions(status=status, flow_id=flow_id, limit=limit)
        finally:
            await store.close()

    rows = _run(go)
    if as_json:
        for row in rows:
            click.echo(json.dumps({"executionId": row.execution_id, "flowId": row.flow_id,
                                   "status": row.status, "waitingOn": row.waiting_on,
                                   "tenant": row.tenant, "updatedAt": row.updated_at}))
        return
    table = Table(title=f"executions in {url}")
    for col in ("execution", "flow", "status", "waiting on", "tenant"):
        table.add_column(col)
    for row in rows:
        table.add_row(row.execution_id, row.flow_id, row.status, row.waiting_on or "",
                      row.tenant or "")
    console.print(table)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
