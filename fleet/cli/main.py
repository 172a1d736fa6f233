"""The ``fleet`` command. It parses arguments and calls the library."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from fleet.config import FleetSettings
from fleet.kernel.errors import ConfigurationError, FleetError
from fleet.kernel.events import EventEnvelope
from fleet.kernel.flows import load_flow
from fleet.kernel.store.spi import EventStore

T = TypeVar("T")
console = Console()


def _run(coro_fn: Callable[[], Awaitable[T]]) -> T:
    try:
        return asyncio.run(coro_fn())  # type: ignore[arg-type]
    except FleetError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc


def _open(url: str) -> EventStore:
    # The URL given (or FLEET_DATABASE_URL), with the rest of the settings:
    # pool sizes, the event size limit and group commit apply to every command.
    from fleet.kernel.store.factory import open_event_store_from_settings

    return open_event_store_from_settings(FleetSettings(database_url=url))


def _log_table(title: str, events: list[EventEnvelope]) -> Table:
    table = Table(title=title)
    table.add_column("seq", justify="right")
    table.add_column("type")
    table.add_column("payload", overflow="fold")
    for event in events:
        table.add_row(str(event.sequence), str(event.type),
                      json.dumps(event.payload, ensure_ascii=False)[:160])
    return table


@click.group()
@click.version_option(package_name="fleet")
def main() -> None:
    """fleet: durable execution for Python."""


@main.command()
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
    url = db or FleetSettings().database_url

    async def go() -> tuple[Any, list[EventEnvelope]]:
        from fleet.kernel.runtime import Runtime

        definition = load_flow(flow_spec)
        store = _open(url)
        try:
            runtime = Runtime(store, flows=[definition])
            handle = await runtime.start(definition.flow_id, data)
            output = await handle.result(timeout=60)
            await runtime.close()
            return output, await store.read(handle.execution_id)
        finally:
            await store.close()

    output, events = _run(go)
    if as_json:
        for event in events:
            click.echo(event.to_json())
        return
    console.print(_log_table(f"{flow_spec} on {url}", events))
    console.print(f"[bold]result:[/bold] {json.dumps(output, ensure_ascii=False)}")


@main.command()
@click.argument("execution_id")
@click.option("--db", default=None, help="store URL")
@click.option("--json", "as_json", is_flag=True)
def log(execution_id: str, db: str | None, as_json: bool) -> None:
    """Print one execution's log."""
    url = db or FleetSettings().database_url

    async def go() -> list[EventEnvelope]:
        store = _open(url)
        try:
            return await store.read(execution_id)
        finally:
            await store.close()

    events = _run(go)
    if not events:
        raise click.ClickException(f"no execution {execution_id!r} in {url}")
    if as_json:
        for event in events:
            click.echo(event.to_json())
        return
    console.print(_log_table(execution_id, events))


@main.command("list")
@click.option("--db", default=None, help="store URL")
@click.option("--status", default=None, help="running, parked, completed, failed, ...")
@click.option("--flow", "flow_id", default=None)
@click.option("--limit", default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def list_(db: str | None, status: str | None, flow_id: str | None, limit: int,
          as_json: bool) -> None:
    """List executions from the store's index."""
    url = db or FleetSettings().database_url

    async def go() -> list[Any]:
        store = _open(url)
        try:
            return await store.list_executions(status=status, flow_id=flow_id, limit=limit)
        finally:
            await store.close()

    rows = _run(go)
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


def _open_snapshots(url: str | None) -> Any:
    if url is None or url == "none":
        return None
    from fleet.kernel.store.factory import open_snapshot_store

    return open_snapshot_store(url)


def _load_callable(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"{spec!r} must look like 'package.module:function'")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"cannot load {spec!r}: {exc}") from exc
    if not callable(target):
        raise ConfigurationError(f"{spec!r} is not callable")
    return target


def _collect(url: str, snapshots: str | None, flow_id: str | None) -> Any:
    """Every finished execution's trajectories (checkpoints read when a snapshot store is set)."""
    from fleet.learning import collect_trajectories

    async def go() -> Any:
        store = _open(url)
        snaps = _open_snapshots(snapshots or url)
        try:
            return await collect_trajectories(store, snaps, flow_id=flow_id)
        finally:
            if snaps is not None:
                await snaps.close()
            await store.close()

    return _run(go)


def _warn_compacted(ids: list[str]) -> None:
    if ids:
        shown = ", ".join(ids[:10]) + (" ..." if len(ids) > 10 else "")
        click.echo(f"warning: {len(ids)} execution(s) look compacted and were not read "
                   f"(configure --snapshots): {shown}", err=True)


@main.group()
def learn() -> None:
    """Learn from logged decisions and their rewards."""


_snapshots_option = click.option(
    "--snapshots", default=None,
    help="snapshot store URL holding checkpoints (default: the --db URL; 'none' for none)")


