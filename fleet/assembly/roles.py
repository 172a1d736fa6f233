"""The one assembly: what each fleet role runs, built from the settings in one place.

=========  ======================================  ==================================
role       its Runtime (``fleet.host.kernel``)     its services, in start order
=========  ======================================  ==================================
worker     the fleet's flows; every durable event  heartbeat
           also to the ``WorkerProcess``           (``WorkerProcess`` runs them on its
                                                   loop; its Celery app is
                                                   ``fleet.workers.make_app``)
timers     the fleet's flows                       ``TimerService`` (drives enqueued
                                                   through a ``Dispatcher``), heartbeat
recovery   the fleet's flows                       ``RecoverySweeper`` (the same),
                                                   heartbeat
attacher   ``annotate: tenant``, producers scoped  ``RewardAttacher``, heartbeat
           (``FLEET_REWARD_TENANTS``; unlisted:
           no tenant) (decisions 0011, 0025)
relay      (none: it only reads the store)         ``EventRelay`` (the store's committed
                                                   feed -> the events stream, one
                                                   replica at a time), heartbeat
flower     (none)                                  Flower on the dispatcher's app
=========  ======================================  ==================================

Events reach the events stream through the relay alone, whoever wrote them
(decision 0021); ADR 0147's ``on_durable_event`` stays the in-process hook.

Both ways of running a fleet use these functions: the process entry points
(``fleet worker`` through the Celery app, ``fleet timers|recovery|attacher|relay``
through ``serve``, ``fleet flower`` through ``run_flower``) and the embedded
fleet (``fleet up``, ``fleet demo``: ``fleet.embedded``), so what the demo runs
is what Kubernetes runs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

from fleet.config import FleetSettings
from fleet.dispatcher.broker import producer_app
from fleet.dispatcher.dispatcher import Dispatcher, DriveOrder
from fleet.host.celery_api import run_command
from fleet.host.control import ControlAuth
from fleet.host.kernel import build_runtime, holder_name, open_store
from fleet.host.tracing import tracing
from fleet.kernel.errors import ConfigurationError
from fleet.kernel.journal import EventObserver
from fleet.kernel.runtime import Runtime
from fleet.kernel.security import AccessPolicy
from fleet.kernel.store.factory import StoreOptions, open_event_store
from fleet.kernel.store.spi import (
    COMMIT_SIGNAL,
    CommitSignal,
    EventStore,
    SignalsCommits,
    capabilities_of,
)
from fleet.kernel.timers import FiredTimer
from fleet.recovery.sweeper import RecoverySweeper
from fleet.services.base import PeriodicService, Service, run_services
from fleet.services.counters import (
    StatsReporter,
    numbers,
    process_name,
)
from fleet.services.health import Heartbeat
from fleet.services.probes import serve_probes
from fleet.streams.attacher import RewardAttacher
from fleet.streams.redis_client import aioredis
from fleet.streams.relay import EventRelay, RelayLease
from fleet.timers.service import TimerService

log = logging.getLogger("fleet.assembly")

#: The roles a fleet process can have.
ROLES: tuple[str, ...] = ("worker", "timers", "recovery", "attacher", "relay", "flower")
#: The roles ``serve`` runs (the worker runs inside Celery, Flower is Flower).
SERVICE_ROLES: tuple[str, ...] = ("timers", "recovery", "attacher", "relay")


@dataclass
class Role:
    """What one role of a fleet process runs, and what it holds open.

    Attributes:
        name: The role.
        store: Its event store (opened, and read once: a wrong URL failed already).
        runtime: Its Runtime on ``store`` (None for the relay, which only reads).
        services: Its services in the order they start (stop in reverse).
        service: The role's own service among them (the timer service, the
            sweeper, the attacher, the relay); None for the worker.
        dispatcher: What the timer service and the sweeper enqueue drives through.
        closers: Called (and awaited) by ``aclose`` after the services stopped.
    """

    name: str
    store: EventStore
    runtime: Runtime | None
    services: list[Service] = field(default_factory=list)
    service: Service | None = None
    dispatcher: Dispatcher | None = None
    closers: list[Callable[[], Any]] = field(default_factory=list)

    def require_runtime(self) -> Runtime:
        if self.runtime is None:
            raise ConfigurationError(f"the {self.name} role has no Runtime")
        return self.runtime

    def stats(self) -> dict[str, Any]:
        """Every service's ``stats()`` by name."""
        return {service.name: service.stats() for service in self.services}

    async def aclose(self) -> None:
        """Close what the opener opened (after the services stopped); the store last."""
        for close in reversed(self.closers):
            try:
                result = close()
                if isinstance(result, Awaitable):
                    await result
            except Exception as exc:  # noqa: BLE001 - closing regardless
                log.warning("closing %s: %s: %s", self.name, type(exc).__name__, exc)
        await self.store.close()


