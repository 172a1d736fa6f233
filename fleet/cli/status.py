"""``fleet status``: executions by state (the store's index) and the workers' counters."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click
from rich.console import Group
from rich.live import Live
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from fleet.cli.common import (
    SafeConsole,
    console,
    id_cell,
    id_column,
    json_option,
    natural_width,
    plain,
    require_database,
)
from fleet.config import FleetSettings
from fleet.services.status import WORKER_FIELDS, StatusReader

# The table's short headers (the lines a narrow terminal gets spell every name out).
_SHORT = {"completed": "done", "stepped_aside": "aside", "fenced_out": "fenced",
          "recovered": "recov", "handed_back": "handed", "divergence_warnings": "div.warn",
          "divergence_parked": "div.park"}
_ALARM = {"fenced_out", "divergence_warnings", "divergence_parked", "errors", "failed"}
#: A service's counters in ``fleet status`` (--json has all of them).
SERVICE_FIELDS: dict[str, tuple[str, ...]] = {
    "timers": ("timers_fired", "enqueued", "enqueue_errors", "errors"),
    "recovery": ("examined", "redriven", "diverged", "errors"),
    "attacher": ("outcomes_attached", "outcomes_dead_lettered", "duplicates", "deferred"),
    "relay": ("published", "lag_ms", "leader", "errors"),
}


def _cell(name: str, value: float) -> Text:
    text = str(int(value)) if float(value).is_integer() else f"{value:.1f}"
    return Text(text, style="bold red" if name in _ALARM and value > 0 else "")


def _age(age_s: float | None, stale: bool) -> Text:
    if age_s is None:
        return Text("")
    return Text(f"stale {age_s:.0f}s", style="red") if stale else Text(f"{age_s:.0f}s")


def _counters(values: Any, names: Any) -> Text:
    """``name=value`` pairs, an alarm's value in red."""
    out = Text()
    for i, name in enumerate(names):
        out.append(("" if i == 0 else " ") + f"{name}=")
        out.append_text(_cell(name, values.get(name, 0)))
    return out


def _workers_table(status: Any, wide: bool) -> Table:
    """Every worker a row, every counter a column (needs about 120 columns)."""
    workers = Table(title=f"workers ({len(status.workers)})")
    id_column(workers, "worker", [w.name for w in status.workers])  # cells: id_cell
    for col in ("pool", "slots", *WORKER_FIELDS, "seen"):
        workers.add_column(col if wide else _SHORT.get(col, col), justify="right",
                           no_wrap=True)
    for w in status.workers:
        workers.add_row(id_cell(w.name), plain(w.pool),
                        "" if w.concurrency is None else str(w.concurrency),
                        *(_cell(name, w.fleet.get(name, 0)) for name in WORKER_FIELDS),
                        _age(w.age_s, w.stale))
    return workers


def _workers_lines(status: Any) -> list[Any]:
    """Every worker in two lines (its name whole, then its counters, wrapped between
    them): what fits a narrow terminal."""
    lines: list[Any] = [Text(f"workers ({len(status.workers)})", style="italic")]
    for w in status.workers:
        slots = "" if w.concurrency is None else f", {w.concurrency} slots"
        pool = f"{w.pool}{slots}" if w.pool else "(did not answer inspect)"
        seen = Text.assemble(", seen ", _age(w.age_s, w.stale)) if w.age_s is not None \
            else Text("")
        lines.append(Text.assemble("  ", id_cell(w.name), ": ", plain(pool), seen))
        lines.append(Padding(_counters(w.fleet, WORKER_FIELDS), (0, 0, 0, 4)))
    return lines


def _services_lines(services: Any) -> Group:
    """Each service process in two lines: its role, name and last report, then the
    counters ``SERVICE_FIELDS`` names (--json has all of them)."""
    lines: list[Any] = [Text(f"services ({len(services)})", style="italic")]
    for p in services:
        lines.append(Text.assemble(f"  {p.role} ", id_cell(p.name), ": seen ",
                                   _age(p.age_s, p.stale)))
        lines.append(Padding(_counters(p.counters, SERVICE_FIELDS.get(p.role, ())),
                             (0, 0, 0, 4)))
    return Group(*lines)


def _status_view(status: Any, *, wide: bool = False, width: int | None = None) -> Group:
    counts = Table(title="executions" + (" (paged; capped)" if status.capped else ""))
    counts.add_column("state")
    counts.add_column("executions", justify="right")
    for state, n in status.executions.items():
        counts.add_row(state, str(n))
    table = _workers_table(status, wide)
    fits = natural_width(table) <= (width or console.width)
    parts: list[Any] = [counts, *([table] if wide or fits else _workers_lines(status))]
    services = status.services
    if services:
        parts.append(_services_lines(services))
    parts += [plain(problem, "red") for problem in status.problems]
    parts.append(time.strftime("at %H:%M:%S", time.localtime(status.at)))
    return Group(*parts)


def _print(view: Group, wide: bool) -> None:
    # --wide: as wide as the table needs (the terminal wraps it), never squeezed.
    out = SafeConsole(width=max(console.width, natural_width(view))) if wide else console
    out.print(view)


@click.command()
@click.option("--watch", is_flag=True, help="refresh until Ctrl-C")
@click.option("--interval", type=click.FloatRange(min=0.2), default=2.0, show_default=True,
              help="seconds between refreshes")
@click.option("--inspect-timeout", type=click.FloatRange(min=0.1), default=1.0,
              show_default=True, help="seconds workers get to answer")
@click.option("--wide", is_flag=True,
              help="one row per worker with every counter, however wide (default: what "
              "fits the terminal)")
@json_option
def status(watch: bool, interval: float, inspect_timeout: float, wide: bool,
           as_json: bool) -> None:
    """Executions by state (the store's index) and workers (Celery inspect stats)."""
    settings = FleetSettings()
    require_database(settings.database_url)
    with StatusReader(settings, inspect_timeout=inspect_timeout) as reader:
        if not watch:
            snapshot = reader.read()
            if as_json:
                click.echo(json.dumps(snapshot.to_dict()))
            else:
                _print(_status_view(snapshot, wide=wide), wide)
            if snapshot.problems:  # what could be read is shown; the exit code says the rest
                sys.exit(1)
            return
        try:
            if as_json:
                while True:
                    click.echo(json.dumps(reader.read().to_dict()))
                    time.sleep(interval)
            with Live(_status_view(reader.read(), wide=wide), console=console,
                      refresh_per_second=4) as live:
                while True:
                    time.sleep(interval)
                    live.update(_status_view(reader.read(), wide=wide))
        except KeyboardInterrupt:
            return


__all__ = ["status"]
