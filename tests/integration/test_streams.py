"""fleet.streams against a real Redis (tests/redis_server.py) and a real Runtime.

Every test names its streams under its own key prefix and deletes them after.
Redis faults are real: a port nothing listens on, a socket that accepts and
never answers, and a TCP proxy in front of the test Redis that refuses new
connections and cuts live ones.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import socket
import time
import tracemalloc
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis as sync_redis
import redis.asyncio as aioredis
from redis_server import prefix, server_url

from fleet import (
    AccessPolicy,
    ConfigurationError,
    Context,
    Decision,
    OutcomeContendedError,
    OutcomeResult,
    Policy,
    Principal,
    Runtime,
    flow,
)
from fleet.config import FleetSettings
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore
from fleet.kernel.store.sqlite import SqliteEventStore
from fleet.services import Service, run_services
from fleet.streams import (
    EventPublisher,
    RewardAttacher,
    RewardMessage,
    StreamConsumer,
    StreamEntry,
    canonical_body,
    sign_reward,
    submit_reward,
    submit_reward_sync,
    verify_reward,
)

pytestmark = pytest.mark.integration
ALICE = Principal("alice", tenant="acme")
EVE = Principal("eve", tenant="other")
KEYS = {"crm": "k-crm-0f3a", "survey": "k-survey-77c1"}
ANNOTATE_ANY = AccessPolicy(rules={"annotate": "any"})


# -- flows ------------------------------------------------------------------------

def _price() -> Decision:
    return Decision("high", policy=Policy("pricing", 1, 0.25), alternatives=["low", "high"])


@flow("stream-deal", version=1, steps=["quote", "confirm"])
async def deal(ctx: Context, n: int) -> str:
    quote = await ctx.step("quote", lambda: n * 2)
    await ctx.decide("price", _price)
    await ctx.step("confirm", lambda: quote + 1)
    return "done"


@flow("stream-gated", version=1, steps=["quote"])
async def gated(ctx: Context, n: int) -> Any:
    await ctx.step("quote", lambda: n)
    await ctx.decide("price", _price)
    answer = await ctx.wait("approval")
    await ctx.sleep(0.01)
    return answer


# -- fixtures and helpers ------------------------------------------------------------

@pytest.fixture
def ns() -> str:
    return prefix()


@pytest.fixture
async def redis(ns: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(server_url())
    try:
        yield client
    finally:
        keys = [k async for k in client.scan_iter(match=f"{ns}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def eventually(check: Callable[[], Awaitable[bool] | bool], timeout: float = 10.0,
                     what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def decoded(fields: dict[Any, Any]) -> dict[str, str]:
    return {text(k): text(v) for k, v in fields.items()}


async def entries(redis: aioredis.Redis, stream: str) -> list[tuple[str, dict[str, str]]]:
    return [(text(eid), decoded(f)) for eid, f in await redis.xrange(stream)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proxy:
    """A TCP proxy to the test Redis that can refuse connections and cut live ones."""

    def __init__(self) -> None:
        target = urlsplit(server_url())
        self.target = (target.hostname or "127.0.0.1", target.port or 6379)
        self.db = target.path.lstrip("/") or "0"
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/{self.db}"

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def close(self) -> None:
        """Refuse new connections and abort every live one (Redis "went away")."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers.update({writer, up_writer})

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))


@pytest.fixture
async def proxy() -> AsyncIterator[Proxy]:
    p = Proxy()
    try:
        yield p
    finally:
        await p.close()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections and never answers (a hung Redis)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(128)
        yield int(s.getsockname()[1])


async def finished(rt: Runtime, n: int = 1, principal: Principal | None = ALICE) -> str:
    handle = await rt.start("stream-deal", n, principal=principal)
    assert await handle.result(timeout=10) == "done"
    return handle.execution_id


