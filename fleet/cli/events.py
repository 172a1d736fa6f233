"""``fleet events tail``: the events stream the relay writes, filtered, as it grows."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable

import click

from fleet.cli.common import db_option, fleet_errors, json_option, open_store_at, run_async
from fleet.cli.common import store_url as resolve_store_url
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
@fleet_errors
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
            click.echo(f"{committed.position}  {event.execution_id}  #{event.sequence}  "
                       f"{event.type.value}  {committed.tenant or '-'}")

    with contextlib.suppress(BrokenPipeError):  # `fleet events tail | head` ends quietly
        run_async(lambda: _tail(settings, after, wanted, count, follow, db, emit))


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
                store = open_store_at(resolve_store_url(db))
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
                    click.echo(f"skipping {cursor}: {exc}", err=True)
                    continue
                if show(committed):
                    return
    finally:
        await client.aclose()


__all__ = ["events"]
