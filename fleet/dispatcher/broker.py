"""The dispatcher's Celery app: what every producer of ``fleet.drive`` speaks.

``producer_app(settings)`` is a Celery app on the fleet's broker with the
fleet's wire format (JSON), its default queue and its drive router, deadlines
on every broker call (``deadline_conf``), and the settings it was made from
(``app.fleet_settings``). It registers no task and
starts no worker: publishing a drive needs only the task's name. The workers'
app (``fleet.workers.make_app``) is this app plus the tasks, the delivery
settings, the stats bootstep and the process hooks.
"""

from __future__ import annotations

from typing import Any

from fleet.config import FleetSettings
from fleet.dispatcher.routing import DriveRouter, check_routes
from fleet.host.broker import broker_conf
from fleet.host.celery_api import Celery, broker_app

#: A publish through Celery (``send_task``) retries twice, briefly: with the connect
#: and command deadlines of ``broker_conf``, a broker that never answers fails it in
#: bounded time (issue 10 item 4) rather than after Celery's default retries.
PUBLISH_RETRY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2,
                 "interval_max": 0.5}


class FleetCelery(Celery):  # type: ignore[misc]
    """A Celery app that knows the ``FleetSettings`` it was made from."""

    fleet_settings: FleetSettings


def producer_app(settings: FleetSettings, *, main: str = "fleet-dispatcher",
                 result_backend: str | None = None, consumes_tasks: bool = False,
                 control_auth: Any = None, **conf: Any) -> Any:
    """A ``FleetCelery`` on ``settings.broker`` that routes drives as the workers expect.

    Args:
        settings: Broker (``redis://`` or ``amqp://``), default queue, routes, the
            broker's retry pace and timeouts (``fleet.host.broker.broker_conf``).
        main: The app's name.
        result_backend: Where ``fleet.dispatch`` answers go (None: nowhere).
        consumes_tasks: Only the workers' app consumes the task queues (and so
            takes part in kombu's ack emulation; ``broker_app`` says why).
        control_auth: Signs its remote-control commands (``fleet.host.control.ControlAuth``;
            Flower's and ``fleet up``'s app), and judges them on a worker; None: unsigned.
        **conf: Further Celery settings, applied last.
    """
    routes = check_routes(settings.routes)
    # How its broker connections fail and come back (decision 0014), then the caller's.
    app = broker_app(main, settings.broker, app_class=FleetCelery, backend=result_backend,
                     consumes_tasks=consumes_tasks, control_auth=control_auth,
                     task_default_queue=settings.queue,
                     task_routes=(DriveRouter(routes, settings.queue),),
                     task_ignore_result=result_backend is None,
                     **{**broker_conf(settings), "task_publish_retry_policy": PUBLISH_RETRY,
                        **conf})
    app.fleet_settings = settings
    return app


__all__ = ["FleetCelery", "producer_app"]
