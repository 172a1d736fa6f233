"""What waits now, per queue and flow: the store's backlog routed to its Celery queues.

The store answers per flow and tenant (``ReportsBacklog.backlog``: one indexed query
on Postgres, never a fold; decision 0046); each group goes to the queue its drives
are published on (``route``: ``fleet.dispatcher.routing.route_queue`` over
``FLEET_ROUTES`` and ``FLEET_QUEUE``, the way the dispatcher and KEDA's
``fleet_scaler_unowned`` route them).
The result is what the metrics export (``fleet_executions_unowned``,
``fleet_executions_unowned_oldest_seconds``, ``fleet_timers_due``,
``fleet_timers_late_seconds``, ``fleet_executions_parked``) and the Fleet page's
parked counts.

``BacklogReader`` keeps the latest snapshot for sync callers (the metrics server's
thread, Flower's executor): a thread of its own queries the store every
``FLEET_METRICS_REFRESH_S`` while anyone reads, and a read answers the latest, so a
scrape costs the same whatever the backlog and the number of scrapers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet.config import FleetSettings
from fleet.host.kernel import open_store_to_read
from fleet.host.loop import EventLoopThread
from fleet.kernel.errors import ConfigurationError, StoreUnavailableError
from fleet.kernel.fold import DIVERGED_GATE, INDOUBT_GATE
from fleet.kernel.store.backlog import Backlog, ReportsBacklog
from fleet.kernel.store.spi import EventStore
from fleet.kernel.store.spi_queues import HoldsQueues, QueueDepth, holds_queues

log = logging.getLogger("fleet.metrics")

#: The operator's gates, by the name the metrics and the page give them.
GATE_KINDS: dict[str, str] = {DIVERGED_GATE: "diverged", INDOUBT_GATE: "in-doubt"}
#: The most (queue, flow) pairs kept at 0 once their backlog drained (see ``_seen``).
SEEN_KEPT = 2_000
#: The queue of a drive of ``(flow_id, tenant)``.
Route = Callable[[str, "str | None"], str]


@dataclass(frozen=True, slots=True)
class QueueBacklog:
    """What waits on one queue for one flow."""

    queue: str
    flow_id: str
    unowned: int = 0
    oldest_unowned_s: float = 0.0
    timers_due: int = 0
    timers_late_s: float = 0.0


@dataclass(frozen=True, slots=True)
class BacklogSnapshot:
    """The backlog by (queue, flow), the executions parked by kind, when it was read."""

    rows: tuple[QueueBacklog, ...]
    parked: dict[str, int] = field(default_factory=dict)
    at: float = field(default_factory=time.time)
    #: Every declared queue's depth (decision 0056), when the store keeps queues.
    queues: tuple[QueueDepth, ...] = ()

    def unowned(self, queue: str) -> int:
        return sum(r.unowned for r in self.rows if r.queue == queue)


def route_backlog(backlog: Backlog, *, now_ms: int, route: Route
                  ) -> tuple[QueueBacklog, ...]:
    """The store's groups summed by (queue, flow); ages in seconds at ``now_ms``."""
    merged: dict[tuple[str, str], list[float]] = {}
    for group in backlog.groups:
        queue = route(group.flow_id, group.tenant)
        row = merged.setdefault((queue, group.flow_id), [0, 0.0, 0, 0.0])
        row[0] += group.unowned
        row[2] += group.timers_due
        if group.unowned_since is not None:
            row[1] = max(row[1], (now_ms - group.unowned_since) / 1000)
        if group.due_since is not None:
            row[3] = max(row[3], (now_ms - group.due_since) / 1000)
    return tuple(QueueBacklog(queue, flow, int(r[0]), round(max(0.0, r[1]), 3), int(r[2]),
                              round(max(0.0, r[3]), 3))
                 for (queue, flow), r in sorted(merged.items()))


