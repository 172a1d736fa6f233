"""Deterministic fault injection for an ``EventStore``.

``FaultInjectingEventStore`` wraps any store and, from one seeded
``random.Random``, rejects, delays or never resolves the writes that carry
events. The same seed, configuration and call order give the same schedule,
so a chaos test that fails names a seed that replays it. Every fault it
injects is recorded in ``injected`` for the test to assert on or print.

Reads, fence operations and deletes pass through untouched: the schedule is
drawn over event writes only, so a test can name the event a fault hit and
the schedule does not shift when the code under test reads more or less.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, cast

from fleet.kernel.errors import StoreUnavailableError, ValidationError
from fleet.kernel.events import EventEnvelope
from fleet.kernel.store.forwarding import ForwardingEventStore
from fleet.kernel.store.spi import (
    AppendRequest,
    ConditionalAppendResult,
    EventStore,
    FenceGrant,
    ManyAnswer,
    ManyRequest,
    TipObservation,
    append_many,
    request_events,
)

__all__ = ["FaultInjectingEventStore", "InjectedFault", "WritePredicate"]

WritePredicate = Callable[[Sequence[EventEnvelope]], bool]


@dataclass(frozen=True, slots=True)
class InjectedFault:
    """One fault the decorator injected: which write, and what it did to it."""

    index: int                    # the write's position among all event writes (0-based)
    execution_id: str
    sequence: int                 # the first event's sequence
    kind: Literal["rejected", "delayed", "hung"]
    delay_ms: float = 0.0


class FaultInjectingEventStore(ForwardingEventStore):
    """An ``EventStore`` decorator that rejects, delays or hangs writes by seed.

    Args:
        inner: The store that receives every write that is let through.
        seed: Seeds the one ``random.Random`` every draw comes from.
        reject_rate: Probability in [0, 1] that a write raises
            ``StoreUnavailableError`` having written nothing.
        delay_ms: A (low, high) range; each write first sleeps a uniform draw
            from it (``(0, 0)``: no delay).
        hang_when: A predicate over a write's events; when it holds the write
            never resolves (it waits until cancelled) and nothing is written.
        reject_when: A predicate over a write's events; when it holds the
            write is rejected as with ``reject_rate``.

    Every event write draws exactly two numbers (reject, delay) whatever the
    configuration, so toggling a predicate does not shift the schedule of the
    other writes.
    """

    def __init__(self, inner: EventStore, *, seed: int = 0, reject_rate: float = 0.0,
                 delay_ms: tuple[float, float] = (0, 0),
                 hang_when: WritePredicate | None = None,
                 reject_when: WritePredicate | None = None) -> None:
        if not 0.0 <= reject_rate <= 1.0:
            raise ValidationError(f"reject_rate must be within [0, 1], got {reject_rate}")
        low, high = delay_ms
        if not 0 <= low <= high:
            raise ValidationError(f"delay_ms must be (low, high) with 0 <= low <= high, "
                                  f"got {delay_ms}")
        super().__init__(inner)
        self.seed = seed
        self._rng = random.Random(seed)
        self._reject_rate = reject_rate
        self._delay_ms = (float(low), float(high))
        self._hang_when = hang_when
        self._reject_when = reject_when
        self._writes = 0
        self.injected: list[InjectedFault] = []

    async def _fault(self, events: Sequence[EventEnvelope]) -> None:
        """Draw this write's fate; return only if the write may go through."""
        index = self._writes
        self._writes += 1
        # Both draws happen before anything awaits, so the schedule depends only
        # on the order in which writes were called, never on how they interleave.
        reject_draw = self._rng.random()
        delay = self._rng.uniform(*self._delay_ms)
        first = events[0]
        if delay > 0:
            self.injected.append(InjectedFault(index, first.execution_id, first.sequence,
                                               "delayed", delay))
            await asyncio.sleep(delay / 1000)
        if self._hang_when is not None and self._hang_when(events):
            self.injected.append(InjectedFault(index, first.execution_id, first.sequence,
                                               "hung"))
            await asyncio.Event().wait()  # never set: only cancellation ends it
        if (reject_draw < self._reject_rate
                or (self._reject_when is not None and self._reject_when(events))):
            self.injected.append(InjectedFault(index, first.execution_id, first.sequence,
                                               "rejected"))
            raise StoreUnavailableError(f"injected fault (seed {self.seed}, write {index}): "
                                        f"{first.id!r} rejected, nothing written")

    # -- writes that carry events: subject to faults ------------------------

    async def append(self, event: EventEnvelope, *, fence: int | None = None) -> None:
        await self._fault((event,))
        await self.inner.append(event, fence=fence)

    async def append_batch(self, events: Sequence[EventEnvelope], *,
                           fence: int | None = None) -> None:
        if not events:  # let the inner store refuse the shape, with its own error
            await self.inner.append_batch(events, fence=fence)
            return
        await self._fault(events)
        await self.inner.append_batch(events, fence=fence)

    async def append_many(self, requests: Sequence[AppendRequest],
                          ) -> list[BaseException | None]:
        """Each request draws its own fate, in order; those let through go to the inner
        store in one ``append_many``. A rejected or hung one writes nothing."""
        return cast(list[BaseException | None], await self.append_many_leased(requests))

    async def append_many_leased(self, requests: Sequence[ManyRequest],
                                 ) -> list[ManyAnswer]:
        """``append_many`` with leased requests too: each draws its fate as its single
        call would, in order; those let through go to the inner store in one call."""
        results: list[ManyAnswer] = [None] * len(requests)
        passed: list[int] = []
        for i, request in enumerate(requests):
            events = request_events(request)
            if not events:
                passed.append(i)  # the inner store refuses the shape, with its own error
                continue
            try:
                await self._fault(events)
            except StoreUnavailableError as exc:
                results[i] = exc
                continue
            passed.append(i)
        answers = await append_many(self.inner, [requests[i] for i in passed])
        for i, answer in zip(passed, answers, strict=True):
            results[i] = answer
        return results

    async def append_acquiring(self, events: Sequence[EventEnvelope], *, holder: str,
                               lease_ms: int, release: bool = False) -> FenceGrant | None:
        if events:
            await self._fault(events)
        return await super().append_acquiring(events, holder=holder, lease_ms=lease_ms,
                                              release=release)

    async def append_releasing(self, events: Sequence[EventEnvelope], *, fence: int) -> None:
        if events:
            await self._fault(events)
        await super().append_releasing(events, fence=fence)

    async def append_if_unchanged(self, execution_id: str, event: EventEnvelope | None,
                                  expect: TipObservation | None = None,
                                  ) -> ConditionalAppendResult:
        if event is not None:  # an observation is a read
            await self._fault((event,))
        return await self.inner.append_if_unchanged(execution_id, event, expect)

    # -- everything else passes through --------------------------------------
