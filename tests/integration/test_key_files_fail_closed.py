"""Issue 25 item 4: revoking a dispatch key fails closed, against a real worker.

One real Celery worker process (the fleet's app, with a result backend to read
``fleet.dispatch`` answers the way any client would), real Redis, a throwaway
Postgres database; its ring is a file (``FLEET_DISPATCH_KEYS_FILE``, a mounted
Secret in Kubernetes). Garbled, deleted, or replaced by a ring without the old
key: a message signed with the old key is refused (``no_key_ring`` while the
file cannot be read, retryable; ``unknown_key`` once a new ring revoked it),
nothing is written, the worker logs the error once, ``fleet health`` says the
worker is not ready (its drives still run: liveness passes), and its report to
Redis carries the problem (the Fleet page shows it red). A good file restores
it without a restart.

On the main branch before this change the garbled and deleted files kept the
last good ring: the old key's message started an execution.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery_wire import message, publish_raw, reply
from fleet_flows import ALL
from fleet_procs_kit import until
from fleet_worker_kit import FLEET, ROOT, WorkerProcess, fleet_env, start_workers
from postgres_server import throwaway_database
from redis_server import url_with_db

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher
from fleet.dispatcher.signing import sign_dispatch
from fleet.services.counters import read_fleet
from fleet.workers import make_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REDIS_DB = 10
OLD = "old-key-0123456789abcdef0123456789"
NEW = "new-key-0123456789abcdef0123456789"
RING = {"shop-1": {"client": "shop", "secret": OLD, "tenants": ["acme"]}}
ACME = {"actor": "shop-user", "tenant": "acme"}


@dataclass
class Fleet:
    settings: FleetSettings
    app: Any
    worker: WorkerProcess
    redis: redis.Redis
    env: dict[str, str]
    keys: Path
    prefix: str


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    broker = url_with_db(REDIS_DB)
    client = redis.Redis.from_url(broker)
    token = secrets.token_hex(3)
    queue = f"fleet.keys-{token}"
    logs = tmp_path_factory.mktemp("key-files")
    keys = logs / "dispatch-keys.json"
    keys.write_text(json.dumps(RING))
    prefix = f"fleet-test:{token}:stats:"
    with throwaway_database() as database_url:
        settings = FleetSettings(database_url=database_url, broker_url=broker, queue=queue,
                                 flows=ALL.split(","))
        env = fleet_env(database_url=database_url, broker_url=broker, queue=queue, flows=ALL,
                        extra={"FLEET_TEST_RESULT_BACKEND": broker, "FLEET_REDIS_URL": broker,
                               "FLEET_DISPATCH_KEYS_FILE": str(keys),
                               "FLEET_HEARTBEAT_DIR": str(logs / "heartbeats"),
                               "FLEET_STATS_PREFIX": prefix, "FLEET_STATS_INTERVAL_S": "0.5"})
        app = make_app(settings)
        (worker,) = start_workers([("keys", [queue])], env, logs, app,
                                  app_module="fleet_test_app")
        try:
            yield Fleet(settings, app, worker, client, env, keys, prefix)
        finally:
            worker.stop()
            app.close()
            client.close()


def send(fleet: Fleet, kwargs: dict[str, Any]) -> dict[str, Any]:
    task_id = publish_raw(fleet.settings.broker, fleet.settings.queue, "fleet.dispatch",
                          message(kwargs))
    return reply(fleet.redis, task_id)


def start(kid: str, secret: str) -> dict[str, Any]:
    return sign_dispatch({"op": "start", "flow_id": "fleet-three", "input": 1,
                          "principal": ACME}, key_id=kid, secret=secret)


def health(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FLEET, "health", "--component", "worker", *args], env=fleet.env,
                          cwd=str(ROOT), capture_output=True, text=True, timeout=60)


async def written(fleet: Fleet, execution_id: str) -> int:
    async with Dispatcher(fleet.settings) as dispatcher:
        runtime = await dispatcher.runtime()
        return len(await runtime.store.read(execution_id))


def problems(fleet: Fleet) -> list[str]:
    counters = read_fleet(fleet.redis, prefix=fleet.prefix)
    return [p for report in counters.processes for p in report.problems]


def rewrite(path: Path, text: str | None) -> None:
    """Change the file (None: delete it), with a new mtime the worker cannot miss, and
    let the worker's key source look again (it checks the file once a second)."""
    if text is None:
        path.unlink()
    else:
        path.write_text(text)
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    time.sleep(1.2)


@pytest.mark.parametrize("breakage", ["garbled", "deleted"])
async def test_an_unreadable_key_file_accepts_no_dispatch(fleet: Fleet, breakage: str) -> None:
    good = start("shop-1", OLD)
    accepted = await asyncio.to_thread(send, fleet, good)
    assert accepted["ok"] is True, accepted
    assert health(fleet).returncode == 0
    rewrite(fleet.keys, '{"shop-1": {"client": "shop", "secr' if breakage == "garbled" else None)
    try:
        message = start("shop-1", OLD)
        answer = await asyncio.to_thread(send, fleet, message)
        assert answer["ok"] is False, answer
        assert answer["error"]["details"] == [{"reason": "no_key_ring"}]
        assert answer["error"]["retryable"] is True  # resend once the file is fixed
        assert "no key is accepted until it is fixed" in answer["error"]["message"]
        assert await written(fleet, message["execution_id"]) == 0
        not_ready = health(fleet)
        assert not_ready.returncode == 1
        assert "keys: FLEET_DISPATCH_KEYS_FILE" in not_ready.stderr
        assert health(fleet, "--liveness").returncode == 0  # drives go on: no restart loop
        found = until(lambda: [p for p in problems(fleet) if "FLEET_DISPATCH_KEYS_FILE" in p],
                      "the worker's report to carry the problem", 15)
        assert str(fleet.keys) in found[0]
        log = fleet.worker.log()
        why = "is not JSON" if breakage == "garbled" else "No such file or directory"
        errors = [line for line in log.splitlines() if "ERROR/" in line and why in line
                  and "FLEET_DISPATCH_KEYS_FILE" in line and line.endswith(
                      "no key is accepted until it is fixed")]
        assert len(errors) == 1, errors  # a clear error, once (not once per message)
        assert "fleet.dispatch refused (no_key_ring)" in log
    finally:
        rewrite(fleet.keys, json.dumps(RING))
    again = await asyncio.to_thread(send, fleet, message)  # the same message, once fixed
    assert again["ok"] is True, again
    assert health(fleet).returncode == 0
    until(lambda: not problems(fleet), "the report to clear", 15)


async def test_a_key_removed_from_the_ring_is_refused_at_once(fleet: Fleet) -> None:
    rewrite(fleet.keys, json.dumps({"shop-2": {"client": "shop", "secret": NEW,
                                               "tenants": ["acme"]}}))
    try:
        old = start("shop-1", OLD)
        answer = await asyncio.to_thread(send, fleet, old)
        assert answer["error"]["details"] == [{"reason": "unknown_key"}], answer
        assert answer["error"]["retryable"] is False
        assert await written(fleet, old["execution_id"]) == 0
        assert (await asyncio.to_thread(send, fleet, start("shop-2", NEW)))["ok"] is True
    finally:
        rewrite(fleet.keys, json.dumps(RING))
