"""Group commit: appends of many executions share one transaction per flush.

``CoalescingEventStore`` wraps any ``EventStore``. ``append``,
``append_batch`` and the leased writes of decision 0029 (``append_acquiring``,
``append_releasing``) join a queue; a flush takes up to ``max_batch`` of them
after at most ``max_wait_ms`` (0: whatever queued during the current loop
turn, and whatever queues while the in-flight flushes run, which is the
batching that matters under load) and hands them to the inner store at once.
Every other call goes straight to the inner store.

A write made while nothing is queued or being written goes straight to the
inner store (a flush of one): at low concurrency the queue would only add task
hops; writes that arrive while it is in flight queue as usual.

On a store that implements ``append_many`` (``spi.AppendsMany``; Postgres: one
statement, one commit; SQLite: one transaction) a flush of plain appends is one
transaction, and on one that implements ``append_many_leased``
(``spi.AppendsManyLeased``: every built-in store) so is a flush that also takes
and ends leases. Each request is still judged alone, as its single call: a stale
fence, a taken slot, a gap or a live lease refuses that request only and writes
nothing of it, never its neighbours. On any other store the requests of a flush
run concurrently, one execution's in order (``spi.append_many``).

Guarantees kept per request: the fence check, the slot, all or nothing for a
batch, order among one caller's sequential appends. A caller's ``append``
returns only after the flush that carried it committed, so the runtime's
``on_durable_event`` (which fires when ``append`` returns) still reports only
what the log holds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

from fleet.kernel.errors import FleetError, StoreError, ValidationError
from fleet.kernel.events import EventEnvelope
from fleet.kernel.store.forwarding import ForwardingEventStore
from fleet.kernel.store.spi import (
    AcquiringAppend,
    AppendRequest,
    AppendsMany,
    EventStore,
    FenceGrant,
    ManyAnswer,
    ManyRequest,
    ReleasingAppend,
    append_many,
    check_batch,
    request_events,
)

__all__ = ["AppendRequest", "CoalescingEventStore", "GroupAppender"]

#: The store a flush commits through in one transaction (``spi.AppendsMany``).
GroupAppender = AppendsMany


T = TypeVar("T")


@dataclass(slots=True)
class _Pending:
    request: ManyRequest
    future: asyncio.Future[ManyAnswer]


class CoalescingEventStore(ForwardingEventStore):
    """An ``EventStore`` decorator that group-commits appends.

    Args:
        inner: The store that receives the flushes.
        max_batch: Most requests in one flush.
        max_wait_ms: Longest a request waits for others to join its flush.
        max_inflight: Flushes running at once (each holds one connection).

    ``flushes`` and ``flushed`` count flushes and the requests they carried.
    """

    def __init__(self, inner: EventStore, *, max_batch: int = 256, max_wait_ms: float = 0.0,
                 max_inflight: int = 4) -> None:
        if max_batch < 1 or max_inflight < 1 or max_wait_ms < 0:
            raise ValidationError("max_batch and max_inflight must be >= 1 and max_wait_ms "
                                  f">= 0; got {max_batch}, {max_inflight}, {max_wait_ms}")
        super().__init__(inner)
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000
        self.flushes = 0
        self.flushed = 0
        self._slots = asyncio.Semaphore(max_inflight)
        self._pending: list[_Pending] = []
        self._full = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._alone_now = 0  # appends written alone (``_alone``) in flight
        self._closed = False

    # -- the coalesced writes ---------------------------------------------------

    async def append(self, event: EventEnvelope, *, fence: int | None = None) -> None:
        if self._idle():
            await self._alone(self.inner.append(event, fence=fence))
            return
        await self._enqueue(((event,), fence))

    async def append_batch(self, events: Sequence[EventEnvelope], *,
                           fence: int | None = None) -> None:
        check_batch(events)
        if self._idle():
            await self._alone(self.inner.append_batch(events, fence=fence))
            return
        await self._enqueue((list(events), fence))

    async def append_acquiring(self, events: Sequence[EventEnvelope], *, holder: str,
                               lease_ms: int, release: bool = False) -> FenceGrant | None:
        """Queued like an append (the inner store judges it as ``append_acquiring``)."""
        check_batch(events)
        if self._idle():
            return await self._alone(super().append_acquiring(
                events, holder=holder, lease_ms=lease_ms, release=release))
        return cast(FenceGrant | None, await self._enqueue(
            AcquiringAppend(list(events), holder, lease_ms, release)))

    async def append_releasing(self, events: Sequence[EventEnvelope], *, fence: int) -> None:
        """Queued like an append (the inner store judges it as ``append_releasing``)."""
        check_batch(events)
        if self._idle():
            await self._alone(super().append_releasing(events, fence=fence))
            return
        await self._enqueue(ReleasingAppend(list(events), fence))

    def _idle(self) -> bool:
        """Nothing queued or being written: a write has nobody to share a flush with."""
        return not (self._pending or self._inflight or self._alone_now or self._closed
                    or self._driver is not None)

    async def _alone(self, write: Awaitable[T]) -> T:
        """A write made while the store is idle goes straight to the inner store (a
        flush of one, without the queue's task hops); writes arriving meanwhile queue
        behind it as behind any flush in flight, so batching under load is unchanged."""
        self._alone_now += 1
        try:
            return await write
        finally:
            self._alone_now -= 1
            self.flushes += 1
            self.flushed += 1

    def _enqueue(self, request: ManyRequest) -> asyncio.Future[ManyAnswer]:
        if self._closed:
            raise StoreError("the coalescing store is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[ManyAnswer] = loop.create_future()
        self._pending.append(_Pending(request, future))
        if len(self._pending) >= self.max_batch:
            self._full.set()
        if self._driver is None:
            self._driver = loop.create_task(self._drive())
        return future

    async def _drive(self) -> None:
        try:
            while self._pending:
                if self.max_wait > 0 and len(self._pending) < self.max_batch:
                    self._full.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._full.wait(), self.max_wait)
                else:
                    await asyncio.sleep(0)  # let this loop turn's appends join
                await self._slots.acquire()
                batch = self._pending[:self.max_batch]
                del self._pending[:self.max_batch]
                task = asyncio.get_running_loop().create_task(self._flush(batch))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)
        finally:
            self._driver = None

    async def _flush(self, batch: list[_Pending]) -> None:
        try:
            results = await self._commit(batch)
        except Exception as exc:  # noqa: BLE001 - every request of the flush hears it
            results = [exc] * len(batch)
        finally:
            self._slots.release()
        self.flushes += 1
        self.flushed += len(batch)
        for pending, result in zip(batch, results, strict=True):
            if pending.future.done():  # the caller was cancelled; the write may have landed
                continue
            if isinstance(result, BaseException):
                pending.future.set_exception(result)
            else:
                pending.future.set_result(result)

    async def _commit(self, batch: list[_Pending]) -> Sequence[ManyAnswer]:
        # One transaction where the inner store has ``append_many`` (and, with a leased
        # write in the flush, ``append_many_leased``): every built-in one does. Otherwise
        # executions concurrently, each one in order.
        return await append_many(self.inner, [p.request for p in batch])

    async def append_many(self, requests: Sequence[AppendRequest],
                          ) -> list[BaseException | None]:
        """Queue every request at once, so they share a flush (or a few); each judged alone."""
        return cast(list[BaseException | None], await self.append_many_leased(requests))

    async def append_many_leased(self, requests: Sequence[ManyRequest],
                                 ) -> list[ManyAnswer]:
        """Queue every request at once (plain, acquiring, releasing), so they share a
        flush (or a few); each judged alone."""
        futures: list[asyncio.Future[ManyAnswer] | None] = []
        results: list[ManyAnswer] = [None] * len(requests)
        for i, request in enumerate(requests):
            try:
                check_batch(request_events(request))
            except FleetError as exc:
                results[i] = exc
                futures.append(None)
                continue
            futures.append(self._enqueue(
                request if isinstance(request, (AcquiringAppend, ReleasingAppend))
                else (list(request[0]), request[1])))
        answers = await asyncio.gather(*(f for f in futures if f is not None),
                                       return_exceptions=True)
        it = iter(answers)
        for i, future in enumerate(futures):
            if future is not None:
                results[i] = next(it)
        return results

    # -- everything else goes straight through ------------------------------------

    async def close(self) -> None:
        """Flush what is queued, then close the inner store."""
        if self._closed:
            return
        self._closed = True
        while self._driver is not None or self._inflight:
            waiting = [t for t in (self._driver, *self._inflight) if t is not None]
            await asyncio.gather(*waiting, return_exceptions=True)
        await self.inner.close()
