"""``fleet diverged list|retry``: the executions parked on the divergence (and in-doubt)
gate, and a retry made as the operator principal (``FLEET_OPERATOR``).

The same ``fleet.dispatcher.operator`` the Fleet page in Flower uses: a retry
writes ``EXECUTION_RESUMED`` on ``__fleet_diverged__`` ``by`` the operator (the
audit), a worker drives it, and the command says how that drive ended:
parked again (the code still diverges: exit code 2), or run on.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import click
from rich.table import Table

from fleet.cli.common import echo, id_cell, id_column, json_option, plain, print_fitting
from fleet.config import FleetSettings
from fleet.dispatcher.operator import GATES, Operator
from fleet.services.counters import CountersReader

#: The exit code of a retry whose re-run diverged again.
REPARKED = 2


@click.group()
def diverged() -> None:
    """Executions parked on the divergence gate: list them, retry one."""


@diverged.command("list")
@click.option("--all-gates", is_flag=True, help="the in-doubt gate's too")
@click.option("--limit", type=click.IntRange(min=1, max=10_000), default=200,
              show_default=True, help="most executions per gate")
@json_option
def list_(all_gates: bool, limit: int, as_json: bool) -> None:
    """Each parked execution: flow, version, worker, when, and the recorded reason."""
    settings = FleetSettings()
    operator = Operator(settings)
    try:
        parked = operator.parked(gates=GATES if all_gates else GATES[:1], limit=limit)
    finally:
        operator.close()
    by = _parked_by(settings)
    parked = [p if p.worker else dataclasses.replace(p, worker=by.get(p.execution_id))
              for p in parked]
    if as_json:  # one object a line, as every listing command prints
        for p in parked:
            click.echo(json.dumps(p.to_dict()))
        return
    table = Table(title=f"parked ({len(parked)})")
    # The ids copy whole into `fleet diverged retry`: never folded nor cut; the reason
    # gives way (print_fitting prints records when even that does not fit).
    id_column(table, "execution", [p.execution_id for p in parked])
    table.add_column("gate", no_wrap=True)
    id_column(table, "flow", [p.flow_id for p in parked])
    table.add_column("version", no_wrap=True, justify="right")
    id_column(table, "worker", [p.worker or "" for p in parked])
    table.add_column("parked (UTC)", no_wrap=True)
    table.add_column("reason", overflow="fold", min_width=12)
    cells = [[p.execution_id, p.kind, p.flow_id,
              "" if p.flow_version is None else str(p.flow_version), p.worker or "",
              time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(p.parked_at / 1000)),
              p.reason] for p in parked]
    for cell in cells:
        table.add_row(*(id_cell(value) for value in cell[:-1]), plain(cell[-1]))
    print_fitting(table, cells)


def _parked_by(settings: FleetSettings) -> dict[str, str]:
    """Which worker parked each execution, from the workers' reports (none without Redis)."""
    if not settings.redis_url:
        return {}
    reader = CountersReader(settings)
    try:
        return reader.read(streams=False).parked_by()
    finally:
        reader.close()


@diverged.command()
@click.argument("execution_id")
@click.option("--wait", type=click.FloatRange(min=0), default=15.0, show_default=True,
              help="seconds to wait for the worker's drive")
@json_option
def retry(execution_id: str, wait: float, as_json: bool) -> None:
    """Retry EXECUTION_ID as FLEET_OPERATOR; exit code 2 if it diverged again."""
    operator = Operator(FleetSettings(), settle_s=wait)
    try:
        result = operator.retry(execution_id)
    finally:
        operator.close()
    if as_json:
        click.echo(json.dumps(result.to_dict()))
    else:
        echo(result.message)
    if result.reparked:
        sys.exit(REPARKED)


__all__ = ["REPARKED", "diverged"]
