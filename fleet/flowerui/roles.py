"""Who may do what in Flower: the operator role, and which tenants a Flower user reads.

Flower itself knows users (basic auth, OAuth) but no roles: any user it lets in
could shut workers down, restart pools, cancel consumers and revoke tasks
through its own API. ``fleet flower`` puts ``RoleGuard`` in front of every
Flower handler (``guard_handlers``; issue 25 item 5, decision 0043):

* **Changing anything** (any method but GET, HEAD and OPTIONS, on any of Flower's
  handlers: every button and ``/api/worker/*``, ``/api/task/*``) needs the
  operator role: the Flower user is named in ``FLEET_OPERATORS`` (``*``: every
  user Flower authenticated). Refused with 403, logged; nothing is sent.
* **No authentication, no role.** On a Flower without basic auth or OAuth
  (``--unauthenticated``, ``FLOWER_UNAUTHENTICATED_API``) nobody has a role, not
  even with ``FLEET_OPERATORS=*``: it is read only. An ``Authorization`` header is
  believed only when Flower itself checked it (basic auth configured): a forged
  one on an open Flower names nobody.
* **Reading is scoped to tenants** (issue 25 item 11). An operator reads
  everything. Another authenticated user reads the executions (the Fleet page's
  parked list and logs) of the tenants ``FLEET_FLOWER_TENANTS`` gives it (``*``:
  every tenant, and executions with none); unlisted, the counters only. Flower's
  own task and worker pages show every task's arguments (``fleet.dispatch``
  inputs, principals), so they need every tenant (operator, or ``*``). An open
  Flower reads everything: whoever reaches its port is trusted to (the operator
  chose ``--unauthenticated``).
"""

from __future__ import annotations

import hmac
import logging
from base64 import b64decode
from dataclasses import dataclass
from typing import Any, ClassVar

import tornado.web
from flower.views import BaseHandler  # type: ignore[import-untyped]  # no type hints
from tornado.routing import URLSpec

from fleet.config import FleetSettings

log = logging.getLogger("fleet.flower")

