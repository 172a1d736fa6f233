"""The fleet's Celery app: ``make_app(settings)``.

Delivery is at least once: ``task_acks_late`` (a message is acknowledged only
after the drive it carries stopped) and ``task_reject_on_worker_lost`` (a
prefork child that dies mid-drive hands its message back). A second delivery
of a live run finds its lease and steps aside; one after a crash takes the
fence, and the dead holder's writes are refused. Nothing depends on the
broker for correctness: the log and the fences are in the store.

``worker_prefetch_multiplier = 1``: a drive runs until its run parks or ends,
which can take long, so a worker reserves only as many messages as it has
drive slots (``worker_drives``, the thread pool's size), and, since a
``fleet.drives`` message carries several drives, no more drives than that
either (``fleet.workers.reservation``, decision 0046). A drive never waits in the
buffer of a busy worker while another is idle, and a killed worker holds at most
its in-flight drives, not a backlog.

The pool defaults to ``threads`` with ``worker_drives`` threads: one process,
one event loop, many concurrent drives on it (decision 0012). Prefork works
too (``FLEET_WORKER_POOL=prefork``, children by ``-c``): each child owns its
own loop and store. (Celery's ``-P prefork`` cannot override a pool the app
configures: it is also the option's default.)

No result backend is needed: a drive's result is in the log. Give
``result_backend=`` to read ``fleet.dispatch`` answers from non-Python clients.
"""

from __future__ import annotations

import weakref
from typing import Any

from fleet.config import FleetSettings
from fleet.dispatcher.broker import FleetCelery, producer_app
from fleet.host.celery_api import current_app, is_prefork, process_index, signals
from fleet.host.control import ControlAuth
from fleet.services.probes import ProbeServer, serve_probes
from fleet.workers import shutdown, stats
from fleet.workers.bootstep import FleetStatsStep
from fleet.workers.consuming import ConsumerWatch
from fleet.workers.process import close_process, local_process, log, open_process, set_node_name
from fleet.workers.reservation import ReservationStep
from fleet.workers.tasks import register_tasks


def make_app(settings: FleetSettings, *, main: str = "fleet",
             result_backend: str | None = None, **conf: Any) -> Any:
    """The Celery app of a fleet: ``fleet.drive`` and ``fleet.dispatch``, routes, the bootstep.

    Args:
        settings: Broker (``settings.broker``: ``redis://`` or ``amqp://``),
            store, flows, default queue, routes, ``worker_drives``, lease.
        main: The app's name.
        result_backend: Where ``fleet.dispatch`` answers go (None: nowhere).
        **conf: Further Celery settings, applied last (for example
            ``broker_transport_options``).

    Returns:
        A ``FleetCelery`` (a ``celery.Celery``); ``app.fleet_settings`` is ``settings``.
        It is the dispatcher's ``producer_app`` (broker, wire format, routes)
        with what a worker adds.
    """
    # Its remote control obeys only an operator's signed command (decision 0042); what
    # it refused is counted where the consumer runs (control_refused).
    control = ControlAuth.from_settings(settings, signs=False)
    app = producer_app(settings, main=main, result_backend=result_backend, consumes_tasks=True,
                       control_auth=control)
    stats.register_stats_source("control", control.stats)
    app.conf.update(
        task_acks_late=True, task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_pool=settings.worker_pool,
        # With prefork, give the number of children with `-c` (each drives one at a time).
        worker_concurrency=settings.worker_drives if settings.worker_pool == "threads" else None,
        # A drive does not need the broker connection to finish (its lease and
        # log are in the store); cancelling it on a broker hiccup would only
        # leave an in-doubt step. Its message comes back and steps aside.
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    app.conf.update(conf)
    app.steps["worker"].add(FleetStatsStep)
    app.steps["consumer"].add(ConsumerWatch)
    # A worker takes no more drives than it runs (decision 0046; threads pool, Redis).
    app.steps["consumer"].add(ReservationStep)
    register_tasks(app)
    _connect_process_hooks(app)
    return app


# The apps make_app built in this process; the worker signals are process-wide,
# so their handlers (connected once) act only for a worker of one of these.
_apps: weakref.WeakSet[Any] = weakref.WeakSet()
_hooks_connected = False


def _connect_process_hooks(app: Any) -> None:
    """Open the worker process's loop, store and Runtime where tasks run; close at exit."""
    global _hooks_connected
    _apps.add(app)
    if _hooks_connected:
        return
    _hooks_connected = True
    signals.worker_init.connect(_on_worker_init, weak=False)
    signals.worker_process_init.connect(_on_process_init, weak=False)
    signals.worker_process_shutdown.connect(_on_process_shutdown, weak=False)
    signals.worker_shutdown.connect(_on_worker_shutdown, weak=False)
    signals.worker_shutting_down.connect(_on_worker_shutting_down, weak=False)


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    if sender is None or sender.app not in _apps:
        return
    shutdown.install()  # before a prefork pool forks: its children inherit the flag
    set_node_name(getattr(sender, "hostname", None))
    # HTTP probes in the main process (it checks a prefork pool's every child's heartbeat).
    _probes.append(serve_probes(sender.app.fleet_settings, "worker"))
    if is_prefork(sender.pool_cls):
        return  # prefork: each child opens its own after the fork
    try:
        open_process(sender.app.fleet_settings)
    except Exception as exc:
        # Fail fast: a worker that cannot open its store or load its flows
        # must not take messages (Celery only logs an exception raised here).
        log.critical("fleet worker cannot start: %s: %s", type(exc).__name__, exc)
        raise SystemExit(1) from exc


def _on_process_init(**_: Any) -> None:  # a prefork child, or the solo pool
    app = current_app()
    if app not in _apps:
        return
    if process_index() is not None:
        # A prefork child: the parent runs the consumer and counts what it refused; the
        # child's copy of the counter would report 0 (issue 14: never a false zero).
        stats.unregister_stats_source("control")
    open_process(app.fleet_settings, slot=process_index())


def _on_process_shutdown(**_: Any) -> None:
    if local_process() is not None:
        close_process()


def _on_worker_shutting_down(**_: Any) -> None:
    # Sent from Celery's SIGTERM/SIGINT/SIGQUIT handler in the worker's main
    # process (sender: its hostname): start handing the drives back
    # (fleet.workers.shutdown). Only memory stores and a loop wake-up here.
    shutdown.request_drain()
    process = local_process()
    if process is not None:
        process.begin_drain()


def _on_worker_shutdown(sender: Any = None, **_: Any) -> None:
    if sender is not None and sender.app in _apps:
        close_process()
        while _probes:
            probes = _probes.pop()
            if probes is not None:
                probes.stop()


_probes: list[ProbeServer | None] = []


__all__ = ["FleetCelery", "make_app"]
