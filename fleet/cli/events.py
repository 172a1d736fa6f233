"""``fleet events tail``: the events stream the relay writes, filtered, as it grows."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import click

from fleet.cli.common import (
    db_option,
    echo,
    json_option,
    open_reader_at,
    read_store_url,
    run_async,
)
from fleet.config import FleetSettings
from fleet.kernel.errors import ConfigurationError, ValidationError
from fleet.kernel.store.spi import ORIGIN, CommittedEvent, Position
from fleet.streams.events import (
    EventFilter,
    backfill,
    committed_to_json,
    parse_entry,
    stream_bounds,
)
from fleet.streams.redis_client import aioredis, as_text, read_entries


@click.group()
def events() -> None:
    """The events stream (FLEET_EVENTS_STREAM): every committed event, once, in order."""


@events.command("tail")
@click.option("--from", "start", default=None, metavar="start|POSITION",
              help="begin after POSITION (or at the first event: 'start'), reading from the "
              "store what the stream trimmed away; default: only events from now on")
@click.option("--execution", "execution_id", default=None, help="only this execution's events")
@click.option("--type", "types", multiple=True, help="only events of this type (repeatable)")
@click.option("--tenant", default=None, help="only events of this tenant's executions")
@click.option("--count", type=click.IntRange(min=1), default=None,
              help="stop after printing this many events")
@click.option("--follow/--no-follow", default=True,
              help="wait for new events (default), or stop at the end of the stream")
@db_option
@json_option
def tail(start: str | None, execution_id: str | None, types: tuple[str, ...],
         tenant: str | None, count: int | None, follow: bool, db: str | None,
         as_json: bool) -> None:
    """Print the events stream's events as they are published.

    Each line is one event: its position, execution, sequence, type and
    tenant (--json: one JSON object per line, with the envelope). Ctrl-C stops.
    """
    settings = FleetSettings()
    if not settings.redis_url:
        raise ConfigurationError("fleet events tail needs FLEET_REDIS_URL")
    try:
        after = None if start is None else (ORIGIN if start == "start" else Position.parse(start))
    except ValidationError as exc:
        raise click.BadParameter(str(exc), param_hint="--from") from exc
    wanted = EventFilter(execution_id=execution_id, types=set(types) or None, tenant=tenant)

    def emit(committed: CommittedEvent) -> None:
        if as_json:
            click.echo(json.dumps(committed_to_json(committed), ensure_ascii=False))
        else:
            event = committed.event
            echo(f"{committed.position}  {event.execution_id}  #{event.sequence}  "
                       f"{event.type.value}  {committed.tenant or '-'}")

    with contextlib.suppress(BrokenPipeError):  # `fleet events tail | head` ends quietly
        run_async(lambda: _tail(settings, after, wanted, count, follow, db, emit))


@events.command("status")
@json_option
def status(as_json: bool) -> None:
    """The events stream and the relay now: length, first and last position, what was
    trimmed, the consumer groups' lag, the publishing relay's counters."""
    settings = FleetSettings()
    if not settings.redis_url:
        raise ConfigurationError("fleet events status needs FLEET_REDIS_URL")
    report = run_async(lambda: _status(settings))
    if as_json:
        click.echo(json.dumps(report))
        return
    relay = report["relay"]
    echo(f"stream {report['stream']}: {report['length']} entries, first "
               f"{report['first'] or '-'}, last {report['last']}, {report['removed']} trimmed")
    for group in report["groups"]:
        echo(f"  group {group['name']}: lag {group['lag']}, pending {group['pending']}, "
                   f"last delivered {group['last_delivered']}")
    if relay:
        echo(f"relay {relay.get('holder') or '-'}: published {relay.get('published')}, "
                   f"position {relay.get('position') or '-'}, lag {relay.get('lag_ms')} ms, "
                   f"errors {relay.get('errors')} ({relay.get('age_s')} s ago)")
    else:
        click.echo("relay: no report in the last 10 s (none running, or none leading)")


async def _status(settings: FleetSettings) -> dict[str, Any]:
    client = aioredis.Redis.from_url(str(settings.redis_url), socket_connect_timeout=2.0,
                                     socket_timeout=10.0)
    stream = settings.events_stream
    try:
        bounds = await stream_bounds(client, stream)
        length = await client.xlen(stream)
        groups = []
        if length or bounds.removed:
            for group in await client.xinfo_groups(stream):
                info = {as_text(k): v for k, v in group.items()}
                groups.append({"name": as_text(info.get("name")),
                               "lag": info.get("lag"), "pending": info.get("pending"),
                               "last_delivered": as_text(info.get("last-delivered-id"))})
        relay = {as_text(k): as_text(v)
                 for k, v in (await client.hgetall(f"{stream}:relay")).items()}
    finally:
        await client.aclose()
    if relay.get("at"):
        relay["age_s"] = str(round(time.time() - float(relay["at"]), 1))
    return {"stream": stream, "length": length,
            "first": None if bounds.first is None else str(bounds.first),
            "last": str(bounds.last), "removed": bounds.removed, "groups": groups,
            "relay": relay}


async def _tail(settings: FleetSettings, after: Position | None, wanted: EventFilter,
                count: int | None, follow: bool, db: str | None,
                emit: Callable[[CommittedEvent], None]) -> None:
    client = aioredis.Redis.from_url(str(settings.redis_url), socket_connect_timeout=2.0,
                                     socket_timeout=10.0)
    stream = settings.events_stream
    printed = 0

    def show(committed: CommittedEvent) -> bool:
        """Print it if wanted; True once ``count`` events were printed."""
        nonlocal printed
        if wanted.matches(committed):
            emit(committed)
            printed += 1
        return count is not None and printed >= count

    try:
        bounds = await stream_bounds(client, stream)
        if after is None:
            cursor = str(bounds.last)
        else:
            end = bounds.gap_after(after)
            if end is not None:  # the stream lost some above where we start: read the store
                store = open_reader_at(read_store_url(db))
                try:
                    async for committed in backfill(store, after=after, until=end):
                        after = committed.position
                        if show(committed):
                            return
                finally:
                    await store.close()
            cursor = str(after)
        while True:
            reply = await client.xread({stream: cursor}, count=200,
                                       block=1000 if follow else None)
            entries = read_entries(reply)
            if not entries and not follow:
                return
            for raw_id, raw in entries:
                cursor = as_text(raw_id)
                fields = {as_text(k): as_text(v) for k, v in (raw or {}).items()}
                try:
                    committed = parse_entry(cursor, fields)
                except ValidationError as exc:
                    echo(f"skipping {cursor}: {exc}", err=True)
                    continue
                if show(committed):
                    return
    finally:
        await client.aclose()


__all__ = ["events"]
