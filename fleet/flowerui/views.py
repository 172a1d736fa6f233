"""The Fleet page's Tornado handlers, inside Flower (``fleet.flowerui``).

==============================  ======  ==============================================
``/fleet``                      GET     the page (Flower's look, auto-refresh)
``/fleet/api/status``           GET     the same as JSON
``/fleet/execution/<id>``       GET     an execution's log
``/fleet/diverged/<id>/retry``  POST    Retry (a form; redirects to the page)
``/fleet/api/diverged/<id>/retry`` POST Retry, answered as JSON
==============================  ======  ==============================================

Every handler is a Flower handler: Flower's authentication applies (basic
auth, OAuth; the API as Flower's own API, ``FLOWER_UNAUTHENTICATED_API``). A
Retry also needs the operator role (``FLEET_OPERATORS``) and Tornado's XSRF
token, whatever Flower's own checks waive; it is written as ``FLEET_OPERATOR``.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import threading
import time
from base64 import b64decode
from collections import OrderedDict
from typing import Any

import tornado.web
from flower.api import BaseApiHandler  # type: ignore[import-untyped]  # no type hints
from flower.views import BaseHandler  # type: ignore[import-untyped]  # no type hints
from tornado.ioloop import IOLoop

from fleet.config import FleetSettings
from fleet.dispatcher.operator import GATES, Operator, ParkedExecution, RetryResult
from fleet.kernel.errors import FleetError
from fleet.kernel.fold import DIVERGED_GATE, INDOUBT_GATE
from fleet.kernel.store.spi_queues import QueueDepth
from fleet.services.counters import ALARMS, WORKER_COUNTERS, CountersReader, FleetCounters

log = logging.getLogger("fleet.flower")

#: The totals the page shows first, as cards.
HEADLINE: tuple[str, ...] = ("drives", "completed", "parked", "active", "divergence_warnings",
                             "divergence_parked", "fenced_out", "timers_fired",
                             "outcomes_attached", "outcomes_dead_lettered", "handed_back",
                             "errors")
REFRESH_S = 5


class FleetState:
    """What the handlers share: the counters' reader and the operator (opened lazily)."""

    def __init__(self, settings: FleetSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._reader: CountersReader | None = None
        self._operator: Operator | None = None
        self.results: OrderedDict[str, tuple[str, bool]] = OrderedDict()

    @property
    def reader(self) -> CountersReader:
        with self._lock:
            if self._reader is None:
                self._reader = CountersReader(self.settings)
            return self._reader

    @property
    def operator(self) -> Operator:
        with self._lock:
            if self._operator is None:
                self._operator = Operator(self.settings)
            return self._operator

    def counters(self) -> FleetCounters:
        if not self.settings.redis_url:
            return FleetCounters((), problems=("the fleet's counters are in Redis: set "
                                               "FLEET_REDIS_URL for Flower",))
        return self.reader.read()

    def parked_counts(self) -> dict[str, int]:
        parked = self.operator.parked(limit=10_000)
        return {"diverged": sum(1 for p in parked if p.gate == DIVERGED_GATE),
                "in-doubt": sum(1 for p in parked if p.gate == INDOUBT_GATE)}

    def queue_depths(self) -> list[QueueDepth]:
        """Every queue as the store holds it now (decision 0056)."""
        return self.operator.queue_depths()

    def snapshot(self) -> dict[str, Any]:
        """The page's data (also ``/fleet/api/status``)."""
        counters = self.counters()
        data = counters.to_dict()
        data["queues"] = []
        try:
            data["queues"] = [q.to_dict() for q in self.queue_depths()]
        except Exception as exc:  # noqa: BLE001 - shown on the page, the rest still served
            data["problems"].append(f"queues: {type(exc).__name__}: {exc}")
        parked: list[ParkedExecution] = []
        try:
            parked = self.operator.parked(gates=GATES)
        except Exception as exc:  # noqa: BLE001 - shown on the page, the rest still served
            data["problems"].append(f"store: {type(exc).__name__}: {exc}")
        by = counters.parked_by()
        data["parked"] = [{**p.to_dict(), "worker": p.worker or by.get(p.execution_id)}
                          for p in parked]
        if parked:
            data["alarms"]["executions parked diverged"] = sum(
                1 for p in parked if p.gate == DIVERGED_GATE)
            indoubt = sum(1 for p in parked if p.gate == INDOUBT_GATE)
            if indoubt:
                data["alarms"]["executions parked in-doubt"] = indoubt
            if not data["alarms"]["executions parked diverged"]:
                del data["alarms"]["executions parked diverged"]
        stale = [p for p in counters.processes if p.stale]
        if stale:
            data["alarms"]["stale processes"] = len(stale)
        data["operator"] = {"principal": self.settings.operator,
                            "retry": bool(self.settings.operator)}
        return data

    def remember(self, message: str, bad: bool) -> str:
        token = secrets.token_urlsafe(12)
        self.results[token] = (message, bad)
        while len(self.results) > 100:
            self.results.popitem(last=False)
        return token

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        if self._operator is not None:
            self._operator.close()


def format_number(value: Any) -> str:
    if value is None:
        return "—"
    number = float(value)
    return f"{int(number):,}" if number.is_integer() else f"{number:,.1f}"


def format_ms(ms: float | None) -> str:
    if not ms:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(ms) / 1000))


