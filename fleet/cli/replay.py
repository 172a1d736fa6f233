"""``fleet replay``: export recorded logs and check them against the current code.

``check`` is a deploy gate: it replays each log dry (``fleet.kernel.replay``:
nothing runs, nothing is written) and exits non-zero when any execution
diverged, no longer matches the registered code, or could not be replayed.
Like the rest of the CLI it parses arguments and calls the library.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from fleet.cli.common import (
    db_option,
    echo,
    id_column,
    open_reader_at,
    open_snapshots,
    print_fitting,
    read_store_url,
    require_database,
    run_async,
    snapshots_option,
)
from fleet.config import FleetSettings
from fleet.kernel.errors import ConfigurationError, FleetError, ValidationError
from fleet.kernel.flows import Features, load_flow
from fleet.kernel.replay import (
    ReplayVerdict,
    export_execution,
    read_export,
    replay_check,
    replay_check_store,
)


@click.group()
def replay() -> None:
    """Replay recorded logs against the current code (dry: nothing runs or is written)."""


@replay.command("export")
@click.argument("execution_id")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="file to write (default: standard output)")
@db_option
@snapshots_option
@click.option("--json", "as_json", is_flag=True,
              help="with -o: say what was written as one JSON object (the export itself is "
              "JSON either way)")
def export(execution_id: str, output: Path | None, db: str | None,
           snapshots: str | None, as_json: bool) -> None:
    """Write EXECUTION_ID's log as JSON (with its checkpoint, when one exists)."""
    url = read_store_url(db)

    async def go() -> dict[str, Any]:
        store = open_reader_at(url)
        snaps = open_snapshots(snapshots or url)
        try:
            return await export_execution(store, execution_id, snapshots=snaps)
        finally:
            if snaps is not None:
                await snaps.close()
            await store.close()

    doc = run_async(go)
    text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    if output is None:
        click.echo(text, nl=False)
        return
    output.write_text(text, encoding="utf-8")
    if as_json:
        click.echo(json.dumps({"executionId": execution_id, "events": len(doc["log"]),
                               "snapshot": "snapshot" in doc, "path": str(output)}))
        return
    echo(f"wrote {len(doc['log'])} events of {execution_id}"
               f"{' and its snapshot' if 'snapshot' in doc else ''} to {output}", err=True)


def _read_log_file(path: Path) -> Any:
    """A file ``export`` wrote, a JSON list of events, or JSON lines (``fleet log --json``)."""
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except ValueError:
        try:
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as exc:
            raise ValidationError(f"{path} is neither JSON nor JSON lines: {exc}") from exc


@replay.command("check")
@click.option("--flow", "flow_specs", multiple=True, required=True,
              help="module:flow of the current code (repeat for every flow and version)")
@click.option("--log", "log_files", multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="an exported log file (repeatable)")
@click.option("--execution", "execution_ids", multiple=True,
              help="an execution id in the store (repeatable)")
@click.option("--all", "check_all", is_flag=True,
              help="every execution in the store of the given flows")
@db_option
@snapshots_option
@click.option("--json", "as_json", is_flag=True, help="print the verdicts as one JSON object")
def check(flow_specs: tuple[str, ...], log_files: tuple[Path, ...],
          execution_ids: tuple[str, ...], check_all: bool, db: str | None,
          snapshots: str | None, as_json: bool) -> None:
    """Replay logs against the current code; exit 1 if any is not ok (a deploy gate)."""
    sources = sum((bool(log_files), bool(execution_ids), check_all))
    if sources != 1:
        raise click.UsageError("give exactly one of --log FILE..., --execution ID... or --all")
    try:
        flows = [load_flow(spec) for spec in flow_specs]
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from exc
    settings = FleetSettings()
    features_on = settings.sha256_flow_hash

    async def go() -> list[ReplayVerdict]:
        features = Features(sha256_flow_hash=features_on)
        if log_files:
            verdicts = []
            for path in log_files:
                try:
                    events, state = read_export(_read_log_file(path))
                except FleetError as exc:
                    verdicts.append(ReplayVerdict(str(path), None, "error", detail=str(exc)))
                    continue
                verdicts.append(await replay_check(events, flows, state=state,
                                                   features=features))
            return verdicts
        url = require_database(db or settings.database_url)
        store = open_reader_at(url)
        snaps = open_snapshots(snapshots or url)
        try:
            return await replay_check_store(
                store, flows, execution_ids=list(execution_ids) if execution_ids else None,
                snapshots=snaps, features=features)
        finally:
            if snaps is not None:
                await snaps.close()
            await store.close()

    verdicts = run_async(go)
    failed = [v for v in verdicts if not v.ok]
    if as_json:
        click.echo(json.dumps({"ok": not failed, "checked": len(verdicts),
                               "failed": len(failed), "executions": [
            {"executionId": v.execution_id, "flowId": v.flow_id, "status": v.status,
             "skipped": v.skipped, "frontier": v.frontier, "detail": v.detail}
            for v in verdicts]}, ensure_ascii=False))
    else:
        table = Table(title=f"replay check: {len(verdicts)} execution(s), "
                            f"{len(failed)} failed")
        id_column(table, "execution", [v.execution_id for v in verdicts])
        for col in ("flow", "verdict", "detail"):
            table.add_column(col, overflow="fold")
        cells = [[v.execution_id, v.flow_id or "", _verdict(v.status),
                  _detail(v.status, v.skipped, v.frontier, v.detail)] for v in verdicts]
        for cell in cells:
            table.add_row(*cell)
        print_fitting(table, cells)
    if failed:
        sys.exit(1)


def _verdict(status: str) -> str:
    return {"ok": "ok", "diverged": "DIVERGED", "code_mismatch": "CODE MISMATCH"}.get(
        status, status.upper())


def _detail(status: str, skipped: list[str], frontier: str | None, detail: str) -> str:
    if status == "ok":
        return f"stopped at {frontier}" if frontier else ""
    if status == "diverged":
        return f"skipped {len(skipped)}: {', '.join(skipped)}"
    return detail
