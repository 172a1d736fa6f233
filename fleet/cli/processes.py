"""The fleet's processes: ``fleet worker``, ``timers``, ``recovery``, ``attacher``, ``relay``,
``flower``.

Each parses its options and runs what ``fleet.assembly.roles`` builds for its role
(the worker: ``fleet.workers.run``), the same parts ``fleet up`` runs.
"""

from __future__ import annotations

import click

from fleet.assembly import roles
from fleet.cli.common import exit_with, loglevel_option, setup_logging
from fleet.config import FleetSettings
from fleet.host.loop import run_loop
from fleet.workers.run import run_worker


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--queues", "-Q", default=None,
              help="comma-separated queues to take drives from (default: FLEET_QUEUE)")
@click.option("--concurrency", "-c", type=click.IntRange(min=1), default=None,
              help="drives at once (threads pool: FLEET_WORKER_DRIVES) or prefork children")
@click.option("--pool", type=click.Choice(["threads", "prefork", "solo"]), default=None,
              help="the Celery pool (default: FLEET_WORKER_POOL, threads)")
@click.option("--hostname", "-n", default=None, help="the worker's node name")
@loglevel_option
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
def worker(queues: str | None, concurrency: int | None, pool: str | None,
           hostname: str | None, loglevel: str, celery_args: tuple[str, ...]) -> None:
    """Run a worker: drives executions from the queues until SIGTERM.

    SIGTERM stops taking drives and hands the running ones back at their next
    durable point (at the latest after FLEET_WORKER_DRAIN_S), releasing their
    leases so another worker continues them at once. Further arguments go to
    `celery worker` as they are.
    """
    names = [q.strip() for q in (queues or "").split(",") if q.strip()]
    exit_with(run_worker(FleetSettings(), queues=names, concurrency=concurrency, pool=pool,
                          loglevel=loglevel.upper(), hostname=hostname, extra=celery_args))


def _service_command(component: str, summary: str) -> click.Command:
    @click.command(component, help=summary)
    @loglevel_option
    def command(loglevel: str) -> None:
        setup_logging(loglevel)
        settings = FleetSettings()
        run_loop(roles.serve(settings, component), event_loop=settings.event_loop)

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
relay = _service_command(
    "relay", "Run the relay: publishes every event the store commits, whoever wrote it, to "
    "the events stream (FLEET_EVENTS_STREAM) exactly once and in commit order, until "
    "SIGTERM. Replicas are safe: a lease on the store makes one of them the publisher.")


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--port", type=int, default=None, help="(default: FLOWER_PORT or 5555)")
@click.option("--address", default=None, help="address to listen on (default: all)")
@click.option("--basic-auth", default=None,
              help="user:password[,user:password] (default: FLOWER_BASIC_AUTH)")
@click.option("--unauthenticated", is_flag=True,
              help="serve without authentication (as FLOWER_UNAUTHENTICATED_API=true)")
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
def flower(port: int | None, address: str | None, basic_auth: str | None,
           unauthenticated: bool, flower_args: tuple[str, ...]) -> None:
    """Run Flower with the Fleet page (/fleet, "Fleet" in its navigation).

    The page: every process's counters from Redis, the streams, the diverged
    executions and their Retry (FLEET_OPERATOR, FLEET_OPERATORS); /metrics has
    the fleet's metrics.

    Refuses to serve without authentication (FLOWER_BASIC_AUTH, --basic-auth or
    FLOWER_AUTH) unless --unauthenticated or FLOWER_UNAUTHENTICATED_API=true.
    """
    from fleet.flowerui import install  # only this command loads Flower's parts

    exit_with(roles.run_flower(FleetSettings(), port=port, address=address,
                               basic_auth=basic_auth, unauthenticated=unauthenticated,
                               extra=flower_args, prepare=install))


__all__ = ["attacher", "flower", "recovery", "relay", "timers", "worker"]