@learn.command("report")
@click.option("--db", default=None, help="store URL")
@_snapshots_option
@click.option("--flow", "flow_id", default=None)
@click.option("--json", "as_json", is_flag=True)
def learn_report(db: str | None, snapshots: str | None, flow_id: str | None,
                 as_json: bool) -> None:
    """Decisions, propensities and joined rewards per policy."""
    url = db or FleetSettings().database_url

    found = _collect(url, snapshots, flow_id)
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for path in found.trajectories:
        for d in path.decisions:
            key = (str(d.policy_name), str(d.policy_version))
            row = rows.setdefault(key, {"policy": key[0], "version": key[1], "decisions": 0,
                                        "rewarded": 0, "reward_sum": 0.0, "propensity_sum": 0.0})
            row["decisions"] += 1
            row["propensity_sum"] += d.propensity or 0.0
            scores = [r.score for r in d.rewards if r.score is not None]
            if scores:
                row["rewarded"] += 1
                row["reward_sum"] += sum(scores) / len(scores)
    report = [{"policy": r["policy"], "version": r["version"], "decisions": r["decisions"],
               "rewarded": r["rewarded"],
               "mean_propensity": r["propensity_sum"] / r["decisions"],
               "mean_reward": (r["reward_sum"] / r["rewarded"]) if r["rewarded"] else None}
              for r in rows.values()]
    _warn_compacted(found.compacted_unread)
    if as_json:
        click.echo(json.dumps({"executions": found.executions, "policies": report,
                               "compactedUnread": found.compacted_unread}))
        return
    table = Table(title=f"{found.executions} finished executions in {url}")
    for col in ("policy", "version", "decisions", "rewarded", "mean propensity",
                "mean reward"):
        table.add_column(col)
    for r in report:
        table.add_row(r["policy"], r["version"], str(r["decisions"]), str(r["rewarded"]),
                      f"{r['mean_propensity']:.3f}",
                      "" if r["mean_reward"] is None else f"{r['mean_reward']:.3f}")
    console.print(table)


@learn.command("eval")
@click.option("--policy", "policy_spec", required=True,
              help="module:function (context, choice, alternatives) -> probability")
