"""Helpers the kernel's behavioural tests share (not fixtures: plain code).

``FaultyStore`` is fault injection, not a mock: it wraps a real store and
refuses chosen writes the way a dying process or a broken disk would, so the
journal sees a write that rejects (ADR 0147: a write that "succeeds" silently
cannot show a lost write).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest

from fleet.kernel.errors import ExecutionFailedError, StoreUnavailableError
from fleet.kernel.events import EventEnvelope
from fleet.kernel.runtime import ExecutionHandle, Runtime
from fleet.kernel.store.spi import (
    EventStore,
    FenceGrant,
    append_acquiring,
    append_releasing,
)


class ManualClock:
    """Milliseconds since the epoch that only move when a test says so."""

    def __init__(self, start: int | None = None) -> None:
        self.now = start if start is not None else time.time_ns() // 1_000_000

    def __call__(self) -> int:
        return self.now

    def advance(self, seconds: float) -> int:
        self.now += int(seconds * 1000)
        return self.now


class FaultyStore:
    """A real store whose writes of chosen events raise, as a crash mid-write would.

    ``fail_when(event)`` picks the events whose write is refused; the whole
    write (a batch too) then raises ``StoreUnavailableError`` and nothing of it
    lands. ``armed`` switches the fault off and on.
    """

    def __init__(self, inner: EventStore, fail_when: Callable[[EventEnvelope], bool]) -> None:
        self.inner = inner
        self.fail_when = fail_when
        self.armed = True
        self.refused: list[EventEnvelope] = []

    def _check(self, events: Sequence[EventEnvelope]) -> None:
        if self.armed and any(self.fail_when(e) for e in events):
            self.refused.extend(events)
            raise StoreUnavailableError("injected fault: the process died before this write")

    async def append(self, event: EventEnvelope, *, fence: int | None = None) -> None:
        self._check([event])
        await self.inner.append(event, fence=fence)

    async def append_batch(self, events: Sequence[EventEnvelope], *,
                           fence: int | None = None) -> None:
        self._check(events)
        await self.inner.append_batch(events, fence=fence)

    async def append_acquiring(self, events: Sequence[EventEnvelope], *, holder: str,
                               lease_ms: int, release: bool = False) -> FenceGrant | None:
        self._check(events)
        return await append_acquiring(self.inner, events, holder=holder, lease_ms=lease_ms,
                                      release=release)

    async def append_releasing(self, events: Sequence[EventEnvelope], *, fence: int) -> None:
        self._check(events)
        await append_releasing(self.inner, events, fence=fence)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def kinds(events: Sequence[EventEnvelope]) -> list[str]:
    """The event kinds of a log, in order."""
    return [str(e.type) for e in events]


def dumped(events: Sequence[EventEnvelope]) -> list[dict[str, Any]]:
    """A log as plain dicts, for exact before/after comparisons."""
    return [e.to_dict() for e in events]


async def settle(runtime: Runtime, timeout: float = 5.0) -> None:
    """Wait until every run this runtime launched has ended (parked, finished, aborted).

    ``Runtime.close`` does the same but also stops local timers; tests keep
    using the runtime afterwards, so they wait on its background tasks here.
    """
    deadline = time.monotonic() + timeout
    while True:
        pending = [t for t in runtime._background if not t.done()]
        if not pending:
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"runs still active after {timeout}s: {pending}")
        await asyncio.wait(pending, timeout=remaining)


async def eventually(check: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0) -> None:
    """Poll ``check`` (sync or async) until it holds, for state another task moves."""
    deadline = time.monotonic() + timeout
    while True:
        held = check()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition never held")
        await asyncio.sleep(0.002)


async def failed_with(handle: ExecutionHandle, code: str, timeout: float = 5.0) -> dict[str, Any]:
    """Assert the execution ``handle`` names ends failed with error ``code``; the error.

    A refusal that can never succeed (a ``ValidationError`` out of a flow body, a
    value the log cannot take) fails the execution with the typed error (decision
    0023); ``result()`` raises ``ExecutionFailedError`` carrying it.
    """
    with pytest.raises(ExecutionFailedError) as failed:
        await handle.result(timeout=timeout)
    assert failed.value.error.get("code") == code, failed.value.error
    return failed.value.error


async def started(runtime: Runtime, flow_id: str, input: Any = None, **kw: Any) -> str:
    """Start an execution and wait until its first drive ends; its id."""
    handle = await runtime.start(flow_id, input, **kw)
    await settle(runtime)
    return handle.execution_id


async def drove(runtime: Runtime, execution_id: str) -> bool:
    """``runtime.drive(execution_id, if_free=True)`` to its stop: whether it took the run
    (not ``stepped_aside``; decision 0051, the one name for what ``drive_if_free`` was)."""
    handle = await runtime.drive(execution_id, if_free=True, wait=True)
    outcome = await handle.outcome()
    assert outcome is not None
    return outcome.kind != "stepped_aside"