class BacklogReader:
    """The latest ``BacklogSnapshot``, kept fresh by a thread of its own, for sync code.

    A read never queries: it answers the snapshot the refresher made last (the first
    read waits for the first one). While anyone reads, the refresher queries the
    store every ``refresh_s`` (the backlog, then the queues' depths; one query at a
    time, on a loop thread and one connection of its own); after ``idle_s`` without a
    read it stops querying until
    the next read. So a scrape costs the same however much waits, and the store sees
    one backlog query per ``refresh_s`` however many scrape (decision 0046).

    Args:
        settings: The store.
        route: The queue of a flow's and tenant's drives.
        refresh_s: Seconds between two queries (``FLEET_METRICS_REFRESH_S``).
        timeout_s: The longest one query, and the first read, may take.
        stale_s: A snapshot older than this is refused (``StoreUnavailableError``):
            the store has not answered for that long, and old numbers must not pass
            for the present (default: three refreshes and a timeout).
        idle_s: No read for this long: the refresher pauses.
    """

    def __init__(self, settings: FleetSettings, route: Route, *, refresh_s: float = 5.0,
                 timeout_s: float = 20.0, stale_s: float | None = None,
                 idle_s: float = 300.0) -> None:
        if refresh_s <= 0 or timeout_s <= 0:
            raise ConfigurationError("BacklogReader: refresh_s and timeout_s must be > 0")
        self.settings = settings
        self.route = route
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self.stale_s = stale_s if stale_s is not None else 3 * refresh_s + timeout_s
        self.idle_s = idle_s
        self._cond = threading.Condition()
        self._snapshot: BacklogSnapshot | None = None
        self._error: BaseException | None = None
        self._last_read = 0.0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: EventLoopThread | None = None
        self._store: EventStore | None = None
        #: (queue, flow) pairs seen with a backlog: shown at 0 once it drained, so a
        #: graph falls to 0 rather than ending (the most recent ``SEEN_KEPT``).
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.reads = 0  # queries made

    def read(self) -> BacklogSnapshot:
        """The latest snapshot; raises the store's error when there is none yet, or when
        the latest is older than ``stale_s``."""
        with self._cond:
            self._last_read = time.monotonic()
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._run, name="fleet-backlog",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()  # wake a paused refresher
            if self._snapshot is None:
                self._cond.wait_for(lambda: self._snapshot is not None
                                    or self._error is not None, self.timeout_s)
            snapshot, error = self._snapshot, self._error
        if snapshot is None:
            raise error or StoreUnavailableError(
                f"the store's backlog did not answer within {self.timeout_s:g} s")
        age = time.time() - snapshot.at
        if age > self.stale_s:
            cause = f": {type(error).__name__}: {error}" if error else ""
            raise StoreUnavailableError(f"the store's backlog was last read {age:.0f} s "
                                        f"ago{cause}")
        return snapshot

    def _run(self) -> None:
        while True:
            with self._cond:
                while (not self._stopping
                       and time.monotonic() - self._last_read > self.idle_s):
                    self._cond.wait()  # nobody reads: no query until somebody does
                if self._stopping:
                    return
            try:
                if self._loop is None:
                    self._loop = EventLoopThread("fleet-backlog-loop",
                                                 event_loop=self.settings.event_loop)
                    self._loop.start()
                snapshot = self._loop.run_coroutine(self._read(), timeout=self.timeout_s)
                with self._cond:
                    self._snapshot, self._error = snapshot, None
                    self.reads += 1
                    self._cond.notify_all()
            except Exception as exc:  # noqa: BLE001 - kept for the readers, tried again
                log.warning("fleet backlog: cannot read the store: %s: %s",
                            type(exc).__name__, exc)
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
            with self._cond:
                self._cond.wait_for(lambda: self._stopping, self.refresh_s)

    async def _read(self) -> BacklogSnapshot:
        if self._store is None:
            # One query at a time: one connection (Postgres; it wins over the URL's sizes).
            self._store = open_store_to_read(self.settings.model_copy(
                update={"pg_pool_min": 1, "pg_pool_max": 1}))
        store = self._store
        if not isinstance(store, ReportsBacklog):
            raise ConfigurationError(f"{type(store).__name__} cannot report its backlog "
                                     "(ReportsBacklog)")
        now_ms = int(time.time() * 1000)
        backlog = await store.backlog(now_ms, gates=list(GATE_KINDS))
        rows = {(r.queue, r.flow_id): r for r in route_backlog(
            backlog, now_ms=now_ms, route=self.route)}
        for key in rows:
            self._seen[key] = None
            self._seen.move_to_end(key)
        while len(self._seen) > SEEN_KEPT:
            self._seen.popitem(last=False)
        for queue, flow in self._seen:
            rows.setdefault((queue, flow), QueueBacklog(queue, flow))
        parked = {kind: backlog.parked.get(gate, 0) for gate, kind in GATE_KINDS.items()}
        queues: tuple[QueueDepth, ...] = ()
        if holds_queues(store) and isinstance(store, HoldsQueues):
            queues = tuple(await store.queue_depths(now_ms))
        return BacklogSnapshot(tuple(rows[k] for k in sorted(rows)), parked, now_ms / 1000,
                               queues)

    def close(self) -> None:
        """Stop the refresher, close the store and the loop."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(self.timeout_s + 5)
        loop, self._loop = self._loop, None
        store, self._store = self._store, None
        if loop is None:
            return
        try:
            if store is not None:
                loop.run_coroutine(store.close(), timeout=10)
        except Exception:  # noqa: BLE001 - closing regardless
            pass
        loop.stop()


__all__ = ["GATE_KINDS", "BacklogReader", "BacklogSnapshot", "QueueBacklog", "Route",
           "route_backlog"]
