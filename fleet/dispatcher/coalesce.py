"""Concurrent single starts of one loop, written and published together.

A web app under load has many ``start`` calls in flight at once (64 request
threads, or 64 coroutines). Written one by one, each costs a store round trip
and a broker round trip; ``Coalescer`` gathers the starts that arrive while
the previous group is being written (and those of the same loop turn) and
hands them to one ``flush`` (``Dispatcher.start_many``'s halves: one
``append_many``, one pipeline publish). Alone, a start waits one loop turn;
under load, the group grows with the load, as a group commit does.

Each caller still gets its own answer: ``flush`` returns one result per item,
an id or the error that item alone would have raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

__all__ = ["Coalescer"]

In = TypeVar("In")
Out = TypeVar("Out")
Flush = Callable[[Sequence[In]], Awaitable[Sequence[Out | BaseException]]]


class Coalescer(Generic[In, Out]):
    """Groups ``submit`` calls of one event loop into calls of ``flush``.

    Args:
        flush: Writes a group; one result (or exception) per item, in order.
        max_batch: Most items in one group.
        max_inflight: Groups being flushed at once.
    """

    def __init__(self, flush: Flush[In, Out], *, max_batch: int = 500,
                 max_inflight: int = 2) -> None:
        self._flush = flush
        self.max_batch = max_batch
        self._slots = asyncio.Semaphore(max_inflight)
        self._pending: list[tuple[In, asyncio.Future[Out]]] = []
        self._driver: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self.groups = 0
        self.items = 0

    async def submit(self, item: In) -> Out:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Out] = loop.create_future()
        self._pending.append((item, future))
        if self._driver is None:
            self._driver = loop.create_task(self._drive())
        return await future

    async def _drive(self) -> None:
        try:
            while self._pending:
                await asyncio.sleep(0)  # let this loop turn's submissions join
                await self._slots.acquire()
                group = self._pending[:self.max_batch]
                del self._pending[:self.max_batch]
                task = asyncio.get_running_loop().create_task(self._run(group))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)
        finally:
            self._driver = None

    async def _run(self, group: list[tuple[In, asyncio.Future[Out]]]) -> None:
        try:
            results: Sequence[Out | BaseException] = await self._flush(
                [item for item, _ in group])
        except BaseException as exc:  # noqa: BLE001 - every caller of the group hears it
            results = [exc] * len(group)
        finally:
            self._slots.release()
        self.groups += 1
        self.items += len(group)
        for (_, future), result in zip(group, results, strict=True):
            if future.done():  # its caller was cancelled; the write may have landed
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def drain(self) -> None:
        """Wait until every group submitted so far is flushed."""
        while self._driver is not None or self._inflight:
            waiting = [t for t in (self._driver, *self._inflight) if t is not None]
            await asyncio.gather(*waiting, return_exceptions=True)
