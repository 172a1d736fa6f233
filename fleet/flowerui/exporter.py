"""The fleet's one Prometheus scrape target, served by ``fleet flower`` (decision 0046).

``exporter_registry(state)`` holds Flower's own metrics (its default registry:
``flower_*``, the process) and ``FleetCollector`` over every process's report and
the store's backlog. It is served twice, never on Flower's event loop:

* on ``FLEET_METRICS_PORT`` by prometheus-client's threaded HTTP server
  (``serve_port``): the target Prometheus scrapes. It has no password of its own;
  the manifests open that port to the scraper alone (NetworkPolicy
  ``fleet-metrics``) and annotate the Flower pod with it;
* on Flower's ``/metrics`` (``AuthenticatedMetrics``, in front of Flower's own
  handler, which needs no login): behind Flower's authentication like every other
  page, the collection run on an executor thread, so ``/healthcheck`` and the UI
  never wait behind a scrape.

A scrape reads Redis once (``read_fleet``) and answers the store's backlog as
``BacklogReader``'s thread last read it (one indexed query every
``FLEET_METRICS_REFRESH_S``), so it costs the same whatever the number of parked or
queued executions.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import tornado.web
from flower.views import BaseHandler  # type: ignore[import-untyped]  # no type hints
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest, start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from tornado.ioloop import IOLoop

from fleet.config import FleetSettings
from fleet.services.metrics import FleetCollector

log = logging.getLogger("fleet.flower")


class _FlowersOwn(Collector):
    """Flower's default registry (its ``flower_*`` metrics, the process), as it is."""

    def collect(self) -> Iterator[Metric]:
        yield from REGISTRY.collect()


def exporter_registry(fleet: FleetCollector) -> CollectorRegistry:
    """Flower's own metrics and the fleet's, in one registry."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_FlowersOwn())
    registry.register(fleet)
    return registry


def serve_port(settings: FleetSettings, registry: CollectorRegistry) -> Any:
    """The registry on ``FLEET_METRICS_PORT`` (a thread of its own); None when unset."""
    if settings.metrics_port is None:
        return None
    server, _ = start_http_server(settings.metrics_port, registry=registry)
    log.info("fleet: the fleet's metrics on port %d (/metrics), for the scraper",
             settings.metrics_port)
    return server


class AuthenticatedMetrics(BaseHandler):  # type: ignore[misc]  # Flower's class is untyped
    """Flower's ``/metrics``, behind Flower's authentication, collected off its loop."""

    def initialize(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    @tornado.web.authenticated
    async def get(self) -> None:
        self.application.purge_offline_worker_metrics()  # as Flower's own handler does
        body = await IOLoop.current().run_in_executor(None, generate_latest, self.registry)
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.write(body)


__all__ = ["AuthenticatedMetrics", "exporter_registry", "serve_port"]
