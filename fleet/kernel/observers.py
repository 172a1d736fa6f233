"""The runtime's two event observers and its warning sink (ADR 0147).

``on_event`` is immediacy: a run's journal calls it as an event is folded,
before its write, so it can report an event that never became durable.
``on_durable_event`` is truth: it is called once a write has resolved, never
for a lost, rejected or fenced write. An event written outside a run's journal
(``fleet.kernel.writes.LogWriter``) is reported to both once it is stored,
``on_event`` first.

A consumer that throws or returns a failing awaitable never reaches the writer;
it is reported through ``on_warn``, at most once a minute per observer.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from fleet.kernel.events import EventEnvelope

EventObserver = Callable[[EventEnvelope], Any]
WarnSink = Callable[[str], Any]

log = logging.getLogger("fleet")


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
            log.warning(message)
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


class Observers:
    """A runtime's observers, shared by its journals and its ``LogWriter``.

    Mutable on purpose: an observer set on the runtime after it was built
    (``runtime.on_durable_event = publisher.on_durable_event``) reaches every
    write made from then on.
    """

    __slots__ = ("on_durable_event", "on_event", "warner")

    def __init__(self, warner: Warner, *, on_event: EventObserver | None = None,
                 on_durable_event: EventObserver | None = None) -> None:
        self.warner = warner
        self.on_event = on_event
        self.on_durable_event = on_durable_event

    def stored(self, events: Sequence[EventEnvelope]) -> None:
        """Report events a write outside a journal has stored: ``on_event`` for each,
        then ``on_durable_event`` for each (ADR 0147's order, ADR 0116 round 3 A)."""
        if self.on_event is not None:
            for event in events:
                deliver(self.on_event, event, self.warner, "on_event")
        if self.on_durable_event is not None:
            for event in events:
                deliver(self.on_durable_event, event, self.warner, "on_durable_event")