def flower_user(handler: Any) -> str | None:
    """Who Flower let in: the OAuth user, the basic-auth user name, or None (open)."""
    user = handler.current_user
    if isinstance(user, bytes):
        user = user.decode()
    if isinstance(user, str) and user:
        return user
    header = handler.request.headers.get("Authorization", "")
    kind, _, credentials = header.partition(" ")
    if kind == "Basic" and credentials:
        try:
            name = b64decode(credentials.encode()).decode().split(":", 1)[0]
        except (ValueError, UnicodeDecodeError):
            return None
        return name or None
    return None


def has_operator_role(user: str | None, operators: list[str]) -> bool:
    """``FLEET_OPERATORS`` names the user, or is ``*`` (everyone Flower lets in)."""
    if "*" in operators:
        return True
    return user is not None and any(hmac.compare_digest(user, name) for name in operators)


class _FleetHandler(BaseHandler):  # type: ignore[misc]  # Flower's class is untyped
    def initialize(self, state: FleetState) -> None:
        self.state = state

    async def blocking(self, fn: Any, *args: Any) -> Any:
        return await IOLoop.current().run_in_executor(None, fn, *args)


class FleetView(_FleetHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        data = await self.blocking(self.state.snapshot)
        token = self.get_argument("result", None)
        message, bad = self.state.results.get(token or "", ("", False))
        settings = self.state.settings
        can_retry = bool(settings.operator) and has_operator_role(flower_user(self),
                                                                   settings.operators)
        retry_off = ("set FLEET_OPERATOR to retry" if not settings.operator
                     else "needs the operator role (FLEET_OPERATORS)")
        processes = data["processes"]
        self.render("fleet.html", data=data, message=message, message_bad=bad,
                    headline=HEADLINE, alarm_names=frozenset(ALARMS),
                    worker_counters=WORKER_COUNTERS,
                    workers=[p for p in processes if p["role"] == "worker"],
                    services=[p for p in processes if p["role"] != "worker"],
                    can_retry=can_retry, retry_off=retry_off, refresh_s=REFRESH_S,
                    events_stream=settings.events_stream, format_number=format_number,
                    format_ms=format_ms)


class FleetLogView(_FleetHandler):
    @tornado.web.authenticated
    async def get(self, execution_id: str) -> None:
        events = await self.blocking(self.state.operator.events, execution_id)
        shown = [{"sequence": e.sequence, "timestamp": e.timestamp, "type": str(e.type),
                  "payload": json.dumps(e.payload, ensure_ascii=False)[:2000],
                  "danger": (e.payload.get("condition") or {}).get("on") in GATES
                  if isinstance(e.payload, dict) else False} for e in events]
        self.render("fleet_log.html", execution_id=execution_id, events=events, shown=shown,
                    format_ms=format_ms)


class FleetStatusApi(BaseApiHandler):  # type: ignore[misc]  # Flower's class is untyped
    def initialize(self, state: FleetState) -> None:
        self.state = state

    @tornado.web.authenticated
    async def get(self) -> None:
        data = await IOLoop.current().run_in_executor(None, self.state.snapshot)
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.write(json.dumps(data))


class _Retry(_FleetHandler):
    """Retry: the operator role, then Tornado's XSRF check (always), then ``retry_diverged``."""

    def check_xsrf_cookie(self) -> None:
        super().check_xsrf_cookie()  # Flower's: cross-site and cross-origin requests
        tornado.web.RequestHandler.check_xsrf_cookie(self)  # the token, even without auth

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None))[1]
        message = exc.log_message if isinstance(exc, tornado.web.HTTPError) else None
        self.set_header("Content-Type", "text/plain; charset=UTF-8")
        self.finish(message or self._reason)

    async def act(self, execution_id: str) -> tuple[int, dict[str, Any]]:
        settings = self.state.settings
        user = flower_user(self)
        if not has_operator_role(user, settings.operators):
            log.warning("fleet: retry of %s refused: %r lacks the operator role",
                        execution_id, user)
            return 403, {"error": "operator_role_required", "message": (
                f"retrying needs the operator role: {user or 'an unauthenticated user'} is "
                "not in FLEET_OPERATORS")}
        if not settings.operator:
            return 409, {"error": "no_operator_principal", "message": (
                "retrying needs an operator principal: set FLEET_OPERATOR (recorded on the "
                "log as who resumed)")}
        try:
            result: RetryResult = await self.blocking(self.state.operator.retry, execution_id)
        except FleetError as exc:
            return 409, {"error": exc.code, "message": exc.message}
        log.info("fleet: %s retried %s as %s: %s", user or "(open)", execution_id,
                 settings.operator, result.message)
        return 200, result.to_dict()


class FleetRetry(_Retry):
    @tornado.web.authenticated
    async def post(self, execution_id: str) -> None:
        status, body = await self.act(execution_id)
        if status == 403:
            raise tornado.web.HTTPError(403, body["message"])
        bad = status != 200 or bool(body.get("reparked"))
        token = self.state.remember(body["message"], bad)
        self.redirect(self.reverse_url("fleet") + f"?result={token}", status=303)


class FleetRetryApi(_Retry):
    @tornado.web.authenticated
    async def post(self, execution_id: str) -> None:
        status, body = await self.act(execution_id)
        self.set_status(status)
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.write(json.dumps(body))


__all__ = ["FleetLogView", "FleetRetry", "FleetRetryApi", "FleetState", "FleetStatusApi",
           "FleetView", "flower_user", "has_operator_role"]
