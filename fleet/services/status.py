"""What the fleet is doing now: executions by state, and the workers (``fleet status``).

Executions come from the store's index (``count_executions``, one grouped
query; a store without it is paged, up to ``page_limit`` rows per state).
With ``FLEET_REDIS_URL`` workers come from every process's own report
(``fleet.services.counters``, decision 0022): a worker's counters, pool and
slots are its reports (a prefork worker's children summed), the services
(timers, recovery, attacher, relay) have theirs, and a process that stopped
reporting is stale. Nothing is broadcast: remote control is the operator
console's alone (decision 0042), and the dispatchers' ``client`` Redis user may
not. Without it (a RabbitMQ-only fleet), workers come from Celery's
``inspect().stats()``, each with the fleet counters its bootstep adds
(``stats["fleet"]``, ``fleet.workers.stats``).

``StatusReader`` keeps one store and one Celery app (a bare one on the broker:
inspecting needs no tasks) open between reads, for ``fleet status --watch``.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fleet.config import FleetSettings
from fleet.host.broker import broker_conf
from fleet.host.celery_api import broker_app
from fleet.host.kernel import open_store_to_read
from fleet.host.loop import EventLoopThread, refuse_inside_loop
from fleet.kernel.errors import FleetError
from fleet.kernel.store.spi import COUNT_EXECUTIONS, CountsExecutions, EventStore, capabilities_of
from fleet.services.counters import CountersReader, FleetCounters, ProcessReport

T = TypeVar("T")

STATES: tuple[str, ...] = ("running", "parked", "completed", "failed", "cancelled",
                           "continued")
#: The worker counters ``fleet status`` shows, in order.
WORKER_FIELDS: tuple[str, ...] = ("active", "drives", "completed", "failed", "parked",
                                  "stepped_aside", "fenced_out", "recovered", "handed_back",
                                  "divergence_warnings", "divergence_parked", "errors")


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One worker as ``inspect stats`` reports it."""

    name: str
    pool: str
    concurrency: int | None
    fleet: dict[str, float]
    pid: int | None = None
    #: Seconds since its last report to Redis (None: none read), and whether stale.
    age_s: float | None = None
    stale: bool = False


@dataclass(frozen=True, slots=True)
class FleetStatus:
    """A snapshot: counts by state, workers, and what could not be read."""

    executions: dict[str, int]
    workers: tuple[WorkerStatus, ...]
    problems: tuple[str, ...] = ()
    at: float = field(default_factory=time.time)
    capped: bool = False  # a paged count stopped at its limit
    counters: FleetCounters | None = None  # every process's report (None: no Redis)

    @property
    def services(self) -> list[ProcessReport]:
        return [] if self.counters is None else [p for p in self.counters.shown
                                                 if p.role != "worker"]

    def to_dict(self) -> dict[str, Any]:
        out = {"at": self.at, "executions": dict(self.executions), "capped": self.capped,
               "workers": [{"name": w.name, "pool": w.pool, "concurrency": w.concurrency,
                            "pid": w.pid, "fleet": dict(w.fleet), "age_s": w.age_s,
                            "stale": w.stale} for w in self.workers],
               "problems": list(self.problems)}
        if self.counters is not None:
            out["services"] = [p.to_dict() for p in self.services]
            out["totals"] = self.counters.totals
            out["streams"] = [st.to_dict() for st in self.counters.streams]
        return out


def merge_workers(inspected: list[WorkerStatus], reports: list[ProcessReport]
                  ) -> list[WorkerStatus]:
    """The workers that answered ``inspect``, with their Redis reports' counters (a prefork
    worker's children, ``<node>#<slot>``, summed), and the reported ones that did not
    answer: stale ones with their last values, never zeros."""
    by_node: dict[str, list[ProcessReport]] = {}
    for report in reports:
        by_node.setdefault(report.name.split("#", 1)[0], []).append(report)
    out: list[WorkerStatus] = []
    for worker in inspected:
        mine = by_node.pop(worker.name, [])
        if not mine:
            out.append(worker)
            continue
        out.append(WorkerStatus(worker.name, worker.pool, worker.concurrency, _sum(mine),
                                worker.pid, min(r.age_s for r in mine),
                                all(r.stale for r in mine)))
    for node, mine in sorted(by_node.items()):
        counters = _sum(mine)
        slots = counters.pop("slots", None)
        out.append(WorkerStatus(node, mine[0].pool, None if slots is None else int(slots),
                                counters, mine[0].pid, min(r.age_s for r in mine),
                                all(r.stale for r in mine)))
    return out


def _sum(reports: list[ProcessReport]) -> dict[str, float]:
    out: dict[str, float] = {}
    for report in reports:
        for name, value in report.counters.items():
            if name == "active" and report.stale:
                continue
            out[name] = out.get(name, 0) + value
    return out


async def execution_counts(store: EventStore, *, page_limit: int = 10_000
                           ) -> tuple[dict[str, int], bool]:
    """``({state: executions}, capped)`` from the store's index."""
    if COUNT_EXECUTIONS in capabilities_of(store) and isinstance(store, CountsExecutions):
        try:
            counts = await store.count_executions()
            return {state: counts.get(state, 0) for state in (*STATES, *counts)}, False
        except FleetError:
            pass  # a decorator over a store that cannot count: page instead
    counts, capped = {}, False
    for state in STATES:
        total, after = 0, None
        while True:
            rows = await store.list_executions(status=state, after_id=after, limit=1000)
            total += len(rows)
            if len(rows) < 1000:
                break
            if total >= page_limit:
                capped = True
                break
            after = rows[-1].execution_id
        counts[state] = total
    return counts, capped