def _report(role: str) -> Callable[[BaseException], None]:
    def report(exc: BaseException) -> None:
        log.warning("%s: %s: %s", role, type(exc).__name__, exc)
    return report


async def _open(settings: FleetSettings, name: str, *,
                on_durable_event: EventObserver | None = None,
                access_policy: AccessPolicy | None = None) -> Role:
    """The store (opened and probed) and the runtime every writing role has."""
    store = open_store(settings)
    try:
        # Connect now (and apply the schema): a wrong URL fails the process at
        # start, not at its first piece of work.
        await store.head("fleet:health-probe")
        runtime = build_runtime(
            settings, store, role=name, on_durable_event=on_durable_event,
            access_policy=access_policy)
    except BaseException:
        await store.close()
        raise
    return Role(name, store, runtime)


def _heartbeat(settings: FleetSettings, role: Role, *,
               collect: Callable[[], dict[str, Any]] | None = None,
               process: str | None = None, **options: Any) -> None:
    """The role's heartbeat file (``fleet health``) and its report to Redis (decision 0022)."""
    service = role.service
    if isinstance(service, PeriodicService):
        options.setdefault("stuck", service.stuck)  # a wedged tick fails liveness
    reporter = StatsReporter.for_settings(settings, role.name, process or process_name(),
                                          collect or functools.partial(role_counters, role))
    if reporter is not None:
        role.services.append(reporter)
    role.services.append(Heartbeat.for_component(settings, role.name, **options))


#: A service's counters under the names the workers use (``fleet.workers.stats``).
_RENAMES: dict[str, dict[str, str]] = {
    "attacher": {"attached": "outcomes_attached", "dead_lettered": "outcomes_dead_lettered"}}


def role_counters(role: Role) -> dict[str, float]:
    """What a service role reports: its service's numeric stats (renamed where a
    worker counter means the same), plus the kernel's ``timers_fired`` for the timers."""
    service = role.service
    values = numbers(service.stats(), _RENAMES.get(role.name)) if service is not None else {}
    if role.name == "attacher":
        values.setdefault("outcomes_dead_lettered", 0)  # {} until the first dead letter
    if role.name == "timers" and role.runtime is not None:
        values["timers_fired"] = role.runtime.timers_fired
    return values


def _bounds(settings: FleetSettings) -> dict[str, Any]:
    """How long a service's tick may run, and how long it may finish after SIGTERM."""
    return {"tick_deadline_s": settings.service_tick_deadline_s,
            "stop_timeout_s": settings.service_stop_s}


async def open_worker(settings: FleetSettings, *, slot: int | None = None,
                      on_durable_event: EventObserver | None = None,
                      on_beat: Callable[[], Any] | None = None,
                      collect: Callable[[], dict[str, Any]] | None = None,
                      name: str | None = None) -> Role:
    """A worker process's parts: its store, its Runtime, its heartbeat, its report.

    Args:
        settings: The worker's settings.
        slot: A prefork child's pool index (its own heartbeat file).
        on_durable_event: The ``WorkerProcess``'s observer.
        on_beat: Called on the loop after each heartbeat (the drain poll).
        collect: The process's counters (``WorkerProcess.snapshot``), reported to
            ``fleet:stats:worker:<name>``.
        name: The worker's Celery node name (a prefork child adds ``#<slot>``).
    """
    role = await _open(settings, "worker", on_durable_event=on_durable_event)
    process = name or process_name()
    if slot is not None:
        process = f"{process}#{slot}"
    _heartbeat(settings, role, slot=slot, on_beat=on_beat, process=process,
               collect=collect or (lambda: {}))
    return role


async def _open_enqueuing(settings: FleetSettings, name: str,
                          make: Callable[[Runtime, Dispatcher], Service],
                          heartbeat: bool) -> Role:
    role = await _open(settings, name)
    try:
        app = producer_app(settings, main=f"fleet-{name}")
        dispatcher = Dispatcher(settings, runtime=role.require_runtime(), app=app)
        role.dispatcher = dispatcher
        role.closers += [app.close, dispatcher.aclose]
        role.service = make(role.require_runtime(), dispatcher)
        role.services.append(role.service)
        if heartbeat:
            _heartbeat(settings, role)
    except BaseException:
        await role.aclose()
        raise
    return role


def publish_fired(dispatcher: Dispatcher) -> Callable[[Sequence[FiredTimer]], Awaitable[None]]:
    """The timer service's ``publish``: the drives of a batch of fired timers in one
    broker round trip, each routed by the flow and tenant its claim read (no index read)."""
    async def publish(fired: Sequence[FiredTimer]) -> None:
        await dispatcher.publish([DriveOrder(timer.execution_id, timer.flow_id, timer.tenant)
                                  for timer in fired], op="timer")
    return publish


