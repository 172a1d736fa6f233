"""The fleet's commands: its processes, its dispatcher, rewards, status and health.

Registered on the ``fleet`` group by ``fleet.cli``. Each parses its arguments
and calls the library (``fleet.processes``, ``fleet.dispatcher``,
``fleet.streams``, ``fleet.status``, ``fleet.health``); results print as
tables, or as JSON with ``--json``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console, Group
from rich.table import Table

from fleet.config import FleetSettings
from fleet.kernel.errors import ConfigurationError, FleetError

F = TypeVar("F", bound=Callable[..., Any])
console = Console()


_CLIENT_MODULES = ("redis", "kombu", "amqp")


def _fleet_errors(fn: F) -> F:
    """A FleetError, or a broker client that cannot connect, is a one-line message and
    exit code 1, not a traceback."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FleetError as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
        except Exception as exc:
            if isinstance(exc, OSError) or type(exc).__module__.startswith(_CLIENT_MODULES):
                raise click.ClickException(
                    f"the broker did not answer: {type(exc).__name__}: {exc}") from exc
            raise
    return wrapper  # type: ignore[return-value]


def _json_arg(value: str | None, option: str) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"{option} is not JSON: {exc}") from exc


def _principal(actor: str | None, tenant: str | None) -> Any:
    if actor is None:
        if tenant is not None:
            raise click.BadParameter("--tenant needs --actor (a principal is an actor "
                                     "with an optional tenant)")
        return None
    from fleet.kernel.security import Principal

    return Principal(actor, tenant)


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="[%(asctime)s: %(levelname)s/%(name)s] %(message)s")


def _exit_code(code: int) -> None:
    if code:
        sys.exit(code)


_loglevel = click.option("--loglevel", "-l", default="INFO", show_default=True,
                         type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"],
                                           case_sensitive=False))
_principal_options = [
    click.option("--actor", default=None, help="who asks (the principal's actor)"),
    click.option("--tenant", default=None, help="the principal's tenant (with --actor)"),
]
_json_option = click.option("--json", "as_json", is_flag=True, help="print JSON")


def _with(options: list[Callable[[F], F]]) -> Callable[[F], F]:
    def apply(fn: F) -> F:
        for option in reversed(options):
            fn = option(fn)
        return fn
    return apply


# --------------------------------------------------------------------------
# Processes.
# --------------------------------------------------------------------------


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--queues", "-Q", default=None,
              help="comma-separated queues to take drives from (default: FLEET_QUEUE)")
@click.option("--concurrency", "-c", type=click.IntRange(min=1), default=None,
              help="drives at once (threads pool: FLEET_WORKER_DRIVES) or prefork children")
@click.option("--pool", type=click.Choice(["threads", "prefork", "solo"]), default=None,
              help="the Celery pool (default: FLEET_WORKER_POOL, threads)")
@click.option("--hostname", "-n", default=None, help="the worker's node name")
@_loglevel
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
@_fleet_errors
def worker(queues: str | None, concurrency: int | None, pool: str | None,
           hostname: str | None, loglevel: str, celery_args: tuple[str, ...]) -> None:
    """Run a worker: drives executions from the queues until SIGTERM.

    SIGTERM stops taking drives and hands the running ones back at their next
    durable point (at the latest after FLEET_WORKER_DRAIN_S), releasing their
    leases so another worker continues them at once. Further arguments go to
    `celery worker` as they are.
    """
    from fleet.processes import run_worker

    names = [q.strip() for q in (queues or "").split(",") if q.strip()]
    _exit_code(run_worker(FleetSettings(), queues=names, concurrency=concurrency, pool=pool,
                          loglevel=loglevel.upper(), hostname=hostname, extra=celery_args))


def _service_command(component: str, summary: str) -> click.Command:
    @click.command(component, help=summary)
    @_loglevel
    @_fleet_errors
    def command(loglevel: str) -> None:
        from fleet.processes import serve

        _logging(loglevel)
        asyncio.run(serve(FleetSettings(), component))

    return command


timers = _service_command(
    "timers", "Run the timer service: fires due timers and enqueues their drives, until "
    "SIGTERM. Replicas are safe (each firing is a conditional claim).")
recovery = _service_command(
    "recovery", "Run the recovery sweeper: re-drives running executions nobody holds (a "
    "dead worker, a lost dispatch) after FLEET_RECOVERY_GRACE_MS, until SIGTERM.")
