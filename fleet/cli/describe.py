"""``fleet describe EXECUTION_ID``: one execution at a glance (issue 29.7).

Its status and where it waits (the parked reason), its flow and version, who owns it,
whether a worker holds its lease, where it came from (a fork's origin, a continuation's
predecessor) and what it led to (its successor; child executions when the log names
them), and its last events. ``--json`` prints the same as one object.
"""

from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table

from fleet.cli.common import (
    PAYLOAD_WIDTH,
    console,
    id_cell,
    log_table,
    open_reader_at,
    plain,
    read_store_url,
    run_async,
)
from fleet.kernel.events import EventEnvelope
from fleet.kernel.fold import fold_log
from fleet.kernel.values import datetime_from_ms


def describe_execution(execution_id: str, events: list[EventEnvelope], summary: Any,
                       last: int) -> dict[str, Any]:
    """What ``fleet describe`` shows of an execution (its log and its index row)."""
    state = fold_log(events)
    waiting = state.waiting or {}
    first = events[0].payload if events and events[0].sequence == 0 else {}
    children = [str(c) for c in (getattr(state, "children", None) or ())]
    return {
        "executionId": execution_id, "status": state.status, "flow": state.flow_id,
        "version": state.flow_version, "owner": state.owner,
        "waitingOn": waiting.get("on"), "waitingKind": waiting.get("kind"),
        "reason": waiting.get("correlationKey") or waiting.get("reason"),
        "error": state.error, "holder": getattr(summary, "holder", None),
        "leaseExpiresAt": getattr(summary, "lease_expires_at", None),
        "startedAt": state.started_at, "updatedAt": state.updated_at,
        "events": state.sequence + 1,
        "forkedFrom": first.get("forkedFrom"), "continuedFrom": state.continued_from,
        "continuedAs": state.next_execution_id, "children": children,
        "lastEvents": [e.to_dict() for e in events[-last:]] if last else [],
    }


def _when(ms: int | None) -> str:
    return "" if ms is None else datetime_from_ms(ms).strftime("%Y-%m-%d %H:%M:%S UTC")


@click.command()
@click.argument("execution_id")
@click.option("--db", default=None, help="store URL")
@click.option("--events", "last", type=click.IntRange(min=0), default=10, show_default=True,
              help="how many of its last events to show")
@click.option("--width", type=click.IntRange(min=1), default=PAYLOAD_WIDTH, show_default=True,
              help="cut each payload in the table at this many characters")
@click.option("--json", "as_json", is_flag=True, help="one JSON object")
def describe(execution_id: str, db: str | None, last: int, width: int, as_json: bool) -> None:
    """Status, flow, version, parked reason, lease, origin, successors, last events."""
    url = read_store_url(db)

    async def go() -> tuple[list[EventEnvelope], Any]:
        store = open_reader_at(url)
        try:
            return await store.read(execution_id), await store.get_execution(execution_id)
        finally:
            await store.close()

    events, summary = run_async(go)
    if not events:
        raise click.ClickException(f"no execution {execution_id!r} in {url}")
    shown = describe_execution(execution_id, events, summary, last)
    if as_json:
        click.echo(json.dumps(shown))
        return
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    rows: list[tuple[str, Any]] = [
        ("execution", id_cell(execution_id)), ("status", plain(shown["status"])),
        ("flow", plain(f"{shown['flow']} v{shown['version']}")),
        ("owner", plain(json.dumps(shown["owner"]) if shown["owner"] else "")),
        ("waiting on", plain(f"{shown['waitingKind']} {shown['waitingOn']}"
                             if shown["waitingOn"] else "")),
        ("reason", plain(shown["reason"] or "")),
        ("error", plain(json.dumps(shown["error"]) if shown["error"] else "")),
        ("lease", plain(f"held by {shown['holder']} until {_when(shown['leaseExpiresAt'])}"
                        if shown["holder"] else "")),
        ("started", plain(_when(shown["startedAt"]))),
        ("updated", plain(_when(shown["updatedAt"]))),
        ("events", plain(str(shown["events"]))),
        ("forked from", plain(json.dumps(shown["forkedFrom"]) if shown["forkedFrom"] else "")),
        ("continued from", id_cell(shown["continuedFrom"] or "")),
        ("continued as", id_cell(shown["continuedAs"] or "")),
        ("children", plain(", ".join(shown["children"]))),
    ]
    for name, value in rows:
        if str(value):
            table.add_row(name, value)
    console.print(table)
    if last:
        console.print(log_table(f"last {min(last, len(events))} of {len(events)} events",
                                events[-last:], width=width))


__all__ = ["describe", "describe_execution"]
