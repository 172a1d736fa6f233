"""The recovery sweeper sees a lost drive whatever a clock or a record says (issue 25 item 12).

A ``running`` execution whose drive message was lost must be re-sent by the sweeper.
Two things used to hide one from it for as long as they said: a drive record
(decision 0019) dated in the future, which any holder of the client's Redis user can
write with no expiry (or a publisher whose clock runs fast writes), and a last write
dated in the future (a writer whose clock runs fast), which the sweeper's grace filter
skipped until that date came. Real Redis and Postgres, the recovery role as ``fleet
recovery`` runs it (``open_recovery``), a queue no worker reads.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator

import pytest
import redis
from redis_server import url_with_db
from test_sweeper_queued import queued, sweep_for

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher
from fleet.dispatcher.publish import DriveRecord, record_key
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.store.factory import open_event_store

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REDIS_DB = 11
DAY_MS = 24 * 3_600_000


@pytest.fixture
async def fleet(database_url: str) -> AsyncIterator[tuple[FleetSettings, redis.Redis]]:
    queue = f"fleet-sweep-clock-{secrets.token_hex(4)}"
    settings = FleetSettings(database_url=database_url, broker_url=url_with_db(REDIS_DB),
                             queue=queue, flows=["fleet_flows:three"], recovery_grace_ms=300,
                             recovery_interval_s=0.1)
    client = redis.Redis.from_url(settings.broker)
    try:
        yield settings, client
    finally:
        for key in client.scan_iter(f"fleet:drive:{queue}:*"):
            client.delete(key)
        client.delete(queue)
        client.close()


def test_a_record_dated_in_the_future_is_not_fresh() -> None:
    now = 1_800_000_000_000
    assert DriveRecord(now - 100, 1).fresh(now, 300)
    assert DriveRecord(now + 200, 1).fresh(now, 300)  # a clock a little fast: tolerated
    assert not DriveRecord(now + 301, 1).fresh(now, 300)
    assert not DriveRecord(now + DAY_MS, 1).fresh(now, 300)
    assert not DriveRecord(now - 301, 1).fresh(now, 300)


async def test_a_forged_record_does_not_keep_a_lost_drive_from_being_sent_again(
        fleet: tuple[FleetSettings, redis.Redis]) -> None:
    settings, client = fleet
    async with Dispatcher(settings) as dispatcher:
        ids = [await dispatcher.start("fleet-three", n) for n in range(3)]
    client.delete(settings.queue)  # the drives are lost (a broker that lost its queue)
    # A holder of the client's Redis user dates each record a day ahead, with no expiry.
    for execution_id in ids:
        key = record_key(execution_id, settings.queue)
        client.hset(key, mapping={"at": time.time_ns() // 1_000_000 + DAY_MS, "n": 1})
        client.persist(key)
    stats = await sweep_for(settings, 2.0)
    assert set(queued(client, settings.queue)) == set(ids), stats  # sent again, each
    assert int(stats["redriven"]) >= len(ids)  # type: ignore[call-overload]
    for execution_id in ids:  # the sweeper's own enqueue wrote a true record, expiring
        key = record_key(execution_id, settings.queue)
        assert int(client.hget(key, "at") or 0) <= time.time_ns() // 1_000_000
        assert client.pttl(key) > 0


async def test_a_run_whose_last_write_is_dated_ahead_is_swept(
        fleet: tuple[FleetSettings, redis.Redis]) -> None:
    """A start written by a process whose clock ran a day fast, its drive lost: the grace
    filter (``updated_before``) hid it for a day; the future-dated scan finds it."""
    settings, client = fleet
    store = open_event_store(settings.database_url)
    ahead = f"ahead-{secrets.token_hex(4)}"
    try:
        await store.append(EventEnvelope.make(
            ahead, 0, EventType.EXECUTION_STARTED, time.time_ns() // 1_000_000 + DAY_MS,
            {"flowId": "fleet-three", "flowVersion": 1, "flowHash": "x", "input": 1,
             "owner": None}))
    finally:
        await store.close()
    stats = await sweep_for(settings, 1.5)
    assert ahead in queued(client, settings.queue), stats
    assert int(stats["future_dated"]) >= 1  # type: ignore[call-overload]
