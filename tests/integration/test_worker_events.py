"""Everything a worker process and the dispatcher write reaches the events stream, through
the relay (the worker publishes nothing itself)."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from fleet_worker_kit import fleet_env, start_workers
from redis_server import url_with_db
from relay_kit import assert_stream_is_the_log, wait_published

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher
from fleet.kernel.store.sqlite import SqliteEventStore
from fleet.streams.relay import EventRelay
from fleet.workers import make_app

pytestmark = pytest.mark.integration
BROKER_DB = 10  # this module's own Redis database


async def test_a_workers_and_the_dispatchers_events_reach_the_stream_as_the_log_holds_them(
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
    store = SqliteEventStore(str(tmp_path / "fleet.db"))
    relay = EventRelay(store, client, stream=stream, poll_s=0.02)
    await relay.start()
    try:
        async with Dispatcher(settings) as dispatcher:
            ids = [await dispatcher.start("fleet-three", n) for n in range(3)]
        for _ in range(300):
            logs = {eid: await store.read(eid) for eid in ids}
            if all(log and log[-1].type.value == "EXECUTION_COMPLETED"
                   for log in logs.values()):
                break
            await asyncio.sleep(0.1)
        await wait_published(client, stream, store)
        # The dispatcher wrote sequence 0 (another process), the worker the rest:
        # the stream has all of it, each log in order, each event once.
        published = await assert_stream_is_the_log(client, stream, store)
        assert {c.event.execution_id for c in published} == set(ids)
        assert "stream_lag_ms" not in worker.stats(app)  # workers publish nothing
    finally:
        await relay.stop()
        await store.close()
        await client.delete(stream)
        await client.aclose()
        worker.stop()
        app.close()
