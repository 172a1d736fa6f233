"""``fleet schedule create | list | pause | resume | delete | trigger | backfill``.

A schedule runs a flow at the ticks of a cron expression or every interval, once per
tick (``Runtime.schedule``, decision 0058). Each command writes through the
dispatcher's runtime (nothing runs in the command) and enqueues the drive a worker
needs, as ``fleet start`` does: exit code 3 when the write stands but the broker did
not take the drive (the recovery sweeper drives it later), 1 when nothing was
written. ``--json`` prints what the library returned.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

import click
from rich.table import Table

from fleet.cli.common import (
    OptionType,
    id_column,
    json_arg,
    json_option,
    principal_from,
    principal_options,
    print_fitting,
    require_database,
    run_async,
    with_options,
)
from fleet.cli.dispatch import NotEnqueuedError, flows_hint
from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher, DriveOrder
from fleet.kernel.errors import BrokerUnavailableError, FlowNotFoundError
from fleet.kernel.runtime import Runtime
from fleet.kernel.schedule_spec import OVERLAPS, SCHEDULE_FLOW_ID, tick_id
from fleet.kernel.schedules import ScheduleInfo, backfill_message, control, delete, list_all
from fleet.kernel.security import Principal

T = TypeVar("T")
_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")


class Duration(OptionType):
    """``90``, ``90s``, ``5m``, ``1h30m``, ``2d``: a ``timedelta``."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, timedelta):
            return value
        text = str(value).strip()
        if text.isdigit():
            return timedelta(seconds=int(text))
        found = _DURATION.fullmatch(text)
        if not text or found is None:
            self.fail(f"{value!r} is not a duration: seconds, or e.g. 30s, 5m, 1h30m, 2d",
                      param, ctx)
        days, hours, minutes, seconds = (int(g or 0) for g in found.groups())
        return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)


class When(OptionType):
    """An ISO 8601 time with its zone (``2025-06-01T03:00:00Z``)."""

    name = "time"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, datetime):
            return value
        try:
            return datetime.fromisoformat(str(value))
        except ValueError:
            self.fail(f"{value!r} is not an ISO 8601 time such as 2025-06-01T03:00:00Z",
                      param, ctx)


def _existing_settings() -> FleetSettings:
    settings = FleetSettings()
    require_database(settings.database_url)
    return settings


def _through_dispatcher(settings: FleetSettings,
                        work: Callable[[Runtime], Awaitable[tuple[T, list[str]]]]) -> T:
    """Run ``work`` on the dispatcher's runtime, then enqueue the drives it names."""
    async def go() -> T:
        async with Dispatcher(settings) as dispatcher:
            runtime = await dispatcher.runtime()
            result, drives = await work(runtime)
            if drives:
                try:
                    await dispatcher.publish([DriveOrder(eid, SCHEDULE_FLOW_ID)
                                              for eid in drives])
                except BrokerUnavailableError as exc:
                    raise NotEnqueuedError(
                        f"the schedule is written, but its drive was not enqueued: "
                        f"{exc.message}. Nothing is lost: the recovery sweeper (fleet "
                        "recovery) drives it once the broker answers") from exc
            return result
    return run_async(go)


def _print(info: ScheduleInfo, as_json: bool, verb: str) -> None:
    if as_json:
        click.echo(json.dumps(info.to_dict()))
        return
    when = info.cron if info.cron is not None else f"every {info.every}"
    click.echo(f"{verb} {info.schedule_id}: {info.flow_id} at {when} ({info.timezone}), "
               f"overlap {info.overlap}; next tick "
               f"{info.next_tick.isoformat() if info.next_tick else '-'}")


@click.group()
def schedule() -> None:
    """Run a flow at cron times or every interval, exactly once per tick."""


@schedule.command()
@click.argument("schedule_id")
@click.argument("flow_id")
@click.option("--input", "input_json", default=None, help="the flow's input, as JSON")
@click.option("--cron", default=None, help="5 fields: minute hour day month weekday")
@click.option("--every", type=Duration(), default=None, help="an interval: 30s, 5m, 1h, 1d")
@click.option("--timezone", default="UTC", show_default=True, help="the cron's time zone")
@click.option("--overlap", type=click.Choice(OVERLAPS), default="skip", show_default=True,
              help="a tick while the last run runs: skip it, buffer one, or allow it")
@click.option("--catchup", type=Duration(), default="0", show_default=True,
              help="after an outage, run the missed ticks this recent")
@with_options(principal_options)
@json_option
def create(schedule_id: str, flow_id: str, input_json: str | None, cron: str | None,
           every: timedelta | None, timezone: str, overlap: str, catchup: timedelta,
           actor: str | None, tenant: str | None, as_json: bool) -> None:
    """Make SCHEDULE_ID run FLOW_ID (the same settings again change nothing)."""
    data = json_arg(input_json, "--input")
    who = principal_from(actor, tenant)
    settings = FleetSettings()
    if not settings.flows:
        raise flows_hint(FlowNotFoundError(f"no flow {flow_id!r} is registered"), settings)

    async def work(runtime: Runtime) -> tuple[ScheduleInfo, list[str]]:
        try:
            info = await runtime.schedule(schedule_id, flow_id, data, cron=cron, every=every,
                                          timezone=timezone, overlap=overlap, catchup=catchup,
                                          principal=who, drive=False)
        except FlowNotFoundError as exc:
            raise flows_hint(exc, settings) from exc
        return info, [info.execution_id]  # a drive of a parked schedule changes nothing

    _print(_through_dispatcher(settings, work), as_json, "scheduled")


