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

``BacklogReader`` reads it from a sync caller (the metrics server's thread, Flower's
executor) on a loop thread of its own, one read at a time: callers that arrive
while a read is running, or within ``max_age_s`` of the last one, share its answer,
so a scrape costs one query whatever the number of scrapers.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet.config import FleetSettings
from fleet.host.kernel import open_store_to_read
from fleet.host.loop import EventLoopThread
from fleet.kernel.errors import ConfigurationError
from fleet.kernel.fold import DIVERGED_GATE, INDOUBT_GATE
from fleet.kernel.store.backlog import Backlog, ReportsBacklog
from fleet.kernel.store.spi import EventStore

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
    """Reads ``BacklogSnapshot`` from sync code, on a store and loop thread of its own.

    Args:
        settings: The store.
        route: The queue of a flow's and tenant's drives.
        max_age_s: A read this recent is answered again instead of querying.
        timeout_s: The longest one read may take.
    """

    def __init__(self, settings: FleetSettings, route: Route, *, max_age_s: float = 1.0,
                 timeout_s: float = 20.0) -> None:
        self.settings = settings
        self.route = route
        self.max_age_s = max_age_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._last: BacklogSnapshot | None = None
        self._loop: EventLoopThread | None = None
        self._store: EventStore | None = None
        #: (queue, flow) pairs seen with a backlog: shown at 0 once it drained, so a
        #: graph falls to 0 rather than ending (the most recent ``SEEN_KEPT``).
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.reads = 0

    def read(self) -> BacklogSnapshot:
        """The backlog now (or within ``max_age_s``); raises what the store raised."""
        with self._lock:
            last = self._last
            if last is not None and time.time() - last.at <= self.max_age_s:
                return last
            if self._loop is None:
                self._loop = EventLoopThread("fleet-backlog",
                                             event_loop=self.settings.event_loop)
                self._loop.start()
            snapshot = self._loop.run_coroutine(self._read(), timeout=self.timeout_s)
            self._last = snapshot
            self.reads += 1
            return snapshot

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
        return BacklogSnapshot(tuple(rows[k] for k in sorted(rows)), parked, now_ms / 1000)

    def close(self) -> None:
        with self._lock:
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