attacher = _service_command(
    "attacher", "Run the reward attacher: verifies signed rewards on the rewards stream and "
    "attaches them as late outcomes (bad ones are dead-lettered), until SIGTERM.")


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--port", type=int, default=None, help="(default: FLOWER_PORT or 5555)")
@click.option("--address", default=None, help="address to listen on (default: all)")
@click.option("--basic-auth", default=None,
              help="user:password[,user:password] (default: FLOWER_BASIC_AUTH)")
@click.option("--unauthenticated", is_flag=True,
              help="serve without authentication (as FLOWER_UNAUTHENTICATED_API=true)")
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
@_fleet_errors
def flower(port: int | None, address: str | None, basic_auth: str | None,
           unauthenticated: bool, flower_args: tuple[str, ...]) -> None:
    """Run Flower on the fleet's workers (their stats["fleet"] counters).

    Refuses to serve without authentication (FLOWER_BASIC_AUTH, --basic-auth or
    FLOWER_AUTH) unless --unauthenticated or FLOWER_UNAUTHENTICATED_API=true.
    """
    from fleet.processes import run_flower

    _exit_code(run_flower(FleetSettings(), port=port, address=address,
                          basic_auth=basic_auth, unauthenticated=unauthenticated,
                          extra=flower_args))


# --------------------------------------------------------------------------
# The dispatcher: write first, then enqueue.
# --------------------------------------------------------------------------


def _dispatch(call: Callable[[Any], Any]) -> Any:
    from fleet.dispatcher import Dispatcher

    with Dispatcher(FleetSettings()) as dispatcher:
        return call(dispatcher)


@click.command()
@click.argument("flow_id")
@click.option("--input", "input_json", default=None, help="the flow input, as JSON")
@click.option("--execution-id", default=None, help="idempotent: the same id starts once")
@click.option("--idempotency-key", default=None,
              help="idempotent: names an execution id (per tenant and flow)")
@_with(_principal_options)
@_json_option
@_fleet_errors
def start(flow_id: str, input_json: str | None, execution_id: str | None,
          idempotency_key: str | None, actor: str | None, tenant: str | None,
          as_json: bool) -> None:
    """Start an execution of FLOW_ID on the fleet; prints its id.

    The flow's module must be importable here (FLEET_FLOWS): the start records
    its version and hash.
    """
    data = _json_arg(input_json, "--input")
    principal = _principal(actor, tenant)
    eid = _dispatch(lambda d: d.start_sync(flow_id, data, principal=principal,
                                           execution_id=execution_id,
                                           idempotency_key=idempotency_key))
    click.echo(json.dumps({"executionId": eid}) if as_json else eid)


@click.command()
@click.argument("execution_id")
@click.argument("gate")
@click.option("--payload", default=None, help="the answer, as JSON")
@_with(_principal_options)
@_json_option
@_fleet_errors
def resume(execution_id: str, gate: str, payload: str | None, actor: str | None,
           tenant: str | None, as_json: bool) -> None:
    """Answer the GATE a parked execution waits on; a worker drives it on."""
    data = _json_arg(payload, "--payload")
    principal = _principal(actor, tenant)
    _dispatch(lambda d: d.resume_sync(execution_id, gate, data, principal=principal))
    click.echo(json.dumps({"executionId": execution_id, "resumed": gate}) if as_json
               else f"resumed {execution_id} at {gate}")


@click.command()
@click.argument("execution_id")
@click.argument("key")
@click.option("--payload", default=None, help="the message, as JSON")
@_with(_principal_options)
@_json_option
@_fleet_errors
def send(execution_id: str, key: str, payload: str | None, actor: str | None,
         tenant: str | None, as_json: bool) -> None:
    """Deliver a message to the execution's ctx.receive(KEY)."""
    data = _json_arg(payload, "--payload")
    principal = _principal(actor, tenant)
    woke = _dispatch(lambda d: d.send_sync(execution_id, key, data, principal=principal))
    if as_json:
        click.echo(json.dumps({"executionId": execution_id, "woke": woke}))
    else:
        click.echo(f"sent {key} to {execution_id}: "
                   + ("it woke and is enqueued" if woke else "kept until it receives it"))


@click.command()
@click.argument("execution_id")
@click.option("--reason", default="", help="recorded with the cancellation")
@_with(_principal_options)
@_json_option
@_fleet_errors
def cancel(execution_id: str, reason: str, actor: str | None, tenant: str | None,
           as_json: bool) -> None:
    """Cancel an execution wherever it runs (its holder is fenced out)."""
    principal = _principal(actor, tenant)
    _dispatch(lambda d: d.cancel_sync(execution_id, principal=principal, reason=reason))
    click.echo(json.dumps({"executionId": execution_id, "cancelled": True}) if as_json
               else f"cancelled {execution_id}")