def reward(execution_id: str, key: str, *, score: float | None = 0.9,
           success: bool | None = None, producer: str = "crm",
           nonce: str | None = None, decision_id: str = "price") -> RewardMessage:
    return RewardMessage(execution_id=execution_id, decision_id=decision_id, key=key,
                         score=score, success=success, producer=producer,
                         sent_at=time.time_ns() // 1_000_000, nonce=nonce)


def late_outcomes(events: list[EventEnvelope]) -> list[dict[str, Any]]:
    return [e.payload for e in events
            if e.type is EventType.OUTCOME_RECORDED and e.payload.get("late") is True]


class Rewards:
    """An attacher on its own streams, over a memory-store runtime."""

    def __init__(self, redis: aioredis.Redis, ns: str, runtime: Runtime | None = None,
                 **options: Any) -> None:
        self.redis = redis
        self.stream, self.dead, self.group = f"{ns}rewards", f"{ns}rewards:dead", f"{ns}g"
        self.inbox = f"{ns}rewards:inbox"
        self.runtime = runtime or Runtime(MemoryEventStore(), flows=[deal, gated],
                                          access_policy=ANNOTATE_ANY)
        options.setdefault("claim_idle_ms", 100)
        options.setdefault("block_ms", 50)
        self.keys: dict[str, str] = options.pop("keys", KEYS)
        options.setdefault("inbox", self.inbox)
        self.attacher = RewardAttacher(self.runtime, redis, keys=self.keys, stream=self.stream,
                                       group=self.group, dead_stream=self.dead,
                                       consumer="attacher-1", **options)

    async def submit(self, message: RewardMessage, key: str | None = None) -> str:
        return await submit_reward(self.redis, self.inbox, message,
                                   self.keys[message.producer] if key is None else key)

    async def raw(self, fields: dict[str, Any]) -> str:
        """An entry on the stream itself (what only the attacher's user may add now: a
        mangled entry, not a message a producer can send)."""
        return text(await self.redis.xadd(self.stream, fields))

    async def pushed(self, message: str | bytes) -> None:
        """What a producer sends, as it sends it: anything, onto the inbox."""
        await self.redis.lpush(self.inbox, message)

    def settled(self) -> int:
        s = self.attacher.stats()
        return int(s["attached"] + s["duplicates"] + sum(s["dead_lettered"].values()))

    async def until_settled(self, n: int, timeout: float = 10.0) -> None:
        await eventually(lambda: self.settled() >= n, timeout, f"{n} rewards settled")
        await eventually(lambda: self._no_pending(), timeout, "no pending entries")

    async def _no_pending(self) -> bool:
        return await self.attacher.consumer.pending() == 0

    async def dead_letters(self) -> list[dict[str, str]]:
        return [f for _, f in await entries(self.redis, self.dead)]

    async def dead_letters_raw(self) -> list[dict[bytes, bytes]]:
        return [f for _, f in await self.redis.xrange(self.dead)]

    async def log(self, execution_id: str) -> list[EventEnvelope]:
        return await self.runtime.store.read(execution_id)


@pytest.fixture
async def rewards(redis: aioredis.Redis, ns: str) -> AsyncIterator[Rewards]:
    r = Rewards(redis, ns)
    await r.attacher.start()
    try:
        yield r
    finally:
        await r.attacher.stop()


# -- the publisher ----------------------------------------------------------------

async def test_publisher_delivers_every_durable_event_as_the_log_holds_it(
        redis: aioredis.Redis, ns: str, tmp_path: Path) -> None:
    settings = FleetSettings(redis_url=server_url())
    publisher = EventPublisher.from_settings(settings, stream=f"{ns}events")
    store: EventStore = SqliteEventStore(str(tmp_path / "fleet.db"))
    rt = Runtime(store, flows=[deal, gated], access_policy=ANNOTATE_ANY,
                 on_durable_event=publisher.on_durable_event)
    await publisher.start()
    try:
        deals = await asyncio.gather(*(rt.start("stream-deal", i) for i in range(20)))
        waits = await asyncio.gather(*(rt.start("stream-gated", i) for i in range(5)))
        assert [await h.result(timeout=10) for h in deals] == ["done"] * 20
        for h in waits:
            await rt.resume(h.execution_id, "approval", {"ok": h.execution_id})
        assert [await h.result(timeout=10) for h in waits] == [
            {"ok": h.execution_id} for h in waits]
        await rt.record_outcome(deals[0].execution_id, decision_id="price", key="csat:1",
                                score=1.0, principal=ALICE)
        assert await publisher.flush(timeout=10)
        published = await entries(redis, f"{ns}events")
        by_execution: dict[str, list[str]] = defaultdict(list)
        for _, fields in published:
            envelope = json.loads(fields["envelope"])
            assert fields["executionId"] == envelope["executionId"]
            assert fields["sequence"] == str(envelope["sequence"])
            assert fields["type"] == envelope["type"]
            by_execution[fields["executionId"]].append(fields["envelope"])
        ids = [h.execution_id for h in deals + waits]
        assert set(by_execution) == set(ids)
        total = 0
        for eid in ids:
            # Exactly the log: every event, byte for byte, in the log's order.
            assert by_execution[eid] == [e.to_json() for e in await store.read(eid)]
            total += len(by_execution[eid])
        assert publisher.stats() == {"published": total, "dropped": 0, "buffered": 0,
                                     "buffered_bytes": 0, "errors": 0, "lag_ms": 0.0}
    finally:
        await publisher.stop()
        await rt.close()
        await store.close()


async def _run_deals(rt: Runtime, n: int) -> float:
    began = time.perf_counter()
    handles = await asyncio.gather(*(rt.start("stream-deal", i) for i in range(n)))
    assert [await h.result(timeout=10) for h in handles] == ["done"] * n
    return time.perf_counter() - began


@pytest.mark.parametrize("fault", ["refused", "silent"])
async def test_an_unreachable_redis_neither_slows_nor_breaks_a_run(
        fault: str, silent_port: int) -> None:
    port = free_port() if fault == "refused" else silent_port
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout=0.3,
                                     socket_connect_timeout=0.3)
    warnings: list[str] = []
    publisher = EventPublisher(client, stream="never", buffer_limit=50, batch_size=10,
                               drain_timeout_s=0.2, on_warn=warnings.append,
                               close_client=True)
    seen = 0

    def count(event: EventEnvelope) -> None:
        nonlocal seen
        seen += 1
        publisher.on_durable_event(event)

    baseline = await _run_deals(Runtime(MemoryEventStore(), flows=[deal]), 40)
    rt = Runtime(MemoryEventStore(), flows=[deal], on_durable_event=count)
    await publisher.start()
    try:
        elapsed = await _run_deals(rt, 40)
        # Redis costs the run nothing it can measure: not a timeout, not a retry.
        assert elapsed < baseline * 3 + 0.25, (elapsed, baseline)
        stats = publisher.stats()
        assert stats["published"] == 0
        assert stats["dropped"] > 0
        assert stats["buffered"] <= 50 + 10
        assert stats["published"] + stats["dropped"] + stats["buffered"] == seen
        assert stats["lag_ms"] > 0
        await eventually(lambda: publisher.errors > 0, 5, "a failed send")
        assert any("dropped the oldest" in w for w in warnings)
    finally:
        await publisher.stop()
    stats = publisher.stats()
    assert stats["buffered"] == 0
    assert stats["dropped"] == seen


async def test_with_redis_down_large_events_are_bounded_in_bytes_not_just_count() -> None:
    # Issue 10 item 6: 4,000 events of 256 KiB held ~1 GiB under a bound of 10,000
    # events. The buffer's bytes are bounded too; the oldest go, counted and warned.
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0",
                                     socket_timeout=0.3, socket_connect_timeout=0.3)
    warnings: list[str] = []
    bound = 4 * 1024 * 1024
    publisher = EventPublisher(client, stream="never", buffer_bytes=bound, batch_size=8,
                               drain_timeout_s=0.2, on_warn=warnings.append, close_client=True)
    await publisher.start()
    size = 256 * 1024
    tracemalloc.start()
    try:
        for n in range(400):  # 100 MiB offered while Redis is down
            publisher.on_durable_event(EventEnvelope.make(
                "big", n, EventType.STEP_COMPLETED, 1, {"stepId": f"s{n}", "attempt": 1,
                                                         "output": "x" * size}))
            if n % 50 == 0:
                await asyncio.sleep(0.01)  # let the sender try (and fail)
        stats = publisher.stats()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        await publisher.stop()
    assert stats["buffered_bytes"] <= bound
    assert stats["buffered"] <= bound // size
    assert stats["dropped"] == 400 - stats["buffered"]
    assert peak < 4 * bound, peak  # what it holds, and one event's copies; not 100 MiB
    assert any("dropped the oldest" in w for w in warnings)
    alone = EventPublisher(client, stream="never", buffer_bytes=size)  # smaller than one event
    alone.on_durable_event(EventEnvelope.make("big", 0, EventType.STEP_COMPLETED, 1, {
        "stepId": "s", "attempt": 1, "output": "x" * size}))
    assert alone.stats()["buffered"] == 0
    assert alone.dropped == 1
    with pytest.raises(ConfigurationError, match="relay's stream"):
        EventPublisher.from_settings(FleetSettings(redis_url=server_url()),
                                     stream="fleet:events")


async def test_publisher_buffers_through_an_outage_and_reconnects(
        redis: aioredis.Redis, ns: str, proxy: Proxy) -> None:
    stream = f"{ns}events"
    client = aioredis.Redis.from_url(proxy.url, socket_timeout=1.0, socket_connect_timeout=0.5)
    publisher = EventPublisher(client, stream=stream, close_client=True, on_warn=lambda m: None)
    store = MemoryEventStore()
    rt = Runtime(store, flows=[deal], on_durable_event=publisher.on_durable_event)
    await proxy.open()
    await publisher.start()
    try:
        first = await asyncio.gather(*(rt.start("stream-deal", i) for i in range(5)))
        for h in first:
            await h.result(timeout=10)
        assert await publisher.flush()
        await proxy.close()  # cut the live connection and refuse new ones
        second = await asyncio.gather(*(rt.start("stream-deal", i) for i in range(5)))
        for h in second:
            await h.result(timeout=10)
        await eventually(lambda: publisher.errors > 0, 5, "a failed send")
        assert publisher.stats()["buffered"] > 0
        await proxy.open()
        assert await publisher.flush(timeout=10)
        got = [f["envelope"] for _, f in await entries(redis, stream)]
        expected = [e.to_json() for h in first + second for e in await store.read(h.execution_id)]
        assert sorted(got) == sorted(expected)
        assert len(got) == len(set(got))
        assert publisher.stats()["dropped"] == 0
    finally:
        await publisher.stop()


