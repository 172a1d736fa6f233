"""The Fleet page's Tornado handlers, inside Flower (``fleet.flowerui``).

==============================  ======  ==============================================
``/fleet``                      GET     the page (Flower's look, auto-refresh)
``/fleet/runbook``              GET     what each alarm means and what to do
``/fleet/api/status``           GET     the same as JSON
``/fleet/execution/<id>``       GET     an execution's log
``/fleet/diverged/<id>/retry``  POST    Retry (a form; redirects to the page)
``/fleet/api/diverged/<id>/retry`` POST Retry, answered as JSON
``/fleet/diverged/retry``       POST    Retry all diverged (of a flow), at most
                                        ``BULK_LIMIT`` a click, ``BULK_RATE`` a second
``/fleet/api/diverged/retry``   POST    the same as JSON (``dry_run=1``: list only)
==============================  ======  ==============================================

Every handler is a Flower handler: Flower's authentication applies (basic
auth, OAuth; the API as Flower's own API, ``FLOWER_UNAUTHENTICATED_API``). A
Retry also needs the operator role (``FLEET_OPERATORS``; nobody has it on a
Flower without authentication) and Tornado's XSRF token, whatever Flower's own
checks waive; it is written as ``FLEET_OPERATOR``. What a user reads is scoped
to its tenants (``fleet.flowerui.roles``): the parked list and the logs of the
executions it may see; another tenant's execution is "no such execution".
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from typing import Any

import tornado.escape
import tornado.web
from flower.api import BaseApiHandler  # type: ignore[import-untyped]  # no type hints
from flower.views import BaseHandler  # type: ignore[import-untyped]  # no type hints
from tornado.ioloop import IOLoop

from fleet.config import FleetSettings
from fleet.dispatcher.operator import GATES, Operator, ParkedExecution, RetryResult
from fleet.dispatcher.routing import route_queue
from fleet.flowerui.roles import Viewer, flower_user, has_operator_role, viewer_of
from fleet.kernel.bulk import BulkReport, ExecutionFilter
from fleet.kernel.errors import FleetError
from fleet.services.alarms import RUNBOOK, fleet_alarms
from fleet.services.backlog import BacklogReader, BacklogSnapshot
from fleet.services.counters import WORKER_COUNTERS, CountersReader, FleetCounters

log = logging.getLogger("fleet.flower")

#: The totals the page shows first, as cards.
HEADLINE: tuple[str, ...] = ("drives", "completed", "parked", "active", "divergence_warnings",
                             "divergence_parked", "fenced_out", "timers_fired",
                             "outcomes_attached", "outcomes_dead_lettered", "handed_back",
                             "errors")
REFRESH_S = 5
#: The worker counters the Workers table shows as columns (the rest, per worker, under
#: "more": the table fits a 1280 px screen, issue 29.11), with their short headers.
WORKER_COLUMNS: tuple[str, ...] = (
    "drives", "completed", "active", "parked", "recovered", "stepped_aside", "failed",
    "fenced_out", "divergence_warnings", "divergence_parked", "dispatch_refused", "errors")
SHORT: dict[str, str] = {"stepped_aside": "aside", "fenced_out": "fenced",
                         "recovered": "recov.", "divergence_warnings": "div. warn",
                         "divergence_parked": "div. park", "dispatch_refused": "disp. refused",
                         "completed": "done"}
#: Most diverged executions one "Retry all" retries (the page says how many remain),
#: and how many a second (``fleet.kernel.bulk``: the workers get a trickle, not a flood).
BULK_LIMIT = 200
BULK_RATE = 20.0


class FleetState:
    """What the handlers share: the counters' and the backlog's readers and the operator
    (each opened lazily)."""

    def __init__(self, settings: FleetSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._reader: CountersReader | None = None
        self._operator: Operator | None = None
        self.backlog_reader = BacklogReader(settings, self.route,
                                            refresh_s=settings.metrics_refresh_s)
        self.results: OrderedDict[str, tuple[str, bool]] = OrderedDict()
        self.metrics_server: Any = None

    def route(self, flow_id: str, tenant: str | None) -> str:
        """The queue a drive of this flow and tenant goes to (``FLEET_ROUTES``)."""
        return route_queue(self.settings.routes, self.settings.queue, flow_id=flow_id,
                           tenant=tenant)

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

    def backlog(self) -> BacklogSnapshot:
        """What waits now and what is parked (the store's index; decision 0046)."""
        return self.backlog_reader.read()

    def runbook_url(self, handler: Any) -> str:
        """Where the alarms link to: ``FLEET_RUNBOOK_URL``, else Flower's copy."""
        return self.settings.runbook_url or handler.reverse_url("fleet-runbook")

    def snapshot_for(self, viewer: Viewer, runbook_url: str = "") -> dict[str, Any]:
        """``snapshot`` as ``viewer`` may read it: the parked executions of its tenants only,
        and no execution ids in the workers' reports unless it reads every tenant."""
        data = self.snapshot(runbook_url)
        if viewer.reads_every_tenant:
            return data
        data["parked"] = [p for p in data["parked"] if viewer.sees(p.get("tenant"))]
        for process in data["processes"]:
            process["parks"] = []
        data["scoped_to"] = sorted(viewer.tenants or ())
        return data

    def snapshot(self, runbook_url: str = "") -> dict[str, Any]:
        """The page's data (also ``/fleet/api/status``), every tenant's."""
        counters = self.counters()
        data = counters.to_dict()
        parked: list[ParkedExecution] = []
        backlog: BacklogSnapshot | None = None
        try:
            backlog = self.backlog()
        except Exception as exc:  # noqa: BLE001 - shown on the page, the rest still served
            data["problems"].append(f"backlog: {type(exc).__name__}: {exc}")
        try:
            parked = self.operator.parked(gates=GATES)
        except Exception as exc:  # noqa: BLE001 - shown on the page, the rest still served
            data["problems"].append(f"store: {type(exc).__name__}: {exc}")
        try:
            data["schedules"] = [s.to_dict() for s in self.operator.schedules()]
        except Exception as exc:  # noqa: BLE001 - shown on the page, the rest still served
            data["schedules"] = []
            data["problems"].append(f"schedules: {type(exc).__name__}: {exc}")
        by = counters.parked_by()
        data["parked"] = [{**p.to_dict(), "worker": p.worker or by.get(p.execution_id)}
                          for p in parked]
        data["parked_now"] = dict(backlog.parked) if backlog is not None else None
        # Every declared queue (decision 0056), read with the backlog off the page's thread.
        data["queues"] = [] if backlog is None else [q.to_dict() for q in backlog.queues]
        data["backlog"] = [] if backlog is None else [
            {"queue": r.queue, "flow": r.flow_id, "unowned": r.unowned,
             "oldestUnownedS": r.oldest_unowned_s, "timersDue": r.timers_due,
             "timersLateS": r.timers_late_s} for r in backlog.rows]
        alarms = fleet_alarms(counters, parked=None if backlog is None else backlog.parked,
                              now=time.time(), window_s=self.settings.alarm_window_s)
        data["alarms"] = {a.name: a.to_dict(runbook_url) for a in alarms}
        data["risen"] = sorted({a.kind for a in alarms})
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
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        if self._reader is not None:
            self._reader.close()
        self.backlog_reader.close()
        if self._operator is not None:
            self._operator.close()


def format_number(value: Any) -> str:
    if value is None:
        return "—"
    number = float(value)
    return f"{int(number):,}" if number.is_integer() else f"{number:,.1f}"


def code_spans(text: str) -> str:
    """``text`` as HTML, escaped, its `backticked` parts as ``<code>`` (the runbook's)."""
    parts = str(text).split("`")
    return "".join(tornado.escape.xhtml_escape(part) if i % 2 == 0
                   else f"<code>{tornado.escape.xhtml_escape(part)}</code>"
                   for i, part in enumerate(parts))


def format_ms(ms: float | None) -> str:
    if not ms:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(ms) / 1000))


