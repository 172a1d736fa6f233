"""The serial write chain of one run, and its two observers (ADR 0147).

``commit`` folds an event into the live state at once and fires ``on_event``
(immediacy: it can report an event whose write later fails). The write joins
a chain that flushes pending events in order, several per store call when
they queue up. ``on_durable_event`` fires from that chain after a write has
resolved (truth): never for a lost, rejected or fenced write, nor for
anything after one; only this runtime's writes; at most once; in order per
writer. A consumer that throws or returns a failing awaitable never reaches
the run; it is reported through ``on_warn`` at most once a minute.

A failed write latches: later commits raise ``RunAborted`` and nothing more
is written under this journal, so a fenced-out zombie stops at its next step.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

from fleet.kernel.errors import RunAborted
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.fold import ExecutionState, apply
from fleet.kernel.store.spi import EventStore

EventObserver = Callable[[EventEnvelope], Any]
WarnSink = Callable[[str], Any]


class Warner:
    """``on_warn`` with a per-key rate limit, so a broken consumer is heard, not spammed."""

    def __init__(self, sink: WarnSink | None, interval_s: float = 60.0) -> None:
        self._sink = sink
        self._interval = interval_s
        self._last: dict[str, float] = {}

    def warn(self, message: str, *, key: str | None = None) -> None:
        if key is not None:
            now = time.monotonic()
            last = self._last.get(key)
            if last is not None and now - last < self._interval:
                return
            self._last[key] = now
        if self._sink is None:
            import logging

            logging.getLogger("fleet").warning(message)
            return
        try:
            self._sink(message)
        except Exception:  # noqa: BLE001 - a broken warn sink must not break a run
            pass


def deliver(observer: EventObserver | None, event: EventEnvelope, warner: Warner,
            name: str) -> None:
    """Call an observer, isolated: a throw or a rejected awaitable is only warned."""
    if observer is None:
        return
    try:
        result = observer(event)
    except Exception as exc:  # noqa: BLE001
        warner.warn(f"{name} raised {type(exc).__name__}: {exc}", key=name)
        return
    if inspect.isawaitable(result):
        task = asyncio.ensure_future(result)
        task.add_done_callback(lambda t: _report(t, warner, name))


def _report(task: asyncio.Future[Any], warner: Warner, name: str) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        warner.warn(f"{name} failed asynchronously: {type(exc).__name__}: {exc}", key=name)


class Journal:
    """Writes one run's events in order under one fence token.

    Writes happen at barriers: ``commit`` only folds and queues, and the first
    task that needs durability (``barrier``) writes everything queued so far in
    one store call while later callers wait for that write. Every path that
    ends a run passes a barrier, so nothing committed is left unwritten, and a
    run needs no extra task per write.
    """

    __slots__ = ("_error", "_flushing", "_pending", "clock", "durable_seq", "fence",
                 "on_durable_event", "on_event", "state", "store", "warner")

    def __init__(self, store: EventStore, state: ExecutionState, *, fence: int | None,
                 clock: Callable[[], int], warner: Warner,
                 on_event: EventObserver | None = None,
                 on_durable_event: EventObserver | None = None) -> None:
        self.store = store
        self.state = state
        self.fence = fence
        self.clock = clock
        self.warner = warner
        self.on_event = on_event
        self.on_durable_event = on_durable_event
        self.durable_seq = state.sequence
        self._pending: list[EventEnvelope] = []
        self._flushing: asyncio.Future[None] | None = None
        self._error: BaseException | None = None

    @property
    def failed(self) -> BaseException | None:
        return self._error

    def commit(self, type: EventType, payload: dict[str, Any], *, kernel: bool = True,
               metadata: dict[str, Any] | None = None) -> EventEnvelope:
        """Fold an event now and queue its write (written at the next barrier)."""
        if self._error is not None:
            raise RunAborted(self._error)
        event = EventEnvelope.make(self.state.execution_id, self.state.sequence + 1, type,
                                   self.clock(), payload, kernel=kernel, metadata=metadata)
        apply(self.state, event)
        if self.on_event is not None:
            deliver(self.on_event, event, self.warner, "on_event")
        self._pending.append(event)
        return event

    async def barrier(self) -> None:
        """Wait until everything committed so far is durable, or raise RunAborted."""
        target = self.state.sequence
        while True:
            if self._error is not None:
                raise RunAborted(self._error)
            if self.durable_seq >= target:
                return
            if self._flushing is not None:
                # Another task is writing: wait for it, then look again.
                await asyncio.shield(self._flushing)
                continue
            await self._flush_once()

    async def _flush_once(self) -> None:
        batch, self._pending = self._pending, []
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._flushing = done
        try:
            if len(batch) == 1:
                await self.store.append(batch[0], fence=self.fence)
            else:
                await self.store.append_batch(batch, fence=self.fence)
        except BaseException as exc:  # latch every kind of failure, then re-raise
            # Latch: a lost, rejected, fenced or interrupted write ends this
            # journal; nothing after it is written or reported as durable.
            self._error = exc
            self._pending.clear()
            if isinstance(exc, Exception):
                raise RunAborted(exc) from exc
            raise
        else:
            self.durable_seq = batch[-1].sequence
            if self.on_durable_event is not None:
                for event in batch:
                    deliver(self.on_durable_event, event, self.warner, "on_durable_event")
        finally:
            self._flushing = None
            done.set_result(None)

    async def close(self) -> None:
        """Wait for an in-flight write to settle (used when a run ends)."""
        if self._flushing is not None:
            await asyncio.shield(self._flushing)