async def test_a_stream_key_redis_refuses_is_retried_without_duplicates(
        redis: aioredis.Redis, ns: str) -> None:
    stream = f"{ns}events"
    await redis.set(stream, "not a stream")  # an operator's mistake: XADD answers WRONGTYPE
    warnings: list[str] = []
    publisher = EventPublisher(redis, stream=stream, on_warn=warnings.append)
    store = MemoryEventStore()
    rt = Runtime(store, flows=[deal], on_durable_event=publisher.on_durable_event)
    await publisher.start()
    try:
        eid = await finished(rt, principal=None)
        await eventually(lambda: publisher.errors > 0, 5, "a refused send")
        assert publisher.stats()["published"] == 0
        assert any("WRONGTYPE" in w for w in warnings)
        await redis.delete(stream)
        assert await publisher.flush(timeout=10)
        got = [f["envelope"] for _, f in await entries(redis, stream)]
        assert got == [e.to_json() for e in await store.read(eid)]
    finally:
        await publisher.stop()


# -- the consumer group -----------------------------------------------------------

class Recorder:
    def __init__(self, fail: Callable[[StreamEntry], bool] = lambda e: False) -> None:
        self.fail = fail
        self.seen: list[tuple[str, int]] = []
        self.done: dict[str, StreamEntry] = {}

    async def __call__(self, entry: StreamEntry) -> None:
        self.seen.append((entry.fields["n"], entry.deliveries))
        if self.fail(entry):
            raise ValueError(f"cannot handle {entry.fields['n']}")
        self.done[entry.fields["n"]] = entry


async def _fill(redis: aioredis.Redis, stream: str, n: int, start: int = 0) -> list[str]:
    pipe = redis.pipeline(transaction=False)
    for i in range(start, start + n):
        pipe.xadd(stream, {"n": str(i)})
    return [text(e) for e in await pipe.execute()]


async def test_consumer_acks_and_redelivers_what_its_handler_failed(
        redis: aioredis.Redis, ns: str) -> None:
    stream = f"{ns}s"
    await _fill(redis, stream, 20)
    handler = Recorder(fail=lambda e: int(e.fields["n"]) % 5 == 0 and e.deliveries == 1)
    consumer = StreamConsumer(redis, stream, "g", "c1", handler, claim_idle_ms=150,
                              block_ms=50, on_warn=lambda m: None)
    await consumer.start()
    try:
        await eventually(lambda: len(handler.done) == 20, 10, "every entry handled")
        await eventually(lambda: _zero(consumer.pending()), 5, "nothing pending")
        stats = consumer.stats()
        assert stats["failures"] == 4
        assert stats["acked"] == 20
        assert stats["dead_lettered"] == {}
        assert stats["claimed"] >= 4
        retried = sorted(int(n) for n, d in handler.seen if d == 2)
        assert retried == [0, 5, 10, 15]
        assert all(handler.done[str(n)].deliveries == 2 for n in retried)
    finally:
        await consumer.stop()


async def _zero(pending: Awaitable[int]) -> bool:
    return await pending == 0


async def test_a_dead_consumers_entries_are_claimed(redis: aioredis.Redis, ns: str) -> None:
    stream = f"{ns}s"
    await redis.xgroup_create(stream, "g", id="0", mkstream=True)
    await _fill(redis, stream, 10)
    # "ghost" reads ten entries and dies without acknowledging any.
    taken = await redis.xreadgroup("g", "ghost", {stream: ">"}, count=10)
    assert len(taken[0][1]) == 10
    handler = Recorder()
    consumer = StreamConsumer(redis, stream, "g", "live", handler, claim_idle_ms=200,
                              block_ms=50)
    await consumer.start()
    try:
        await _fill(redis, stream, 5, start=10)
        await eventually(lambda: len(handler.done) == 15, 10, "all 15 handled by live")
        await eventually(lambda: _zero(consumer.pending()), 5, "nothing pending")
        assert {n for n, e in handler.done.items() if int(n) < 10} == {str(i) for i in range(10)}
        assert all(handler.done[str(i)].deliveries == 2 for i in range(10))
        assert all(handler.done[str(i)].deliveries == 1 for i in range(10, 15))
        members = {text(c["name"]): c for c in await redis.xinfo_consumers(stream, "g")}
        assert members["ghost"]["pending"] == 0
        assert consumer.stats()["claimed"] == 10
    finally:
        await consumer.stop()


async def test_a_restarted_consumer_handles_its_own_pending_entries_first(
        redis: aioredis.Redis, ns: str) -> None:
    stream = f"{ns}s"
    await redis.xgroup_create(stream, "g", id="0", mkstream=True)
    await _fill(redis, stream, 6)
    await redis.xreadgroup("g", "c1", {stream: ">"}, count=6)  # then "c1" crashed
    handler = Recorder()
    # A claim would wait a minute: the restart must not.
    consumer = StreamConsumer(redis, stream, "g", "c1", handler, claim_idle_ms=60_000,
                              block_ms=50)
    await consumer.start()
    try:
        await eventually(lambda: len(handler.done) == 6, 5, "own pending handled")
        await eventually(lambda: _zero(consumer.pending()), 5, "nothing pending")
        assert consumer.stats()["claimed"] == 0
    finally:
        await consumer.stop()


async def test_a_poison_entry_is_dead_lettered_and_the_consumer_keeps_going(
        redis: aioredis.Redis, ns: str) -> None:
    stream = f"{ns}s"
    await _fill(redis, stream, 3)
    handler = Recorder(fail=lambda e: e.fields["n"] == "1")
    consumer = StreamConsumer(redis, stream, "g", "c1", handler, claim_idle_ms=100,
                              max_deliveries=3, block_ms=50, on_warn=lambda m: None)
    await consumer.start()
    try:
        await eventually(lambda: consumer.stats()["dead_lettered"] == {"handler_error": 1},
                         10, "the poison entry dead-lettered")
        await _fill(redis, stream, 1, start=3)
        await eventually(lambda: set(handler.done) == {"0", "2", "3"}, 5, "the rest handled")
        await eventually(lambda: _zero(consumer.pending()), 5, "nothing pending")
        dead = await entries(redis, f"{stream}:dead")
        assert len(dead) == 1
        letter = dead[0][1]
        assert letter["n"] == "1"  # the original fields, verbatim
        assert letter["dead_reason"] == "handler_error"
        assert "ValueError: cannot handle 1" in letter["dead_detail"]
        assert letter["dead_deliveries"] == "3"
        assert letter["dead_stream"] == stream
        assert [d for n, d in handler.seen if n == "1"] == [1, 2, 3]
        assert consumer.stats()["failures"] == 3
    finally:
        await consumer.stop()


async def test_a_consumer_on_a_key_of_another_type_fails_at_start(
        redis: aioredis.Redis, ns: str) -> None:
    await redis.set(f"{ns}s", "not a stream")
    consumer = StreamConsumer(redis, f"{ns}s", "g", "c1", Recorder())
    with pytest.raises(ConfigurationError, match="cannot create group"):
        await consumer.start()