async def open_timers(settings: FleetSettings, *, heartbeat: bool = True) -> Role:
    """The timer service: fires due timers in batches, publishes their drives (routed as
    every drive) in one round trip per batch (decision 0048)."""
    return await _open_enqueuing(settings, "timers", lambda runtime, dispatcher: TimerService(
        runtime, publish=publish_fired(dispatcher), interval_s=settings.timer_interval_s,
        batch=settings.timer_batch, on_error=_report("timers"), **_bounds(settings)),
        heartbeat)


async def open_recovery(settings: FleetSettings, *, heartbeat: bool = True) -> Role:
    """The recovery sweeper: re-drives running executions nobody holds."""
    return await _open_enqueuing(settings, "recovery", lambda runtime, dispatcher: RecoverySweeper(
        runtime, enqueue=functools.partial(dispatcher.enqueue_drive, redrive=True),
        recent=dispatcher.recent_drives, interval_s=settings.recovery_interval_s,
        grace_ms=settings.recovery_grace_ms, on_error=_report("recovery"),
        **_bounds(settings)), heartbeat)


async def open_attacher(settings: FleetSettings, *, heartbeat: bool = True) -> Role:
    """The reward attacher: signed rewards from the stream -> late outcomes.

    A producer is never an execution's owner: only the attacher's runtime lets
    one ``annotate`` (decision 0011); nobody else's does. Its rule is ``tenant``
    and each producer acts within the scope ``FLEET_REWARD_TENANTS`` gives it
    (decision 0025); unlisted, within no tenant (issue 25 item 13: scoping is the
    default, ``["*"]`` opts a producer out).
    """
    # Producers are always scoped (issue 25 item 13: opt out, not in): the kernel's tenant
    # rule judges each producer's scope (FLEET_REWARD_TENANTS); one it does not list acts
    # with no tenant, so it rewards only executions that have none.
    if not settings.reward_tenants:
        log.warning("no reward producer is listed in FLEET_REWARD_TENANTS: every producer "
                    "may reward only executions with no tenant; list each producer's "
                    'tenants (["*"]: every tenant) (decision 0025)')
    role = await _open(settings, "attacher", access_policy=AccessPolicy(
        rules={"annotate": "tenant"}))
    try:
        role.service = RewardAttacher.from_settings(settings, role.require_runtime(),
                                                    on_warn=log.warning)
        role.services.append(role.service)
        if heartbeat:
            _heartbeat(settings, role)
    except BaseException:
        await role.aclose()
        raise
    return role


async def open_relay(settings: FleetSettings, *, heartbeat: bool = True) -> Role:
    """The relay: the store's committed feed onto the events stream, exactly once.

    Its store is opened without group commit (it only reads). On Postgres with
    ``relay_notify`` a LISTEN/NOTIFY signal wakes it on commits; it polls every
    ``relay_poll_s`` regardless. A lease on the store (``relay_lease_ms``)
    makes one replica the publisher.
    """
    if not settings.redis_url:
        raise ConfigurationError("the relay needs FLEET_REDIS_URL (the events stream's Redis)")
    options = settings.store_options()
    store = open_event_store(settings.database_url, StoreOptions(
        pool_min=options.pool_min, pool_max=options.pool_max,
        max_event_bytes=options.max_event_bytes, group_commit=False,  # it only reads
        max_lease_ms=options.max_lease_ms))
    try:
        await store.head("fleet:health-probe")  # a wrong URL fails here, at start
    except BaseException:
        await store.close()
        raise
    signal: CommitSignal | None = None
    if settings.relay_notify and COMMIT_SIGNAL in capabilities_of(store) \
            and isinstance(store, SignalsCommits):
        signal = store.commit_signal()
    client = aioredis.Redis.from_url(settings.redis_url, socket_connect_timeout=2.0,
                                     socket_timeout=10.0)
    relay = EventRelay(store, client, stream=settings.events_stream,
                       maxlen=settings.events_maxlen, batch_size=settings.relay_batch_size,
                       batch_bytes=settings.relay_batch_bytes, poll_s=settings.relay_poll_s,
                       linger_s=settings.relay_linger_ms / 1000,
                       signal=signal,
                       lease=RelayLease(store, settings.events_stream,
                                        lease_ms=settings.relay_lease_ms,
                                        holder=holder_name("relay"),
                                        on_warn=log.warning),
                       on_warn=log.warning, close_client=True)
    role = Role("relay", store, None, services=[relay], service=relay)
    if heartbeat:
        _heartbeat(settings, role)
    return role