def worker_statuses(app: Any, *, timeout: float = 1.0) -> list[WorkerStatus]:
    """Every worker that answers ``inspect stats`` within ``timeout`` seconds."""
    replies = app.control.inspect(timeout=timeout).stats() or {}
    workers = []
    for name, reply in sorted(replies.items()):
        pool = reply.get("pool") or {}
        implementation = str(pool.get("implementation", ""))
        fleet = {k: v for k, v in (reply.get("fleet") or {}).items()
                 if isinstance(v, int | float)}
        # "celery.concurrency.thread:TaskPool" -> "thread"
        kind = implementation.split(":", 1)[0].rsplit(".", 1)[-1]
        workers.append(WorkerStatus(name=name, pool=kind,
                                    concurrency=pool.get("max-concurrency"), fleet=fleet,
                                    pid=reply.get("pid")))
    return workers


def within(deadline_s: float, call: Callable[[], T], what: str) -> T:
    """``call()`` on a daemon thread, abandoned after ``deadline_s``: a broker that
    accepts connections but never answers cannot hold a command past it (kombu
    reconnects forever on its own)."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)

    threading.Thread(target=run, name=f"fleet-{what}", daemon=True).start()
    try:
        return future.result(deadline_s)
    except concurrent.futures.TimeoutError:
        if future.done():
            raise
        raise TimeoutError(f"no answer within {deadline_s:g} s") from None


class _ReportsInstead(Exception):  # noqa: N818 - control flow inside read(), never raised out
    """The workers' reports in Redis are read instead of inspecting them."""


class StatusReader:
    """Reads ``FleetStatus`` again and again over one store and one app (sync).

    Args:
        settings: Store and broker.
        inspect_timeout: How long workers get to answer, in seconds.
    """

    def __init__(self, settings: FleetSettings, *, inspect_timeout: float = 1.0) -> None:
        refuse_inside_loop("StatusReader")
        self.settings = settings
        self.inspect_timeout = inspect_timeout
        #: The longest a read waits for the broker: the workers' answers, plus the
        #: connect and one command's deadline.
        self.broker_deadline_s = (inspect_timeout + settings.broker_connect_timeout_s
                                  + settings.broker_socket_timeout_s)
        self._loop = EventLoopThread("fleet-status", event_loop=settings.event_loop)
        self._loop.start()
        self._store: EventStore | None = None
        self._app: Any = None
        self._counters: CountersReader | None = None

    async def _counts(self) -> tuple[dict[str, int], bool]:
        if self._store is None:
            # A reader: a missing SQLite file is a problem to show, not one to create.
            self._store = open_store_to_read(self.settings)
        return await execution_counts(self._store)

    def read(self) -> FleetStatus:
        """One snapshot; a part that cannot be read is named in ``problems``."""
        problems: list[str] = []
        counts: dict[str, int] = {}
        capped = False
        try:
            counts, capped = self._loop.run_coroutine(self._counts(), timeout=30)
        except Exception as exc:  # noqa: BLE001 - shown, and the rest still reported
            problems.append(f"store: {type(exc).__name__}: {exc}")
        workers: list[WorkerStatus] = []
        try:
            if self.settings.redis_url:
                # Every worker's own report (read below) says what inspect would: no
                # broadcast, which is the operator console's alone (decision 0042).
                raise _ReportsInstead
            if self._app is None:
                self._app = broker_app("fleet-status", self.settings.broker,
                                       **broker_conf(self.settings))
            app = self._app
            workers = within(self.broker_deadline_s,
                             lambda: worker_statuses(app, timeout=self.inspect_timeout),
                             "status-inspect")
        except _ReportsInstead:
            pass
        except Exception as exc:  # noqa: BLE001 - shown, and the rest still reported
            problems.append(f"broker: {type(exc).__name__}: {exc}")
        counters: FleetCounters | None = None
        if self.settings.redis_url:
            if self._counters is None:
                self._counters = CountersReader(self.settings)
            counters = self._counters.read()
            problems += counters.problems
            # A stopped or gone worker is not shown (decision 0047); its counters stay
            # in the totals.
            workers = merge_workers(workers, [r for r in counters.of("worker") if r.shown])
        return FleetStatus(counts, tuple(workers), tuple(problems), capped=capped,
                           counters=counters)

    def close(self) -> None:
        if self._counters is not None:
            self._counters.close()
        if self._store is not None:
            store, self._store = self._store, None
            try:
                self._loop.run_coroutine(store.close(), timeout=10)
            except Exception:  # noqa: BLE001 - closing regardless
                pass
        self._loop.stop()
        if self._app is not None:
            app, self._app = self._app, None
            try:
                within(self.settings.broker_connect_timeout_s, app.close, "status-close")
            except Exception:  # noqa: BLE001 - a wedged broker connection is left behind
                pass

    def __enter__(self) -> StatusReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["STATES", "WORKER_FIELDS", "FleetStatus", "StatusReader", "WorkerStatus",
           "execution_counts", "merge_workers", "within", "worker_statuses"]