async def test_consumer_keeps_running_through_a_redis_outage(
        redis: aioredis.Redis, ns: str, proxy: Proxy) -> None:
    stream = f"{ns}s"
    client = aioredis.Redis.from_url(proxy.url, socket_connect_timeout=0.5)
    handler = Recorder()
    consumer = StreamConsumer(client, stream, "g", "c1", handler, claim_idle_ms=200,
                              block_ms=50, on_warn=lambda m: None)
    await proxy.open()
    await consumer.start()
    try:
        await _fill(redis, stream, 3)
        await eventually(lambda: len(handler.done) == 3, 5, "first entries")
        await proxy.close()
        await eventually(lambda: consumer.errors > 0, 5, "the outage noticed")
        await _fill(redis, stream, 3, start=3)
        await asyncio.sleep(0.3)
        await proxy.open()
        await eventually(lambda: len(handler.done) == 6, 10, "entries after the outage")
        await eventually(lambda: _zero(consumer.pending()), 5, "nothing pending")
    finally:
        await consumer.stop()
        await client.aclose()


# -- rewards in ----------------------------------------------------------------------

def test_the_documented_signature_vector() -> None:
    """The vector in docs/decisions/0011-reward-producers.md, for non-Python producers."""
    message = RewardMessage(execution_id="exec-1", decision_id="price", key="csat:1",
                            score=0.75, producer="crm", sent_at=1767225600000, nonce="n-1")
    body = canonical_body(message.body())
    assert body == (b'{"decision_id":"price","execution_id":"exec-1","key":"csat:1",'
                    b'"nonce":"n-1","producer":"crm","score":0.75,"sent_at":1767225600000}')
    signed = sign_reward(message, "secret-crm")
    assert signed.signature == hmac.new(b"secret-crm", body, hashlib.sha256).hexdigest()
    assert signed.signature == (
        "38a12439d17436567f1f8803fcc5306a9c7ad292138738af5282c30028399b80")
    assert verify_reward(signed.to_wire(), {"crm": "secret-crm"}) == signed


async def test_a_signed_reward_is_attached_exactly_once(rewards: Rewards) -> None:
    eid = await finished(rewards.runtime)
    message = reward(eid, "csat:1", score=0.9, nonce="a")
    await rewards.submit(message)
    await rewards.submit(message)  # the producer retried
    await rewards.until_settled(2)
    stats = rewards.attacher.stats()
    assert (stats["attached"], stats["duplicates"], stats["dead_lettered"]) == (1, 1, {})
    outcomes = late_outcomes(await rewards.log(eid))
    assert len(outcomes) == 1
    assert outcomes[0] == {**outcomes[0], "decisionId": "price", "key": "csat:1", "score": 0.9,
                           "recordedBy": "producer:crm"}
    assert await rewards.dead_letters() == []


async def test_attacher_from_settings_runs_as_a_service(redis: aioredis.Redis,
                                                      ns: str) -> None:
    settings = FleetSettings(redis_url=server_url(), rewards_stream=f"{ns}rewards",
                             rewards_dead=f"{ns}dead", rewards_group=f"{ns}g",
                             rewards_inbox=f"{ns}inbox", reward_keys=KEYS)
    rt = Runtime(MemoryEventStore(), flows=[deal], access_policy=ANNOTATE_ANY)
    publisher = EventPublisher(redis, stream=f"{ns}events")
    attacher = RewardAttacher.from_settings(settings, rt, block_ms=50)
    rt.on_durable_event = publisher.on_durable_event
    assert isinstance(attacher, Service)
    assert isinstance(publisher, Service)
    assert isinstance(attacher.consumer, Service)

    async def work() -> None:
        eid = await finished(rt)
        await submit_reward(redis, settings.rewards_inbox, reward(eid, "csat:1"), KEYS["crm"])
        await eventually(lambda: attacher.stats()["attached"] == 1, 10, "attached")
        await publisher.flush()
        types = [f["type"] for _, f in await entries(redis, f"{ns}events")]
        assert types[-1] == EventType.OUTCOME_RECORDED.value  # the publisher saw it too

    await run_services([publisher, attacher], until=work())
    assert attacher.consumer._task is None
    assert publisher.stats()["buffered"] == 0


def _forge(body: dict[str, Any], key: str, *, allow_nan: bool = False) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                           allow_nan=allow_nan)
    sig = hmac.new(key.encode(), canonical.encode(), hashlib.sha256).hexdigest()
    return json.dumps({**body, "signature": sig}, allow_nan=allow_nan)


def bad_messages(eid: str, tag: str) -> list[tuple[str, dict[str, str]]]:
    """(expected reason, entry fields) for every way a message is refused before attaching."""
    good = reward(eid, f"bad:{tag}", nonce=tag)
    body = good.body()
    signed = sign_reward(good, KEYS["crm"])
    tampered = json.loads(signed.to_wire())
    tampered["score"] = 0.1
    no_decision = {k: v for k, v in body.items() if k != "decision_id"}
    return [
        ("bad_signature", {"message": sign_reward(good, "not-crm's-key").to_wire()}),
        ("bad_signature", {"message": json.dumps(tampered)}),
        ("bad_signature", {"message": json.dumps({**body, "signature": "zz"})}),
        ("unknown_producer", {"message": _forge({**body, "producer": "mallory"}, "m-key")}),
        ("unknown_producer", {"message": _forge({k: v for k, v in body.items()
                                                 if k != "producer"}, "m-key")}),
        ("unsigned", {"message": good.to_wire()}),
        ("malformed", {"message": '{"execution_id": "' + eid + '", '}),
        ("malformed", {"message": "[1, 2, 3]"}),
        ("malformed", {"reward": signed.to_wire()}),
        ("invalid", {"message": _forge(no_decision, KEYS["crm"])}),
        ("invalid", {"message": _forge({**body, "score": float("nan")}, KEYS["crm"],
                                       allow_nan=True)}),
        ("invalid", {"message": _forge({**body, "score": "0.9"}, KEYS["crm"])}),
        ("invalid", {"message": _forge({**body, "tenant": "acme"}, KEYS["crm"])}),
        ("invalid", {"message": _forge({k: v for k, v in body.items() if k != "score"},
                                       KEYS["crm"])}),
    ]


async def test_bad_rewards_are_dead_lettered_with_their_reason(rewards: Rewards) -> None:
    eid = await finished(rewards.runtime)
    before = [e.to_json() for e in await rewards.log(eid)]
    cases = bad_messages(eid, "x")
    originals: dict[str, tuple[str, dict[str, str]]] = {}
    for reason, fields in cases:
        originals[await rewards.raw(fields)] = (reason, fields)
    await rewards.until_settled(len(cases))
    assert [e.to_json() for e in await rewards.log(eid)] == before  # nothing attached
    letters = await rewards.dead_letters()
    assert len(letters) == len(cases)
    for letter in letters:
        reason, fields = originals[letter["dead_id"]]
        assert letter["dead_reason"] == reason, (letter, fields)
        assert {k: letter[k] for k in fields} == fields  # the original message, verbatim
        assert letter["dead_detail"]
    assert rewards.attacher.stats()["dead_lettered"] == dict(Counter(r for r, _ in cases))
    # The consumer is still running: a good message after them attaches.
    await rewards.submit(reward(eid, "csat:after"))
    await rewards.until_settled(len(cases) + 1)
    assert [o["key"] for o in late_outcomes(await rewards.log(eid))] == ["csat:after"]


