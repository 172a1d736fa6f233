"""``fleet start``, ``resume``, ``send``, ``cancel``: through the dispatcher (write first,
then enqueue a drive).

The write is reported as soon as it is durable (``fleet start`` prints the id
first), then the drive is published within ``FLEET_PUBLISH_TIMEOUT_S``. A broker
that refuses or never answers is not a silent success: the command says the
write stands and the recovery sweeper will drive it, and exits 3 (1: nothing
was written).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import click

from fleet.cli.common import (
    echo,
    input_from,
    input_options,
    json_arg,
    json_option,
    principal_from,
    principal_options,
    require_database,
    with_options,
)
from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher, DriveOrder
from fleet.kernel.errors import BrokerUnavailableError, FlowNotFoundError

#: The exit code of a command whose write stands but whose drive was not enqueued.
NOT_ENQUEUED = 3


class NotEnqueuedError(click.ClickException):
    """The write is durable, the drive was not published (exit code 3)."""

    exit_code = NOT_ENQUEUED


def enqueue_or_explain(dispatcher: Dispatcher, order: DriveOrder, what: str) -> None:
    """Publish the drive of ``order``; a broker fault ends the command with exit code 3
    and says what stands and what happens next."""
    try:
        dispatcher.publish_sync([order])
    except BrokerUnavailableError as exc:
        raise NotEnqueuedError(
            f"{what} is written, but its drive was not enqueued: {exc.message}. Nothing is "
            "lost: the recovery sweeper (fleet recovery) drives it after "
            "FLEET_RECOVERY_GRACE_MS once the broker answers") from exc


def dispatch(call: Callable[[Any], Any]) -> Any:
    """Call ``call(dispatcher)`` on a Dispatcher built from the settings, then close it."""
    with Dispatcher(existing_store()) as dispatcher:
        return call(dispatcher)


def existing_store() -> FleetSettings:
    """The settings of a command that acts on executions already written: their
    database must exist (it is never created for them)."""
    settings = FleetSettings()
    require_database(settings.database_url)
    return settings


def flows_hint(exc: FlowNotFoundError, settings: FleetSettings) -> click.ClickException:
    """A flow that is not registered here, and what registers it."""
    hint = ("no flows are registered here: set FLEET_FLOWS=module:flow[,module:flow], e.g. "
            "FLEET_FLOWS=fleet.examples.onboarding:onboard (`fleet up` writes it to "
            ".fleet/env: `. .fleet/env`)" if not settings.flows else
            f"FLEET_FLOWS registers {', '.join(settings.flows)}: add the module:flow that "
            "declares it")
    return click.ClickException(f"{type(exc).__name__}: {exc}; {hint}")


_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, option: str) -> timedelta:
    """``90s``, ``15m``, ``2h``, ``1d``, ``250ms`` (or a number of seconds) as a timedelta."""
    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d)?\s*", text)
    if found is None:
        raise click.BadParameter(f"{text!r} is not a duration; e.g. 90s, 15m, 2h, 1d",
                                 param_hint=option)
    return timedelta(seconds=float(found.group(1)) * _UNITS[found.group(2) or "s"])


def parse_time(text: str, option: str) -> datetime:
    """An ISO 8601 time with its zone (``2027-01-01T09:00:00+00:00``, ``...Z``)."""
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not an ISO 8601 time; e.g. "
                                 "2027-01-01T09:00:00+00:00", param_hint=option) from None
    if when.tzinfo is None:
        raise click.BadParameter(f"{text!r} has no time zone: add one, e.g. +00:00 or Z",
                                 param_hint=option)
    return when


def later_options(at: str | None, within: str | None, queue: str | None, key: str | None,
                  priority: int | None, debounce: str | None) -> dict[str, Any]:
    """``fleet start``'s options that make a start run later (decisions 0055-0057)."""
    later: dict[str, Any] = {"queue": queue, "key": key, "priority": priority}
    if at is not None:
        later["start_at"] = parse_time(at, "--at")
    if within is not None:
        later["start_in"] = parse_duration(within, "--in")
    if debounce is not None:
        later["debounce"] = parse_duration(debounce, "--debounce")
    return {name: value for name, value in later.items() if value is not None}


@click.command()
@click.argument("flow_id")
@click.option("--input", "input_json", default=None, help="the flow input, as JSON")
@click.option("--execution-id", default=None, help="idempotent: the same id starts once")
@click.option("--idempotency-key", default=None,
              help="idempotent: names an execution id (per tenant and flow)")
@click.option("--at", "at", default=None,
              help="start at this time (ISO 8601 with a zone); it exists at once, parked")
@click.option("--in", "within", default=None, help="start after this long: 90s, 15m, 2h, 1d")
@click.option("--queue", default=None, help="start within this queue's limits (FLEET_QUEUES)")
@click.option("--key", default=None, help="the queue partition or debounce key")
@click.option("--priority", type=int, default=None, help="rank in a priority queue (lower first)")
@click.option("--debounce", default=None,
              help="collapse the starts of --key within this window into one run: 5s")
