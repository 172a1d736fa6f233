"""Celery, behind one typed seam.

Celery ships no type information; everything fleet takes from it is imported
here once, typed as ``Any``, so the rest of the package stays ``mypy --strict``
without an ignore per import.
"""

from __future__ import annotations

from typing import Any

import celery as _celery  # type: ignore[import-untyped]
from celery import bootsteps as _bootsteps
from celery import signals as _signals
from celery.app.amqp import AMQP as _AMQP  # type: ignore[import-untyped]
from celery.concurrency import get_implementation as _get_implementation  # type: ignore[import-untyped]
from kombu.connection import Connection as _Connection

Celery: Any = _celery.Celery
Task: Any = _celery.Task
StartStopStep: Any = _bootsteps.StartStopStep
signals: Any = _signals
AMQP: Any = _AMQP
Connection: Any = _Connection


def celery_version() -> tuple[int, int, int]:
    """The installed Celery's (major, minor, micro)."""
    major, minor, micro = _celery.VERSION[:3]
    return int(major), int(minor), int(micro)


def pool_class(pool: Any) -> type[Any]:
    """The pool class a worker runs (``"threads"``, ``"prefork"`` and classes accepted)."""
    resolved: type[Any] = _get_implementation(pool)
    return resolved


def is_prefork(pool: Any) -> bool:
    """Whether ``pool`` forks child processes that run the tasks."""
    from celery.concurrency.prefork import TaskPool  # type: ignore[import-untyped]

    cls = pool_class(pool)
    return isinstance(cls, type) and issubclass(cls, TaskPool)


def current_app() -> Any:
    """The Celery app current in this process (the worker's, inside a worker)."""
    return _celery.current_app._get_current_object()


__all__ = ["AMQP", "Celery", "Connection", "StartStopStep", "Task", "celery_version",
           "current_app", "is_prefork", "pool_class", "signals"]
