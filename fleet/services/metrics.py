"""Prometheus metrics over the fleet: one collector, one scrape target (decisions 0022, 0046).

``FleetCollector`` is served by ``fleet flower`` only: on ``FLEET_METRICS_PORT`` (the
port the manifests open to the scraper alone, annotated for scraping) and on
Flower's own ``/metrics`` behind Flower's authentication, both computed off
Flower's event loop (``fleet.flowerui.metrics``). Every fact is exported there
once: each process's counters as it last reported them to Redis, the streams,
and what the store says waits now. A service process's own ``/metrics`` carries
only its Python and process metrics, so nothing is counted twice.

Families:

* per process (``role``, ``process``), for the processes that report now or are
  missing (decision 0047; one that stopped cleanly or was replaced is left out: its
  series end): a counter ``fleet_<name>_total`` for each counter it reports
  (``fleet_drives_total``, ``fleet_divergence_parked_total``,
  ``fleet_timers_fired_total``...), a gauge ``fleet_<name>`` for its gauges
  (``fleet_active``, ``fleet_lag_ms``...), ``fleet_process_stale`` (1: missing, red
  on the Fleet page) and ``fleet_process_report_age_seconds``;
* ``fleet_processes_live{role}``: the processes of each role reporting now;
* ``fleet_stream_length``, ``fleet_stream_group_lag``, ``fleet_stream_dead_letters``;
* from the store (``BacklogSnapshot``), per ``queue`` and ``flow``:
  ``fleet_executions_unowned`` (runnable, no live lease),
  ``fleet_executions_unowned_oldest_seconds``, ``fleet_timers_due`` (due, not
  fired) and ``fleet_timers_late_seconds`` (the oldest due one's lateness); and
  ``fleet_executions_parked{gate="diverged"|"in-doubt"}`` (parked now), and
  ``fleet_backlog_age_seconds`` (how old those numbers are: the exporter reads the
  store every ``FLEET_METRICS_REFRESH_S``, and a scrape answers the latest read).
* per queue (decision 0056), read from the store: ``fleet_queue_waiting``,
  ``fleet_queue_oldest_wait_seconds``, ``fleet_queue_running``, ``fleet_queue_delayed``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet.kernel.store.spi_queues import QueueDepth
from fleet.services.backlog import BacklogSnapshot
from fleet.services.counters import GAUGES, MISSING, ROLES, FleetCounters

log = logging.getLogger("fleet.metrics")

_NAME = re.compile(r"[^a-zA-Z0-9_]")
#: What a counter means, for its HELP line (the rest say "reported by the process").
HELP: dict[str, str] = {
    "drives": "runs started", "completed": "runs that ended the execution",
    "failed": "runs that failed the execution", "parked": "runs that parked the execution",
    "stepped_aside": "deliveries that found a live lease", "fenced_out":
    "runs whose writes were refused (a stale fence)", "recovered":
    "drives that resumed a run a dead holder left", "timers_fired": "timers fired",
    "divergence_warnings": "replay divergences reported (warn mode)",
    "divergence_parked": "runs parked on the divergence gate",
    "handed_back": "runs let go at shutdown", "outcomes_attached": "late outcomes attached",
    "outcomes_dead_lettered": "reward messages dead-lettered",
    "dispatch_refused": "fleet.dispatch messages refused",
    "dispatch_accepted": "fleet.dispatch messages carried out",
    "published": "events the relay published", "lag_ms": "the relay's lag (ms)",
    "active": "runs in flight now"}


def metric_name(counter: str) -> str:
    return "fleet_" + _NAME.sub("_", counter)


class FleetCollector(Collector):
    """A collector over ``read()`` (a ``FleetCounters``) and ``backlog()`` (what waits
    now, from the store, every queue's depth among it), if given. A part that cannot be
    read is logged and left out; the rest is still served."""

    def __init__(self, read: Callable[[], FleetCounters],
                 backlog: Callable[[], BacklogSnapshot] | None = None) -> None:
        self.read = read
        self.backlog = backlog

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: its families depend on what processes report

    def collect(self) -> Iterator[Metric]:
        try:
            fleet: FleetCounters | None = self.read()
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail the whole page
            log.warning("fleet metrics: cannot read the counters: %s: %s",
                        type(exc).__name__, exc)
            fleet = None
        if fleet is not None:
            yield from self._processes(fleet)
            yield from self._streams(fleet)
        if self.backlog is not None:
            try:
                snapshot = self.backlog()
            except Exception as exc:  # noqa: BLE001 - the rest is still served
                log.warning("fleet metrics: cannot read the backlog: %s: %s",
                            type(exc).__name__, exc)
                return
            yield from backlog_families(snapshot)
            yield from queue_families(snapshot.queues)

    def _processes(self, fleet: FleetCounters) -> Iterator[Metric]:
        families: dict[str, Any] = {}
        labels = ["role", "process"]
        shown = fleet.shown
        for process in shown:
            for name, value in sorted(process.counters.items()):
                metric = metric_name(name)
                family = families.get(metric)
                if family is None:
                    help_text = HELP.get(name, f"{name}, as the process reports it")
                    family = (GaugeMetricFamily(metric, help_text, labels=labels)
                              if name in GAUGES else
                              CounterMetricFamily(metric, help_text, labels=labels))
                    families[metric] = family
                family.add_metric([process.role, process.name], value)
        yield from families.values()
        stale = GaugeMetricFamily("fleet_process_stale", "1: the process stopped reporting "
                                  "without a clean stop and is still expected back (its "
                                  "counters are its last values)", labels=labels)
        age = GaugeMetricFamily("fleet_process_report_age_seconds",
                                "seconds since the process last reported", labels=labels)
        for process in shown:
            stale.add_metric([process.role, process.name], 1 if process.state == MISSING
                             else 0)
            age.add_metric([process.role, process.name], round(process.age_s, 3))
        yield stale
        yield age
        live = GaugeMetricFamily("fleet_processes_live", "processes of the role reporting now",
                                 labels=["role"])
        for role in ROLES:
            live.add_metric([role], fleet.live(role))
        yield live

    def _streams(self, fleet: FleetCounters) -> Iterator[Metric]:
        if not fleet.streams:
            return
        length = GaugeMetricFamily("fleet_stream_length", "entries in the stream",
                                   labels=["stream"])
        lag = GaugeMetricFamily("fleet_stream_group_lag", "entries a consumer group has "
                                "not read yet", labels=["stream", "group"])
        dead = GaugeMetricFamily("fleet_stream_dead_letters", "entries in the stream's "
                                 "dead letters", labels=["stream"])
        for stream in fleet.streams:
            length.add_metric([stream.stream], stream.length or 0)
            dead.add_metric([stream.stream], stream.dead_letters or 0)
            for group, behind in stream.groups.items():
                if behind is not None:
                    lag.add_metric([stream.stream, group], behind)
        yield length
        yield lag
        yield dead


def backlog_families(snapshot: BacklogSnapshot) -> Iterator[Metric]:
    """The store's part: what waits per queue and flow, and what is parked now."""
    labels = ["queue", "flow"]
    unowned = GaugeMetricFamily("fleet_executions_unowned", "runnable executions no live "
                                "lease holds (queued, reserved, or left by a dead holder)",
                                labels=labels)
    oldest = GaugeMetricFamily("fleet_executions_unowned_oldest_seconds", "how long the "
                               "oldest unowned execution has waited", labels=labels)
    due = GaugeMetricFamily("fleet_timers_due", "timers due and not fired", labels=labels)
    late = GaugeMetricFamily("fleet_timers_late_seconds", "how late the oldest timer due "
                             "and not fired is", labels=labels)
    for row in snapshot.rows:
        key = [row.queue, row.flow_id]
        unowned.add_metric(key, row.unowned)
        oldest.add_metric(key, row.oldest_unowned_s)
        due.add_metric(key, row.timers_due)
        late.add_metric(key, row.timers_late_s)
    yield unowned
    yield oldest
    yield due
    yield late
    parked = GaugeMetricFamily("fleet_executions_parked", "executions parked now on an "
                               "operator's gate (diverged, in-doubt)", labels=["gate"])
    for kind in ("diverged", "in-doubt"):
        parked.add_metric([kind], snapshot.parked.get(kind, 0))
    yield parked
    yield GaugeMetricFamily("fleet_backlog_age_seconds", "how old the store's numbers above "
                            "are (read every FLEET_METRICS_REFRESH_S)",
                            value=round(max(0.0, time.time() - snapshot.at), 3))


def queue_families(depths: Sequence[QueueDepth]) -> Iterator[Metric]:
    """The queue gauges (the module's docstring), one sample per queue."""
    waiting = GaugeMetricFamily("fleet_queue_waiting", "runs waiting for a slot of their "
                                "queue now (eligible, not admitted)", labels=["queue"])
    oldest = GaugeMetricFamily("fleet_queue_oldest_wait_seconds", "how long the longest "
                               "waiting run of the queue has waited (0: none waits)",
                               labels=["queue"])
    running = GaugeMetricFamily("fleet_queue_running", "admitted runs of the queue that have "
                                "not ended (the slots taken)", labels=["queue"])
    delayed = GaugeMetricFamily("fleet_queue_delayed", "queued runs not eligible yet (a "
                                "delayed or debounced start)", labels=["queue"])
    for depth in depths:
        waiting.add_metric([depth.queue], depth.waiting)
        oldest.add_metric([depth.queue], (depth.oldest_wait_ms or 0) / 1000)
        running.add_metric([depth.queue], depth.running)
        delayed.add_metric([depth.queue], depth.delayed)
    yield from (waiting, oldest, running, delayed)


__all__ = ["HELP", "FleetCollector", "backlog_families", "metric_name", "queue_families"]