@schedule.command("list")
@with_options(principal_options)
@json_option
def list_(actor: str | None, tenant: str | None, as_json: bool) -> None:
    """The schedules (those --actor may read): next tick, last run, runs, skipped ticks."""
    who = principal_from(actor, tenant)
    settings = _existing_settings()

    async def work(runtime: Runtime) -> tuple[list[ScheduleInfo], list[str]]:
        return await list_all(runtime.engine, principal=who, system=False), []

    infos = _through_dispatcher(settings, work)
    if as_json:
        for info in infos:  # one JSON object per line, as `fleet list --json`
            click.echo(json.dumps(info.to_dict()))
        return
    table = Table(title=f"schedules ({len(infos)})")
    id_column(table, "schedule", [i.schedule_id for i in infos])
    for header in ("flow", "when", "overlap", "next tick", "last run", "status", "runs",
                   "skipped"):
        table.add_column(header, justify="right" if header in ("runs", "skipped") else "left")
    rows = []
    for i in infos:
        row = [i.schedule_id, i.flow_id,
               (i.cron or f"every {i.every}") + ("" if i.timezone == "UTC" else
                                                   f" {i.timezone}"),
               i.overlap, "paused" if i.paused else
               (i.next_tick.isoformat() if i.next_tick else "-"),
               i.last_run or "-", i.last_run_status or "-", str(i.runs), str(i.skipped)]
        table.add_row(*row)
        rows.append(row)
    print_fitting(table, rows)


def _control(op: str, schedule_id: str, who: Principal | None,
             message: dict[str, Any] | None = None) -> None:
    async def work(runtime: Runtime) -> tuple[None, list[str]]:
        target, woke = await control(runtime.engine, schedule_id, message or {"op": op},
                                     principal=who, drive=False)
        return None, [target] if woke else []
    _through_dispatcher(_existing_settings(), work)


@schedule.command()
@click.argument("schedule_id")
@with_options(principal_options)
@json_option
def pause(schedule_id: str, actor: str | None, tenant: str | None, as_json: bool) -> None:
    """Stop firing SCHEDULE_ID's ticks until it is resumed."""
    _control("pause", schedule_id, principal_from(actor, tenant))
    click.echo(json.dumps({"scheduleId": schedule_id, "paused": True}) if as_json
               else f"paused {schedule_id}")


@schedule.command()
@click.argument("schedule_id")
@with_options(principal_options)
@json_option
def resume(schedule_id: str, actor: str | None, tenant: str | None, as_json: bool) -> None:
    """Fire SCHEDULE_ID's ticks again from now on."""
    _control("resume", schedule_id, principal_from(actor, tenant))
    click.echo(json.dumps({"scheduleId": schedule_id, "paused": False}) if as_json
               else f"resumed {schedule_id}")


@schedule.command()
@click.argument("schedule_id")
@with_options(principal_options)
@json_option
def trigger(schedule_id: str, actor: str | None, tenant: str | None, as_json: bool) -> None:
    """Start a run of SCHEDULE_ID now; prints its execution id."""
    who = principal_from(actor, tenant)

    async def work(runtime: Runtime) -> tuple[str, list[str]]:
        at = runtime.engine.clock()
        target, woke = await control(runtime.engine, schedule_id, {"op": "trigger", "at": at},
                                     principal=who, drive=False)
        return tick_id(schedule_id, at), [target] if woke else []

    eid = _through_dispatcher(_existing_settings(), work)
    click.echo(json.dumps({"scheduleId": schedule_id, "executionId": eid}) if as_json
               else eid)


@schedule.command()
@click.argument("schedule_id")
@click.option("--start", type=When(), required=True, help="the window's first time (ISO)")
@click.option("--end", type=When(), required=True, help="its last time (ISO, not after now)")
@with_options(principal_options)
@json_option
def backfill(schedule_id: str, start: datetime, end: datetime, actor: str | None,
             tenant: str | None, as_json: bool) -> None:
    """Run the ticks of SCHEDULE_ID in the past window [--start, --end] (those that ran
    already are not run again); prints the ids of their runs."""
    who = principal_from(actor, tenant)

    async def work(runtime: Runtime) -> tuple[list[str], list[str]]:
        message, ids = await backfill_message(runtime.engine, schedule_id, start, end, who)
        target, woke = await control(runtime.engine, schedule_id, message, principal=who,
                                     drive=False)
        return ids, [target] if woke else []

    ids = _through_dispatcher(_existing_settings(), work)
    click.echo(json.dumps({"scheduleId": schedule_id, "executionIds": ids}) if as_json
               else "\n".join(ids))


@schedule.command("delete")
@click.argument("schedule_id")
@with_options(principal_options)
@json_option
def delete_(schedule_id: str, actor: str | None, tenant: str | None, as_json: bool) -> None:
    """End SCHEDULE_ID now (the runs it started go on); the id may be scheduled again."""
    who = principal_from(actor, tenant)

    async def work(runtime: Runtime) -> tuple[str, list[str]]:
        return await delete(runtime.engine, schedule_id, principal=who), []

    _through_dispatcher(_existing_settings(), work)
    click.echo(json.dumps({"scheduleId": schedule_id, "deleted": True}) if as_json
               else f"deleted {schedule_id}")


__all__ = ["Duration", "When", "schedule"]
