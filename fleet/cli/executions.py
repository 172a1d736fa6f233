"""``fleet run``, ``fleet log``, ``fleet list``: executions in a store, here and now."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from datetime import datetime
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from fleet.cli.common import (
    PAYLOAD_WIDTH,
    OptionType,
    console,
    echo,
    id_cell,
    id_column,
    json_arg,
    log_table,
    open_reader_at,
    open_store_at,
    plain,
    print_fitting,
    read_store_url,
    run_async,
    store_url,
)
from fleet.kernel.errors import ConfigurationError, FleetError
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.flows import FlowDefinition, load_flow
from fleet.kernel.runtime import Runtime

_ENDS = (EventType.EXECUTION_COMPLETED, EventType.EXECUTION_FAILED,
         EventType.EXECUTION_CANCELLED, EventType.EXECUTION_CONTINUED)


def park_line(execution_id: str, waiting: dict[str, Any], due_ms: int | None,
              now_ms: int | None = None) -> str:
    """What ``fleet run`` prints when the run parks: on what, and until when."""
    on, kind = str(waiting.get("on")), str(waiting.get("kind") or "gate")
    if kind == "timer" and due_ms is not None:
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        due = datetime.fromtimestamp(due_ms / 1000)
        shown = due.strftime("%H:%M:%S" if due.date() == datetime.now().date()
                             else "%Y-%m-%d %H:%M:%S")
        return (f"parked on timer {on} until {shown} (in {max(0, (due_ms - now_ms)) / 1000:.0f} s);"
                " waiting here for it (Ctrl-C leaves the run parked in the store)")
    if kind == "gate":
        return (f"parked on gate {on!r}: nothing here answers it; `fleet resume {execution_id} "
                f"{on} --input JSON` does, on a fleet using this store")
    if kind == "message":
        key = waiting.get("correlationKey") or on
        return (f"parked on message {key!r}: `fleet send {execution_id} {key} --input JSON` "
                "delivers it, on a fleet using this store")
    return f"parked on {kind} {on!r}"


class _FlowSpec(OptionType):
    name = "module:flow"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, FlowDefinition):
            return value
        try:
            return load_flow(str(value))
        except ConfigurationError as exc:
            self.fail(str(exc), param, ctx)


@click.command()
@click.option("--flow", "definition", type=_FlowSpec(),
              default="fleet.examples.onboarding:onboard", show_default=True,
              help="module:flow to run (a module in this directory imports, as with python -m)")
@click.option("--input", "input_json", default='"u-1"', show_default=True,
              help="the flow input, as JSON")
@click.option("--db", default=None, help="store URL (default: FLEET_DATABASE_URL or "
              "sqlite:///fleet.db)")
@click.option("--json", "as_json", is_flag=True,
              help="print the log as JSON lines (what it parks on goes to standard error)")
def run(definition: FlowDefinition, input_json: str, db: str | None, as_json: bool) -> None:
    """Run a flow here and print its log.

    It runs until the execution ends. A durable sleep waits here (the line
    says until when); a gate or a message ends the command with the execution
    parked in the store, and says how to answer it.
    """
    data = json_arg(input_json, "--input")
    url = store_url(db)
    started: list[str] = []

    def say(line: str) -> None:
        echo(line, err=as_json)

    async def go() -> tuple[str, list[EventEnvelope], Any, str | None]:
        loop = asyncio.get_running_loop()
        news: asyncio.Queue[EventEnvelope] = asyncio.Queue()

        def observe(event: EventEnvelope) -> None:
            if event.type is EventType.EXECUTION_SUSPENDED or event.type in _ENDS:
                loop.call_soon_threadsafe(news.put_nowait, event)

        store = open_store_at(url)
        runtime = Runtime(store, flows=[definition], on_durable_event=observe)
        try:
            handle = await runtime.start(definition.flow_id, data)
            eid = handle.execution_id
            started.append(eid)
            current, stopped = eid, None
            # The result ends the wait too: a run that stopped without an end (a write
            # failed) raises through it instead of leaving this loop waiting.
            ended = asyncio.ensure_future(handle.result())
            while stopped is None:
                getter = asyncio.ensure_future(news.get())
                done, _ = await asyncio.wait({getter, ended},
                                             return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    break
                event = getter.result()
                if event.execution_id != current:
                    continue
                if event.type is EventType.EXECUTION_CONTINUED:
                    current = str(event.payload.get("nextExecutionId") or current)
                    continue
                if event.type is not EventType.EXECUTION_SUSPENDED:
                    break
                state = await runtime.load_state(current, system=True)
                waiting = dict(event.payload.get("condition") or {})
                due = (state.timers.get(str(waiting.get("on"))) or {}).get("dueAt")
                say(park_line(current, waiting, due if isinstance(due, int) else None))
                if waiting.get("kind") != "timer":
                    stopped = f"parked on {waiting.get('kind') or 'gate'} {waiting.get('on')!r}"
            output: Any = None
            error: str | None = None
            if stopped is None:
                try:
                    output = await asyncio.wait_for(ended, 30)
                except FleetError as exc:
                    error = f"{type(exc).__name__}: {exc}"
            else:
                ended.cancel()
            return eid, await store.read(eid), output, stopped or error
        finally:
            await runtime.close()
            await store.close()

    try:
        eid, events, output, stopped = run_async(go)
    except KeyboardInterrupt:
        where = f"execution {started[0]} stays" if started else "the execution stays"
        echo(f"interrupted: {where} parked in {url}; a fleet on this store carries it "
             "on (`fleet up`, or `fleet timers` and a worker)", err=True)
        sys.exit(130)
    if as_json:
        for event in events:
            click.echo(event.to_json())
    else:
        console.print(log_table(f"{definition.flow_id} {eid} on {url}", events))
    failed = stopped is not None and not stopped.startswith("parked")
    if failed:
        raise click.ClickException(f"execution {eid} failed: {stopped}")
    if not as_json:
        console.print(plain(stopped, "bold") if stopped else
                      Text.assemble(("result: ", "bold"),
                                    plain(json.dumps(output, ensure_ascii=False))))


@click.command()
@click.argument("execution_id")
@click.option("--db", default=None, help="store URL")
@click.option("--json", "as_json", is_flag=True,
              help="one JSON object per event, each whole (the stored event)")
@click.option("--width", type=click.IntRange(min=1), default=PAYLOAD_WIDTH, show_default=True,
              help="cut each payload in the table at this many characters (saying so)")
@click.option("--full", is_flag=True, help="every payload whole in the table")
def log(execution_id: str, db: str | None, as_json: bool, width: int, full: bool) -> None:
    """Print one execution's log.

    Payloads are printed as the JSON they are: text in square brackets stays,
    and control characters are written as escapes (\\x1b).
    """
    url = read_store_url(db)

    async def go() -> list[EventEnvelope]:
        store = open_reader_at(url)
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
    console.print(log_table(execution_id, events, width=None if full else width))


@click.command("list")
@click.option("--db", default=None, help="store URL")
@click.option("--status", default=None, help="running, parked, completed, failed, ...")
@click.option("--flow", "flow_id", default=None)
@click.option("--limit", default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="one JSON object per execution")
def list_(db: str | None, status: str | None, flow_id: str | None, limit: int,
          as_json: bool) -> None:
    """List executions from the store's index (ids whole: they copy into `fleet log`)."""
    url = read_store_url(db)

    async def go() -> list[Any]:
        store = open_reader_at(url)
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
    id_column(table, "execution", [row.execution_id for row in rows])
    id_column(table, "flow", [row.flow_id for row in rows])  # copied into --flow
    id_column(table, "status", [row.status for row in rows])
    # Only the columns that say something: the ids keep the width.
    extra = [(header, attr) for header, attr in (("waiting on", "waiting_on"),
                                                 ("tenant", "tenant"))
             if any(getattr(row, attr) for row in rows)]
    for header, _ in extra:
        table.add_column(header, overflow="fold", min_width=7)
    cells = [[row.execution_id, row.flow_id, row.status,
              *(getattr(row, attr) or "" for _, attr in extra)] for row in rows]
    for cell in cells:
        table.add_row(*(id_cell(value) for value in cell))
    print_fitting(table, cells)


__all__ = ["list_", "log", "park_line", "run"]
