"""``fleet status``: executions by state (the store's index) and the workers' counters."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click
from rich.console import Group
from rich.live import Live
from rich.table import Table

from fleet.cli.common import console, fleet_errors, json_option
from fleet.config import FleetSettings
from fleet.services.status import WORKER_FIELDS, StatusReader

_SHORT = {"completed": "done", "stepped_aside": "aside", "fenced_out": "fenced",
          "recovered": "recov", "handed_back": "handed", "divergence_parked": "diverged"}


def _status_view(status: Any) -> Group:
    counts = Table(title="executions" + (" (paged; capped)" if status.capped else ""))
    counts.add_column("state")
    counts.add_column("executions", justify="right")
    for state, n in status.executions.items():
        counts.add_row(state, str(n))
    workers = Table(title=f"workers ({len(status.workers)})")
    for col in ("worker", "pool", "slots", *WORKER_FIELDS):
        workers.add_column(_SHORT.get(col, col), justify="left" if col == "worker"
                           else "right")
    for w in status.workers:
        workers.add_row(w.name, w.pool, "" if w.concurrency is None else str(w.concurrency),
                        *(str(int(w.fleet.get(name, 0))) for name in WORKER_FIELDS))
    parts: list[Any] = [counts, workers]
    parts += [f"[red]{problem}[/red]" for problem in status.problems]
    parts.append(time.strftime("at %H:%M:%S", time.localtime(status.at)))
    return Group(*parts)


@click.command()
@click.option("--watch", is_flag=True, help="refresh until Ctrl-C")
@click.option("--interval", type=click.FloatRange(min=0.2), default=2.0, show_default=True,
              help="seconds between refreshes")
@click.option("--inspect-timeout", type=click.FloatRange(min=0.1), default=1.0,
              show_default=True, help="seconds workers get to answer")
@json_option
@fleet_errors
def status(watch: bool, interval: float, inspect_timeout: float, as_json: bool) -> None:
    """Executions by state (the store's index) and workers (Celery inspect stats)."""
    with StatusReader(FleetSettings(), inspect_timeout=inspect_timeout) as reader:
        if not watch:
            snapshot = reader.read()
            if as_json:
                click.echo(json.dumps(snapshot.to_dict()))
            else:
                console.print(_status_view(snapshot))
            if snapshot.problems:  # what could be read is shown; the exit code says the rest
                sys.exit(1)
            return
        try:
            if as_json:
                while True:
                    click.echo(json.dumps(reader.read().to_dict()))
                    time.sleep(interval)
            with Live(_status_view(reader.read()), console=console,
                      refresh_per_second=4) as live:
                while True:
                    time.sleep(interval)
                    live.update(_status_view(reader.read()))
        except KeyboardInterrupt:
            return


__all__ = ["status"]