async def test_permanent_refusals_are_dead_lettered_with_the_kernels_reason(
        rewards: Rewards) -> None:
    eid = await finished(rewards.runtime)
    await rewards.submit(reward(eid, "csat:1", score=0.5))
    await rewards.until_settled(1)
    cases = [("outcome_refused", reward(eid, "csat:1", score=0.6)),  # another value, same key
             ("outcome_refused", reward(eid, "csat:2", decision_id="nope")),
             ("execution_not_found", reward("no-such-execution", "csat:1")),
             ("validation", reward(eid, "csat:3", score=1e12))]
    for _, message in cases:
        await rewards.submit(message)
    await rewards.until_settled(1 + len(cases))
    letters = await rewards.dead_letters()
    assert [(d["dead_reason"], json.loads(d["message"])["key"]) for d in letters] == [
        (reason, m.key) for reason, m in cases]
    assert [(o["key"], o["score"]) for o in late_outcomes(await rewards.log(eid))] == [
        ("csat:1", 0.5)]


async def test_a_reward_for_a_running_execution_waits_for_it_to_finish(
        redis: aioredis.Redis, ns: str) -> None:
    r = Rewards(redis, ns, max_deliveries=4, claim_idle_ms=100)
    await r.attacher.start()
    try:
        later = await r.runtime.start("stream-gated", 1)
        never = await r.runtime.start("stream-gated", 2)
        await eventually(lambda: _parked(r.runtime, later.execution_id), 5, "parked")
        await eventually(lambda: _parked(r.runtime, never.execution_id), 5, "parked")
        await r.submit(reward(later.execution_id, "csat:1"))
        await r.submit(reward(never.execution_id, "csat:1"))
        await eventually(lambda: r.attacher.stats()["deferred"] >= 2, 5, "deferred")
        assert late_outcomes(await r.log(later.execution_id)) == []
        await r.runtime.resume(later.execution_id, "approval", "yes")
        assert await later.result(timeout=10) == "yes"
        await r.until_settled(2)
        assert [o["key"] for o in late_outcomes(await r.log(later.execution_id))] == ["csat:1"]
        assert late_outcomes(await r.log(never.execution_id)) == []
        letters = await r.dead_letters()
        assert [d["dead_reason"] for d in letters] == ["execution_not_terminal"]
        assert json.loads(letters[0]["message"])["execution_id"] == never.execution_id
        assert letters[0]["dead_deliveries"] == "4"
    finally:
        await r.attacher.stop()


async def _parked(rt: Runtime, execution_id: str) -> bool:
    return (await rt.load_state(execution_id, system=True)).parked


class ContendedRuntime(Runtime):
    """A real runtime whose record_outcome first meets a moving tip ``contended`` times."""

    contended = 0

    async def record_outcome(self, execution_id: str, **kwargs: Any) -> OutcomeResult:
        if self.contended > 0:
            self.contended -= 1
            raise OutcomeContendedError(f"the log of {execution_id!r} kept moving")
        return await super().record_outcome(execution_id, **kwargs)


async def test_retryable_errors_are_retried_then_dead_lettered(
        redis: aioredis.Redis, ns: str) -> None:
    rt = ContendedRuntime(MemoryEventStore(), flows=[deal], access_policy=ANNOTATE_ANY)
    r = Rewards(redis, ns, runtime=rt, retries=2, backoff_s=0.01, retry_deliveries=2,
                claim_idle_ms=100)
    await r.attacher.start()
    try:
        eid = await finished(rt)
        rt.contended = 2  # two misses, then it lands: retried in place
        await r.submit(reward(eid, "csat:1"))
        await r.until_settled(1)
        assert r.attacher.stats()["attached"] == 1
        assert r.attacher.stats()["retried"] == 2
        rt.contended = 10**6  # never lands: 3 tries per delivery, 2 deliveries, then dead
        await r.submit(reward(eid, "csat:2"))
        await r.until_settled(2)
        stats = r.attacher.stats()
        assert stats["dead_lettered"] == {"outcome_contended": 1}
        assert stats["retried"] == 2 + 2 * 2
        assert stats["deferred"] == 2
        letter = (await r.dead_letters())[0]
        assert letter["dead_reason"] == "outcome_contended"
        assert letter["dead_deliveries"] == "2"
        assert [o["key"] for o in late_outcomes(await r.log(eid))] == ["csat:1"]
    finally:
        await r.attacher.stop()


async def test_a_producer_annotates_as_its_own_principal_within_its_tenant(
        redis: aioredis.Redis, ns: str) -> None:
    with pytest.raises(ConfigurationError, match="owner"):
        RewardAttacher(Runtime(MemoryEventStore(), flows=[deal]), redis, keys=KEYS)
    rt = Runtime(MemoryEventStore(), flows=[deal],
                 access_policy=AccessPolicy(rules={"annotate": "tenant"}))
    r = Rewards(redis, ns, runtime=rt, producer_tenants={"crm": "acme"})
    await r.attacher.start()
    try:
        ours, theirs = await finished(rt, principal=ALICE), await finished(rt, principal=EVE)
        await r.submit(reward(ours, "csat:1"))
        await r.submit(reward(theirs, "csat:1"))
        await r.submit(reward(ours, "csat:2", producer="survey"))  # no tenant assigned
        await r.until_settled(3)
        assert [(o["key"], o["recordedBy"]) for o in late_outcomes(await r.log(ours))] == [
            ("csat:1", "producer:crm")]
        assert late_outcomes(await r.log(theirs)) == []
        assert [d["dead_reason"] for d in await r.dead_letters()] == ["out_of_scope"] * 2
    finally:
        await r.attacher.stop()


GINA = Principal("gina", tenant="globex")
SCOPED_KEYS = {**KEYS, "ops": "k-ops-5e1d", "stray": "k-stray-9a0b"}


