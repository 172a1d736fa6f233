"""Is this worker taking work? The queues its task consumer consumes, watched.

A worker told to stop consuming (Celery's ``cancel_consumer``) keeps running,
beating and answering pings: every probe that looks only at the process passes
while it takes nothing (issue 25 item 1). ``ConsumerWatch``, a step of the
worker's consumer (the process that holds the broker connection: the worker
itself, or a prefork pool's parent), writes every second which queues its task
consumer consumes to ``fleet-worker.consumer`` beside the heartbeat
(``FLEET_HEARTBEAT_DIR``). ``fleet health --component worker`` fails, liveness
included (so the pod is restarted, consuming its queues again), when the
worker consumes none of the fleet's queues (``FLEET_QUEUE`` and the
``FLEET_ROUTES`` queues); the worker's report to Redis says so, and the Fleet
page shows it red. While the consumer reconnects (no task consumer) nothing is
judged: a broker outage restarts no pod.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Any

from fleet.config import FleetSettings
from fleet.host.celery_api import StartStopStep
from fleet.services.health import consumer_problem, consumer_state_path, fleet_queues

log = logging.getLogger("fleet.workers")

WATCH_INTERVAL_S = 1.0


class ConsumerWatch(StartStopStep):  # type: ignore[misc]  # Celery's bootsteps are untyped
    """A consumer step: every second, which queues the task consumer consumes (to a file)."""

    label = "fleet-consumer-watch"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.tref: Any = None
        settings: FleetSettings = c.app.fleet_settings
        self.path = consumer_state_path(settings)
        self.fleet_queues = fleet_queues(settings)
        self.last_problem: str | None = None

    def start(self, c: Any) -> None:
        self.write(c)
        if self.tref is None:
            self.tref = c.timer.call_repeatedly(WATCH_INTERVAL_S, self.write, (c,), priority=10)

    def shutdown(self, c: Any) -> None:
        tref, self.tref = self.tref, None
        if tref is not None:
            with contextlib.suppress(Exception):
                tref.cancel()
        with contextlib.suppress(OSError):
            self.path.unlink()

    def write(self, c: Any) -> None:
        consumer = getattr(c, "task_consumer", None)
        queues = sorted({q.name for q in consumer.queues}) if consumer is not None else []
        state = {"pid": os.getpid(), "at": time.time(), "queues": queues,
                 "fleet_queues": self.fleet_queues, "connected": consumer is not None}
        problem = consumer_problem(state)
        if problem != self.last_problem:
            if problem is not None:
                log.error("%s", problem)
            elif self.last_problem is not None:
                log.warning("the worker consumes a fleet queue again: %s", ", ".join(queues))
            self.last_problem = problem
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.path)
        except OSError as exc:  # the probe then sees an old state and says so
            log.warning("cannot write %s: %s", self.path, exc)


__all__ = ["WATCH_INTERVAL_S", "ConsumerWatch"]
