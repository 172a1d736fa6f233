"""The dispatcher: write first, then enqueue a drive on the routed queue.

``Dispatcher`` for Python callers (async, with sync twins); the ``fleet.dispatch``
Celery task (``fleet.dispatcher.remote``) for producers in any language. The
client side of the fleet: it never imports ``fleet.workers`` (the workers
import it: its routes and task names are the wire both sides speak).
"""

from fleet.dispatcher.broker import FleetCelery, producer_app
from fleet.dispatcher.dispatcher import (
    Dispatcher,
    DriveOrder,
    Send,
    Start,
    idempotent_execution_id,
)
from fleet.dispatcher.remote import DispatchReply, DispatchRequest
from fleet.dispatcher.routing import DriveRouter, check_routes, route_queue

__all__ = ["DispatchReply", "DispatchRequest", "Dispatcher", "DriveOrder", "DriveRouter",
           "FleetCelery", "Send", "Start", "check_routes", "idempotent_execution_id",
           "producer_app", "route_queue"]
