"""What the relay tests share: writers that race, and the check that the stream is the log.

``assert_stream_is_the_log`` is the property every relay test ends with: the
stream holds exactly the union of all logs of the store: every event once,
under its store position, positions growing, each execution in sequence order,
and each execution's entries equal to its log byte for byte.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from typing import Any

import redis.asyncio as aioredis

from fleet.kernel.errors import DuplicateSequenceError, StaleFenceError
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.store.conformance import make_event, started
from fleet.kernel.store.conformance_feed import check_feed, read_feed
from fleet.kernel.store.spi import CommittedEvent, EventStore, Position
from fleet.streams.events import parse_entry
from fleet.streams.redis_client import as_text

E = EventType


async def stream_events(redis: aioredis.Redis, stream: str) -> list[CommittedEvent]:
    """Every entry of ``stream``, parsed (paged: never one huge reply)."""
    out: list[CommittedEvent] = []
    start = "-"
    while True:
        entries = await redis.xrange(stream, min=start, count=1000)
        for raw_id, raw in entries:
            eid = as_text(raw_id)
            out.append(parse_entry(eid, {as_text(k): as_text(v) for k, v in raw.items()}))
        if len(entries) < 1000:
            return out
        start = "(" + as_text(entries[-1][0])


async def all_execution_ids(store: EventStore) -> list[str]:
    ids: list[str] = []
    after: str | None = None
    while rows := await store.list_executions(after_id=after, limit=1000):
        ids += [r.execution_id for r in rows]
        after = rows[-1].execution_id
    return ids


async def assert_stream_is_the_log(redis: aioredis.Redis, stream: str, store: EventStore,
                                   *, ignore: set[str] | None = None) -> list[CommittedEvent]:
    """The stream holds exactly the union of the store's logs (see the module docstring)."""
    published = await stream_events(redis, stream)
    check_feed(published)  # positions grow, no repeat, each execution in sequence order
    skip = ignore or set()
    feed = await read_feed(store)
    assert [(c.position, c.event.to_json()) for c in published
            if c.event.execution_id not in skip] == [
        (c.position, c.event.to_json()) for c in feed if c.event.execution_id not in skip]
    by_execution: dict[str, list[str]] = defaultdict(list)
    for c in published:
        by_execution[c.event.execution_id].append(c.event.to_json())
    ids = [x for x in await all_execution_ids(store) if x not in skip]
    assert set(by_execution) - skip == set(ids), (set(by_execution) - skip) ^ set(ids)
    for x in ids:
        assert by_execution[x] == [e.to_json() for e in await store.read(x)], x
    return published


async def wait_published(redis: aioredis.Redis, stream: str, store: EventStore,
                         timeout: float = 30.0) -> None:
    """Until the feed holds every event of every log and the stream its last position.

    (Postgres's feed may lag a commit while an older transaction anywhere on the
    server is open: waiting for the logs' events, not a count, rides that out.)
    """
    expected = {(e.execution_id, e.sequence) for x in await all_execution_ids(store)
                for e in await store.read(x)}
    deadline = asyncio.get_running_loop().time() + timeout
    last: Position | None = None
    while asyncio.get_running_loop().time() < deadline:
        feed = await read_feed(store)
        if expected <= {(c.execution_id, c.sequence) for c in feed}:
            last = feed[-1].position if feed else None
            if last is None:
                return
            if await redis.exists(stream):
                top = await redis.xrevrange(stream, count=1)
                if top and Position.parse(as_text(top[0][0])) >= last:
                    return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the stream does not hold every event (last {last}) after "
                         f"{timeout} s")


class Writers:
    """Writers that race on a store: new logs, batches, fenced writers that get fenced
    out, conditional appends that lose, refused slots; what they wrote is the store's."""

    def __init__(self, store: EventStore, *, seed: int, prefix: str = "w") -> None:
        self.store = store
        self.rng = random.Random(seed)
        self.prefix = prefix
        self.refused = 0

    async def run(self, writers: int = 6, executions: int = 5, events: int = 6,
                  pause_s: float = 0.0) -> None:
        await asyncio.gather(*(self._writer(w, executions, events, pause_s)
                               for w in range(writers)))

    async def _writer(self, w: int, executions: int, events: int, pause_s: float) -> None:
        for i in range(executions):
            x = f"{self.prefix}{w}-{i}"
            await self.store.append(started(x, tenant=self.rng.choice(["t1", "t2", None])))
            grant = await self.store.acquire_fence(x, holder=f"h{w}", lease_ms=60_000)
            sequence = 1
            while sequence < events:
                roll = self.rng.random()
                if roll < 0.15:  # a batch of two
                    await self.store.append_batch(
                        [make_event(x, sequence), make_event(x, sequence + 1)],
                        fence=grant.token)
                    sequence += 2
                    continue
                if roll < 0.25:  # a writer whose fence was taken: refused, writes nothing
                    stale = grant.token
                    grant = await self.store.acquire_fence(x, holder=f"h{w}b",
                                                           lease_ms=60_000)
                    try:
                        await self.store.append(make_event(x, sequence), fence=stale)
                    except StaleFenceError:
                        self.refused += 1
                if roll < 0.32:  # a taken slot: refused
                    try:
                        await self.store.append(make_event(x, sequence - 1))
                    except DuplicateSequenceError:
                        self.refused += 1
                await self.store.append(make_event(x, sequence), fence=grant.token)
                sequence += 1
                if pause_s:
                    await asyncio.sleep(self.rng.uniform(0, pause_s))
            await self.store.append(make_event(x, sequence, E.EXECUTION_COMPLETED),
                                    fence=grant.token)
            tip = (await self.store.append_if_unchanged(x, None)).tip
            outcome = make_event(x, sequence + 1, E.OUTCOME_RECORDED, {"key": f"k{w}"})
            await self.store.append_if_unchanged(x, outcome, tip)


def payload(size: int) -> dict[str, Any]:
    return {"output": "z" * size}


def big_events(execution_id: str, count: int, size: int) -> list[EventEnvelope]:
    return [started(execution_id)] + [make_event(execution_id, s, payload=payload(size))
                                      for s in range(1, count)]