@click.option("--db", default=None, help="store URL")
@_snapshots_option
@click.option("--flow", "flow_id", default=None)
@click.option("--min-lift", default=0.0, show_default=True)
@click.option("--min-ess", default=30.0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def learn_eval(policy_spec: str, db: str | None, snapshots: str | None, flow_id: str | None,
               min_lift: float, min_ess: float, as_json: bool) -> None:
    """Evaluate a target policy offline (IPS/SNIPS) against the logged decisions."""
    from fleet.learning import evaluate_policy, promotion_gate

    url = db or FleetSettings().database_url
    target = _load_callable(policy_spec)

    found = _collect(url, snapshots, flow_id)
    _warn_compacted(found.compacted_unread)
    try:
        result = evaluate_policy(found.trajectories, target)
    except FleetError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
    gate = promotion_gate(result, min_lift=min_lift, min_ess=min_ess)
    fields = {"samples": result.samples, "ips": result.ips, "snips": result.snips,
              "ess": result.effective_sample_size, "logged": result.logged_value,
              "estimated": result.estimated_value, "lift": result.lift,
              "ci": list(result.confidence_interval), "passed": gate.passed,
              "reasons": list(gate.reasons)}
    if as_json:
        click.echo(json.dumps(fields))
    else:
        table = Table(title=f"{policy_spec} against {found.executions} executions")
        table.add_column("measure")
        table.add_column("value", justify="right")
        for name in ("samples", "ips", "snips", "ess", "logged", "estimated", "lift"):
            value = fields[name]
            table.add_row(name, f"{value:.4f}" if isinstance(value, float) else str(value))
        low, high = result.confidence_interval
        table.add_row("ci", f"[{low:.4f}, {high:.4f}]")
        table.add_row("gate", "PASS" if gate.passed else "FAIL: " + "; ".join(gate.reasons))
        console.print(table)
    if not gate.passed:
        sys.exit(1)


@main.group()
def repair() -> None:
    """Repair logs (run with the executions quiesced)."""


@repair.command("terminal-event")
@click.argument("execution_ids", nargs=-1, required=True)
@click.option("--db", default=None, help="store URL")
@_snapshots_option
@click.option("--apply", is_flag=True, help="write (default: only say what would be written)")
@click.option("--json", "as_json", is_flag=True)
def repair_terminal_event(execution_ids: tuple[str, ...], db: str | None,
                          snapshots: str | None, apply: bool, as_json: bool) -> None:
    """Restore the terminal event an older compaction removed."""
    from fleet.kernel.lifecycle import LogLifecycle

    url = db or FleetSettings().database_url

    async def go() -> list[Any]:
        store = _open(url)
        snaps = _open_snapshots(snapshots or url)
        if snaps is None:
            raise ConfigurationError("the repair reads checkpoints: give --snapshots")
        try:
            lifecycle = LogLifecycle(store, snaps)
            return [await lifecycle.restore_terminal_event(eid, apply=apply)
                    for eid in execution_ids]
        finally:
            await snaps.close()
            await store.close()

    reports = _run(go)
    if as_json:
        for r in reports:
            click.echo(json.dumps({"executionId": r.execution_id, "action": r.action,
                                   "sequence": r.sequence, "type": r.type}))
        return
    table = Table(title="terminal-event repair" + ("" if apply else " (dry run: --apply)"))
    for col in ("execution", "action", "sequence", "type"):
        table.add_column(col)
    for r in reports:
        table.add_row(r.execution_id, r.action, "" if r.sequence is None else str(r.sequence),
                      r.type or "")
    console.print(table)


@main.group()
def outcome() -> None:
    """Attach rewards to decisions of finished executions."""


@outcome.command("attach")
@click.option("--execution", "execution_id", required=True)
@click.option("--decision", "decision_id", required=True)
@click.option("--key", required=True, help="a namespaced reward key, e.g. csat:1")
@click.option("--score", type=float, default=None)
@click.option("--success", type=bool, default=None)
@click.option("--actor", default=None, help="who attaches it (the principal's actor)")
@click.option("--tenant", default=None)
@click.option("--db", default=None, help="store URL")
@click.option("--json", "as_json", is_flag=True)
def outcome_attach(execution_id: str, decision_id: str, key: str, score: float | None,
                   success: bool | None, actor: str | None, tenant: str | None,
                   db: str | None, as_json: bool) -> None:
    """Record a late outcome (authorised as `annotate` for --actor/--tenant)."""
    from fleet.kernel.runtime import Runtime
    from fleet.kernel.security import Principal

    settings = FleetSettings()
    url = db or settings.database_url
    principal = Principal(actor, tenant) if actor else None

    async def go() -> Any:
        store = _open(url)
        try:
            runtime = Runtime(store, strict=settings.strict)
            return await runtime.record_outcome(execution_id, decision_id=decision_id,
                                                key=key, score=score, success=success,
                                                principal=principal)
        finally:
            await store.close()

    result = _run(go)
    if as_json:
        click.echo(json.dumps({"appended": result.appended, "sequence": result.sequence}))
    elif result.appended:
        click.echo(f"attached at sequence {result.sequence}")
    else:
        click.echo("already attached (same value): nothing written")


@main.group("db")
def db_group() -> None:
    """The Postgres schema (versioned migrations; a store also applies them on first use)."""


async def _schema_status(url: str | None, *, upgrade: bool) -> Any:
    from fleet.kernel.store.factory import open_postgres_event_store

    store = open_postgres_event_store(url or FleetSettings().database_url, migrate=False)
    try:
        return await (store.upgrade_schema() if upgrade else store.schema_status())
    finally:
        await store.close()


def _print_schema_status(status: Any, as_json: bool) -> None:
    fields = {"version": status.version, "latest": status.latest, "state": status.state,
              "applied": list(status.applied), "pending": list(status.pending),
              "schema": status.schema}
    if as_json:
        click.echo(json.dumps(fields))
        return
    table = Table(title="fleet schema" + (f" in {status.schema}" if status.schema else ""))
    table.add_column("field")
    table.add_column("value", justify="right")
    for name, value in fields.items():
        shown = ", ".join(map(str, value)) if isinstance(value, list) else value
        table.add_row(name, "" if shown is None else str(shown))
    console.print(table)


_db_url_option = click.option("--db", "url", default=None,
                              help="postgresql:// URL, ?schema= allowed "
                                   "(default: FLEET_DATABASE_URL)")


@db_group.command("upgrade")
@_db_url_option
@click.option("--json", "as_json", is_flag=True)
def db_upgrade(url: str | None, as_json: bool) -> None:
    """Apply the missing migrations and print the schema version."""
    _print_schema_status(_run(lambda: _schema_status(url, upgrade=True)), as_json)


@db_group.command("status")
@_db_url_option
@click.option("--json", "as_json", is_flag=True)
def db_status(url: str | None, as_json: bool) -> None:
    """Print the schema version the database holds and what an upgrade would apply."""
    _print_schema_status(_run(lambda: _schema_status(url, upgrade=False)), as_json)


# The `fleet replay` group lives in its own module (it imports this one lazily).
from fleet.cli_replay import replay as _replay_group  # noqa: E402

main.add_command(_replay_group, "replay")

# The fleet's process, dispatch, reward, status and health commands: fleet/cli_fleet.py.
from fleet.cli_fleet import register as _register_fleet_commands  # noqa: E402

_register_fleet_commands(main)

# `fleet up` and `fleet demo`, the embedded fleet: fleet/cli_embedded.py.
from fleet.cli_embedded import demo as _demo_command  # noqa: E402
from fleet.cli_embedded import up as _up_command  # noqa: E402

main.add_command(_up_command, "up")
main.add_command(_demo_command, "demo")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
