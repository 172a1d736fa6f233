"""The fleet's two Celery tasks: ``fleet.drive`` and ``fleet.dispatch``.

``fleet.drive(execution_id, flow_id=None, tenant=None)`` drives an execution
to the end of its run (park, complete, fail, abort) before it returns, so the
message is acknowledged (``acks_late``) only once the run stopped; it returns
how the run stopped (``completed``, ``parked``, ``stepped_aside``,
``fenced_out``, ...). ``flow_id`` and ``tenant`` only route the message.

``fleet.dispatch(**request)`` is the dispatcher for producers that are not
Python (``fleet.dispatcher.remote``).
"""

from __future__ import annotations

from typing import Any

from fleet.dispatcher.routing import DISPATCH_TASK, DRIVE_TASK
from fleet.kernel.errors import StoreUnavailableError


def register_tasks(app: Any) -> None:
    """Register ``fleet.drive`` and ``fleet.dispatch`` on ``app``."""

    def drive(execution_id: str, flow_id: str | None = None,
              tenant: str | None = None) -> str:
        from fleet.workers.process import open_process

        return open_process(app.fleet_settings).drive(execution_id)

    def dispatch(*args: Any, **kwargs: Any) -> dict[str, Any]:
        from fleet.dispatcher.dispatcher import Dispatcher
        from fleet.dispatcher.remote import handle_dispatch
        from fleet.workers.process import open_process

        process = open_process(app.fleet_settings)
        dispatcher = Dispatcher(runtime=process.runtime, app=app)
        return handle_dispatch(dispatcher, process.loop.run_coroutine, args, kwargs)

    # A store outage is retried a few times (short countdowns, far below the
    # Redis visibility timeout); after that the recovery sweeper re-drives it.
    app.task(name=DRIVE_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
             autoretry_for=(StoreUnavailableError,), retry_backoff=True, retry_backoff_max=30,
             max_retries=5)(drive)
    app.task(name=DISPATCH_TASK, acks_late=True, reject_on_worker_lost=True)(dispatch)


__all__ = ["register_tasks"]