#: The opener of each role ``serve`` runs.
OPENERS: dict[str, Callable[..., Awaitable[Role]]] = {
    "timers": open_timers, "recovery": open_recovery, "attacher": open_attacher,
    "relay": open_relay}


async def open_role(settings: FleetSettings, name: str, *, heartbeat: bool = True) -> Role:
    """Build (without starting) the services of a role ``serve`` runs (``SERVICE_ROLES``).

    The store is opened and read once, so a wrong URL fails here. With
    ``heartbeat``, a ``Heartbeat`` for ``fleet health`` is the last service.
    """
    opener = OPENERS.get(name)
    if opener is None:
        raise ConfigurationError(f"unknown service role {name!r}; one of {SERVICE_ROLES}")
    return await opener(settings, heartbeat=heartbeat)


async def serve(settings: FleetSettings, name: str, *,
                until: Awaitable[Any] | None = None) -> dict[str, Any]:
    """Run role ``name`` until SIGTERM/SIGINT (or ``until``); its services' stats.

    Stops cleanly: services in reverse order (in-flight ticks finish, the
    attacher acknowledges what it handled, the relay finishes its batch and
    releases its lease), then the heartbeat file is removed and the store and
    broker connections close. A relay that stopped for good (another writer
    uses its stream) ends the process with its error.
    """
    role = await open_role(settings, name)
    tracing(name)  # this process's traces are named for its role (off unless configured)
    log.info("fleet %s (pid %d) running: %s", name, os.getpid(),
             ", ".join(s.name for s in role.services))
    relay = role.service if isinstance(role.service, EventRelay) else None
    metrics = serve_metrics(settings, role)
    probes = serve_probes(settings, name)
    try:
        await run_services(role.services, until=_first(until, relay))
    finally:
        if probes is not None:
            probes.stop()
        if metrics is not None:
            metrics.shutdown()
        await role.aclose()
    stats = role.stats()
    log.info("fleet %s stopped: %s", name, stats)
    if relay is not None and relay.failed is not None:
        raise relay.failed  # a refusal that can never succeed ends the process
    return stats


def serve_metrics(settings: FleetSettings, role: Role) -> Any:
    """This process's ``/metrics`` on ``FLEET_METRICS_PORT`` (None when unset): its Python
    and process metrics only (CPU, memory, open files, the collector's counts). Its
    fleet counters reach Prometheus once, through ``fleet flower``'s exporter, which
    reads every process's report from Redis (decision 0046): served here too, they
    would be counted twice."""
    if settings.metrics_port is None:
        return None
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    server, _ = start_http_server(settings.metrics_port, registry=registry)
    log.info("fleet %s: its process metrics on port %d (/metrics)", role.name,
             settings.metrics_port)
    return server


async def _first(until: Awaitable[Any] | None, relay: EventRelay | None) -> None:
    """Whichever ends first: ``until``, or the relay stopping for good."""
    waiters: list[asyncio.Future[Any]] = []
    if until is not None:
        waiters.append(asyncio.ensure_future(until))
    if relay is not None:
        waiters.append(asyncio.ensure_future(relay.ended()))
    if not waiters:
        await asyncio.Event().wait()  # only a signal stops it
    _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()



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


def flower_app(settings: FleetSettings) -> Any:
    """The app Flower runs on: the dispatcher's (broker and routes; Flower needs no tasks).

    Its control commands are signed with the operator key of ``FLEET_CONTROL_KEYS``
    (``FLEET_CONTROL_KEY_ID``), without which the workers obey none that changes them
    (decision 0042); Flower offers those only to its users with the operator role.
    """
    return producer_app(settings, main="fleet-flower",
                        control_auth=ControlAuth.from_settings(settings))


def run_flower(settings: FleetSettings, *, port: int | None = None,
               address: str | None = None, basic_auth: str | None = None,
               unauthenticated: bool = False, extra: Sequence[str] = (),
               prepare: Callable[[FleetSettings], Any] | None = None) -> int:
    """Serve Flower on the fleet's broker until SIGTERM.

    ``prepare(settings)`` runs once authentication is settled, before Flower
    builds its app: ``fleet flower`` adds the Fleet page there (``fleet.flowerui``).
    """
    argv = flower_argv(port=port, address=address, basic_auth=basic_auth,
                       unauthenticated=unauthenticated, extra=extra)
    if unauthenticated:
        # Flower reads this itself: its API answers without credentials.
        os.environ["FLOWER_UNAUTHENTICATED_API"] = "true"
    if prepare is not None:
        prepare(settings)
    return run_command(flower_app(settings), argv)


__all__ = ["OPENERS", "ROLES", "SERVICE_ROLES", "Role", "flower_app",
           "flower_argv", "open_attacher", "open_recovery", "open_relay", "open_role",
           "open_timers", "open_worker", "run_flower", "serve"]
