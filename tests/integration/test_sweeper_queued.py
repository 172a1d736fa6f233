"""The recovery sweeper leaves merely-queued executions alone (issue 10 item 8, issue 28
item 3).

Twenty starts through the dispatcher sit in a real Redis queue that no worker
reads (a backlog, or workers still reconnecting after a broker restart); the
store is a real Postgres. The recovery role (``open_recovery``, what ``fleet
recovery`` runs) sweeps every 0.1 s with a 0.3 s grace for 3 s. On the main
branch before this change it re-enqueued every one of them on every tick past
the grace (about 25 drives each here; ~720 extra drives in the broker-restart
run the issue reports); now each drive record keeps it off an execution whose
drive is still in the queue: the oldest message on the queue is no younger than
the record (decision 0048), so none is re-sent at all. A drive a live worker took
is left alone too; one taken by a worker that is gone, or lost with its queue,
is re-sent.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator

import pytest
import redis
from redis_server import url_with_db

from fleet.assembly.roles import open_recovery
from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher
from fleet.dispatcher.broker import producer_app
from fleet.dispatcher.publish import PublishedDrive, open_publisher
from fleet.workers.marks import DriveMarks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REDIS_DB = 11
STARTS = 20


@pytest.fixture
async def fleet(database_url: str) -> AsyncIterator[tuple[FleetSettings, redis.Redis]]:
    queue = f"fleet-sweep-{secrets.token_hex(4)}"
    settings = FleetSettings(database_url=database_url, broker_url=url_with_db(REDIS_DB),
                             queue=queue, flows=["fleet_flows:three"], recovery_grace_ms=300,
                             recovery_interval_s=0.1, publish_events=False)
    client = redis.Redis.from_url(settings.broker)
    try:
        yield settings, client
    finally:
        client.delete(queue)
        client.close()


def queued(client: redis.Redis, queue: str) -> Counter[str]:
    """How many drives of each execution wait in ``queue`` (a ``fleet.drives`` message
    carries several: decision 0030)."""
    counts: Counter[str] = Counter()
    for raw in client.lrange(queue, 0, -1):
        first = json.loads(base64.b64decode(json.loads(raw)["body"]))[0][0]
        counts.update(first if isinstance(first, list) else [first])
    return counts


async def sweep_for(settings: FleetSettings, seconds: float) -> dict[str, object]:
    role = await open_recovery(settings, heartbeat=False)
    try:
        for service in role.services:
            await service.start()
        await asyncio.sleep(seconds)
    finally:
        for service in reversed(role.services):
            await service.stop()
        await role.aclose()
    return role.stats()["recovery"]


async def test_queued_drives_are_not_sent_again_and_again_but_lost_ones_are(
        fleet: tuple[FleetSettings, redis.Redis]) -> None:
    settings, client = fleet
    async with Dispatcher(settings) as dispatcher:
        ids = [await dispatcher.start("fleet-three", n) for n in range(STARTS)]
    assert queued(client, settings.queue) == Counter({eid: 1 for eid in ids})

    stats = await sweep_for(settings, 3.0)
    counts = queued(client, settings.queue)
    # Still on their queue (the oldest message there is as old as each one's record):
    # never re-sent, however long past the grace (decision 0048; main before decision
    # 0019: ~25 each in 3 s, then up to 4 each).
    assert counts == Counter({eid: 1 for eid in ids})
    assert stats["redriven"] == 0
    assert stats["queued"] > STARTS  # every tick past the grace found them queued

    # Now the broker loses them (a restart of a non-persistent Redis): re-sent.
    client.delete(settings.queue)
    await sweep_for(settings, 7.0)
    assert set(queued(client, settings.queue)) == set(ids)


async def test_a_fleet_sharing_the_redis_database_never_sees_anothers_drive_records(
        fleet: tuple[FleetSettings, redis.Redis]) -> None:
    """Two fleets on one Redis database can hold executions of one id (idempotency
    keys derive them): one's fresh record must not make the other's sweeper wait."""
    settings, _client = fleet
    other = settings.model_copy(update={"queue": f"fleet-other-{secrets.token_hex(4)}"})
    eid = f"shared-{secrets.token_hex(4)}"
    mine, theirs = open_publisher(producer_app(settings), settings), \
        open_publisher(producer_app(other), other)
    try:
        await theirs.publish([PublishedDrive(eid, other.queue)])
        assert eid in await theirs.recent([eid])
        assert await mine.recent([eid]) == {}  # fails with one key per execution id
        await mine.publish([PublishedDrive(eid, settings.queue)])
        assert eid in await mine.recent([eid])
    finally:
        await mine.aclose()
        await theirs.aclose()
        _client.delete(other.queue)


async def test_a_drive_a_live_worker_holds_is_left_and_a_dead_workers_is_resent(
        fleet: tuple[FleetSettings, redis.Redis]) -> None:
    """The worker's marks (``fleet.workers.marks``) on real Redis, read by the
    publisher the sweeper uses: taken and not done by a live worker is ``held``;
    the same once that worker's live key is gone is ``lost``; done is judged by time."""
    settings, client = fleet
    publisher = open_publisher(producer_app(settings), settings)
    marks = DriveMarks(settings.broker, settings.queue, f"w-{secrets.token_hex(3)}")
    held, done = f"held-{secrets.token_hex(3)}", f"done-{secrets.token_hex(3)}"
    try:
        await publisher.publish([PublishedDrive(held, settings.queue),
                                 PublishedDrive(done, settings.queue)])
        client.delete(settings.queue)  # a worker popped both (as its BRPOP would)
        marks.beat()
        marks.taken([held, done])
        marks.done([done])
        await asyncio.sleep(0.2)  # the marks are sent without blocking the drive
        now = int(time.time() * 1000)
        records = await publisher.recent([held, done])
        assert records[held].verdict(now, grace_ms=60_000) == "held"
        assert records[held].verdict(now + 10**6, grace_ms=1) == "held"  # however long
        assert records[done].verdict(now, grace_ms=60_000) == "queued"   # young: wait
        assert records[done].verdict(now + 10**6, grace_ms=1) == "lost"  # ended, still waits
        await marks.aclose()  # a clean stop gives up the live key
        records = await publisher.recent([held])
        assert records[held].verdict(now, grace_ms=60_000) == "lost"
    finally:
        await marks.aclose()
        await publisher.aclose()
