"""The fleet's long-running processes, as library calls (``fleet worker`` and friends).

* ``run_worker``: the Celery worker of ``make_app(settings)`` (``fleet worker``).
* ``serve(settings, component)``: the timer service, the recovery sweeper or the
  reward attacher, with a heartbeat, until SIGTERM (``fleet timers``,
  ``fleet recovery``, ``fleet attacher``). ``open_component`` builds the same
  services without running them (for a caller with its own loop).
* ``run_flower``: Flower on the fleet's app, never without authentication
  unless asked for (``fleet flower``).

Each reads nothing but the ``FleetSettings`` it is given.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet.config import FleetSettings
from fleet.health import COMPONENTS, Heartbeat
from fleet.kernel.errors import ConfigurationError
from fleet.kernel.store.spi import EventStore
from fleet.services import Service, run_services

log = logging.getLogger("fleet.processes")

SERVICE_COMPONENTS: tuple[str, ...] = ("timers", "recovery", "attacher")
POOLS: tuple[str, ...] = ("threads", "prefork", "solo")


# --------------------------------------------------------------------------
# The worker.
# --------------------------------------------------------------------------


def worker_argv(settings: FleetSettings, *, queues: Sequence[str] = (),
                concurrency: int | None = None, loglevel: str = "INFO",
                hostname: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The ``celery worker`` arguments ``run_worker`` passes (queues default to the
    settings' queue)."""
    argv = ["worker", "--queues", ",".join(queues or [settings.queue]),
            "--loglevel", loglevel]
    if concurrency is not None:
        argv += ["--concurrency", str(concurrency)]
    if hostname:
        argv += ["--hostname", hostname]
    return [*argv, *extra]


def worker_settings(settings: FleetSettings, *, pool: str | None = None,
                    concurrency: int | None = None) -> FleetSettings:
    """``settings`` with the pool and, for threads, the drive count a command line chose.

    The pool is a setting, not Celery's ``-P``: Celery's option cannot override a
    pool the app configures (``FleetSettings.worker_pool``).
    """
    changes: dict[str, Any] = {}
    if pool is not None:
        if pool not in POOLS:
            raise ConfigurationError(f"pool {pool!r}: one of {POOLS}")
        changes["worker_pool"] = pool
    if concurrency is not None:
        if concurrency < 1:
            raise ConfigurationError("concurrency must be at least 1")
        if (pool or settings.worker_pool) == "threads":
            changes["worker_drives"] = concurrency
    return settings.model_copy(update=changes) if changes else settings


