"""What the dispatcher publishes for starts that run later (``fleet.dispatcher.later``).

A real Redis queue that no worker reads, and a real Postgres store: a delayed or a
waiting queued start publishes no drive (the timer service or a slot's release
wakes it); a queued start admitted at once publishes its own; a start whose queue
pass admits an older waiting run publishes that run's drive instead of its own.
"""

from __future__ import annotations

import base64
import json
import secrets
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from redis_server import url_with_db

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher, Start
from fleet.kernel.errors import GateMismatchError, ValidationError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REDIS_DB = 11


@pytest.fixture
def fleet(database_url: str) -> Iterator[tuple[Dispatcher, redis.Redis, str]]:
    queue = f"fleet-later-{secrets.token_hex(4)}"
    settings = FleetSettings(database_url=database_url, broker_url=url_with_db(REDIS_DB),
                             queue=queue, flows=["queue_flows:quick"], drive_batch=1,
                             queues={f"one-{queue}": {"concurrency": 1}})
    client = redis.Redis.from_url(settings.broker)
    dispatcher = Dispatcher(settings)
    try:
        yield dispatcher, client, queue
    finally:
        dispatcher.close()
        client.delete(queue)
        client.close()


def queued(client: redis.Redis, queue: str) -> Counter[str]:
    """How many drives of each execution wait in ``queue``."""
    counts: Counter[str] = Counter()
    for raw in client.lrange(queue, 0, -1):
        first = json.loads(base64.b64decode(json.loads(raw)["body"]))[0][0]
        counts.update(first if isinstance(first, list) else [first])
    return counts


def test_only_runs_that_may_run_now_are_published(
        fleet: tuple[Dispatcher, redis.Redis, str]) -> None:
    dispatcher, client, queue = fleet
    one = f"one-{queue}"
    first = dispatcher.start_sync("qf-quick", 1, queue=one)
    assert queued(client, queue) == Counter({first: 1})  # admitted at once: driven
    second = dispatcher.start_sync("qf-quick", 2, queue=one)
    later = dispatcher.start_sync("qf-quick", 3, start_in=timedelta(hours=1))
    assert queued(client, queue) == Counter({first: 1})  # one waits for a slot, one for time
    dispatcher.cancel_sync(first, force=True)  # a slot freed without a pass (nor a drive)
    third = dispatcher.start_sync("qf-quick", 4, queue=one)
    # The third's pass admitted the older second (first come, first served).
    assert queued(client, queue) == Counter({first: 1, second: 1})
    assert len({first, second, third, later}) == 4


def test_start_many_mixes_plain_later_and_queued_starts_in_order(
        fleet: tuple[Dispatcher, redis.Redis, str]) -> None:
    dispatcher, client, queue = fleet
    items: list[Start] = [
        Start("qf-quick", "plain"),
        Start("qf-quick", "delayed", start_in=timedelta(minutes=5)),
        Start("qf-quick", "queued", queue=f"one-{queue}"),
        Start("qf-quick", "debounced", debounce=timedelta(seconds=30), key="k"),
        Start("qf-quick", "debounced again", debounce=timedelta(seconds=30), key="k"),
    ]
    ids = dispatcher.start_many_sync(items)
    assert len(ids) == 5
    assert ids[3] == ids[4]
    assert queued(client, queue) == Counter({ids[0]: 1, ids[2]: 1})


def test_a_bad_later_start_is_refused_alone(fleet: tuple[Dispatcher, redis.Redis, str]) -> None:
    dispatcher, client, queue = fleet
    bad: dict[str, Any] = {"queue": "nope"}
    with pytest.raises(ValidationError, match="no queue 'nope'"):
        dispatcher.start_sync("qf-quick", 1, **bad)
    with pytest.raises(ValidationError, match="negative"):
        dispatcher.start_sync("qf-quick", 1, start_in=timedelta(seconds=-5))
    assert queued(client, queue) == Counter()


def test_a_waiting_runs_gate_cannot_be_resumed_through_the_dispatcher(
        fleet: tuple[Dispatcher, redis.Redis, str]) -> None:
    dispatcher, client, queue = fleet
    one = f"one-{queue}"
    dispatcher.start_sync("qf-quick", 1, queue=one)
    waiting = dispatcher.start_sync("qf-quick", 2, queue=one)
    later = dispatcher.start_sync("qf-quick", 3, start_in=timedelta(hours=1))
    before = queued(client, queue)
    for eid, gate in ((waiting, f"__fleet_queue__:{one}"), (later, "__fleet_start__")):
        head = dispatcher.wait_sync(eid, until="parked").head
        with pytest.raises(GateMismatchError, match="timer"):
            dispatcher.resume_sync(eid, gate, "skip the line")
        assert dispatcher.wait_sync(eid, until="parked").head == head  # nothing written
    assert queued(client, queue) == before  # and no drive
