"""The conformance kit's tests of the committed feed (``read_committed``).

``EventStoreConformance`` inherits them, so every backend and decorator that
runs the kit proves them; they live here only to keep each module small. What
they pin: every event a writer appended appears once, and a refused write
never does; positions only grow and are never reused; one execution's events
come in sequence order; pages (``after``, ``limit``, ``max_bytes``) join up
without a gap or a repeat, also while writers run; deleted and compacted
events leave the feed; bad arguments are ``ValidationError``.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from fleet.kernel.errors import (
    DuplicateSequenceError,
    SequenceGapError,
    StaleFenceError,
    ValidationError,
)
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.store.conformance_events import make_event, started
from fleet.kernel.store.spi import ORIGIN, CommittedEvent, EventStore, Position

__all__ = ["FeedConformance", "check_feed", "read_feed", "settled_feed"]

E = EventType


async def read_feed(store: EventStore, *, after: Position = ORIGIN, page: int = 500,
                    **kw: Any) -> list[CommittedEvent]:
    """Every committed event above ``after``, read page by page."""
    out: list[CommittedEvent] = []
    while True:
        batch = await store.read_committed(after=after, limit=page, **kw)
        out += batch
        if not batch:
            return out
        after = batch[-1].position


async def settled_feed(store: EventStore, count: int, *, timeout: float = 20.0,
                       **kw: Any) -> list[CommittedEvent]:
    """``read_feed`` once it holds ``count`` events (or the timeout passed).

    The feed may lag the writes that returned: Postgres holds back rows while
    any older transaction of the server is still open (decision 0020), and a
    shared test server has other clients' transactions. Never a gap: later.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        feed = await read_feed(store, **kw)
        if len(feed) >= count or loop.time() >= deadline:
            return feed
        await asyncio.sleep(0.02)


def _wire(event: EventEnvelope) -> str:
    return json.dumps(event.to_dict(), sort_keys=True)


def check_feed(feed: list[CommittedEvent]) -> None:
    """Positions strictly grow, nothing repeats, each execution comes in sequence order."""
    positions = [c.position for c in feed]
    assert positions == sorted(set(positions)), "positions must strictly increase"
    last: dict[str, int] = {}
    for c in feed:
        assert c.event.sequence > last.get(c.event.execution_id, -1), c.event.id
        last[c.event.execution_id] = c.event.sequence