class _FleetHandler(BaseHandler):  # type: ignore[misc]  # Flower's class is untyped
    def initialize(self, state: FleetState) -> None:
        self.state = state

    async def blocking(self, fn: Any, *args: Any) -> Any:
        return await IOLoop.current().run_in_executor(None, fn, *args)


class FleetView(_FleetHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        settings = self.state.settings
        viewer = viewer_of(self, settings)
        data = await self.blocking(self.state.snapshot_for, viewer, self.state.runbook_url(self))
        token = self.get_argument("result", None)
        message, bad = self.state.results.get(token or "", ("", False))
        can_retry = bool(settings.operator) and viewer.operator
        retry_off = ("set FLEET_OPERATOR to retry" if not settings.operator
                     else "needs the operator role (FLEET_OPERATORS)")
        # Stopped and gone processes leave the page (their counters stay in the totals).
        processes = [p for p in data["processes"] if p["state"] in ("live", "missing")]
        now, window = time.time(), settings.alarm_window_s
        self.render("fleet.html", data=data, message=message, message_bad=bad,
                    headline=HEADLINE, risen=frozenset(data["risen"]),
                    rose=lambda p, name: now - p["rose"].get(name, -1e18) <= window,
                    hidden=len(data["processes"]) - len(processes), alarm_window_s=window,
                    worker_counters=WORKER_COUNTERS, worker_columns=WORKER_COLUMNS,
                    short=SHORT,
                    workers=[p for p in processes if p["role"] == "worker"],
                    services=[p for p in processes if p["role"] != "worker"],
                    can_retry=can_retry, retry_off=retry_off, refresh_s=REFRESH_S,
                    events_stream=settings.events_stream, format_number=format_number,
                    format_ms=format_ms, code_spans=code_spans)


class FleetLogView(_FleetHandler):
    @tornado.web.authenticated
    async def get(self, execution_id: str) -> None:
        viewer = viewer_of(self, self.state.settings)
        events = await self.blocking(self.state.operator.visible_events, execution_id,
                                     viewer.tenants)
        if events is None:  # none, or not this user's tenant's: the same answer (no oracle)
            raise tornado.web.HTTPError(404, f"no execution {execution_id[:200]!r}")
        shown = [{"sequence": e.sequence, "timestamp": e.timestamp, "type": str(e.type),
                  "payload": json.dumps(e.payload, ensure_ascii=False)[:2000],
                  "danger": (e.payload.get("condition") or {}).get("on") in GATES
                  if isinstance(e.payload, dict) else False} for e in events]
        self.render("fleet_log.html", execution_id=execution_id, events=events, shown=shown,
                    format_ms=format_ms)


class FleetRunbook(_FleetHandler):
    """The runbook's entries for the alarms (``docs/operations.md``, section Runbook)."""

    @tornado.web.authenticated
    async def get(self) -> None:
        self.render("fleet_runbook.html", entries=list(RUNBOOK.values()),
                    code_spans=code_spans)


class FleetStatusApi(BaseApiHandler):  # type: ignore[misc]  # Flower's class is untyped
    def initialize(self, state: FleetState) -> None:
        self.state = state

    @tornado.web.authenticated
    async def get(self) -> None:
        viewer = viewer_of(self, self.state.settings)
        data = await IOLoop.current().run_in_executor(None, self.state.snapshot_for, viewer,
                                                      self.state.runbook_url(self))
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

    def refusal(self, what: str) -> tuple[int, dict[str, Any]] | None:
        """Why this user may not retry (403: no operator role; 409: no operator principal)."""
        settings = self.state.settings
        user = flower_user(self)  # only a user Flower authenticated: never a forged header
        if not has_operator_role(user, settings.operators):
            log.warning("fleet: retry of %s refused: %r lacks the operator role", what, user)
            return 403, {"error": "operator_role_required", "message": (
                f"retrying needs the operator role: {user or 'an unauthenticated user'} is "
                "not in FLEET_OPERATORS")}
        if not settings.operator:
            return 409, {"error": "no_operator_principal", "message": (
                "retrying needs an operator principal: set FLEET_OPERATOR (recorded on the "
                "log as who resumed)")}
        return None

    async def act(self, execution_id: str) -> tuple[int, dict[str, Any]]:
        settings = self.state.settings
        user = flower_user(self)
        refused = self.refusal(execution_id)
        if refused is not None:
            return refused
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


class _BulkRetry(_Retry):
    """Retry every diverged execution (of one flow, ``flow=``), as ``fleet executions
    retry`` does: each as the single Retry, audited, paced, at most ``BULK_LIMIT``."""

    async def act_all(self) -> tuple[int, dict[str, Any]]:
        flow = self.get_argument("flow", "").strip() or None
        dry_run = self.get_argument("dry_run", "") in ("1", "true", "on")
        refused = None if dry_run else self.refusal(f"all diverged ({flow or 'every flow'})")
        if refused is not None:
            return refused
        try:
            report: BulkReport = await self.blocking(
                lambda: self.state.operator.bulk("retry", ExecutionFilter(flow=flow),
                                                 dry_run=dry_run, rate=BULK_RATE,
                                                 limit=BULK_LIMIT))
        except FleetError as exc:
            return 409, {"error": exc.code, "message": exc.message}
        body = report.to_dict()
        scope = f"flow {flow}" if flow else "every flow"
        if dry_run:
            body["message"] = f"{report.matched} diverged execution(s) of {scope} would be retried"
        else:
            more = " (more remain: retry all again)" if report.stopped else ""
            body["message"] = (f"retried {report.acted} diverged execution(s) of {scope}; "
                               f"{report.skipped} done already, {report.failed} failed{more}")
            log.info("fleet: %s retried all diverged of %s as %s: %s",
                     flower_user(self) or "(open)", scope, self.state.settings.operator,
                     body["message"])
        return 200, body


class FleetBulkRetry(_BulkRetry):
    @tornado.web.authenticated
    async def post(self) -> None:
        status, body = await self.act_all()
        if status == 403:
            raise tornado.web.HTTPError(403, body["message"])
        token = self.state.remember(body["message"], status != 200 or bool(body.get("failed")))
        self.redirect(self.reverse_url("fleet") + f"?result={token}", status=303)


class FleetBulkRetryApi(_BulkRetry):
    @tornado.web.authenticated
    async def post(self) -> None:
        status, body = await self.act_all()
        self.set_status(status)
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.write(json.dumps(body))


class FleetRetryApi(_Retry):
    @tornado.web.authenticated
    async def post(self, execution_id: str) -> None:
        status, body = await self.act(execution_id)
        self.set_status(status)
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.write(json.dumps(body))


__all__ = ["BULK_LIMIT", "BULK_RATE", "SHORT", "WORKER_COLUMNS", "FleetBulkRetry",
           "FleetBulkRetryApi", "FleetLogView", "FleetRetry", "FleetRetryApi", "FleetRunbook",
           "FleetState", "FleetStatusApi", "FleetView"]
