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


def run_command(app: Any, argv: list[str]) -> int:
    """``app.start(argv)`` (``celery worker ...``, ``celery flower ...``) with its exit code.

    Celery's ``app.start`` runs its click command with ``standalone_mode=False``,
    where click returns the code ``ctx.exit(code)`` gave, and drops it: a worker
    that stopped on an unrecoverable error ("Unrecoverable error: ...", exit
    code 1 under ``celery worker``) would end ``fleet worker`` with status 0.
    The same call, keeping the code.
    """
    from celery.bin.celery import celery as command  # type: ignore[import-untyped]
    from click.exceptions import Exit

    command.params[0].default = app  # what app.start does: the command's --app
    try:
        code = command.main(args=argv, standalone_mode=False)
    except Exit as exc:  # should a click raise it rather than return the code
        code = exc.exit_code
    finally:
        command.params[0].default = None
    return code if isinstance(code, int) else 0


def current_app() -> Any:
    """The Celery app current in this process (the worker's, inside a worker)."""
    return _celery.current_app._get_current_object()


__all__ = ["AMQP", "Celery", "Connection", "StartStopStep", "Task", "celery_version",
           "current_app", "is_prefork", "pool_class", "run_command", "signals"]