class FeedConformance:
    """``read_committed``: mixed into ``EventStoreConformance``."""

    async def test_feed_holds_every_accepted_write_once_and_no_refused_one(
            self, store: EventStore) -> None:
        written: list[EventEnvelope] = []
        for x, tenant in (("fa", "t1"), ("fb", None), ("fc", "t2")):
            batch = [started(x, tenant=tenant), make_event(x, 1)]
            await store.append_batch(batch)
            written += batch
        grant = await store.acquire_fence("fa", holder="w", lease_ms=60_000)
        for refused, write in (
                (StaleFenceError, store.append(make_event("fa", 2), fence=grant.token - 1)),
                (DuplicateSequenceError, store.append(make_event("fb", 1))),
                (SequenceGapError, store.append(make_event("fc", 5))),
                (SequenceGapError, store.append_batch([make_event("fc", 2),
                                                       make_event("fc", 4)]))):
            with pytest.raises(refused):
                await write
        event = make_event("fa", 2)
        await store.append(event, fence=grant.token)
        written.append(event)
        tip = (await store.append_if_unchanged("fb", None)).tip
        moved = await store.append_if_unchanged("fb", make_event("fb", 3, E.OUTCOME_RECORDED),
                                                tip)
        assert not moved.appended
        outcome = make_event("fb", 2, E.OUTCOME_RECORDED)
        assert (await store.append_if_unchanged("fb", outcome, tip)).appended
        written.append(outcome)
        batch = [make_event("fc", 2), make_event("fc", 3, E.EXECUTION_COMPLETED)]
        await store.append_batch(batch)
        written += batch

        feed = await settled_feed(store, len(written))
        check_feed(feed)
        assert sorted(_wire(c.event) for c in feed) == sorted(_wire(e) for e in written)
        # Commit order: these writes were sequential, so the feed keeps their order.
        assert [c.event.id for c in feed] == [e.id for e in written]
        tenants = {c.event.execution_id: c.tenant for c in feed}
        assert tenants == {"fa": "t1", "fb": None, "fc": "t2"}

    async def test_feed_pages_join_up(self, store: EventStore) -> None:
        for x in ("p1", "p2"):
            await store.append_batch([started(x)] + [make_event(x, s) for s in range(1, 6)])
        whole = await settled_feed(store, 12)
        assert len(whole) == 12
        assert await read_feed(store, page=5) == whole
        assert await read_feed(store, page=1) == whole
        assert await store.read_committed(after=whole[3].position, limit=2) == whole[4:6]
        assert await store.read_committed(after=whole[-1].position) == []
        assert await store.read_committed(after=Position(2**64 - 1, 2**64 - 1)) == []
        assert await store.read_committed(limit=0) == []
        assert await store.read_committed(after=ORIGIN, limit=3) == whole[:3]

    async def test_feed_bad_arguments_are_refused(self, store: EventStore) -> None:
        for kwargs in ({"limit": -1}, {"max_bytes": 0}, {"after": "1-0"}, {"after": 5}):
            with pytest.raises(ValidationError):
                await store.read_committed(**kwargs)
        for text in ("", "x", "1-", "-1", "1-2-3", "1.5", str(2**64)):
            with pytest.raises(ValidationError):
                Position.parse(text)
        assert Position.parse("12-3") == Position(12, 3)
        assert Position.parse(" 7 ") == Position(7, 0)
        assert str(Position(5, 9)) == "5-9"

    async def test_feed_positions_are_never_reused(self, store: EventStore) -> None:
        await store.append_batch([started("gone")] + [make_event("gone", s)
                                                      for s in range(1, 4)])
        await store.append_batch([started("kept")] + [make_event("kept", s)
                                                      for s in range(1, 5)])
        before = await settled_feed(store, 9)
        highest = before[-1].position
        assert await store.delete_execution("gone") is True
        assert await store.compact_through("kept", 2) == 2
        left = await read_feed(store)
        assert [(c.event.execution_id, c.event.sequence) for c in left] == [
            ("kept", 0), ("kept", 3), ("kept", 4)]
        assert [c.position for c in left] == [c.position for c in before
                                              if c.event.id in {e.event.id for e in left}]
        # The same id again, and more of the kept log: new positions, above every old one.
        await store.append_batch([started("gone"), make_event("gone", 1)])
        await store.append(make_event("kept", 5))
        fresh = await settled_feed(store, 3, after=highest)
        assert [(c.event.execution_id, c.event.sequence) for c in fresh] == [
            ("gone", 0), ("gone", 1), ("kept", 5)]
        assert all(c.position > highest for c in fresh)

    async def test_feed_max_bytes_bounds_a_page(self, store: EventStore) -> None:
        await store.append(started("big"))
        await store.append_batch([make_event("big", s, payload={"output": "x" * 1000})
                                  for s in range(1, 7)])
        size = len(_wire((await store.read("big", after=1))[0]).encode())
        await settled_feed(store, 7)
        first = await store.read_committed(limit=1)
        page = await store.read_committed(after=first[0].position, max_bytes=2 * size + 1)
        assert [c.event.sequence for c in page] == [1, 2, 3]  # the third crosses the bound
        one = await store.read_committed(after=first[0].position, max_bytes=1)
        assert [c.event.sequence for c in one] == [1]  # at least one, however large
        every = await read_feed(store, after=first[0].position, max_bytes=2 * size + 1)
        assert [c.event.sequence for c in every] == [1, 2, 3, 4, 5, 6]

    async def test_feed_read_while_writers_run_misses_nothing(self, store: EventStore) -> None:
        rng = random.Random(20)
        executions = [f"w{i}" for i in range(8)]
        per_execution = 12
        done = asyncio.Event()

        async def writer(x: str) -> None:
            await store.append(started(x))
            for s in range(1, per_execution):
                if rng.random() < 0.3:
                    await asyncio.sleep(0)
                await store.append(make_event(x, s))

        async def reader() -> list[CommittedEvent]:
            seen: list[CommittedEvent] = []
            after = ORIGIN
            while True:
                finished = done.is_set()
                batch = await store.read_committed(after=after, limit=7)
                seen += batch
                if batch:
                    after = batch[-1].position
                elif finished:
                    return seen
                else:
                    await asyncio.sleep(0.001)

        reading = asyncio.ensure_future(reader())
        await asyncio.gather(*(writer(x) for x in executions))
        await settled_feed(store, len(executions) * per_execution)
        done.set()
        seen = await reading
        check_feed(seen)
        assert sorted((c.event.execution_id, c.event.sequence) for c in seen) == sorted(
            (x, s) for x in executions for s in range(per_execution))