async def test_a_producer_rewards_only_the_tenants_it_is_scoped_to(
        redis: aioredis.Redis, ns: str) -> None:
    """Issue 10 item 7: producers scoped to tenants (FLEET_REWARD_TENANTS). A reward for
    another tenant's execution is refused by the kernel and dead-lettered out_of_scope
    on its first delivery, the log untouched; a producer the scoping does not list
    rewards only executions with no tenant."""
    rt = Runtime(MemoryEventStore(), flows=[deal],
                 access_policy=AccessPolicy(rules={"annotate": "tenant"}))
    warnings: list[str] = []
    r = Rewards(redis, ns, runtime=rt, on_warn=warnings.append, keys=SCOPED_KEYS,
                producer_tenants={"crm": ["acme"], "survey": ["globex", "initech"],
                                  "ops": ["*"]})  # "stray" has a key and no tenants
    await r.attacher.start()
    try:
        acme, globex = await finished(rt, principal=ALICE), await finished(rt, principal=GINA)
        nobody = await finished(rt, principal=None)
        before = {eid: [e.to_json() for e in await r.log(eid)]
                  for eid in (acme, globex, nobody)}
        allowed = [("crm", acme), ("survey", globex), ("ops", acme), ("ops", nobody),
                   ("stray", nobody)]
        refused = [("crm", globex), ("survey", acme), ("crm", nobody), ("stray", acme),
                   ("stray", globex)]
        for i, (producer, eid) in enumerate(refused + allowed):
            await r.submit(reward(eid, f"csat:{i}", producer=producer))
        await r.until_settled(len(refused) + len(allowed))
        letters = await r.dead_letters()
        assert sorted((json.loads(d["message"])["producer"], json.loads(d["message"])[
            "execution_id"]) for d in letters) == sorted(refused)
        for letter in letters:
            assert letter["dead_reason"] == "out_of_scope"
            assert letter["dead_deliveries"] == "1"  # final at once: never redelivered
            producer = json.loads(letter["message"])["producer"]
            assert f"producer {producer!r} may not reward" in letter["dead_detail"]
        stats = r.attacher.stats()
        assert stats["dead_lettered"] == {"out_of_scope": len(refused)}
        assert stats["attached"] == len(allowed)
        assert stats["scoped"] is True
        assert stats["consumer"]["failures"] == 0
        assert rt.denied == len(refused)  # the kernel judged (and counted) every one
        assert any("reward refused (out_of_scope)" in w for w in warnings)
        got = {eid: sorted(o["recordedBy"] for o in late_outcomes(await r.log(eid)))
               for eid in (acme, globex, nobody)}
        assert got == {acme: ["producer:crm", "producer:ops"], globex: ["producer:survey"],
                       nobody: ["producer:ops", "producer:stray"]}
        for eid in (acme, globex, nobody):  # only the allowed outcomes were appended
            log = [e.to_json() for e in await r.log(eid)]
            assert log[:len(before[eid])] == before[eid]
            assert len(log) == len(before[eid]) + len(got[eid])
    finally:
        await r.attacher.stop()


async def test_a_leaked_key_cannot_squat_another_tenants_reward_key(
        redis: aioredis.Redis, ns: str) -> None:
    """Issue 10 item 7's second half: unscoped, a leaked key attached first and the real
    producer's value was then refused (same decision and key, another value). Scoped,
    the leaked key's reward is out_of_scope and the real one attaches."""
    rt = Runtime(MemoryEventStore(), flows=[deal],
                 access_policy=AccessPolicy(rules={"annotate": "tenant"}))
    r = Rewards(redis, ns, runtime=rt, producer_tenants={"crm": ["acme"],
                                                         "survey": ["globex"]})
    await r.attacher.start()
    try:
        eid = await finished(rt, principal=ALICE)
        await r.submit(reward(eid, "csat:1", score=0.0, producer="survey"))  # the leak
        await r.until_settled(1)
        await r.submit(reward(eid, "csat:1", score=0.9, producer="crm"))  # the real one
        await r.until_settled(2)
        assert [(o["score"], o["recordedBy"]) for o in late_outcomes(await r.log(eid))] == [
            (0.9, "producer:crm")]
        assert [d["dead_reason"] for d in await r.dead_letters()] == ["out_of_scope"]
    finally:
        await r.attacher.stop()


