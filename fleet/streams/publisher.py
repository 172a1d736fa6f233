"""``EventPublisher``: every durable event of this process onto a Redis stream.

Pass ``publisher.on_durable_event`` to a ``Runtime``. The callback runs on the
journal's write chain (ADR 0147: a slow consumer delays the next write), so it
only appends to an in-process buffer; a background task sends the buffer to
Redis in pipelined ``XADD`` batches (``MAXLEN ~``), one pipeline in flight at a
time, so events that arrive during a send go out together in the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from fleet.kernel.errors import ConfigurationError
from fleet.kernel.events import EventEnvelope
from fleet.kernel.journal import Warner, WarnSink
from fleet.streams.redis_client import TRANSIENT, aioredis

if TYPE_CHECKING:
    from fleet.config import FleetSettings

__all__ = ["EventPublisher", "event_fields"]

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
    """A ``Service`` that publishes this runtime's durable events to ``events_stream``.

    What the stream holds is a report, not the record: the log is. The stream
    inherits ADR 0147's contract and weakens it where Redis is involved:

    * **At most once, by the ADR's own contract.** An event this process never
      saw (another process wrote it, the process died after the write) is not
      published. While Redis is unreachable events wait in a bounded buffer;
      past ``buffer_limit`` the oldest are dropped, counted in ``dropped`` and
      reported through ``on_warn`` (at most once a minute). Events still in the
      buffer when ``stop`` gives up draining are lost the same way.
    * **A batch can appear twice.** A pipeline whose connection breaks after
      Redis applied it cannot be told apart from one that never arrived, and it
      is sent again. The envelope ``id`` (``executionId-sequence``) is unique on
      the log: a consumer that must not see one twice keeps the highest
      sequence per execution it has handled.
    * **In order per writer.** Entries appear in the order this runtime's
      writes resolved, which ADR 0147 says is not always sequence order per
      execution; a consumer that cares orders by ``sequence``.
    * **Never blocks the run.** ``on_durable_event`` is O(1): it appends to a
      deque and, when the sender is idle, wakes it. Redis being slow, down or
      unreachable costs the run nothing but the buffer's memory.

    Args:
        redis: An asyncio Redis client (``redis.asyncio.Redis``).
        stream: The stream key (``FleetSettings.events_stream``).
        maxlen: ``XADD MAXLEN ~`` (``FleetSettings.events_maxlen``).
        buffer_limit: Events held while Redis cannot take them (the in-flight
            batch comes on top, at most ``batch_size``).
        batch_size: Most ``XADD`` commands in one pipeline.
        drain_timeout_s: How long ``stop`` keeps sending what is buffered.
        on_warn: Where drops and connection faults are reported (rate-limited).
        close_client: Close ``redis`` on ``stop`` (set by ``from_settings``).

    ``stats()`` reports ``published``, ``dropped``, ``buffered``, ``errors``
    (failed sends) and ``lag_ms``: how long the oldest event not yet published
    has waited since it became durable (measured on this process's monotonic
    clock rather than the event's ``timestamp``, so an injected runtime clock
    or a wall-clock step does not distort it).
    """

    requires: tuple[str, ...] = ()

    def __init__(self, redis: aioredis.Redis, *, stream: str = "fleet:events",
                 maxlen: int = 100_000, buffer_limit: int = 10_000, batch_size: int = 256,
                 drain_timeout_s: float = 5.0, on_warn: WarnSink | None = None,
                 name: str = "event-publisher", close_client: bool = False) -> None:
        if buffer_limit < 1 or batch_size < 1 or maxlen < 1:
            raise ConfigurationError(
                "EventPublisher: buffer_limit, batch_size and maxlen must be >= 1")
        self.name = name
        self.redis = redis
        self.stream = stream
        self.maxlen = maxlen
        self.buffer_limit = buffer_limit
        self.batch_size = batch_size
        self.drain_timeout_s = drain_timeout_s
        self.warner = Warner(on_warn)
        self._close_client = close_client
        # (monotonic ns when it became durable, event); oldest on the left.
        self._buffer: deque[tuple[int, EventEnvelope]] = deque()
        self._inflight: list[tuple[int, EventEnvelope]] = []
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
    def from_settings(cls, settings: FleetSettings, **kwargs: Any) -> EventPublisher:
        """A publisher on ``settings.redis_url`` / ``events_stream`` / ``events_maxlen``."""
        if not settings.redis_url:
            raise ConfigurationError("the event publisher needs FLEET_REDIS_URL")
        client = aioredis.Redis.from_url(
            settings.redis_url, socket_connect_timeout=settings.broker_connect_timeout_s,
            socket_timeout=settings.broker_socket_timeout_s)
        kwargs.setdefault("stream", settings.events_stream)
        kwargs.setdefault("maxlen", settings.events_maxlen)
        return cls(client, close_client=True, **kwargs)

    # -- the callback (the journal's write chain runs it) ------------------------
    def on_durable_event(self, event: EventEnvelope) -> None:
        """Queue one durable event for the stream; O(1), never raises, never waits."""
        buffer = self._buffer
        if len(buffer) >= self.buffer_limit:
            buffer.popleft()
            self.dropped += 1
            self.warner.warn(
                f"{self.name}: buffer full ({self.buffer_limit} events, Redis not taking "
                f"them): dropping the oldest; {self.dropped} dropped so far. The log "
                "still holds every event; only the stream misses them.",
                key="publisher-drop")
        buffer.append((time.monotonic_ns(), event))
        if self._idle:
            self._idle = False
            if self._loop_thread == threading.get_ident():
                self._wake.set()
            elif self._loop is not None:
                with contextlib.suppress(RuntimeError):  # that loop has closed
                    self._loop.call_soon_threadsafe(self._wake.set)

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
        oldest = self._inflight[0][0] if self._inflight else (
            self._buffer[0][0] if self._buffer else None)
        lag_ms = 0.0 if oldest is None else (time.monotonic_ns() - oldest) / 1e6
        return {"published": self.published, "dropped": self.dropped,
                "buffered": len(self._buffer) + len(self._inflight), "errors": self.errors,
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
                self.warner.warn(f"{self.name}: dropped a batch of {len(self._inflight)} "
                                 f"events ({type(exc).__name__}: {exc})",
                                 key="publisher-refused")
                self._inflight = []
                continue
            else:
                self.published += len(self._inflight) - len(refused)
                if not refused:
                    self._inflight = []
                    backoff = _BACKOFF_MIN_S
                    continue
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

    async def _send(self, batch: list[tuple[int, EventEnvelope]]
                    ) -> list[tuple[tuple[int, EventEnvelope], BaseException]]:
        """One pipeline of XADDs; returns the entries Redis refused, with its answer."""
        pipe = self.redis.pipeline(transaction=False)
        for _, event in batch:
            fields: dict[Any, Any] = event_fields(event)
            pipe.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)
        replies = await pipe.execute(raise_on_error=False)
        return [(item, reply) for item, reply in zip(batch, replies, strict=True)
                if isinstance(reply, BaseException)]

    def _restore_inflight(self) -> None:
        """Put an unsent batch back at the front, dropping the oldest past the limit."""
        inflight, self._inflight = self._inflight, []
        excess = len(self._buffer) + len(inflight) - self.buffer_limit
        if excess > 0:
            self.dropped += excess
            inflight = inflight[excess:]
            self.warner.warn(f"{self.name}: buffer full: dropped the {excess} oldest events",
                             key="publisher-drop")
        self._buffer.extendleft(reversed(inflight))