#: Methods that read; any other changes something and needs the operator role.
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: Flower's handlers whose answers carry tasks' arguments or results (every tenant's):
#: readable only by a user who may read every tenant.
ALL_TENANTS: frozenset[str] = frozenset({
    "TasksView", "TaskView", "TasksDataTable", "WorkerView", "ListTasks", "TaskInfo",
    "TaskResult", "ListWorkers"})
#: Flower's handlers whose POST only reads (the tasks table's query).
READING_POSTS: frozenset[str] = frozenset({"TasksDataTable"})
#: Flower's handlers left as they are (their own rules; nothing of the fleet's behind them).
UNGUARDED: frozenset[str] = frozenset({"NotFoundErrorHandler"})


def authenticating(handler: Any) -> bool:
    """Whether this Flower authenticates its users (basic auth or OAuth)."""
    options = handler.application.options
    return bool(options.basic_auth or options.auth)


def flower_user(handler: Any) -> str | None:
    """Who Flower authenticated: the OAuth user, the basic-auth user name; None on a Flower
    without authentication (whatever ``Authorization`` header the request carries)."""
    if not authenticating(handler):
        return None
    user = handler.current_user  # Flower's check: a wrong basic-auth header is a 401 here
    if isinstance(user, bytes):
        user = user.decode()
    if isinstance(user, str) and user:
        return user
    if not handler.application.options.basic_auth or not user:
        return None
    kind, _, credentials = handler.request.headers.get("Authorization", "").partition(" ")
    if kind != "Basic" or not credentials:
        return None
    try:
        name = b64decode(credentials.encode()).decode().split(":", 1)[0]
    except (ValueError, UnicodeDecodeError):
        return None
    return name or None


def has_operator_role(user: str | None, operators: list[str]) -> bool:
    """``FLEET_OPERATORS`` names ``user`` (an authenticated one), or is ``*``."""
    if user is None:
        return False
    return "*" in operators or any(hmac.compare_digest(user, name) for name in operators)


@dataclass(frozen=True, slots=True)
class Viewer:
    """A request's user as the fleet sees it.

    ``tenants``: the tenants whose executions it reads; None: every tenant (and
    executions with none).
    """

    user: str | None
    authenticated: bool
    operator: bool
    tenants: frozenset[str] | None

    @property
    def reads_every_tenant(self) -> bool:
        return self.tenants is None

    def sees(self, tenant: str | None) -> bool:
        """Whether this user may read an execution of ``tenant`` (None: no tenant)."""
        return self.tenants is None or (tenant is not None and tenant in self.tenants)

    def name(self) -> str:
        return self.user or ("an unauthenticated user" if not self.authenticated
                             else "this user")


def viewer_of(handler: Any, settings: FleetSettings) -> Viewer:
    """The fleet's view of the user behind ``handler``'s request (module docstring)."""
    if not authenticating(handler):
        return Viewer(None, False, False, None)  # open: reads everything, no role
    user = flower_user(handler)
    if has_operator_role(user, settings.operators):
        return Viewer(user, True, True, None)
    listed = settings.flower_tenants.get(user or "") if user else None
    if listed and "*" in listed:
        return Viewer(user, True, False, None)
    return Viewer(user, True, False, frozenset(listed or ()))


class RoleGuard:
    """Put in front of a Flower handler: mutations need the operator role, and pages that
    show every tenant's tasks need every tenant (module docstring)."""

    fleet_settings: ClassVar[FleetSettings]
    fleet_handler: ClassVar[str]

    def prepare(self) -> Any:
        handler: Any = self
        result = super().prepare()  # type: ignore[misc]  # Flower's (the API's auth check)
        method = handler.request.method
        reading = method in READ_METHODS or self.fleet_handler in READING_POSTS
        if reading and self.fleet_handler not in ALL_TENANTS:
            # Nothing to judge: Flower's own rules (its /healthcheck and /metrics answer
            # without credentials, for the probes and Prometheus).
            return result
        viewer = viewer_of(handler, self.fleet_settings)
        if not reading and not viewer.operator:
            log.warning("fleet: %s %s refused: %s lacks the operator role", method,
                        handler.request.path, viewer.name())
            raise tornado.web.HTTPError(403, "this needs the operator role (FLEET_OPERATORS)"
                                        f": {viewer.name()} has none"
                                        + ("" if viewer.authenticated else
                                           "; this Flower authenticates nobody, so nobody "
                                           "has it (it is read only)"))
        if self.fleet_handler in ALL_TENANTS and not viewer.reads_every_tenant:
            log.warning("fleet: %s %s refused: %s may not read every tenant", method,
                        handler.request.path, viewer.name())
            raise tornado.web.HTTPError(403, "Flower's task and worker pages show every "
                                        "tenant's task arguments: they need the operator role "
                                        "or FLEET_FLOWER_TENANTS \"*\"")
        return result


def guarded(cls: type[Any], settings: FleetSettings) -> type[Any]:
    """``cls`` (a Flower handler) behind ``RoleGuard``."""
    return type(f"Guarded{cls.__name__}", (RoleGuard, cls),
                {"fleet_settings": settings, "fleet_handler": cls.__name__})


def guard_handlers(handlers: list[Any], settings: FleetSettings) -> list[Any]:
    """Flower's handler list with every Flower handler behind ``RoleGuard``."""
    out: list[Any] = []
    for entry in handlers:
        if isinstance(entry, URLSpec):
            cls = entry.handler_class
            if _guardable(cls):
                entry = URLSpec(entry.regex.pattern, guarded(cls, settings), entry.kwargs,
                                entry.name)
        elif isinstance(entry, tuple) and len(entry) >= 2 and _guardable(entry[1]):
            entry = (entry[0], guarded(entry[1], settings), *entry[2:])
        out.append(entry)
    return out


def _guardable(cls: Any) -> bool:
    return (isinstance(cls, type) and issubclass(cls, BaseHandler)
            and not issubclass(cls, RoleGuard) and cls.__name__ not in UNGUARDED)


__all__ = ["ALL_TENANTS", "READING_POSTS", "READ_METHODS", "RoleGuard", "Viewer",
           "authenticating", "flower_user", "guard_handlers", "guarded", "has_operator_role",
           "viewer_of"]