def run_worker(settings: FleetSettings, *, queues: Sequence[str] = (),
               concurrency: int | None = None, pool: str | None = None,
               loglevel: str = "INFO", hostname: str | None = None,
               extra: Sequence[str] = ()) -> int:
    """Run a fleet worker in this process until it is shut down; its exit code.

    SIGTERM is a warm shutdown that hands running drives back
    (``fleet.workers.shutdown``). ``extra`` goes to ``celery worker`` as it is.
    """
    from fleet.workers.app import make_app

    chosen = worker_settings(settings, pool=pool, concurrency=concurrency)
    app = make_app(chosen)
    argv = worker_argv(chosen, queues=queues, concurrency=concurrency, loglevel=loglevel,
                       hostname=hostname, extra=extra)
    try:
        # app.worker_main() without dropping the worker's exit code.
        code = app.start(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return int(code or 0)


# --------------------------------------------------------------------------
# The services: timers, recovery, attacher.
# --------------------------------------------------------------------------


@dataclass
class Component:
    """The services of one fleet component and what they hold open."""

    name: str
    services: list[Service]
    store: EventStore
    closers: list[Any] = field(default_factory=list)

    async def aclose(self) -> None:
        """Close what ``open_component`` opened (after the services stopped)."""
        for close in reversed(self.closers):
            try:
                result = close()
                if isinstance(result, Awaitable):
                    await result
            except Exception as exc:  # noqa: BLE001 - closing regardless
                log.warning("closing %s: %s: %s", self.name, type(exc).__name__, exc)
        await self.store.close()


def _on_error(component: str) -> Any:
    def report(exc: BaseException) -> None:
        log.warning("%s: %s: %s", component, type(exc).__name__, exc)
    return report


async def open_component(settings: FleetSettings, component: str, *,
                         heartbeat: bool = True) -> Component:
    """Build the services of ``timers``, ``recovery`` or ``attacher`` from ``settings``.

    The store is opened (and read once, so a wrong URL fails here); the timer
    service and the sweeper enqueue drives through a ``Dispatcher`` on the
    fleet's app (routed as every drive is); the attacher reads the rewards
    stream with the producers' keys and records outcomes under a runtime whose
    policy lets a producer ``annotate`` (decision 0011). With ``heartbeat``, a
    ``Heartbeat`` for ``fleet health`` is the last service.
    """
    if component not in SERVICE_COMPONENTS:
        raise ConfigurationError(f"unknown service component {component!r}; one of "
                                 f"{SERVICE_COMPONENTS}")
    from fleet.workers.process import build_runtime, open_store

    store = open_store(settings)
    try:
        await store.head("fleet:health-probe")
        built = Component(component, [], store)
        if component == "attacher":
            from fleet.kernel.security import AccessPolicy
            from fleet.streams import RewardAttacher

            runtime = build_runtime(settings, store, role=component,
                                    access_policy=AccessPolicy(rules={"annotate": "any"}))
            built.services.append(RewardAttacher.from_settings(settings, runtime,
                                                               on_warn=log.warning))
        else:
            from fleet.dispatcher import Dispatcher
            from fleet.recovery import RecoverySweeper
            from fleet.timers import TimerService
            from fleet.workers.app import make_app

            runtime = build_runtime(settings, store, role=component)
            app = make_app(settings, main=f"fleet-{component}")
            dispatcher = Dispatcher(runtime=runtime, app=app)
            built.closers += [app.close, dispatcher.aclose]
            if component == "timers":
                built.services.append(TimerService(
                    runtime, enqueue=dispatcher.enqueue_drive,
                    interval_s=settings.timer_interval_s, on_error=_on_error(component)))
            else:
                built.services.append(RecoverySweeper(
                    runtime, enqueue=dispatcher.enqueue_drive,
                    interval_s=settings.recovery_interval_s,
                    grace_ms=settings.recovery_grace_ms, on_error=_on_error(component)))
        if heartbeat:
            built.services.append(Heartbeat.for_component(settings, component))
    except BaseException:
        await store.close()
        raise
    return built


async def serve(settings: FleetSettings, component: str, *,
                until: Awaitable[Any] | None = None) -> dict[str, Any]:
    """Run ``component``'s services until SIGTERM/SIGINT (or ``until``); their stats.

    Stops cleanly: services in reverse order (in-flight ticks finish, the
    attacher acknowledges what it handled), then the heartbeat file is
    removed and the store and broker connections close.
    """
    built = await open_component(settings, component)
    log.info("fleet %s (pid %d) running: %s", component, os.getpid(),
             ", ".join(s.name for s in built.services))
    try:
        await run_services(built.services, until=until)
    finally:
        await built.aclose()
    stats = {s.name: s.stats() for s in built.services}
    log.info("fleet %s stopped: %s", component, stats)
    return stats


# --------------------------------------------------------------------------
# Flower.
# --------------------------------------------------------------------------


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def flower_argv(*, port: int | None = None, address: str | None = None,
                basic_auth: str | None = None, unauthenticated: bool = False,
                environ: dict[str, str] | None = None,
                extra: Sequence[str] = ()) -> list[str]:
    """The ``celery flower`` arguments ``run_flower`` passes, once authentication is settled.

    Basic auth comes from ``basic_auth`` or ``FLOWER_BASIC_AUTH``
    (``user:password[,user:password]``); OAuth from ``FLOWER_AUTH``. With
    neither, Flower's pages and its API (which can shut workers down) would be
    open to anyone who reaches the port: refused unless ``unauthenticated`` or
    ``FLOWER_UNAUTHENTICATED_API=true`` says that is intended.

    Raises:
        ConfigurationError: no authentication, and none was waived.
    """
    env = os.environ if environ is None else environ
    has_auth = bool(basic_auth or env.get("FLOWER_BASIC_AUTH") or env.get("FLOWER_AUTH"))
    waived = unauthenticated or _truthy(env.get("FLOWER_UNAUTHENTICATED_API"))
    if not has_auth and not waived:
        raise ConfigurationError(
            "fleet flower refuses to serve without authentication: set FLOWER_BASIC_AUTH="
            "user:password (or --basic-auth), or FLOWER_AUTH for OAuth; to serve it open "
            "(a trusted network only), pass --unauthenticated or set "
            "FLOWER_UNAUTHENTICATED_API=true")
    argv = ["flower"]
    if port is not None:
        argv.append(f"--port={port}")
    if address is not None:
        argv.append(f"--address={address}")
    if basic_auth:
        argv.append(f"--basic-auth={basic_auth}")
    return [*argv, *extra]


def run_flower(settings: FleetSettings, *, port: int | None = None,
               address: str | None = None, basic_auth: str | None = None,
               unauthenticated: bool = False, extra: Sequence[str] = ()) -> int:
    """Serve Flower on the fleet's app (workers' ``stats["fleet"]``) until SIGTERM."""
    from fleet.workers.app import make_app

    argv = flower_argv(port=port, address=address, basic_auth=basic_auth,
                       unauthenticated=unauthenticated, extra=extra)
    if unauthenticated:
        # Flower reads this itself: its API answers without credentials.
        os.environ["FLOWER_UNAUTHENTICATED_API"] = "true"
    app = make_app(settings, main="fleet-flower", consumes_tasks=False)
    try:
        code = app.start(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return int(code or 0)


__all__ = ["COMPONENTS", "POOLS", "SERVICE_COMPONENTS", "Component", "flower_argv",
           "open_component", "run_flower", "run_worker", "serve", "worker_argv",
           "worker_settings"]
