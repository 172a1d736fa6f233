"""``fleet worker``: run the fleet's Celery worker in this process.

The worker's app is ``make_app(settings)``; inside it, each process that runs
tasks opens its ``WorkerProcess`` (its parts built by
``fleet.assembly.roles.open_worker``, as every role's are).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fleet.config import FleetSettings
from fleet.host.celery_api import run_command
from fleet.kernel.errors import ConfigurationError
from fleet.workers.app import make_app

POOLS: tuple[str, ...] = ("threads", "prefork", "solo")


def worker_argv(settings: FleetSettings, *, queues: Sequence[str] = (),
                concurrency: int | None = None, loglevel: str = "INFO",
                hostname: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The ``celery worker`` arguments ``run_worker`` passes (queues default to the
    settings' queue)."""
    # No mingle: it broadcasts on the control channel, which only the operator's
    # console may publish on (decision 0042); what it syncs (revoked ids, the clock)
    # fleet does not use.
    argv = ["worker", "--queues", ",".join(queues or [settings.queue]),
            "--loglevel", loglevel, "--without-mingle"]
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
    (``fleet.workers.shutdown``): 0. A worker that stops on a fatal error (one
    Celery calls unrecoverable: the broker gone past ``broker_max_retries``, a
    failing bootstep) or cannot open its store returns non-zero, so
    ``Restart=on-failure`` and its kin restart it. ``extra`` goes to ``celery
    worker`` as it is.
    """
    chosen = worker_settings(settings, pool=pool, concurrency=concurrency)
    app = make_app(chosen)
    argv = worker_argv(chosen, queues=queues, concurrency=concurrency, loglevel=loglevel,
                       hostname=hostname, extra=extra)
    return run_command(app, argv)


__all__ = ["POOLS", "run_worker", "worker_argv", "worker_settings"]
