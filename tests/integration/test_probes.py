"""HTTP liveness and readiness from real fleet processes (issue 28 item 4).

``fleet timers``, ``fleet recovery`` and ``fleet worker`` subprocesses on Redis and
Postgres serve ``/livez`` and ``/readyz`` on ``FLEET_HEALTH_PORT``
(``fleet.services.probes``), the checks ``fleet health`` runs: a process whose
broker is unreachable is live (its loop beats) but not ready, and says why.
"""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fleet_procs_kit import Proc, nodename, process_env, stop_all, until, wait_ready
from postgres_server import free_port, throwaway_database
from redis_server import url_with_db

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REDIS_DB = 15


def get(port: int, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Proc, int]]]:
    log_dir = tmp_path_factory.mktemp("probes")
    token = secrets.token_hex(3)
    dead_broker = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with throwaway_database() as database_url:
        base = process_env({"FLEET_DATABASE_URL": database_url,
                            "FLEET_REDIS_URL": url_with_db(REDIS_DB),
                            "FLEET_QUEUE": f"fleet.probes-{token}",
                            "FLEET_FLOWS": "timer_flows:timer_nap"})
        started: dict[str, tuple[Proc, int]] = {}
        plan: list[tuple[str, list[str], dict[str, str], str | None]] = [
            ("timers", ["timers"], {}, None),
            ("recovery", ["recovery"], {"FLEET_BROKER_URL": dead_broker}, None),
            ("worker", ["worker", "-n", nodename("probe-worker", token), "--without-mingle",
                        "--without-gossip", "--concurrency", "2"], {}, "probe-worker")]
        try:
            for name, argv, extra, _ in plan:
                port = free_port()
                env = {**base, "FLEET_HEALTH_PORT": str(port),
                       "FLEET_HEARTBEAT_DIR": str(log_dir / f"beats-{name}"), **extra}
                proc = Proc(name, argv, env, Path(log_dir))
                started[name] = (proc, port)
            for proc, _ in started.values():
                proc.nodename = None  # ready when it beats (the worker too)
                wait_ready(proc)
            yield started
        finally:
            stop_all(p for p, _ in started.values())


@pytest.mark.parametrize("name", ["timers", "worker"])
def test_a_healthy_process_is_live_and_ready_over_http(
        procs: dict[str, tuple[Proc, int]], name: str) -> None:
    proc, port = procs[name]
    _, live = until(lambda: (r := get(port, "/livez"))[0] == 200 and r, f"{name} live")
    assert live["ok"] is True
    assert [c["name"] for c in live["checks"]] == ["heartbeat"]
    _, ready = until(lambda: (r := get(port, "/readyz"))[0] == 200 and r,
                     f"{name} ready", timeout=30)
    assert ready["ok"] is True
    # A worker's readiness also reads its key files (issue 25 item 4: they fail closed).
    keys = {"keys"} if name == "worker" else set()
    assert {c["name"] for c in ready["checks"]} == {"heartbeat", "broker", "store", *keys}
    assert proc.alive()


def test_a_process_without_its_broker_is_live_but_not_ready(
        procs: dict[str, tuple[Proc, int]]) -> None:
    _, port = procs["recovery"]
    assert get(port, "/livez")[0] == 200
    status, ready = get(port, "/readyz")
    assert status == 503
    assert ready["ok"] is False
    broker = next(c for c in ready["checks"] if c["name"] == "broker")
    assert broker["ok"] is False
    assert broker["detail"]


def test_any_other_path_is_not_found(procs: dict[str, tuple[Proc, int]]) -> None:
    _, port = procs["timers"]
    assert get(port, "/metrics")[0] == 404
    assert get(port, "/livez/../readyz")[0] == 404
