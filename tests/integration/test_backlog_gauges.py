"""The backlog a fleet can scale on (issue 28 item 1; decision 0046), end to end.

Real processes on a throwaway Postgres database and Redis: ``fleet flower`` (its
metrics port: the one scrape target), one ``fleet worker`` running 16 drives at
once, then a second. 2,000 starts of a flow whose one step takes a second make a
backlog the first worker cannot drain while the test samples the gauges; the
test's own reading of the store and of the Celery queue in Redis is the truth the
gauges are held to.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis
from backlog_flows import ALL
from fleet_procs_kit import FLEET, ROOT, Proc, StoreView, nodename, process_env, stop_all, until
from fleet_procs_kit import wait_ready as proc_ready
from fleet_worker_kit import free_port
from postgres_server import throwaway_database
from prometheus_client.parser import text_string_to_metric_families
from redis_server import url_with_db

from fleet.config import FleetSettings
from fleet.dispatcher.broker import producer_app
from fleet.dispatcher.dispatcher import Dispatcher, Start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REDIS_DB = 8
RUNS = 2_000
NAP_S = 1.0
FIRST_DRIVES = 16
BATCH = 16  # FLEET_DRIVE_BATCH's default: the most drives one message carries
FLOW = "backlog-slow"


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """The metrics port's samples: ``{name: {labels: value}}``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def drives_in(raw: bytes | str) -> list[str]:
    """The executions one kombu message on a fleet queue drives (``fleet.drives``: its ids)."""
    message = json.loads(raw)
    body = json.loads(base64.b64decode(message["body"]))
    if message["headers"]["task"] == "fleet.drives":
        return list(body[0][0])
    return [body[0][0]]


def gauge(samples: dict[str, Any], name: str, queue: str) -> float | None:
    return samples.get(name, {}).get((("flow", FLOW), ("queue", queue)))


def test_the_unowned_gauge_tracks_the_unclaimed_runs_and_falls_to_zero_with_a_second_worker(
        tmp_path: Path) -> None:
    token = secrets.token_hex(3)
    queue = f"fleet.backlog-{token}"
    broker = url_with_db(REDIS_DB)
    metrics_port = free_port()
    with throwaway_database() as database_url, _fleet(database_url, broker, queue, token,
                                                     metrics_port, tmp_path) as fleet:
        settings, store, start_worker = fleet
        client = redis.Redis.from_url(broker)
        dispatcher = Dispatcher(settings)
        try:
            ids = dispatcher.start_many_sync([Start(FLOW, NAP_S)] * RUNS)
        finally:
            dispatcher.close()
        assert len(set(ids)) == RUNS

        def unclaimed() -> int:
            """Running, with no live lease: the store's own listing, page by page."""
            now, total, after = int(time.time() * 1000), 0, None
            while True:
                rows = store.run(store.store.list_executions(
                    status="running", lease_expired_at=now, after_id=after, limit=1000))
                total += len(rows)
                if len(rows) < 1000:
                    return total
                after = rows[-1].execution_id

        def held() -> tuple[int, int]:
            """Drives on the queue, and drives the worker took and has not finished (in
            the messages it has not acknowledged, those still running: a message is
            acknowledged when its last drive stops)."""
            waiting = sum(len(drives_in(m)) for m in client.lrange(queue, 0, -1))
            taken: list[str] = []
            for raw in client.hvals("unacked"):
                message, _, routing_key = json.loads(raw)
                if routing_key == queue:
                    taken += drives_in(json.dumps(message))
            # Read after the messages: a drive can only have stopped since.
            return waiting, sum(1 for eid in taken if store.status(eid) == "running")

        samples: list[tuple[float, float]] = []
        for _ in range(3):
            time.sleep(1.5)  # three of the exporter's reads of the store
            truth_before = unclaimed()
            found = scrape(metrics_port)
            truth_after = unclaimed()
            waiting, taken = held()
            unowned = gauge(found, "fleet_executions_unowned", queue)
            oldest = gauge(found, "fleet_executions_unowned_oldest_seconds", queue)
            assert unowned is not None, sorted(found)
            assert oldest is not None, sorted(found)
            truth = (truth_before + truth_after) / 2
            assert truth > RUNS / 2  # the backlog persists: one slow worker
            assert abs(unowned - truth) <= 0.1 * truth, (unowned, truth_before, truth_after)
            # The worker holds no more unfinished drives than it runs (plus one message's
            # worth), so the queue holds the backlog: the gauge and the queue agree.
            assert taken <= FIRST_DRIVES + BATCH - 1, taken
            assert abs(unowned - waiting) <= FIRST_DRIVES + BATCH + 0.1 * unowned, (
                unowned, waiting, taken)
            samples.append((unowned, oldest))
        oldest_seen = [o for _, o in samples]
        assert oldest_seen == sorted(oldest_seen), samples
        assert oldest_seen[-1] > oldest_seen[0] + 2, samples  # it grows: 3 s between them

        start_worker("b", 200)

        def drained() -> tuple[float, float] | None:
            found = scrape(metrics_port)
            now = (gauge(found, "fleet_executions_unowned", queue),
                   gauge(found, "fleet_executions_unowned_oldest_seconds", queue))
            return now if now == (0, 0) else None
        assert until(drained, "both gauges to fall to 0", 120, interval=1.0) == (0, 0)
        assert unclaimed() == 0
        assert held()[0] == 0


