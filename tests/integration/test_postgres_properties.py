"""Hypothesis-driven interleavings on a real Postgres server.

Three writers, each with its own store (its own pool, so its own server
connections), run groups of operations concurrently against one execution:
unconditional and polite takeovers, fenced appends and batches at the head
they read, and conditional appends. Whatever the schedule, the log is
contiguous, holds exactly the writes that were acknowledged, and the fence
tokens along it never go down: no superseded writer's event lands after its
successor's.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from postgres_server import throwaway_database

from fleet.kernel.errors import DuplicateSequenceError, SequenceGapError, StaleFenceError
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.store.conformance import T0, started
from fleet.kernel.store.postgres import PostgresEventStore

pytestmark = pytest.mark.integration

_OPS = st.sampled_from(["takeover", "polite", "append", "batch", "conditional"])
_GROUPS = st.lists(st.lists(st.tuples(_OPS, st.integers(0, 2)), min_size=1, max_size=4),
                   min_size=1, max_size=8)


@pytest.fixture(scope="module")
def database_url() -> Iterator[str]:
    with throwaway_database() as url:
        yield url + f"?schema=p_{secrets.token_hex(5)}"  # one schema; an execution per example


@dataclass
class _Clock:
    now: int = T0

    def __call__(self) -> int:
        return self.now


@dataclass
class _History:
    acknowledged: list[list[EventEnvelope]] = field(default_factory=list)
    refused: list[list[EventEnvelope]] = field(default_factory=list)
    ops: int = 0


def _events(x: str, first: int, n: int, token: int, op: int) -> list[EventEnvelope]:
    return [EventEnvelope.make(x, first + i, EventType.STEP_COMPLETED, T0 + first + i,
                               {"stepId": f"op{op}-{i}", "attempt": 1},
                               metadata={"token": token, "op": op}) for i in range(n)]


async def _schedule(url: str, groups: list[list[tuple[str, int]]]) -> None:
    X = f"prop-{secrets.token_hex(6)}"  # noqa: N806 - the execution of this example
    clock = _Clock()
    stores = [PostgresEventStore(url, pool_max=2, clock=clock) for _ in range(3)]
    tokens: list[int | None] = [None, None, None]
    history = _History()
    try:
        await stores[0].open()
        await stores[0].append(started(X))

        async def run(op: str, who: int) -> None:
            store = stores[who]
            history.ops += 1
            ident = history.ops
            if op in ("takeover", "polite"):
                grant = (await store.acquire_fence(X, holder=f"w{who}", lease_ms=50)
                         if op == "takeover" else
                         await store.acquire_fence_if(X, holder=f"w{who}", lease_ms=50))
                if grant is not None:
                    tokens[who] = grant.token
                return
            if op == "conditional":
                tip = (await store.append_if_unchanged(X, None)).tip
                assert tip.head is not None
                (event,) = _events(X, tip.head + 1, 1, tip.fence, ident)
                result = await store.append_if_unchanged(X, event, tip)
                (history.acknowledged if result.appended else history.refused).append([event])
                return
            token = tokens[who]
            if token is None:
                return
            head = await store.head(X)
            assert head is not None
            events = _events(X, head + 1, 3 if op == "batch" else 1, token, ident)
            try:
                await store.append_batch(events, fence=token)
            except (StaleFenceError, DuplicateSequenceError, SequenceGapError):
                history.refused.append(events)
                return
            history.acknowledged.append(events)

        for group in groups:
            clock.now += 20  # leases are 50 ms: a holder that stops acting loses it
            await asyncio.gather(*(run(op, who) for op, who in group))
        log = await stores[0].read(X)
    finally:
        for store in stores:
            await store.close()

    assert [e.sequence for e in log] == list(range(len(log)))
    on_log = {e.metadata["op"] for e in log[1:]}
    for events in history.acknowledged:  # acknowledged: on the log, exactly
        assert [e for e in log if e.metadata.get("op") == events[0].metadata["op"]] == events
    for events in history.refused:       # refused: not a trace
        assert events[0].metadata["op"] not in on_log
    assert sum(len(events) for events in history.acknowledged) == len(log) - 1
    tokens_along = [e.metadata["token"] for e in log[1:]]
    assert tokens_along == sorted(tokens_along)


@settings(max_examples=25, deadline=None)
@given(groups=_GROUPS)
def test_racing_writers_leave_a_contiguous_fenced_log(
        database_url: str, groups: list[list[tuple[str, int]]]) -> None:
    asyncio.run(_schedule(database_url, groups))
