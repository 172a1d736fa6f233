"""``EventPublisher``: this process's durable events onto a Redis stream, at most once.

Not how events reach ``fleet:events``: the relay (``fleet relay``,
``fleet.streams.relay``) publishes every committed event there exactly once,
whoever wrote it (decision 0021). The publisher is ADR 0147's in-process hook
onto a stream of your own (a low-latency, lossy feed of one process's runs);
no fleet role runs it.

Pass ``publisher.on_durable_event`` to a ``Runtime``. The callback runs on the
journal's write chain (ADR 0147: a slow consumer delays the next write), so it
only serialises the event and appends it to an in-process buffer bounded in
events and in bytes; a background task sends the buffer to Redis in pipelined
``XADD`` batches (``MAXLEN ~``), one pipeline in flight at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleet.kernel.errors import ConfigurationError
from fleet.kernel.events import EventEnvelope
from fleet.kernel.journal import Warner, WarnSink
from fleet.streams.redis_client import TRANSIENT, aioredis

if TYPE_CHECKING:
    from fleet.config import FleetSettings

__all__ = ["DEFAULT_BUFFER_BYTES", "EventPublisher", "event_fields"]

DEFAULT_BUFFER_BYTES = 64 * 1024 * 1024  # well under a worker pod's 1 GiB limit
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 2.0


def event_fields(event: EventEnvelope) -> dict[str, str]:
    """The fields of one stream entry: the envelope as the log holds it, and a filter index.

    ``envelope`` is the event's canonical JSON (``EventEnvelope.to_json``, the
    same text the stores write); ``executionId``, ``sequence`` and ``type`` are
    copies for consumers that filter without parsing it.
    """
    return {"envelope": event.to_json(), "executionId": event.execution_id,
            "sequence": str(event.sequence), "type": event.type.value}


class EventPublisher:
    """A ``Service`` that publishes this runtime's durable events to ``stream``.

    What the stream holds is a report, not the record: the log is (and
    ``fleet:events``, which the relay writes, holds all of it). The stream
    inherits ADR 0147's contract and weakens it where Redis is involved:

    * **At most once, by the ADR's own contract.** An event this process never
      saw (another process wrote it, the process died after the write) is not
      published. While Redis is unreachable events wait in a buffer bounded by
      ``buffer_limit`` events and ``buffer_bytes`` bytes of JSON; past either
      the oldest are dropped, counted in ``dropped`` and reported through
      ``on_warn`` (at most once a minute); an event larger than
      ``buffer_bytes`` on its own is dropped at once. Events still in the
      buffer when ``stop`` gives up draining are lost the same way.
    * **A batch can appear twice.** A pipeline whose connection breaks after
      Redis applied it cannot be told apart from one that never arrived, and it
      is sent again. The envelope ``id`` (``executionId-sequence``) is unique on
      the log: a consumer that must not see one twice keeps the highest
      sequence per execution it has handled.
    * **In order per writer.** Entries appear in the order this runtime's
      writes resolved, which ADR 0147 says is not always sequence order per
      execution; a consumer that cares orders by ``sequence``.
    * **Never blocks the run.** ``on_durable_event`` serialises the event once
      (the work the sender would do anyway), appends it to a deque and, when
      the sender is idle, wakes it. Redis being slow, down or unreachable
      costs the run nothing but the buffer's memory, which the bounds cap.

    Args:
        redis: An asyncio Redis client (``redis.asyncio.Redis``).
        stream: The stream key: one of your own, never the relay's
            ``fleet:events`` (the relay refuses to share it).
        maxlen: ``XADD MAXLEN ~``.
        buffer_limit: Events held while Redis cannot take them (the in-flight
            batch counts towards it).
        buffer_bytes: Bytes of JSON held (``FLEET_PUBLISHER_BUFFER_BYTES``).
        batch_size: Most ``XADD`` commands in one pipeline.
        drain_timeout_s: How long ``stop`` keeps sending what is buffered.
        on_warn: Where drops and connection faults are reported (rate-limited).
        close_client: Close ``redis`` on ``stop`` (set by ``from_settings``).

    ``stats()`` reports ``published``, ``dropped``, ``buffered``,
    ``buffered_bytes``, ``errors``
    (failed sends) and ``lag_ms``: how long the oldest event not yet published
    has waited since it became durable (measured on this process's monotonic
    clock rather than the event's ``timestamp``, so an injected runtime clock
    or a wall-clock step does not distort it).
    """

    requires: tuple[str, ...] = ()

    def __init__(self, redis: aioredis.Redis, *, stream: str, maxlen: int = 100_000,
                 buffer_limit: int = 10_000, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                 batch_size: int = 256, drain_timeout_s: float = 5.0,
                 on_warn: WarnSink | None = None, name: str = "event-publisher",
                 close_client: bool = False) -> None:
        if buffer_limit < 1 or buffer_bytes < 1 or batch_size < 1 or maxlen < 1:
            raise ConfigurationError("EventPublisher: buffer_limit, buffer_bytes, batch_size "
                                     "and maxlen must be >= 1")
        self.name = name
        self.redis = redis
        self.stream = stream
        self.maxlen = maxlen
        self.buffer_limit = buffer_limit
        self.buffer_bytes = buffer_bytes
        self.batch_size = batch_size
        self.drain_timeout_s = drain_timeout_s
        self.warner = Warner(on_warn)
        self._close_client = close_client
        # Oldest on the left; the in-flight batch counts towards both bounds.
        self._buffer: deque[_Item] = deque()
        self._inflight: list[_Item] = []
        self._held_bytes = 0  # of the buffer and the in-flight batch
        self._wake = asyncio.Event()
        self._idle = False
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self.published = 0
        self.dropped = 0
        self.errors = 0

    @classmethod
    def from_settings(cls, settings: FleetSettings, *, stream: str,
                      **kwargs: Any) -> EventPublisher:
        """A publisher on ``settings.redis_url`` to ``stream`` (not the relay's), its buffer
        bounded by ``settings.publisher_buffer_bytes``."""
        if not settings.redis_url:
            raise ConfigurationError("the event publisher needs FLEET_REDIS_URL")
        if stream == settings.events_stream:
            raise ConfigurationError(
                f"{stream!r} is the relay's stream (FLEET_EVENTS_STREAM): the publisher "
                "writes to a stream of its own")
        client = aioredis.Redis.from_url(
            settings.redis_url, socket_connect_timeout=settings.broker_connect_timeout_s,
            socket_timeout=settings.broker_socket_timeout_s)
        kwargs.setdefault("maxlen", settings.events_maxlen)
        kwargs.setdefault("buffer_bytes", settings.publisher_buffer_bytes)
        return cls(client, stream=stream, close_client=True, **kwargs)

    # -- the callback (the journal's write chain runs it) ------------------------
    def on_durable_event(self, event: EventEnvelope) -> None:
        """Queue one durable event for the stream; never raises, never waits."""
        fields = event_fields(event)
        size = len(fields["envelope"].encode("utf-8", "surrogatepass"))
        if size > self.buffer_bytes:
            self._drop(1, f"an event of {size} bytes ({event.id!r}) is larger than the "
                       f"whole buffer ({self.buffer_bytes} bytes)")
            return
        self._make_room(1, size)
        if (self._held_bytes + size > self.buffer_bytes
                or len(self._inflight) + 1 > self.buffer_limit):
            # What is left is the batch being sent: this event does not fit beside it.
            self._drop(1, f"buffer full with the batch in flight ({self._held_bytes} bytes)")
            return
        self._buffer.append(_Item(time.monotonic_ns(), fields, size))
        self._held_bytes += size
        if self._idle:
            self._idle = False
            if self._loop_thread == threading.get_ident():
                self._wake.set()
            elif self._loop is not None:
                with contextlib.suppress(RuntimeError):  # that loop has closed
                    self._loop.call_soon_threadsafe(self._wake.set)

    def _make_room(self, count: int, size: int) -> None:
        """Drop the oldest buffered events until ``count`` more of ``size`` bytes fit."""
        dropped = 0
        while self._buffer and (
                len(self._buffer) + len(self._inflight) + count > self.buffer_limit
                or self._held_bytes + size > self.buffer_bytes):
            self._held_bytes -= self._buffer.popleft().size
            dropped += 1
        if dropped:
            self._drop(dropped, f"buffer full ({self.buffer_limit} events / "
                       f"{self.buffer_bytes} bytes, Redis not taking them): dropped the "
                       "oldest")

    def _drop(self, count: int, why: str) -> None:
        self.dropped += count
        self.warner.warn(f"{self.name}: {why}; {self.dropped} dropped so far. The log still "
                         "holds every event, and the relay publishes them to the events "
                         "stream.", key="publisher-drop")

    # -- the service --------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._stopping = False
        self._wake = asyncio.Event()
        self._task = self._loop.create_task(self._pump(), name=self.name)

    async def stop(self) -> None:
        """Send what is buffered (up to ``drain_timeout_s``), then stop."""
        task = self._task
        if task is None:
            return
        self._stopping = True
        self._wake.set()
        done, _ = await asyncio.wait({task}, timeout=self.drain_timeout_s)
        if not done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self._restore_inflight()
        self._task = None
        left = len(self._buffer)
        if left:
            self.dropped += left
            self._buffer.clear()
            self._held_bytes = 0
            self.warner.warn(f"{self.name}: stopped with {left} events unpublished "
                             "(dropped; the log holds them)")
        if self._close_client:
            await self.redis.aclose()

    async def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued so far is published; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._buffer or self._inflight:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.002)
        return True

    def stats(self) -> dict[str, Any]:
        oldest = self._inflight[0].at if self._inflight else (
            self._buffer[0].at if self._buffer else None)
        lag_ms = 0.0 if oldest is None else (time.monotonic_ns() - oldest) / 1e6
        return {"published": self.published, "dropped": self.dropped,
                "buffered": len(self._buffer) + len(self._inflight),
                "buffered_bytes": self._held_bytes, "errors": self.errors,
                "lag_ms": round(lag_ms, 3)}

    # -- the sender ----------------------------------------------------------------
    async def _pump(self) -> None:
        backoff = _BACKOFF_MIN_S
        while True:
            if not self._buffer:
                if self._stopping:
                    return
                self._idle = True
                if self._buffer:  # an event landed between the check and the flag
                    self._idle = False
                    continue
                await self._wake.wait()
                self._wake.clear()
                continue
            take = min(self.batch_size, len(self._buffer))
            self._inflight = [self._buffer.popleft() for _ in range(take)]
            try:
                refused = await self._send(self._inflight)
            except TRANSIENT as exc:
                # The connection failed mid-batch: Redis may have applied part
                # of it, and the whole batch is sent again (see the docstring).
                fault: BaseException = exc
            except Exception as exc:  # noqa: BLE001 - never wedge the sender on a bug
                self.errors += 1
                self.dropped += len(self._inflight)
                self._held_bytes -= sum(item.size for item in self._inflight)
                self.warner.warn(f"{self.name}: dropped a batch of {len(self._inflight)} "
                                 f"events ({type(exc).__name__}: {exc})",
                                 key="publisher-refused")
                self._inflight = []
                continue
            else:
                self.published += len(self._inflight) - len(refused)
                self._held_bytes -= sum(item.size for item in self._inflight)
                if not refused:
                    self._inflight = []
                    backoff = _BACKOFF_MIN_S
                    continue
                self._held_bytes += sum(item.size for item, _ in refused)
                # Redis answered and refused some (OOM, a key of another type):
                # only those are sent again, so nothing it took is duplicated.
                fault = refused[0][1]
                self._inflight = [item for item, _ in refused]
            self.errors += 1
            self._restore_inflight()
            self.warner.warn(f"{self.name}: XADD to {self.stream!r} failed "
                             f"({type(fault).__name__}: {fault}); buffering and retrying",
                             key="publisher-send")
            # A stop does not cut the backoff short: it keeps trying to drain
            # until stop's own deadline cancels this task.
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def _send(self, batch: list[_Item]) -> list[tuple[_Item, BaseException]]:
        """One pipeline of XADDs; returns the entries Redis refused, with its answer."""
        pipe = self.redis.pipeline(transaction=False)
        for item in batch:
            fields: dict[Any, Any] = item.fields
            pipe.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)
        replies = await pipe.execute(raise_on_error=False)
        return [(item, reply) for item, reply in zip(batch, replies, strict=True)
                if isinstance(reply, BaseException)]

    def _restore_inflight(self) -> None:
        """Put an unsent batch back at the front, dropping the oldest past the bounds."""
        inflight, self._inflight = self._inflight, []
        self._buffer.extendleft(reversed(inflight))
        dropped = 0
        while self._buffer and (len(self._buffer) > self.buffer_limit
                                or self._held_bytes > self.buffer_bytes):
            self._held_bytes -= self._buffer.popleft().size
            dropped += 1
        if dropped:
            self._drop(dropped, "buffer full: dropped the oldest")


@dataclass(slots=True)
class _Item:
    at: int  # monotonic ns when it became durable
    fields: dict[str, str]
    size: int
