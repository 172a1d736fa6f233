"""``StreamConsumer``: one member of a Redis consumer group, as a fleet ``Service``.

The loop: make the group if it is missing (``XGROUP CREATE ... MKSTREAM``),
handle this consumer's own pending entries first (a restart under the same
name), then ``XREADGROUP >`` with a block; every ``claim_every_s`` take over
entries idle longer than ``claim_idle_ms`` (``XAUTOCLAIM``), whether a dead
consumer left them or this one's handler failed on them. Acknowledgements and
dead letters of one batch go out in one pipeline.

Delivery is at least once: an entry is acknowledged only after its handler
returned, so a consumer that dies mid-batch leaves the rest pending for
another to claim, and a handler may see an entry again. Handlers should be
idempotent (the reward attacher is: ``record_outcome`` is).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fleet.kernel.errors import ConfigurationError
from fleet.kernel.journal import Warner, WarnSink
from fleet.streams.redis_client import TRANSIENT, ResponseError, aioredis, as_text, read_entries

__all__ = ["DEAD_FIELDS_KEPT", "DEAD_FIELD_BYTES", "DEAD_MAXLEN", "Defer", "Handler", "Reject",
           "StreamConsumer", "StreamEntry", "default_consumer_name"]

_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 2.0
_REMEMBERED = 10_000  # deferral reasons kept per consumer (oldest forgotten first)
_DETAIL_CHARS = 2_000  # the longest dead_detail written
#: A dead letter keeps at most this many of the entry's fields, each cut to
#: ``dead_field_bytes`` (issue 25 item 2: a 1 MB entry is not copied whole).
DEAD_FIELDS_KEPT = 32
DEAD_FIELD_BYTES = 8 * 1024
DEAD_MAXLEN = 10_000


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def default_consumer_name() -> str:
    """``host:pid``: unique per process, so a restarted process is a new consumer."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """One stream entry handed to a handler.

    ``fields`` are decoded as UTF-8 text; ``raw`` is what Redis returned, kept
    so a dead letter carries the original bytes. ``deliveries`` counts this
    delivery (1 on the first read; a claim or a re-read adds one).
    """

    id: str
    fields: dict[str, str]
    raw: Mapping[Any, Any]
    deliveries: int


@dataclass(frozen=True, slots=True)
class Defer:
    """Leave the entry pending: it is claimed again after ``claim_idle_ms``.

    Once it has been delivered ``max_deliveries`` times (the consumer's
    bound unless given here) it is dead-lettered with ``reason``.
    """

    reason: str
    detail: str = ""
    max_deliveries: int | None = None


@dataclass(frozen=True, slots=True)
class Reject:
    """Never retry: dead-letter the entry with ``reason`` and acknowledge it."""

    reason: str
    detail: str = ""


Handler = Callable[[StreamEntry], Awaitable["Defer | Reject | None"]]


class StreamConsumer:
    """Reads ``stream`` as ``consumer`` in ``group`` and hands each entry to ``handler``.

    The handler returns ``None`` (done: acknowledged), ``Defer`` (try again
    later) or ``Reject`` (dead-letter now). A handler that raises is counted in
    ``failures`` and treated as ``Defer("handler_error")``: the entry stays
    pending, is claimed again after ``claim_idle_ms``, and after
    ``max_deliveries`` deliveries goes to ``dead_stream`` with the reason. The
    consumer itself never stops on a handler's or Redis's fault: a Redis error
    is counted in ``errors`` and retried with backoff (the client reconnects).

    A dead letter is the original entry's fields (at most ``DEAD_FIELDS_KEPT`` of
    them, each cut to ``dead_field_bytes``; ``dead_cut`` then says which, with
    their sizes, as JSON), plus ``dead_reason``, ``dead_detail``, ``dead_stream``,
    ``dead_id``, ``dead_deliveries``, ``dead_consumer`` and ``dead_at`` (epoch
    ms). The dead stream keeps about ``dead_maxlen`` letters (``MAXLEN ~``).

    ``feed`` (the reward attacher's inbox) runs before each read and says how many
    entries it added; with one, a read blocks at most ``feed_every_s``.
    ``trim_acked`` trims the stream (``XTRIM MINID``) below what every group of it
    has acknowledged, at most every ``trim_every_s``: the stream holds only what is
    still to be handled (the rewards stream; never the events stream, which the
    relay bounds).

    Args:
        redis: An asyncio Redis client.
        stream: The stream key.
        group: The consumer group (created at ``start_id`` if missing).
        consumer: This member's name, unique per live process
            (``default_consumer_name()``).
        handler: ``async (StreamEntry) -> Defer | Reject | None``.
        dead_stream: Where dead letters go (default ``f"{stream}:dead"``).
        block_ms: Longest ``XREADGROUP`` block.
        count: Most entries per read or claim.
        claim_idle_ms: An entry pending longer than this is taken over.
        claim_every_s: How often to look for such entries (default: half of
            ``claim_idle_ms``, between 0.05 and 5 s).
        max_deliveries: Deliveries before a failing or deferred entry is
            dead-lettered.
        start_id: Where a newly created group starts (``"0"``: the whole stream).
        on_warn: Where handler and Redis faults are reported (rate-limited).
    """

    def __init__(self, redis: aioredis.Redis, stream: str, group: str, consumer: str,
                 handler: Handler, *, dead_stream: str | None = None, block_ms: int = 1000,
                 count: int = 100, claim_idle_ms: int = 30_000,
                 claim_every_s: float | None = None, max_deliveries: int = 5,
                 start_id: str = "0", on_warn: WarnSink | None = None,
                 name: str | None = None, requires: tuple[str, ...] = (),
                 dead_maxlen: int = DEAD_MAXLEN, dead_field_bytes: int = DEAD_FIELD_BYTES,
                 feed: Callable[[], Awaitable[int]] | None = None, feed_every_s: float = 0.1,
                 trim_acked: bool = False, trim_every_s: float = 5.0) -> None:
        if block_ms < 1 or count < 1 or claim_idle_ms < 1 or max_deliveries < 1:
            raise ConfigurationError(
                "StreamConsumer: block_ms, count, claim_idle_ms and max_deliveries must be >= 1")
        if dead_maxlen < 1 or dead_field_bytes < 64 or feed_every_s <= 0 or trim_every_s < 0:
            raise ConfigurationError(
                "StreamConsumer: dead_maxlen >= 1, dead_field_bytes >= 64, feed_every_s > 0 "
                "and trim_every_s >= 0")
        self.name = name or f"consumer:{stream}:{group}"
        self.requires = requires
        self.redis = redis
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.handler = handler
        self.dead_stream = dead_stream or f"{stream}:dead"
        self.block_ms = block_ms
        self.count = count
        self.claim_idle_ms = claim_idle_ms
        self.claim_every_s = (claim_every_s if claim_every_s is not None
                              else min(5.0, max(0.05, claim_idle_ms / 2000)))
        self.max_deliveries = max_deliveries
        self.start_id = start_id
        self.warner = Warner(on_warn)
        self.dead_maxlen = dead_maxlen
        self.dead_field_bytes = dead_field_bytes
        self.feed = feed
        self.feed_every_s = feed_every_s
        self.trim_acked = trim_acked
        self.trim_every_s = trim_every_s
        self._untrimmed = False
        self._next_trim = 0.0
        self.trimmed = 0
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._blocking = False
        self._group_ready = False
        self._history_from: str | None = "0"
        self._claim_cursor = "0-0"
        self._next_claim = 0.0
        # Why an entry this consumer deferred was deferred, and its own bound.
        self._deferred: dict[str, tuple[str, str, int]] = {}
        self.delivered = 0
        self.acked = 0
        self.failures = 0
        self.deferred = 0
        self.claimed = 0
        self.vanished = 0
        self.errors = 0
        self.dead_lettered: Counter[str] = Counter()

    # -- the service --------------------------------------------------------------
    async def start(self) -> None:
        """Create the group (a misconfigured key fails here), then run in the background."""
        if self._task is not None:
            return
        try:
            await self._ensure_group()
        except ResponseError as exc:
            raise ConfigurationError(
                f"{self.name}: cannot create group {self.group!r} on {self.stream!r}: "
                f"{exc}") from exc
        except TRANSIENT as exc:  # Redis not up yet: the loop keeps trying
            self.errors += 1
            self.warner.warn(f"{self.name}: Redis unavailable at start ({exc}); retrying",
                             key="consumer-redis")
        self._stop = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        """Finish the entry in hand, settle the batch, and stop.

        Entries read but not yet handled stay pending under this consumer: a
        restart under the same name handles them first; otherwise another
        member claims them after ``claim_idle_ms``.
        """
        task = self._task
        if task is None:
            return
        self._stop.set()
        if self._blocking:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self._task = None

    def stats(self) -> dict[str, Any]:
        return {"delivered": self.delivered, "acked": self.acked, "failures": self.failures,
                "deferred": self.deferred, "claimed": self.claimed,
                "dead_lettered": dict(self.dead_lettered), "vanished": self.vanished,
                "errors": self.errors, "trimmed": self.trimmed}

    async def pending(self) -> int:
        """Entries of the group delivered and not yet acknowledged (any member)."""
        summary = await self.redis.xpending(self.stream, self.group)
        return int(summary["pending"] if isinstance(summary, Mapping) else summary[0])

    # -- the loop -----------------------------------------------------------------
    async def _run(self) -> None:
        backoff = _BACKOFF_MIN_S
        while not self._stop.is_set():
            try:
                if not self._group_ready:
                    await self._ensure_group()
                if self.feed is not None:
                    await self.feed()
                if self.trim_acked and self._untrimmed and time.monotonic() >= self._next_trim:
                    await self._trim()
                if time.monotonic() >= self._next_claim:
                    more = await self._claim()
                    self._next_claim = time.monotonic() + (0 if more else self.claim_every_s)
                if self._history_from is not None:
                    await self._read_history()
                else:
                    await self._read_new()
                backoff = _BACKOFF_MIN_S
            except TRANSIENT as exc:
                self.errors += 1
                if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
                    self._group_ready = False  # the stream or group was deleted
                self.warner.warn(f"{self.name}: {type(exc).__name__}: {exc}; retrying",
                                 key="consumer-redis")
                await self._pause(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
            except Exception as exc:  # noqa: BLE001 - the consumer never dies of a fault
                self.errors += 1
                self.warner.warn(f"{self.name}: unexpected {type(exc).__name__}: {exc}; "
                                 "retrying", key="consumer-bug")
                await self._pause(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, self.group, id=self.start_id,
                                           mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    async def _read_new(self) -> None:
        wait_ms = int((self._next_claim - time.monotonic()) * 1000)
        if self.feed is not None:  # what arrives in the feed is moved at the next turn
            wait_ms = min(wait_ms, int(self.feed_every_s * 1000))
        block = max(1, min(self.block_ms, wait_ms))
        self._blocking = True
        try:
            if self._stop.is_set():
                return
            reply = await self.redis.xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                                count=self.count, block=block)
        finally:
            self._blocking = False
        entries = read_entries(reply)
        await self._process(entries, dict.fromkeys((as_text(e) for e, _ in entries), 1))

    async def _read_history(self) -> None:
        """This consumer's own pending entries (left by a previous run under its name)."""
        assert self._history_from is not None
        reply = await self.redis.xreadgroup(self.group, self.consumer,
                                            {self.stream: self._history_from}, count=self.count)
        entries = read_entries(reply)
        if not entries:
            self._history_from = None
            return
        self._history_from = as_text(entries[-1][0])
        await self._process(entries, await self._deliveries(entries))

    async def _claim(self) -> bool:
        """Take over idle entries; True when the scan has more to look at."""
        reply = await self.redis.xautoclaim(self.stream, self.group, self.consumer,
                                            self.claim_idle_ms, start_id=self._claim_cursor,
                                            count=self.count)
        cursor = as_text(reply[0])
        entries: list[tuple[Any, Mapping[Any, Any] | None]] = list(reply[1])
        self.vanished += len(reply[2]) if len(reply) > 2 else 0  # deleted: dropped from the PEL
        self._claim_cursor = cursor
        if entries:
            self.claimed += len(entries)
            await self._process(entries, await self._deliveries(entries))
        return cursor != "0-0"

    async def _deliveries(self, entries: list[tuple[Any, Any]]) -> dict[str, int]:
        pipe = self.redis.pipeline(transaction=False)
        for eid, _ in entries:
            pipe.xpending_range(self.stream, self.group, eid, eid, 1)
        out: dict[str, int] = {}
        for (eid, _), rows in zip(entries, await pipe.execute(), strict=True):
            out[as_text(eid)] = int(rows[0]["times_delivered"]) if rows else 1
        return out

    # -- handling -------------------------------------------------------------------
    async def _process(self, entries: list[tuple[Any, Mapping[Any, Any] | None]],
                       deliveries: dict[str, int]) -> None:
        acks: list[str] = []
        dead: list[tuple[StreamEntry, str, str]] = []
        for raw_id, raw in entries:
            if self._stop.is_set():
                break  # the rest stays pending under this consumer
            eid = as_text(raw_id)
            if not raw:  # deleted or trimmed while pending: nothing to handle
                acks.append(eid)
                self.vanished += 1
                continue
            entry = StreamEntry(eid, {as_text(k): as_text(v) for k, v in raw.items()}, raw,
                                deliveries.get(eid, 1))
            known = self._deferred.get(eid)
            bound = known[2] if known else self.max_deliveries
            if entry.deliveries > bound:
                reason, detail = (known[0], known[1]) if known else (
                    "max_deliveries", "never acknowledged (a consumer died handling it?)")
                dead.append((entry, reason, f"{detail} [{entry.deliveries - 1} deliveries]"))
                continue
            self.delivered += 1
            try:
                verdict = await self.handler(entry)
            except Exception as exc:  # noqa: BLE001 - counted, the entry stays pending
                self.failures += 1
                self.warner.warn(f"{self.name}: handler raised {type(exc).__name__}: {exc} "
                                 f"on {eid}", key="consumer-handler")
                verdict = Defer("handler_error", f"{type(exc).__name__}: {exc}")
            else:
                if isinstance(verdict, Defer):
                    self.deferred += 1
            if verdict is None:
                acks.append(eid)
            elif isinstance(verdict, Reject):
                dead.append((entry, verdict.reason, verdict.detail))
            else:
                bound = verdict.max_deliveries or self.max_deliveries
                if entry.deliveries >= bound:
                    dead.append((entry, verdict.reason,
                                 f"{verdict.detail} [{entry.deliveries} deliveries]"))
                else:
                    self._remember(eid, verdict.reason, verdict.detail, bound)
        await self._settle(acks, dead)

    def _remember(self, eid: str, reason: str, detail: str, bound: int) -> None:
        self._deferred.pop(eid, None)
        self._deferred[eid] = (reason, detail, bound)
        if len(self._deferred) > _REMEMBERED:
            self._deferred.pop(next(iter(self._deferred)))

    async def _settle(self, acks: list[str], dead: list[tuple[StreamEntry, str, str]]) -> None:
        """Dead letters, then one XACK for the batch, in one round trip."""
        if not acks and not dead:
            return
        now = str(time.time_ns() // 1_000_000)
        pipe = self.redis.pipeline(transaction=False)
        for entry, reason, detail in dead:
            fields = self._excerpt(entry.raw)
            # The detail may quote the entry (an id, a message): bounded, as the
            # entry's own fields are.
            fields.update({"dead_reason": reason, "dead_detail": _cut(detail, _DETAIL_CHARS),
                           "dead_stream": self.stream, "dead_id": entry.id,
                           "dead_deliveries": str(entry.deliveries),
                           "dead_consumer": self.consumer, "dead_at": now})
            pipe.xadd(self.dead_stream, fields, maxlen=self.dead_maxlen, approximate=True)
        pipe.xack(self.stream, self.group, *acks, *(e.id for e, _, _ in dead))
        # A failure here leaves every entry of the batch pending, to be handled
        # again (handlers are idempotent); a dead letter may then appear twice.
        await pipe.execute()
        self._untrimmed = True
        self.acked += len(acks)
        for entry, reason, _ in dead:
            self.dead_lettered[reason] += 1
            self._deferred.pop(entry.id, None)
        for eid in acks:
            self._deferred.pop(eid, None)

    def _excerpt(self, raw: Mapping[Any, Any]) -> dict[Any, Any]:
        """The entry's fields for its dead letter: at most ``DEAD_FIELDS_KEPT``, each at most
        ``dead_field_bytes``; ``dead_cut`` names what was cut (field: original bytes)."""
        out: dict[Any, Any] = {}
        cut: dict[str, int] = {}
        for index, (key, value) in enumerate(raw.items()):
            data = value if isinstance(value, bytes) else str(value).encode(
                "utf-8", "surrogatepass")
            if index >= DEAD_FIELDS_KEPT:
                cut[as_text(key)[:200]] = len(data)
                continue
            if len(data) > self.dead_field_bytes:
                cut[as_text(key)[:200]] = len(data)
                data = data[:self.dead_field_bytes]
            out[key] = data
        if cut:
            out["dead_cut"] = json.dumps(cut, separators=(",", ":"))
        return out

    async def _trim(self) -> None:
        """``XTRIM MINID`` below the lowest id some group of the stream still needs: its
        first pending entry, or what it has not read yet (never an unacknowledged one)."""
        self._untrimmed = False
        self._next_trim = time.monotonic() + self.trim_every_s
        floor: tuple[int, int] | None = None
        for group in await self.redis.xinfo_groups(self.stream):
            info = {as_text(k): v for k, v in dict(group).items()}
            need = _stream_id(as_text(info.get("last-delivered-id", "0-0")))
            if int(info.get("pending") or 0):
                summary = await self.redis.xpending(self.stream, as_text(info["name"]))
                first = summary.get("min") if isinstance(summary, Mapping) else summary[1]
                if first is not None:
                    need = min(need, _stream_id(as_text(first)))
            floor = need if floor is None else min(floor, need)
        if floor is not None and floor > (0, 0):
            self.trimmed += int(await self.redis.xtrim(
                self.stream, minid=f"{floor[0]}-{floor[1]}", approximate=False))


def _stream_id(text: str) -> tuple[int, int]:
    """``"ms-seq"`` as a pair that sorts as Redis orders ids."""
    ms, _, seq = text.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return (0, 0)
