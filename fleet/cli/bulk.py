"""``fleet executions cancel|retry|resume``: an operator's action on every execution a
filter matches (``fleet.kernel.bulk``, decision 0052).

Each match is written and audited as the single command would (as ``FLEET_OPERATOR``),
at most ``--rate`` a second; ``--dry-run`` lists what would change and writes nothing.
Matches are visited in id order: an interrupted run (Ctrl-C, a lost connection) goes on
with ``--after ID`` (the last id it printed), or by itself with ``--cursor-file PATH``,
which holds the last id settled; running it again is safe as well (what was done is
skipped).

Exit codes: 0 done (or the ``--limit`` reached: the summary says where to go on), 1
some matches failed or the run stopped early (the store did not answer), 2 usage.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import click

from fleet.cli.common import echo, json_arg
from fleet.config import FleetSettings
from fleet.dispatcher.operator import Operator
from fleet.kernel.bulk import Action, BulkReport, ExecutionFilter, Match

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}


def parse_age(value: str | None) -> timedelta | None:
    """``90``, ``90s``, ``10m``, ``2h``, ``3d`` as a ``timedelta`` (None stays None)."""
    if value is None:
        return None
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", value)
    if found is None:
        raise click.BadParameter(f"{value!r} is not an age: give seconds or a number with "
                                 "s, m, h or d (e.g. 10m, 2h, 3d)", param_hint="--older-than")
    return timedelta(seconds=float(found.group(1)) * _UNITS[found.group(2) or "s"])


def filter_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed([
        click.option("--flow", default=None, help="only this flow"),
        click.option("--version", "flow_version", type=int, default=None,
                     help="only this flow version"),
        click.option("--status", default=None, help="running, parked, ... (cancel)"),
        click.option("--waiting-on", "waiting_on", default=None,
                     help="only executions parked on this gate (cancel)"),
        click.option("--reason", default=None, help="text the parked reason contains"),
        click.option("--tenant", default=None, help="only this tenant's executions"),
        click.option("--older-than", default=None,
                     help="untouched for at least this long (90s, 10m, 2h, 3d)"),
        click.option("--dry-run", is_flag=True, help="list what would change; write nothing"),
        click.option("--rate", type=click.FloatRange(min=0.01), default=20.0,
                     show_default=True, help="most actions a second"),
        click.option("--limit", type=click.IntRange(min=0), default=None,
                     help="stop after this many actions"),
        click.option("--after", "after_id", default=None,
                     help="go on after this execution id (an interrupted run's last)"),
        click.option("--cursor-file", type=click.Path(dir_okay=False, path_type=Path),
                     default=None, help="resume from, and keep, the last id settled here"),
        click.option("--json", "as_json", is_flag=True,
                     help="one JSON object a match, then the summary"),
    ]):
        fn = option(fn)
    return fn


@click.group()
def executions() -> None:
    """Act on every execution a filter matches: cancel, retry (diverged), resume."""


def _run(action: Action, options: dict[str, Any], *, gate: str | None = None,
         payload: Any = None) -> None:
    flt = ExecutionFilter(flow=options["flow"], version=options["flow_version"],
                          status=options["status"], gate=options["waiting_on"],
                          reason=options["reason"], tenant=options["tenant"],
                          older_than=parse_age(options["older_than"]))
    cursor_file: Path | None = options["cursor_file"]
    after = options["after_id"]
    if after is None and cursor_file is not None and cursor_file.exists():
        after = cursor_file.read_text().strip() or None
    as_json, dry_run = options["as_json"], options["dry_run"]

    def told(match: Match, said: str) -> None:
        if as_json:
            click.echo(json.dumps({**match.to_dict(), "result": said}))
        else:
            version = "" if match.version is None else f" v{match.version}"
            echo(f"{match.execution_id}  {match.flow_id}{version}  {match.status}"
                 f"{'' if not match.waiting_on else ' on ' + match.waiting_on}  {said}")
        if cursor_file is not None and not dry_run:
            partial = cursor_file.with_name(cursor_file.name + ".partial")
            partial.write_text(match.execution_id)
            os.replace(partial, cursor_file)

    operator = Operator(FleetSettings())
    try:
        report = operator.bulk(action, flt, gate=gate, payload=payload, dry_run=dry_run,
                               rate=options["rate"], limit=options["limit"], after_id=after,
                               on_item=told)
    except KeyboardInterrupt:
        where = f"--after {after}" if cursor_file is None else f"--cursor-file {cursor_file}"
        echo(f"interrupted: run it again with {where} (the last id printed) to go on; what "
             "was done is skipped", err=True)
        sys.exit(130)
    finally:
        operator.close()
    _summary(report, flt, as_json)


def _summary(report: BulkReport, flt: ExecutionFilter, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"summary": report.to_dict(), "filter": flt.describe()}))
    elif report.dry_run:
        echo(f"dry run: {report.matched} execution(s) would be {report.action} "
             f"({flt.describe()}); nothing written")
    else:
        echo(f"{report.action}: {report.acted} done, {report.skipped} skipped (done "
             f"already), {report.failed} failed, of {report.matched} matched "
             f"({flt.describe()})")
        if report.stopped:
            echo(f"stopped: {report.stopped}")
    if report.failed or (report.stopped and not report.stopped.startswith("limit")):
        sys.exit(1)


@executions.command()
@filter_options
def cancel(**options: Any) -> None:
    """Cancel every execution the filter matches (a filter is required)."""
    _run("cancel", options)


@executions.command()
@filter_options
def retry(**options: Any) -> None:
    """Retry every execution parked on the divergence gate that the filter matches."""
    _run("retry", options)


@executions.command()
@click.argument("gate")
@click.option("--input", "input_json", default=None,
              help="the payload each gate is answered with, as JSON")
@filter_options
def resume(gate: str, input_json: str | None, **options: Any) -> None:
    """Answer GATE on every execution parked on it that the filter matches."""
    _run("resume", options, gate=gate, payload=json_arg(input_json, "--input"))


__all__ = ["executions", "parse_age"]
