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
from celery.concurrency import get_implementation as _get_implementation  # type: ignore[import-untyped]

from fleet.config import FleetSettings

Celery: Any = _celery.Celery
Task: Any = _celery.Task
StartStopStep: Any = _bootsteps.StartStopStep
signals: Any = _signals


def broker_app(main: str, broker: str, *, app_class: Any = None, backend: str | None = None,
               **conf: Any) -> Any:
    """A Celery app on ``broker`` that speaks the fleet's wire format (JSON only).

    What every fleet producer and reader of the broker shares: the dispatcher's
    app and the workers' build on it (``fleet.dispatcher.broker``,
    ``fleet.workers.app``); ``fleet status`` inspects workers through a bare one.
    """
    app = (app_class or Celery)(main, broker=broker, backend=backend)
    app.conf.update(task_serializer="json", result_serializer="json",
                    accept_content=["json"], result_accept_content=["json"],
                    broker_connection_retry_on_startup=True, worker_hijack_root_logger=False)
    app.conf.update(conf)
    return app


def deadline_conf(settings: FleetSettings) -> dict[str, Any]:
    """The Celery settings that bound every broker call of an app made from ``settings``.

    A broker that accepts connections but never answers must not hang a publish,
    ``fleet status`` or a service: connects give up after
    ``broker_connect_timeout_s``; on Redis every command after
    ``broker_socket_timeout_s``; a publish retries twice, briefly.
    """
    options: dict[str, Any] = {}
    if settings.broker.split("://", 1)[0].lower() in ("redis", "rediss", "valkey", "valkeys"):
        options.update(socket_connect_timeout=settings.broker_connect_timeout_s,
                       socket_timeout=settings.broker_socket_timeout_s,
                       socket_keepalive=True)
    return {"broker_transport_options": options,
            "broker_connection_timeout": settings.broker_connect_timeout_s,
            "task_publish_retry_policy": {"max_retries": 2, "interval_start": 0,
                                          "interval_step": 0.2, "interval_max": 0.5}}


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


def current_app() -> Any:
    """The Celery app current in this process (the worker's, inside a worker)."""
    return _celery.current_app._get_current_object()


__all__ = ["Celery", "StartStopStep", "Task", "broker_app", "current_app", "deadline_conf",
           "is_prefork",
           "pool_class", "process_index", "signals"]
