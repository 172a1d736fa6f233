"""``fleet run``, ``fleet log``, ``fleet list``: executions in a store, here and now."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table

from fleet.cli.common import console, log_table, open_store_at, run_async, store_url
from fleet.kernel.events import EventEnvelope
from fleet.kernel.flows import load_flow
from fleet.kernel.runtime import Runtime


@click.command()
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
    url = store_url(db)

    async def go() -> tuple[Any, list[EventEnvelope]]:
        definition = load_flow(flow_spec)
        store = open_store_at(url)
        try:
            runtime = Runtime(store, flows=[definition])
            handle = await runtime.start(definition.flow_id, data)
            output = await handle.result(timeout=60)
            await runtime.close()
            return output, await store.read(handle.execution_id)
        finally:
            await store.close()

    output, events = run_async(go)
    if as_json:
        for event in events:
            click.echo(event.to_json())
        return
    console.print(log_table(f"{flow_spec} on {url}", events))
    console.print(f"[bold]result:[/bold] {json.dumps(output, ensure_ascii=False)}")


@click.command()
@click.argument("execution_id")
@click.option("--db", default=None, help="store URL")
@click.option("--json", "as_json", is_flag=True)
def log(execution_id: str, db: str | None, as_json: bool) -> None:
    """Print one execution's log."""
    url = store_url(db)

    async def go() -> list[EventEnvelope]:
        store = open_store_at(url)
        try:
            return await store.read(execution_id)
        finally:
            await store.close()

    events = run_async(go)
    if not events:
        raise click.ClickException(f"no execution {execution_id!r} in {url}")
    if as_json:
        for event in events:
            click.echo(event.to_json())
        return
    console.print(log_table(execution_id, events))


@click.command("list")
@click.option("--db", default=None, help="store URL")
@click.option("--status", default=None, help="running, parked, completed, failed, ...")
@click.option("--flow", "flow_id", default=None)
@click.option("--limit", default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def list_(db: str | None, status: str | None, flow_id: str | None, limit: int,
          as_json: bool) -> None:
    """List executions from the store's index."""
    url = store_url(db)

    async def go() -> list[Any]:
        store = open_store_at(url)
        try:
            return await store.list_executions(status=status, flow_id=flow_id, limit=limit)
        finally:
            await store.close()

    rows = run_async(go)
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


__all__ = ["list_", "log", "run"]
