"""``fleet repair``: mend logs an older version wrote (run with the executions quiesced)."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table

from fleet.cli.common import (
    id_column,
    open_snapshots,
    open_store_at,
    print_fitting,
    read_store_url,
    run_async,
    snapshots_option,
)
from fleet.kernel.errors import ConfigurationError
from fleet.kernel.lifecycle import LogLifecycle


@click.group()
def repair() -> None:
    """Repair logs (run with the executions quiesced)."""


@repair.command("terminal-event")
@click.argument("execution_ids", nargs=-1, required=True)
@click.option("--db", default=None, help="store URL")
@snapshots_option
@click.option("--apply", is_flag=True, help="write (default: only say what would be written)")
@click.option("--json", "as_json", is_flag=True)
def repair_terminal_event(execution_ids: tuple[str, ...], db: str | None,
                          snapshots: str | None, apply: bool, as_json: bool) -> None:
    """Restore the terminal event an older compaction removed."""
    url = read_store_url(db)

    async def go() -> list[Any]:
        store = open_store_at(url)
        snaps = open_snapshots(snapshots or url)
        if snaps is None:
            raise ConfigurationError("the repair reads checkpoints: give --snapshots")
        try:
            lifecycle = LogLifecycle(store, snaps)
            return [await lifecycle.restore_terminal_event(eid, apply=apply)
                    for eid in execution_ids]
        finally:
            await snaps.close()
            await store.close()

    reports = run_async(go)
    if as_json:
        for r in reports:
            click.echo(json.dumps({"executionId": r.execution_id, "action": r.action,
                                   "sequence": r.sequence, "type": r.type,
                                   "endedAt": r.ended_at}))
        return
    table = Table(title="terminal-event repair" + ("" if apply else " (dry run: --apply)"))
    id_column(table, "execution", [r.execution_id for r in reports])
    for col in ("action", "sequence", "type", "ended at (ms)"):
        table.add_column(col, overflow="fold")
    cells = [[r.execution_id, r.action, "" if r.sequence is None else str(r.sequence),
              r.type or "", "" if r.ended_at is None else str(r.ended_at)] for r in reports]
    for cell in cells:
        table.add_row(*cell)
    print_fitting(table, cells)


__all__ = ["repair"]