class _fleet:  # noqa: N801 - a context manager used like a function
    """Flower (the metrics port) and worker ``a`` (16 drives), and a way to start more."""

    def __init__(self, database_url: str, broker: str, queue: str, token: str,
                 metrics_port: int, tmp: Path) -> None:
        self.settings_env = {
            "FLEET_DATABASE_URL": database_url, "FLEET_BROKER_URL": broker,
            "FLEET_REDIS_URL": broker, "FLEET_QUEUE": queue, "FLEET_FLOWS": ALL,
            "FLEET_STATS_PREFIX": f"fleet-test:{token}:stats:",
            "FLEET_STATS_INTERVAL_S": "0.5", "FLEET_METRICS_REFRESH_S": "0.5",
            "FLEET_EVENTS_STREAM": f"fleet-test:{token}:events"}
        self.settings = FleetSettings(database_url=database_url, broker_url=broker,
                                      redis_url=broker, queue=queue, flows=[ALL])
        self.token, self.tmp, self.metrics_port = token, tmp, metrics_port
        self.procs: list[Proc] = []
        self.store: StoreView | None = None
        self.app: Any = None

    def env(self, name: str, **extra: str) -> dict[str, str]:
        env = process_env({**self.settings_env, **extra})
        env["FLEET_HEARTBEAT_DIR"] = str(self.tmp / "heartbeats" / name)
        return env

    def start_worker(self, name: str, drives: int) -> Proc:
        node = nodename(name, self.token)
        proc = Proc(name, ["worker", "--queues", self.settings.queue, "--concurrency",
                           str(drives), "-n", node, "--without-mingle", "--without-gossip"],
                    self.env(name), self.tmp, node)
        self.procs.append(proc)
        proc_ready(proc, self.app)
        return proc

    def __enter__(self) -> tuple[FleetSettings, StoreView, Any]:
        import subprocess

        done = subprocess.run([FLEET, "db", "upgrade"], env=self.env("cli"), cwd=str(ROOT),
                              capture_output=True, text=True, timeout=90)
        assert done.returncode == 0, done.stderr
        self.app = producer_app(self.settings, main="backlog-test")
        self.store = StoreView(self.settings)
        port = free_port()
        flower = Proc("flower", ["flower", "--port", str(port), "--address", "127.0.0.1",
                                 "--unauthenticated"],
                      self.env("flower", FLEET_METRICS_PORT=str(self.metrics_port)), self.tmp)
        self.procs.append(flower)
        proc_ready(flower, healthcheck=f"http://127.0.0.1:{port}/healthcheck")
        self.start_worker("a", FIRST_DRIVES)
        return self.settings, self.store, self.start_worker

    def __exit__(self, *exc: object) -> None:
        stop_all(self.procs)
        if self.store is not None:
            self.store.close()
        if self.app is not None:
            self.app.close()
