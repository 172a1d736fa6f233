"""Which Celery queue a drive goes to: ``flow:<id>``, then ``tenant:<t>``, then the default.

``FleetSettings.routes`` maps ``"flow:<flow id>"`` or ``"tenant:<tenant>"`` to
a queue name, so heavy flows (or a noisy tenant) get workers of their own
(``celery worker -Q <queue>``). The flow route wins over the tenant route.

The Celery app installs ``DriveRouter`` as its router, so every producer of
``fleet.drive`` (the dispatcher, the timer service, the recovery sweeper, a
hand-written ``send_task``) routes the same way, from the ``flow_id`` and
``tenant`` keyword arguments the message carries.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fleet.kernel.errors import ConfigurationError

DRIVE_TASK = "fleet.drive"
#: Several drives of one route in one message (``fleet.dispatcher.publish``, decision 0030).
DRIVES_TASK = "fleet.drives"
DISPATCH_TASK = "fleet.dispatch"
_KINDS = ("flow:", "tenant:")


def check_routes(routes: Mapping[str, str]) -> dict[str, str]:
    """Validate a routes table; a copy. Keys are ``flow:<id>`` or ``tenant:<t>``."""
    checked: dict[str, str] = {}
    for key, queue in routes.items():
        if not isinstance(key, str) or not key.startswith(_KINDS) or key in _KINDS:
            raise ConfigurationError(
                f"route {key!r}: a route key is 'flow:<flow id>' or 'tenant:<tenant>'")
        if not isinstance(queue, str) or not queue:
            raise ConfigurationError(f"route {key!r} names no queue")
        checked[key] = queue
    return checked


def route_queue(routes: Mapping[str, str], default: str, *, flow_id: str | None = None,
                tenant: str | None = None) -> str:
    """The queue for a drive of a ``flow_id`` execution owned by ``tenant``."""
    if flow_id:
        queue = routes.get(f"flow:{flow_id}")
        if queue:
            return queue
    if tenant:
        queue = routes.get(f"tenant:{tenant}")
        if queue:
            return queue
    return default


def needs_lookup(routes: Mapping[str, str]) -> bool:
    """Whether any route exists, i.e. a drive's flow and tenant change its queue."""
    return bool(routes)


class DriveRouter:
    """A Celery router (``task_routes``) for ``fleet.drive(s)`` and ``fleet.dispatch``."""

    def __init__(self, routes: Mapping[str, str], default: str) -> None:
        self.routes = check_routes(routes)
        self.default = default

    def __call__(self, name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                 **_: Any) -> dict[str, str] | None:
        if name in (DRIVE_TASK, DRIVES_TASK):
            kw = kwargs if isinstance(kwargs, Mapping) else {}
            return {"queue": route_queue(self.routes, self.default,
                                         flow_id=kw.get("flow_id"), tenant=kw.get("tenant"))}
        if name == DISPATCH_TASK:
            return {"queue": self.default}
        return None
