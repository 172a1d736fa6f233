"""A worker process publishes every durable event it writes to the events stream."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from fleet_worker_kit import fleet_env, start_workers
from redis_server import url_with_db

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher
from fleet.kernel.store.sqlite import SqliteEventStore
from fleet.workers import make_app

pytestmark = pytest.mark.integration
BROKER_DB = 10  # this module's own Redis database


async def test_a_workers_durable_events_reach_the_stream_as_the_log_holds_them(
        tmp_path: Path) -> None:
    token = secrets.token_hex(3)
    broker = url_with_db(BROKER_DB)
    stream = f"fleet-test:{token}:events"
    database_url = f"sqlite:///{tmp_path / 'fleet.db'}"
    queue = f"fleet-ev-{token}"
    flows = "fleet_flows:three"
    settings = FleetSettings(database_url=database_url, broker_url=broker, queue=queue,
                             flows=[flows], redis_url=broker, events_stream=stream)
    env = fleet_env(database_url=database_url, broker_url=broker, queue=queue, flows=flows,
                    extra={"FLEET_REDIS_URL": broker, "FLEET_EVENTS_STREAM": stream})
    app = make_app(settings)
    (worker,) = start_workers([("events", [queue])], env, tmp_path, app)
    client = aioredis.Redis.from_url(broker)
    try:
        async with Dispatcher(settings) as dispatcher:
            ids = [await dispatcher.start("fleet-three", n) for n in range(3)]
        store = SqliteEventStore(str(tmp_path / "fleet.db"))
        try:
            for _ in range(300):
                logs = {eid: await store.read(eid) for eid in ids}
                if all(log and log[-1].type.value == "EXECUTION_COMPLETED"
                       for log in logs.values()):
                    break
                await asyncio.sleep(0.1)
        finally:
            await store.close()
        published: dict[str, list[str]] = {eid: [] for eid in ids}
        for _ in range(100):  # the publisher sends in the background
            entries = await client.xrange(stream)
            published = {eid: [] for eid in ids}
            for _, fields in entries:
                envelope = json.loads(fields[b"envelope"])
                if envelope["executionId"] in published:
                    published[envelope["executionId"]].append(fields[b"envelope"].decode())
            if all(len(published[eid]) >= len(logs[eid]) - 1 for eid in ids):
                break
            await asyncio.sleep(0.1)
        for eid in ids:
            # The dispatcher wrote sequence 0 (another process: not this
            # worker's write); everything the worker wrote is there, in order.
            worker_part = [e.to_json() for e in logs[eid] if e.sequence > 0]
            assert published[eid] == worker_part
        assert worker.stats(app).get("stream_lag_ms") is not None
    finally:
        await client.delete(stream)
        await client.aclose()
        worker.stop()
        app.close()