# --------------------------------------------------------------------------
# Rewards.
# --------------------------------------------------------------------------


@click.group()
def reward() -> None:
    """Rewards for logged decisions, through the signed rewards stream."""


@reward.command("submit")
@click.option("--execution", "execution_id", required=True)
@click.option("--decision", "decision_id", required=True)
@click.option("--key", required=True, help="a namespaced reward key, e.g. csat:1")
@click.option("--score", type=float, default=None)
@click.option("--success/--failure", "success", default=None)
@click.option("--producer", required=True, help="names the producer's key")
@click.option("--key-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="the producer's secret (default: FLEET_REWARD_KEYS)")
@click.option("--nonce", default=None)
@_json_option
@_fleet_errors
def reward_submit(execution_id: str, decision_id: str, key: str, score: float | None,
                  success: bool | None, producer: str, key_file: Path | None,
                  nonce: str | None, as_json: bool) -> None:
    """Sign a reward with the producer's key and add it to the rewards stream."""
    from fleet.streams.rewards import submit_reward_from_settings

    secret = key_file.read_text().strip() if key_file is not None else None
    if key_file is not None and not secret:
        raise ConfigurationError(f"{key_file} is empty")
    entry = submit_reward_from_settings(
        FleetSettings(), execution_id=execution_id, decision_id=decision_id, key=key,
        producer=producer, score=score, success=success, secret=secret, nonce=nonce)
    click.echo(json.dumps({"entry": entry}) if as_json else f"submitted as {entry}")


# --------------------------------------------------------------------------
# Status and health.
# --------------------------------------------------------------------------


_SHORT = {"completed": "done", "stepped_aside": "aside", "fenced_out": "fenced",
          "recovered": "recov", "handed_back": "handed"}


def _status_view(status: Any) -> Group:
    from fleet.status import WORKER_FIELDS

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
@_json_option
@_fleet_errors
def status(watch: bool, interval: float, inspect_timeout: float, as_json: bool) -> None:
    """Executions by state (the store's index) and workers (Celery inspect stats)."""
    from fleet.status import StatusReader

    with StatusReader(FleetSettings(), inspect_timeout=inspect_timeout) as reader:
        if not watch:
            snapshot = reader.read()
            if as_json:
                click.echo(json.dumps(snapshot.to_dict()))
            else:
                console.print(_status_view(snapshot))
            if snapshot.problems and not snapshot.executions and not snapshot.workers:
                sys.exit(1)
            return
        try:
            if as_json:
                while True:
                    click.echo(json.dumps(reader.read().to_dict()))
                    time.sleep(interval)
            from rich.live import Live

            with Live(_status_view(reader.read()), console=console,
                      refresh_per_second=4) as live:
                while True:
                    time.sleep(interval)
                    live.update(_status_view(reader.read()))
        except KeyboardInterrupt:
            return


@click.command()
@click.option("--component", required=True,
              type=click.Choice(["worker", "timers", "recovery", "attacher"]))
@click.option("--liveness", is_flag=True,
              help="only the process's event loop (its heartbeat), not the broker or store")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="seconds for each of the broker and store checks")
@click.option("--max-age", type=click.FloatRange(min=0.1), default=None,
              help="oldest heartbeat that passes (default: FLEET_HEARTBEAT_MAX_AGE_S)")
@_json_option
@_fleet_errors
def health(component: str, liveness: bool, timeout: float, max_age: float | None,
           as_json: bool) -> None:
    """Exit 0 when this machine's COMPONENT is healthy, else 1 with the reason.

    Readiness (the default): the event loop's heartbeat, a broker ping and a
    store read. --liveness: the heartbeat only.
    """
    from fleet.health import check_health

    report = check_health(FleetSettings(), component, liveness=liveness, timeout_s=timeout,
                          max_age_s=max_age)
    if as_json:
        click.echo(json.dumps(report.to_dict()))
    elif report.ok:
        click.echo(f"ok: {component}: {report.reason}")
    else:
        click.echo(f"unhealthy: {component}: {report.reason}", err=True)
    if not report.ok:
        sys.exit(1)


COMMANDS: tuple[click.Command, ...] = (worker, timers, recovery, attacher, flower, start,
                                       resume, send, cancel, reward, status, health)


def register(group: click.Group) -> None:
    """Add the fleet's commands to the ``fleet`` group."""
    for command in COMMANDS:
        group.add_command(command)


__all__ = ["COMMANDS", "register"]
