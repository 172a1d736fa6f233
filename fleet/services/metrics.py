"""Prometheus metrics over the fleet's counters (decision 0022): one collector, two places.

* **Flower's** ``/metrics`` (``fleet flower`` registers ``FleetCollector`` in the
  default registry Flower serves): every process's last report from Redis,
  labelled ``role`` and ``process``; stale ones too (their last values), with
  ``fleet_process_stale`` saying which; the streams' group lags and dead
  letters; and how many executions are parked on the divergence and in-doubt
  gates now.
* **Each service process's** own ``/metrics`` (``FLEET_METRICS_PORT``; for a
  Kubernetes scrape of the pod): the same families, its own counters only.

Families: a counter ``fleet_<name>_total`` for each counter a process reports
(``fleet_drives_total``, ``fleet_divergence_parked_total``,
``fleet_timers_fired_total``, ``fleet_outcomes_attached_total``...), a gauge
``fleet_<name>`` for the gauges (``fleet_active``, ``fleet_lag_ms``...), and
``fleet_process_stale``, ``fleet_process_report_age_seconds``,
``fleet_stream_length``, ``fleet_stream_group_lag``, ``fleet_stream_dead_letters``,
and ``fleet_executions_parked{gate="diverged"|"in-doubt"}`` (executions parked now), and
per queue (decision 0056), read from the store: ``fleet_queue_waiting``,
``fleet_queue_oldest_wait_seconds``, ``fleet_queue_running``, ``fleet_queue_delayed``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet.kernel.store.spi_queues import QueueDepth
from fleet.services.counters import GAUGES, FleetCounters

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
    """A collector over ``read()`` (a ``FleetCounters``), ``parked()`` (executions
    parked now by gate kind: ``{"diverged": n, "in-doubt": m}``) and ``queues()``
    (every queue's depth, ``spi_queues.QueueDepth``), if given."""

    def __init__(self, read: Callable[[], FleetCounters],
                 parked: Callable[[], dict[str, int]] | None = None,
                 queues: Callable[[], Sequence[QueueDepth]] | None = None) -> None:
        self.read = read
        self.parked = parked
        self.queues = queues

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: its families depend on what processes report

    def collect(self) -> Iterator[Metric]:
        try:
            fleet = self.read()
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail the whole page
            log.warning("fleet metrics: cannot read the counters: %s: %s",
                        type(exc).__name__, exc)
            return
        families: dict[str, Any] = {}
        labels = ["role", "process"]
        for process in fleet.processes:
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
                                  "(its counters are its last values)", labels=labels)
        age = GaugeMetricFamily("fleet_process_report_age_seconds",
                                "seconds since the process last reported", labels=labels)
        for process in fleet.processes:
            stale.add_metric([process.role, process.name], 1 if process.stale else 0)
            age.add_metric([process.role, process.name], round(process.age_s, 3))
        yield stale
        yield age
        if fleet.streams:
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
        if self.queues is not None:
            yield from queue_families(self.queues)
        if self.parked is not None:
            try:
                parked = self.parked()
            except Exception as exc:  # noqa: BLE001 - the rest is still served
                log.warning("fleet metrics: cannot count parked executions: %s: %s",
                            type(exc).__name__, exc)
                return
            now = GaugeMetricFamily("fleet_executions_parked", "executions parked now on an "
                                    "operator's gate (diverged, in-doubt)", labels=["gate"])
            for kind in ("diverged", "in-doubt"):
                now.add_metric([kind], parked.get(kind, 0))
            yield now

def queue_families(read: Callable[[], Sequence[QueueDepth]]) -> Iterator[Metric]:
    """The queue gauges (``fleet.services.metrics``'s docstring), one sample per queue."""
    try:
        depths = read()
    except Exception as exc:  # noqa: BLE001 - the rest is still served
        log.warning("fleet metrics: cannot read the queues: %s: %s", type(exc).__name__, exc)
        return
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


__all__ = ["HELP", "FleetCollector", "metric_name", "queue_families"]
