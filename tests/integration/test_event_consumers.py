"""Consumers of the events stream (real Redis, a real SQLite store, a real relay).

``EventStreamConsumer``: once per event, in order, resuming where it stopped,
skipping a redelivery it already handled, reading what the trim took from the
store, dead-lettering what is not a relay entry. ``fleet events tail``: the
same events on the command line, filtered, from the store where the stream
was trimmed.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis_server import prefix, server_url
from relay_kit import Writers, stream_events

from fleet.kernel.errors import ValidationError
from fleet.kernel.events import EventType
from fleet.kernel.store.conformance import make_event, started
from fleet.kernel.store.conformance_feed import read_feed
from fleet.kernel.store.spi import CommittedEvent, Position
from fleet.kernel.store.sqlite import SqliteEventStore
from fleet.streams.events import (
    EventFilter,
    EventStreamConsumer,
    RedisCheckpoint,
    backfill,
    parse_entry,
)
from fleet.streams.relay import EventRelay

pytestmark = pytest.mark.integration
FLEET = str(Path(sys.executable).with_name("fleet"))


class Setup:
    def __init__(self, store: SqliteEventStore, redis: aioredis.Redis, stream: str,
                 path: Path) -> None:
        self.store, self.redis, self.stream, self.path = store, redis, stream, path
        self.relay: EventRelay | None = None

    async def publish(self, **options: Any) -> EventRelay:
        if self.relay is None:
            self.relay = EventRelay(self.store, self.redis, stream=self.stream, poll_s=0.02,
                                    **options)
            await self.relay.start()
        assert await self.relay.caught_up()
        return self.relay


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    store = SqliteEventStore(tmp_path / "fleet.db")
    redis = aioredis.Redis.from_url(server_url())
    ns = prefix()
    made = Setup(store, redis, f"{ns}events", tmp_path / "fleet.db")
    yield made
    if made.relay is not None:
        await made.relay.stop()
    for key in await redis.keys(f"{ns}*"):
        await redis.delete(key)
    await redis.aclose()
    await store.close()


def recorder() -> tuple[list[CommittedEvent], Any]:
    seen: list[CommittedEvent] = []

    async def handle(committed: CommittedEvent) -> None:
        seen.append(committed)
    return seen, handle


async def until(predicate: Any, timeout: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_each_event_once_in_order_and_a_restart_resumes_where_it_stopped(
        setup: Setup) -> None:
    await Writers(setup.store, seed=1, prefix="a").run(writers=3, executions=2, events=5)
    await setup.publish()
    seen, handle = recorder()
    checkpoint = RedisCheckpoint(setup.redis, f"{setup.stream}:cp:g")
    first = EventStreamConsumer(setup.redis, handle, stream=setup.stream, group="g",
                                consumer="c1", checkpoint=checkpoint, block_ms=50)
    await first.start()
    feed = await read_feed(setup.store)
    await until(lambda: len(seen) == len(feed))
    await first.stop()
    await Writers(setup.store, seed=2, prefix="b").run(writers=2, executions=2, events=5)
    await setup.publish()
    again = EventStreamConsumer(setup.redis, handle, stream=setup.stream, group="g",
                                consumer="c2", checkpoint=checkpoint, block_ms=50)
    await again.start()
    feed = await read_feed(setup.store)
    await until(lambda: len(seen) == len(feed))
    await asyncio.sleep(0.2)  # nothing more arrives
    await again.stop()
    assert [c.position for c in seen] == [c.position for c in feed]  # once each, in order
    assert [c.event.to_json() for c in seen] == [c.event.to_json() for c in feed]
    assert again.stats()["handled"] == len(feed) - first.stats()["handled"]
    assert await checkpoint.load() == feed[-1].position
    await checkpoint.save(Position(1, 0))  # a checkpoint never moves back
    assert await checkpoint.load() == feed[-1].position


async def test_a_redelivery_of_what_was_handled_is_acknowledged_not_handled_again(
        setup: Setup) -> None:
    await Writers(setup.store, seed=3).run(writers=2, executions=2, events=4)
    await setup.publish()
    stream, group = setup.stream, "g"
    await setup.redis.xgroup_create(stream, group, id="0", mkstream=True)
    # A consumer that handled everything and saved its position, then died before XACK.
    reply = await setup.redis.xreadgroup(group, "dead", {stream: ">"}, count=1000)
    delivered = len(reply[0][1])
    last = Position.parse(reply[0][1][-1][0].decode())
    checkpoint = RedisCheckpoint(setup.redis, f"{stream}:cp")
    await checkpoint.save(last)
    seen, handle = recorder()
    survivor = EventStreamConsumer(setup.redis, handle, stream=stream, group=group,
                                   consumer="alive", checkpoint=checkpoint, block_ms=50,
                                   claim_idle_ms=50)
    await survivor.start()
    await until(lambda: survivor.stats()["skipped"] == delivered)
    await survivor.stop()
    assert seen == []
    assert survivor.stats()["claimed"] == delivered
    assert await survivor.consumer.pending() == 0


async def test_a_consumer_behind_the_trim_reads_the_gap_from_the_store(setup: Setup) -> None:
    # MAXLEN ~ trims whole nodes of 100 entries: enough events that some go.
    await Writers(setup.store, seed=4).run(writers=6, executions=5, events=10)
    relay = await setup.publish(maxlen=10)
    feed = await read_feed(setup.store)
    assert await setup.redis.xlen(setup.stream) < len(feed)  # trimmed
    assert relay.published == len(feed)
    seen, handle = recorder()
    consumer = EventStreamConsumer(setup.redis, handle, stream=setup.stream, group="late",
                                   checkpoint=RedisCheckpoint(setup.redis,
                                                              f"{setup.stream}:cp:late"),
                                   store=setup.store, block_ms=50)
    assert await consumer.fell_behind()
    await consumer.start()
    await until(lambda: len(seen) == len(feed))
    await consumer.stop()
    assert [c.position for c in seen] == [c.position for c in feed]
    assert consumer.stats()["backfilled"] > 0
    assert not await consumer.fell_behind()
    # The library call on its own: the store's events, the relay's positions, in order.
    first = (await stream_events(setup.redis, setup.stream))[0].position
    gap = [c async for c in backfill(setup.store, until=first, page=7)]
    assert [c.position for c in gap] == [c.position for c in feed if c.position < first]


async def test_filters_and_a_malformed_entry_is_dead_lettered(setup: Setup) -> None:
    await setup.store.append_batch([started("keep", tenant="t1"), make_event("keep", 1),
                                    make_event("keep", 2, EventType.EXECUTION_COMPLETED)])
    await setup.store.append_batch([started("other", tenant="t2"), make_event("other", 1)])
    relay = await setup.publish()
    await relay.stop()
    setup.relay = None
    await setup.redis.xadd(setup.stream, {"envelope": "{not json", "position": "999999-0"},
                           id="999999-0")
    seen, handle = recorder()
    consumer = EventStreamConsumer(
        setup.redis, handle, stream=setup.stream, group="f", block_ms=50,
        filter=EventFilter(tenant="t1", types={"STEP_COMPLETED", "EXECUTION_COMPLETED"}))
    await consumer.start()
    await until(lambda: sum(consumer.stats()["dead_lettered"].values()) == 1)
    await consumer.stop()
    assert [(c.event.execution_id, c.event.sequence) for c in seen] == [("keep", 1),
                                                                        ("keep", 2)]
    assert consumer.stats()["filtered"] == 3
    dead = await setup.redis.xrange(f"{setup.stream}:dead")
    assert dead[0][1][b"dead_reason"] == b"malformed"
    for fields in ({"position": "1-0"}, {"envelope": "{}", "position": "2-0"}):
        with pytest.raises(ValidationError, match=r"not a relay entry|envelope|match"):
            parse_entry("1-0", fields)
    # Issue 25 item 3: digits of another script are refused typed, never a ValueError.
    forged = json.dumps({"executionId": "x", "sequence": "\u00b2", "type": "EMITTED"})
    with pytest.raises(ValidationError, match="match"):
        parse_entry("1-0", {"envelope": forged, "position": "1-0", "executionId": "x",
                            "sequence": "\u00b2", "type": "EMITTED"})
    for text in ("\u00b2", "\u0663-0", "1-\uff13"):
        with pytest.raises(ValidationError, match="is not a position"):
            Position.parse(text)


# ---------------------------------------------------------------------------
# fleet events tail
# ---------------------------------------------------------------------------

def _env(setup: Setup) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update({"FLEET_REDIS_URL": server_url(), "FLEET_EVENTS_STREAM": setup.stream,
                "FLEET_DATABASE_URL": f"sqlite:///{setup.path}"})
    return env


async def tail(setup: Setup, *args: str) -> list[dict[str, Any]]:
    done = await asyncio.to_thread(subprocess.run, [FLEET, "events", "tail", "--json", *args],
                                   env=_env(setup), capture_output=True, text=True,
                                   timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


async def test_events_tail_reads_the_trimmed_part_from_the_store_and_filters(
        setup: Setup) -> None:
    await setup.store.append_batch([started("ta", tenant="t1"), make_event("ta", 1),
                                    make_event("ta", 2, EventType.EXECUTION_COMPLETED)])
    await Writers(setup.store, seed=5).run(writers=6, executions=5, events=10)
    await setup.publish(maxlen=5)
    feed = await read_feed(setup.store)
    everything = await tail(setup, "--from", "start", "--no-follow")
    assert [e["position"] for e in everything] == [str(c.position) for c in feed]
    assert everything[0]["event"] == json.loads(feed[0].event.to_json())
    ours = await tail(setup, "--from", "start", "--no-follow", "--execution", "ta")
    assert [(e["sequence"], e["type"], e["tenant"]) for e in ours] == [
        (0, "EXECUTION_STARTED", "t1"), (1, "STEP_COMPLETED", "t1"),
        (2, "EXECUTION_COMPLETED", "t1")]
    done = await tail(setup, "--from", "start", "--no-follow", "--type",
                      "EXECUTION_COMPLETED", "--tenant", "t1")
    assert [e["executionId"] for e in done] == [
        c.event.execution_id for c in feed
        if c.event.type is EventType.EXECUTION_COMPLETED and c.tenant == "t1"]
    assert done[0]["executionId"] == "ta"
    later = await tail(setup, "--from", str(feed[-3].position), "--no-follow")
    assert [e["position"] for e in later] == [str(c.position) for c in feed[-2:]]
    two = await tail(setup, "--from", "start", "--count", "2")
    assert len(two) == 2


async def test_events_tail_follows_new_events_and_refuses_a_bad_position(
        setup: Setup) -> None:
    await setup.store.append(started("old"))
    await setup.publish()
    proc = await asyncio.to_thread(subprocess.Popen,
                                   [FLEET, "events", "tail", "--json", "--count", "2"],
                                   env=_env(setup), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
    try:
        await asyncio.sleep(1.5)  # it starts "from now": "old" is not printed
        await setup.store.append_batch([started("new"), make_event("new", 1)])
        await setup.publish()
        out, err = await asyncio.to_thread(proc.communicate, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert [json.loads(line)["executionId"] for line in out.splitlines()] == ["new", "new"]
    bad = await asyncio.to_thread(subprocess.run, [FLEET, "events", "tail", "--from", "x-1"],
                                  env=_env(setup), capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2
    assert "not a position" in bad.stderr


async def test_events_status_shows_the_stream_the_groups_and_the_publishing_relay(
        setup: Setup) -> None:
    await Writers(setup.store, seed=6).run(writers=2, executions=2, events=4)
    relay = await setup.publish()
    seen, handle = recorder()
    consumer = EventStreamConsumer(setup.redis, handle, stream=setup.stream, group="g1",
                                   block_ms=50)
    await consumer.start()
    feed = await read_feed(setup.store)
    await until(lambda: len(seen) == len(feed))
    await consumer.stop()
    await asyncio.sleep(1.2)  # the relay reports every second
    done = await asyncio.to_thread(subprocess.run, [FLEET, "events", "status", "--json"],
                                   env=_env(setup), capture_output=True, text=True,
                                   timeout=30)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["length"] == len(feed) == relay.published
    assert (report["first"], report["last"]) == (str(feed[0].position),
                                                 str(feed[-1].position))
    assert report["removed"] == 0
    assert [(g["name"], g["lag"], g["pending"]) for g in report["groups"]] == [("g1", 0, 0)]
    assert report["relay"]["published"] == str(len(feed))
    assert report["relay"]["position"] == str(feed[-1].position)
    assert float(report["relay"]["age_s"]) < 5
    text = await asyncio.to_thread(subprocess.run, [FLEET, "events", "status"],
                                   env=_env(setup), capture_output=True, text=True, timeout=30)
    assert f"{len(feed)} entries" in text.stdout
