"""Celery, behind one typed seam.

Celery ships no type information; everything fleet takes from it is imported
here once, typed as ``Any``, so the rest of the package stays ``mypy --strict``
without an ignore per import. Both the client (``fleet.dispatcher``) and the
workers use it.
"""

from __future__ import annotations

from typing import Any

import celery as _celery  # type: ignore[import-untyped]
from billiard import process as _billiard_process  # type: ignore[import-untyped]
from celery import bootsteps as _bootsteps
from celery import signals as _signals
from celery.app.amqp import AMQP as _AMQP  # type: ignore[import-untyped]
from celery.app.control import Control as _Control  # type: ignore[import-untyped]
from celery.concurrency import get_implementation as _get_implementation  # type: ignore[import-untyped]
from celery.utils.time import (  # type: ignore[import-untyped]
    get_exponential_backoff_interval as _backoff,
)
from celery.worker import state as _worker_state  # type: ignore[import-untyped]
from click.exceptions import Exit
from kombu.connection import Connection as _Connection

Celery: Any = _celery.Celery
Task: Any = _celery.Task
StartStopStep: Any = _bootsteps.StartStopStep
signals: Any = _signals
#: A worker's request bookkeeping (``reserved_requests``: taken, not yet finished).
worker_state: Any = _worker_state
AMQP: Any = _AMQP
#: Celery's remote-control client (``app.control``); ``fleet.host.control`` extends it.
Control: Any = _Control
Connection: Any = _Connection
#: The countdown Celery's ``retry_backoff`` gives a retry (full jitter).
get_exponential_backoff_interval: Any = _backoff

#: The class that opens every broker connection of a fleet app (decision 0014).
FLEET_AMQP = "fleet.host.broker:FleetAMQP"
#: The remote control of every fleet app: signed commands, a worker that obeys only
#: those (decision 0042).
FLEET_CONTROL = "fleet.host.control:FleetControl"


def celery_version() -> tuple[int, int, int]:
    """The installed Celery's (major, minor, micro)."""
    major, minor, micro = _celery.VERSION[:3]
    return int(major), int(minor), int(micro)


# The broker URL schemes kombu serves with its Redis transport.
_REDIS_SCHEMES = ("redis", "rediss", "sentinel", "valkey", "valkeys")


def broker_app(main: str, broker: str, *, app_class: Any = None, backend: str | None = None,
               consumes_tasks: bool = False, control_auth: Any = None, **conf: Any) -> Any:
    """A Celery app on ``broker`` that speaks the fleet's wire format (JSON only).

    What every fleet producer and reader of the broker shares: the dispatcher's
    app and the workers' build on it (``fleet.dispatcher.broker``,
    ``fleet.workers.app``); ``fleet status`` inspects workers through a bare one.
    Its broker connections are ``fleet.host.broker.FleetConnection``s (they
    survive a broker restart; ``broker_conf(settings)`` sets their pace).

    Only a worker consumes the task queues (``consumes_tasks=True``, which
    ``fleet.workers.make_app`` passes), so only a worker takes part in kombu's
    Redis ack emulation: the ``unacked`` hash of taken messages and the restore
    of those a dead consumer left. kombu would otherwise have any process that
    reads a queue, Flower and ``fleet status`` reading their reply queues,
    restore other consumers' messages onto the task queues; off, their Redis
    users need neither the ``unacked*`` keys nor the right to push onto a queue
    (decision 0017).

    Its remote control is ``fleet.host.control.FleetControl``: what it broadcasts is
    signed with ``control_auth``'s operator key (``ControlAuth``; none: unsigned), and
    a worker on it obeys a command that changes it only when signed (decision 0042).
    """
    app = (app_class or Celery)(main, broker=broker, backend=backend, amqp=FLEET_AMQP,
                                control=FLEET_CONTROL)
    app.fleet_control_auth = control_auth
    app.conf.update(task_serializer="json", result_serializer="json",
                    accept_content=["json"], result_accept_content=["json"],
                    broker_connection_retry_on_startup=True, worker_hijack_root_logger=False)
    app.conf.update(conf)
    if not consumes_tasks and broker.split("://", 1)[0].lower() in _REDIS_SCHEMES:
        app.conf.broker_transport_options = {**(app.conf.broker_transport_options or {}),
                                             "ack_emulation": False}
    return app


def pool_class(pool: Any) -> type[Any]:
    """The pool class a worker runs (``"threads"``, ``"prefork"`` and classes accepted)."""
    resolved: type[Any] = _get_implementation(pool)
    return resolved


def is_prefork(pool: Any) -> bool:
    """Whether ``pool`` forks child processes that run the tasks."""
    cls = pool_class(pool)
    return isinstance(cls, type) and issubclass(cls, pool_class("prefork"))


def process_index() -> int | None:
    """This pool child's index (prefork: 0 .. concurrency-1, kept by a replacement child);
    None outside a prefork child."""
    index = getattr(_billiard_process.current_process(), "index", None)
    return index if isinstance(index, int) else None


def run_command(app: Any, argv: list[str]) -> int:
    """``app.start(argv)`` (``celery worker ...``, ``celery flower ...``) with its exit code.

    Celery's ``app.start`` runs its click command with ``standalone_mode=False``,
    where click returns the code ``ctx.exit(code)`` gave, and drops it: a worker
    that stopped on an unrecoverable error ("Unrecoverable error: ...", exit
    code 1 under ``celery worker``) would end ``fleet worker`` with status 0.
    The same call, keeping the code (decision 0014).
    """
    # Celery's command line (every subcommand's module) loads only where it runs.
    from celery.bin.celery import celery as command  # type: ignore[import-untyped]

    command.params[0].default = app  # what app.start does: the command's --app
    try:
        code = command.main(args=argv, standalone_mode=False)
    except Exit as exc:  # should a click raise it rather than return the code
        code = exc.exit_code
    except SystemExit as exc:  # a fatal error before the worker ran (its store, its flows)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        command.params[0].default = None
    return code if isinstance(code, int) else 0


def current_app() -> Any:
    """The Celery app current in this process (the worker's, inside a worker)."""
    return _celery.current_app._get_current_object()


__all__ = ["AMQP", "FLEET_AMQP", "FLEET_CONTROL", "Celery", "Connection", "Control",
           "StartStopStep", "Task", "broker_app",
           "celery_version", "current_app", "get_exponential_backoff_interval", "is_prefork",
           "pool_class", "process_index", "run_command", "signals", "worker_state"]