@with_options(principal_options)
@json_option
def start(flow_id: str, input_json: str | None, execution_id: str | None,
          idempotency_key: str | None, at: str | None, within: str | None,
          queue: str | None, key: str | None, priority: int | None, debounce: str | None,
          actor: str | None, tenant: str | None, as_json: bool) -> None:
    """Start an execution of FLOW_ID on the fleet; prints its id.

    The flow's module must be importable here (FLEET_FLOWS): the start records
    its version and hash. The id is printed once the start is durable; exit
    code 3 if the broker then did not take its drive (the start stands). With
    --at/--in it waits for its time, with --queue for its queue's slot, with
    --debounce for its window: the timer service or a worker drives it then.
    """
    data = json_arg(input_json, "--input")
    who = principal_from(actor, tenant)
    later = later_options(at, within, queue, key, priority, debounce)
    settings = FleetSettings()
    if not settings.flows:  # refused before the store is opened (or created)
        raise flows_hint(FlowNotFoundError(f"no flow {flow_id!r} is registered"), settings)
    with Dispatcher(settings) as dispatcher:
        try:
            order = dispatcher.write_start_sync(flow_id, data, principal=who,
                                                execution_id=execution_id,
                                                idempotency_key=idempotency_key, **later)
        except FlowNotFoundError as exc:
            raise flows_hint(exc, settings) from exc
        eid = order.execution_id
        if not as_json:
            echo(eid)  # as soon as it is durable, before the broker is asked
        try:
            enqueue_or_explain(dispatcher, order, f"execution {eid}")
        except NotEnqueuedError:
            if as_json:
                click.echo(json.dumps({"executionId": eid, "enqueued": False}))
            raise
    if as_json:
        click.echo(json.dumps({"executionId": eid, "enqueued": True,
                               "waits": not order.drive}))


@click.command()
@click.argument("execution_id")
@click.argument("gate")
@with_options(input_options("the answer, as JSON"))
@with_options(principal_options)
@json_option
def resume(execution_id: str, gate: str, input_json: str | None, payload: str | None,
           actor: str | None, tenant: str | None, as_json: bool) -> None:
    """Answer the GATE a parked execution waits on; a worker drives it on."""
    data = input_from(input_json, payload)
    who = principal_from(actor, tenant)
    with Dispatcher(existing_store()) as dispatcher:
        order = dispatcher.write_resume_sync(execution_id, gate, data, principal=who)
        enqueue_or_explain(dispatcher, order, f"the answer to {gate!r} of {execution_id}")
    click.echo(json.dumps({"executionId": execution_id, "resumed": gate}) if as_json
               else f"resumed {execution_id} at {gate}")


@click.command()
@click.argument("execution_id")
@click.argument("key")
@with_options(input_options("the message, as JSON"))
@with_options(principal_options)
@json_option
def send(execution_id: str, key: str, input_json: str | None, payload: str | None,
         actor: str | None, tenant: str | None, as_json: bool) -> None:
    """Deliver a message to the execution's ctx.receive(KEY)."""
    data = input_from(input_json, payload)
    who = principal_from(actor, tenant)
    with Dispatcher(existing_store()) as dispatcher:
        order = dispatcher.write_send_sync(execution_id, key, data, principal=who)
        woke = order is not None
        if order is not None:
            enqueue_or_explain(dispatcher, order, f"the message {key!r} to {execution_id}")
    if as_json:
        click.echo(json.dumps({"executionId": execution_id, "woke": woke}))
    else:
        echo(f"sent {key} to {execution_id}: "
             + ("it woke and is enqueued" if woke else "kept until it receives it"))


@click.command()
@click.argument("execution_id")
@click.option("--reason", default="", help="recorded with the cancellation")
@click.option("--force", is_flag=True,
              help="end it at once, with no cleanup (the flow never sees it)")
@with_options(principal_options)
@json_option
def cancel(execution_id: str, reason: str, force: bool, actor: str | None,
           tenant: str | None, as_json: bool) -> None:
    """Cancel an execution wherever it runs: the flow gets asyncio.CancelledError where it
    waits and may clean up (--force: ends it at once)."""
    who = principal_from(actor, tenant)
    dispatch(lambda d: d.cancel_sync(execution_id, principal=who, reason=reason,
                                     force=force))
    click.echo(json.dumps({"executionId": execution_id, "cancelled": True, "force": force})
               if as_json else f"cancel {'ended' if force else 'requested for'} {execution_id}")


__all__ = ["NOT_ENQUEUED", "NotEnqueuedError", "cancel", "dispatch", "enqueue_or_explain",
           "later_options", "parse_duration", "parse_time", "resume", "send", "start"]
