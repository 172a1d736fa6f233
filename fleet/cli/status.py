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

# Short headers keep the workers' table within 80 columns (--json has every counter).
_SHORT = {"active": "act", "drives": "drive", "completed": "done", "failed": "fail",
          "parked": "park", "stepped_aside": "aside", "fenced_out": "fence",
          "recovered": "recov", "handed_back": "hand", "errors": "err",
          "divergence_warnings": "dv.w", "divergence_parked": "dv.p"}
_ALARM = {"fenced_out", "divergence_warnings", "divergence_parked", "errors", "failed"}
#: A service's counters in ``fleet status`` (--json has all of them).
SERVICE_FIELDS: dict[str, tuple[str, ...]] = {
    "timers": ("timers_fired", "enqueued", "enqueue_errors", "errors"),
    "recovery": ("examined", "redriven", "diverged", "errors"),
    "attacher": ("outcomes_attached", "outcomes_dead_lettered", "duplicates", "deferred"),
    "relay": ("published", "lag_ms", "leader", "errors"),
}


def _cell(name: str, value: float) -> str:
    text = str(int(value)) if float(value).is_integer() else f"{value:.1f}"
    return f"[bold red]{text}[/bold red]" if name in _ALARM and value > 0 else text


def _age(age_s: float | None, stale: bool) -> str:
    if age_s is None:
        return ""
    return f"[red]stale {age_s:.0f}s[/red]" if stale else f"{age_s:.0f}s"


def _status_view(status: Any) -> Group:
    counts = Table(title="executions" + (" (paged; capped)" if status.capped else ""))
    counts.add_column("state")
    counts.add_column("executions", justify="right")
    for state, n in status.executions.items():
        counts.add_row(state, str(n))
    workers = Table(title=f"workers ({len(status.workers)})", padding=(0, 0),
                    pad_edge=False, collapse_padding=True)
    for col in ("worker", *WORKER_FIELDS, "seen"):
        workers.add_column(_SHORT.get(col, col), justify="left" if col == "worker"
                           else "right", overflow="fold", max_width=24 if col == "worker"
                           else None)
    for w in status.workers:
        workers.add_row(w.name, *(_cell(name, w.fleet.get(name, 0)) for name in WORKER_FIELDS),
                        _age(w.age_s, w.stale))
    parts: list[Any] = [counts, workers]
    services = status.services
    if services:
        table = Table(title=f"services ({len(services)})")
        for col in ("service", "process", "counters", "seen"):
            table.add_column(col, overflow="fold")
        for p in services:
            shown = SERVICE_FIELDS.get(p.role, ())
            table.add_row(p.role, p.name, " ".join(
                f"{name}={_cell(name, p.counters.get(name, 0))}" for name in shown),
                _age(p.age_s, p.stale))
        parts.append(table)
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