async def test_scoping_is_refused_where_it_would_be_ignored_or_mistyped(
        redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    tenant_rule = Runtime(MemoryEventStore(), flows=[deal],
                          access_policy=AccessPolicy(rules={"annotate": "tenant"}))
    with pytest.raises(ConfigurationError, match="would ignore the scope"):
        RewardAttacher(Runtime(MemoryEventStore(), flows=[deal], access_policy=ANNOTATE_ANY),
                       redis, keys=KEYS, producer_tenants={"crm": ["acme"]})
    with pytest.raises(ConfigurationError, match="'crn', which has no key"):
        RewardAttacher(tenant_rule, redis, keys=KEYS, producer_tenants={"crn": ["acme"]})
    with pytest.raises(ConfigurationError, match="non-empty list of tenant names"):
        RewardAttacher(tenant_rule, redis, keys=KEYS, producer_tenants={"crm": []})
    with pytest.raises(ConfigurationError, match="set of tenant names"):
        Principal("producer:crm", scope="acme")  # type: ignore[arg-type]  # the mistake
    monkeypatch.setenv("FLEET_REWARD_TENANTS", '{"crm": ["acme", "globex"], "ops": ["*"]}')
    assert FleetSettings().reward_tenants == {"crm": ["acme", "globex"], "ops": ["*"]}
    monkeypatch.setenv("FLEET_REWARD_TENANTS", '{"crm": []}')
    with pytest.raises(Exception, match="non-empty list of tenant names"):
        FleetSettings()


async def test_scoping_is_the_attachers_default(redis: aioredis.Redis, ns: str,
                                                tmp_path: Path) -> None:
    """Issue 25 item 13: ``fleet attacher`` with no FLEET_REWARD_TENANTS (the k8s base's
    case before this change) scopes every producer to no tenant: a reward for any
    tenant's execution is dead-lettered out_of_scope and writes nothing; one for an
    execution with no tenant attaches. (Before, its runtime took ``annotate: any`` and
    the first reward attached to another tenant's run.) ``["*"]`` opts a producer out."""
    from fleet.assembly.roles import open_attacher

    db = f"sqlite:///{tmp_path / 'fleet.db'}"
    settings = FleetSettings(database_url=db, redis_url=server_url(),
                             rewards_stream=f"{ns}rewards", rewards_dead=f"{ns}dead",
                             rewards_group=f"{ns}g", rewards_inbox=f"{ns}inbox",
                             reward_keys=KEYS)
    assert settings.reward_tenants == {}
    writer = SqliteEventStore(str(tmp_path / "fleet.db"))
    rt = Runtime(writer, flows=[deal])
    tenants = [await finished(rt, principal=ALICE), await finished(rt, principal=GINA)]
    nobodys = await finished(rt, principal=None)
    before = {eid: [e.to_json() for e in await writer.read(eid)] for eid in tenants}
    for opted_out in (False, True):
        chosen = settings.model_copy(update={"reward_tenants": {"survey": ["*"]}}) \
            if opted_out else settings
        role = await open_attacher(chosen, heartbeat=False)
        try:
            assert role.require_runtime().access_policy.rule_for("annotate") == "tenant"
            attacher = role.service
            assert isinstance(attacher, RewardAttacher)
            assert attacher.stats()["scoped"] is True
            await attacher.start()
            producer = "survey" if opted_out else "crm"
            key = f"csat:{producer}"
            for eid in (*tenants, nobodys):
                await submit_reward(redis, chosen.rewards_inbox,
                                    reward(eid, key, producer=producer), KEYS[producer])
            want = ((3, {}) if opted_out else (1, {"out_of_scope": 2}))

            def judged(attacher: RewardAttacher = attacher,
                       want: tuple[int, dict[str, int]] = want) -> bool:
                stats = attacher.stats()
                return (stats["attached"], stats["dead_lettered"]) == want
            await eventually(judged, 10, "the rewards to be judged")
        finally:
            if role.service is not None:
                await role.service.stop()
            await role.aclose()
    for eid in tenants:  # crm's rewards wrote nothing; survey (opted out) attached
        assert [o["recordedBy"] for o in late_outcomes(await writer.read(eid))] == [
            "producer:survey"]
        assert [e.to_json() for e in await writer.read(eid)][:len(before[eid])] == before[eid]
    assert [o["recordedBy"] for o in late_outcomes(await writer.read(nobodys))] == [
        "producer:crm", "producer:survey"]
    letters = [f for _, f in await entries(redis, settings.rewards_dead)]
    assert [d["dead_reason"] for d in letters] == ["out_of_scope", "out_of_scope"]
    await writer.close()


async def test_the_attacher_role_scopes_producers_from_its_settings(
        redis: aioredis.Redis, ns: str, tmp_path: Path) -> None:
    """``fleet attacher`` (the assembly's role) with FLEET_REWARD_TENANTS: its runtime
    judges annotate by tenant and a cross-tenant reward is dead-lettered out_of_scope."""
    from fleet.assembly.roles import open_attacher

    db = f"sqlite:///{tmp_path / 'fleet.db'}"
    base = FleetSettings(database_url=db, redis_url=server_url(),
                         rewards_stream=f"{ns}rewards", rewards_dead=f"{ns}dead",
                         rewards_group=f"{ns}g", rewards_inbox=f"{ns}inbox", reward_keys=KEYS)
    settings = base.model_copy(update={"reward_tenants": {"crm": ["acme"]}})
    role = await open_attacher(settings, heartbeat=False)
    writer = SqliteEventStore(str(tmp_path / "fleet.db"))
    try:
        assert role.require_runtime().access_policy.rule_for("annotate") == "tenant"
        rt = Runtime(writer, flows=[deal])
        ours, theirs = await finished(rt, principal=ALICE), await finished(rt, principal=GINA)
        before = [e.to_json() for e in await writer.read(theirs)]
        assert role.service is not None
        await role.service.start()
        await submit_reward(redis, settings.rewards_inbox, reward(theirs, "csat:1"),
                            KEYS["crm"])
        await submit_reward(redis, settings.rewards_inbox, reward(ours, "csat:1"),
                            KEYS["crm"])
        attacher = role.service
        assert isinstance(attacher, RewardAttacher)
        await eventually(lambda: attacher.stats()["attached"] == 1
                         and attacher.stats()["dead_lettered"] == {"out_of_scope": 1}, 10,
                         "one attached, one out of scope")
        assert [e.to_json() for e in await writer.read(theirs)] == before
        assert [o["recordedBy"] for o in late_outcomes(await writer.read(ours))] == [
            "producer:crm"]
        letters = [f for _, f in await entries(redis, settings.rewards_dead)]
        assert [(d["dead_reason"], d["dead_deliveries"]) for d in letters] == [
            ("out_of_scope", "1")]
    finally:
        if role.service is not None:
            await role.service.stop()
        await role.aclose()
        await writer.close()


def _cli(*args: str, env: dict[str, str]) -> tuple[int, str]:
    from click.testing import CliRunner

    from fleet.cli import main

    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.output


async def test_fleet_reward_submit_signs_with_the_key_file_fleet_up_writes(
        redis: aioredis.Redis, ns: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 15 item 5: `fleet up` writes .fleet/reward-keys.json ({"local": secret});
    `fleet reward submit --key-file` read it as a raw secret, printed "submitted", and
    the reward was dead-lettered bad_signature. One format now, read by one reader: the
    attacher `fleet up` runs and the CLI both read that file, and the reward attaches.
    A file without the producer, or in another format, is refused before sending."""
    from fleet.embedded.machine import EmbeddedFleet

    for name in ("FLEET_REWARD_KEYS", "FLEET_REWARD_KEYS_FILE", "FLEET_REWARD_TENANTS"):
        monkeypatch.delenv(name, raising=False)
    data_dir = tmp_path / ".fleet"
    data_dir.mkdir()
    given = FleetSettings(database_url=f"sqlite:///{data_dir / 'fleet.db'}",
                          redis_url=server_url(), rewards_stream=f"{ns}rewards",
                          rewards_dead=f"{ns}dead", rewards_group=f"{ns}g",
                          rewards_inbox=f"{ns}inbox")
    settings = EmbeddedFleet(given, data_dir=data_dir)._resolve(given)  # what `fleet up` runs
    key_file = data_dir / "reward-keys.json"
    assert settings.reward_keys_file == str(key_file)
    assert list(json.loads(key_file.read_text())) == ["local"]
    # Scoped by default (issue 25 item 13): fleet up's own producer, for every tenant.
    assert settings.reward_tenants == {"local": ["*"]}
    rt = Runtime(MemoryEventStore(), flows=[deal],
                 access_policy=AccessPolicy(rules={"annotate": "tenant"}))
    attacher = RewardAttacher.from_settings(settings, rt, block_ms=50, claim_idle_ms=100)
    env = {"FLEET_REDIS_URL": server_url(), "FLEET_REWARDS_STREAM": settings.rewards_stream,
           "FLEET_REWARDS_INBOX": settings.rewards_inbox}
    await attacher.start()
    try:
        eid = await finished(rt)
        submit = ["reward", "submit", "--execution", eid, "--decision", "price"]
        code, out = await asyncio.to_thread(
            _cli, *submit, "--key", "csat:1", "--score", "0.5", "--producer", "local",
            "--key-file", str(key_file), env=env)
        assert code == 0, out
        assert "accepted for attachment as reward " in out
        await eventually(lambda: attacher.stats()["attached"] == 1, 10, "attached")
        assert [(o["key"], o["recordedBy"]) for o in late_outcomes(
            await rt.store.read(eid))] == [("csat:1", "producer:local")]
        # FLEET_REWARD_KEYS_FILE is the same file, the same format.
        code, out = await asyncio.to_thread(
            _cli, *submit, "--key", "csat:2", "--success", "--producer", "local",
            env={**env, "FLEET_REWARD_KEYS_FILE": str(key_file)})
        assert code == 0, out
        await eventually(lambda: attacher.stats()["attached"] == 2, 10, "attached")

        sent = await redis.xlen(settings.rewards_stream) + await redis.llen(settings.rewards_inbox)
        raw_secret = tmp_path / "raw.key"
        raw_secret.write_text(json.loads(key_file.read_text())["local"] + "\n")
        refusals = [
            (["--producer", "crm", "--key-file", str(key_file)],
             f"RewardKeyError: the key file {key_file} holds no key for producer 'crm' "
             "(it holds: 'local')"),
            (["--producer", "local", "--key-file", str(raw_secret)], "looks like a bare secret"),
            (["--producer", "local", "--key-file", str(tmp_path / "nowhere.json")],
             "cannot read the reward key file"),
        ]
        for extra, message in refusals:
            code, out = await asyncio.to_thread(
                _cli, *submit, "--key", "csat:3", "--score", "1", *extra, env=env)
            assert code == 1, out
            assert message in out, out
            assert len(out.strip().splitlines()) == 1, out  # one line, no traceback
        assert await redis.xlen(settings.rewards_stream) + await redis.llen(
            settings.rewards_inbox) == sent  # nothing was sent
        assert attacher.stats()["dead_lettered"] == {}
    finally:
        await attacher.stop()


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


async def test_hostile_rewards_are_dead_lettered_on_their_first_delivery(
        rewards: Rewards) -> None:
    """Issue 10 item 9 and its siblings: a non-ASCII signature made compare_digest raise
    TypeError and 10,000-deep JSON raised RecursionError; both looped through
    redeliveries as handler_error. Every refusal of a message's bytes is final: it is
    dead-lettered with its reason on the first delivery, and the consumer goes on."""
    eid = await finished(rewards.runtime)
    before = [e.to_json() for e in await rewards.log(eid)]
    good = reward(eid, "hostile:1", nonce="h")
    body = good.body()
    signed = json.loads(sign_reward(good, KEYS["crm"]).to_wire())
    cases: list[tuple[str, dict[str, Any]]] = [
        ("bad_signature", {"message": json.dumps({**signed, "signature": "é" * 64},
                                                  ensure_ascii=False)}),
        ("bad_signature", {"message": json.dumps({**signed, "signature": "\u2603"})}),
        ("bad_signature", {"message": json.dumps({**signed, "signature": "\ud800"})}),
        ("malformed", {"message": _deep(10_000)}),
        ("malformed", {"message": '{"a":' * 10_000 + "1" + "}" * 10_000}),
        ("malformed", {"message": json.dumps({**signed, "nonce": "@"}).replace(
            '"@"', _deep(10_000))}),
        ("malformed", {"message": b'{"producer": "crm", "signature": "\xff\xfe"}'}),
        ("malformed", {"message": json.dumps({**body, "nonce": "\ud800", "signature": "00"})}),
        ("oversized", {"message": _forge({**body, "nonce": "x" * 70_000}, KEYS["crm"])}),
        ("unsigned", {"message": json.dumps({**signed, "signature": 12345})}),
        ("unknown_producer", {"message": json.dumps({**signed, "producer": ["crm"]})}),
        ("invalid", {"message": _forge({**body, "score": [0.9]}, KEYS["crm"])}),
        ("invalid", {"message": _forge({**body, "score": True}, KEYS["crm"])}),
        # Signed and well-formed, for an execution id of 60,000 characters: the
        # kernel's refusal quotes it, the dead letter's detail stays bounded.
        ("execution_not_found", {"message": _forge({**body, "execution_id": "x" * 60_000},
                                                   KEYS["crm"])}),
    ]
    for _, fields in cases:  # as a producer sends them: onto the inbox
        message = fields["message"]
        await rewards.pushed(message if isinstance(message, bytes)
                             else message.encode("utf-8", "surrogatepass"))
    await rewards.until_settled(len(cases))
    letters = await rewards.dead_letters_raw()
    assert Counter(text(d[b"dead_reason"]) for d in letters) == Counter(
        reason for reason, _ in cases)
    originals = {reason: [] for reason, _ in cases}  # type: dict[str, list[bytes]]
    for reason, fields in cases:
        message = fields["message"]
        originals[reason].append(message if isinstance(message, bytes)
                                 else message.encode("utf-8", "surrogatepass"))
    for letter in letters:
        reason = text(letter[b"dead_reason"])
        assert 0 < len(letter[b"dead_detail"]) < 2_100
        kept = letter[b"message"]
        (original,) = [o for o in originals[reason] if o.startswith(kept)]
        # Issue 25 item 2: a bounded excerpt, never the whole entry, and what was cut.
        if reason == "oversized":  # refused by the inbox's move, before any delivery
            assert text(letter[b"dead_deliveries"]) == "0"
            assert kept == original[:4096]
            assert text(letter[b"dead_sha1"]) == hashlib.sha1(original).hexdigest()
        else:
            assert text(letter[b"dead_deliveries"]) == "1"
            assert kept == original[:8192]
        if len(original) > len(kept):
            assert json.loads(letter[b"dead_cut"]) == {"message": len(original)}
        else:
            assert b"dead_cut" not in letter
    stats = rewards.attacher.stats()
    assert stats["consumer"]["failures"] == 0  # nothing reached the handler_error path
    assert stats["dead_lettered"] == dict(Counter(reason for reason, _ in cases))
    assert [e.to_json() for e in await rewards.log(eid)] == before
    await rewards.submit(reward(eid, "csat:after"))  # the consumer is still running
    await rewards.until_settled(len(cases) + 1)
    assert [o["key"] for o in late_outcomes(await rewards.log(eid))] == ["csat:after"]


async def test_submit_reward_sync_refuses_a_running_loop_and_works_outside_one(
        rewards: Rewards) -> None:
    eid = await finished(rewards.runtime)
    client = sync_redis.Redis.from_url(server_url())
    try:
        with pytest.raises(ConfigurationError, match="running event loop"):
            submit_reward_sync(client, rewards.inbox, reward(eid, "csat:1"), KEYS["crm"])
        entry = await asyncio.to_thread(submit_reward_sync, client, rewards.inbox,
                                        reward(eid, "csat:1", producer="survey"),
                                        KEYS["survey"])
        assert entry
        await rewards.until_settled(1)
        assert [o["recordedBy"] for o in late_outcomes(await rewards.log(eid))] == [
            "producer:survey"]
    finally:
        client.close()


# -- the flood -----------------------------------------------------------------------

FLOOD = 10_000


@pytest.mark.slow
async def test_a_flood_of_rewards_every_good_one_once_every_bad_one_dead_lettered(
        redis: aioredis.Redis, ns: str) -> None:
    """10,000 messages, 10% malformed or forged, over 200 finished executions;
    5% of the good ones are sent twice (a producer's retry)."""
    r = Rewards(redis, ns, count=500)
    executions = await asyncio.gather(*(finished(r.runtime, i) for i in range(200)))
    fields: list[dict[str, str]] = []
    expected_dead: list[str] = []
    expected: dict[str, Counter[str]] = defaultdict(Counter)
    sent_good: list[str] = []
    for i in range(FLOOD):
        eid = executions[i % len(executions)]
        if i % 10 == 0:
            cases = bad_messages(eid, str(i))
            reason, entry = cases[(i // 10) % len(cases)]
            expected_dead.append(reason)
            fields.append(entry)
        elif i % 20 == 1 and sent_good:
            fields.append({"message": sent_good[(i // 20) % len(sent_good)]})  # a resend
        else:
            producer = "crm" if i % 2 else "survey"
            message = sign_reward(reward(eid, f"r:{i}", score=i / FLOOD, producer=producer),
                                  KEYS[producer])
            sent_good.append(message.to_wire())
            expected[eid][f"r:{i}"] += 1
            fields.append({"message": message.to_wire()})
    began = time.perf_counter()
    for start in range(0, len(fields), 1000):
        pipe = redis.pipeline(transaction=False)
        for entry in fields[start:start + 1000]:
            pipe.xadd(r.stream, entry)
        await pipe.execute()
    submitted = time.perf_counter() - began
    await r.attacher.start()
    try:
        await r.until_settled(FLOOD, timeout=50)
    finally:
        await r.attacher.stop()
    elapsed = time.perf_counter() - began
    stats = r.attacher.stats()
    appended = sum(len(c) for c in expected.values())
    assert stats["attached"] == appended
    assert stats["duplicates"] == FLOOD - appended - len(expected_dead)
    assert stats["dead_lettered"] == dict(Counter(expected_dead))
    for eid in executions:
        got = Counter(o["key"] for o in late_outcomes(await r.log(eid)))
        assert got == expected[eid], eid  # every good one exactly once, nothing else
    letters = await r.dead_letters()
    assert Counter(d["dead_reason"] for d in letters) == Counter(expected_dead)
    print(f"\nflood of {FLOOD}: submitted in {submitted:.2f}s, settled in {elapsed:.2f}s "
          f"({FLOOD / elapsed:.0f} messages/s)")
