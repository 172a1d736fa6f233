"""The one write path for events the kernel writes outside a run's journal.

A run writes through its ``Journal`` (``fleet.kernel.journal``). Everything
else the kernel appends goes through ``LogWriter``: a start's
``EXECUTION_STARTED`` (and a continue-as-new successor's), resume's
``EXECUTION_RESUMED``, send's ``MESSAGE_RECEIVED``, cancel's ``STEP_CANCELLED`` /
``EXECUTION_CANCELLED``, a timer's ``TIMER_FIRED``, a reopen's bootstrap
(``resume_as``), the late ``OUTCOME_RECORDED`` and the ``EXECUTION_DENIED``
audit, and the lifecycle's repair (a writer with no observers: ADR 0147 does
not report maintenance paths).

``write`` appends under a lease's fence; ``write_if_unchanged`` appends with
the store's conditional append, for the two writers the records keep off the
fence (ADR 0116 Q1: a late outcome; decision 0007: the denial audit). Either
way, once the store has the events they are reported to ``on_event`` and then
``on_durable_event`` (``Observers.stored``); a refused write reports nothing,
is warned through ``on_warn`` and re-raised, and tells its lease whether to
stay (``Lease.write_failed``). ``append_events`` is the journal's call into the
store. No other kernel code appends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fleet.kernel.errors import DuplicateSequenceError, ExecutionBusyError
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.lease import Lease
from fleet.kernel.observers import Observers
from fleet.kernel.store.spi import (
    ConditionalAppendResult,
    EventStore,
    ReleasingAppend,
    TipObservation,
    append_acquiring,
    append_many,
    append_releasing,
)


async def append_events(store: EventStore, events: Sequence[EventEnvelope], *,
                        fence: int | None) -> None:
    """Hand a journal's ``events`` (contiguous, one execution) to the store in one call.

    One event is a plain ``append`` (the common case of a run's write chain);
    more are one all-or-nothing ``append_batch``.
    """
    if len(events) == 1:
        await store.append(events[0], fence=fence)
    else:
        await store.append_batch(events, fence=fence)


async def append_under(lease: Lease, events: Sequence[EventEnvelope], *,
                       last: bool = False) -> None:
    """Append ``events`` (contiguous, one execution) under ``lease``, in one round trip.

    A deferred lease is taken by this write (``append_acquiring``: refused with
    ``ExecutionBusyError``, nothing written, when a live lease is held); with
    ``last`` the write also ends the lease (``append_releasing``), so its holder
    need not release it (decision 0029). A lease already let go (kept, passed
    on) writes under its token and ends nothing.
    """
    if lease.grant is None:
        execution_id, holder, lease_ms = lease.wanted
        grant = await append_acquiring(lease.store, events, holder=holder, lease_ms=lease_ms,
                                       release=last)
        if grant is None:
            raise ExecutionBusyError(f"execution {execution_id!r} is held by a live lease; "
                                     "nothing was written, retry")
        lease.granted(grant, released=last)
    elif last and not lease.released and lease.kept is None:
        await append_releasing(lease.store, events, fence=lease.grant.token)
        lease.released_by_write()
    else:
        await append_events(lease.store, events, fence=lease.grant.token)


def make_events(execution_id: str, after: int, now: int,
                bodies: Sequence[tuple[EventType, dict[str, Any]]]) -> list[EventEnvelope]:
    """Kernel-stamped envelopes for ``bodies`` in the slots after sequence ``after``."""
    return [EventEnvelope.make(execution_id, after + 1 + i, type_, now, body)
            for i, (type_, body) in enumerate(bodies)]


class LogWriter:
    """Appends events outside a run's journal, then reports them (see the module).

    Args:
        store: The event store.
        observers: Who hears of a stored event; ``None`` reports nothing (maintenance).
    """

    __slots__ = ("observers", "store")

    def __init__(self, store: EventStore, observers: Observers | None) -> None:
        self.store = store
        self.observers = observers

    async def write(self, lease: Lease, events: Sequence[EventEnvelope], *,
                    last: bool = False) -> None:
        """Append ``events`` under ``lease``'s fence and report them once stored.

        A deferred lease is taken by this write; with ``last`` the write also ends
        the lease (decision 0029: one round trip for all three).

        Raises:
            whatever the store raised (nothing was reported; ``lease`` knows).
        """
        try:
            # Always the all-or-nothing batch append, even for one event: a
            # bootstrap is one batch (ADR 0116 round 3 A), and a store decorator
            # sees every write from outside a run the same way.
            if lease.grant is None or last:
                await append_under(lease, events, last=last)
            else:
                await self.store.append_batch(events, fence=lease.token)
        except BaseException as exc:
            lease.write_failed(exc)
            self._refused(events, exc)
            raise
        if self.observers is not None:
            self.observers.stored(events)

    async def create_many(self, starts: Sequence[EventEnvelope]) -> list[BaseException | None]:
        """Write each sequence-0 event (a new execution's ``EXECUTION_STARTED``) under
        fence 0, all in one ``append_many`` (``Runtime.start_many``); report those stored.

        An answer per event: None (written) or the store's refusal for it alone
        (``StaleFenceError``: its fence was ever taken; ``DuplicateSequenceError``: it
        exists). Only what landed is reported.
        """
        answers = await append_many(self.store, [([event], 0) for event in starts])
        stored = [event for event, answer in zip(starts, answers, strict=True)
                  if answer is None]
        if stored and self.observers is not None:
            self.observers.stored(stored)
        return answers

    async def write_releasing_many(self, writes: Sequence[tuple[Lease, Sequence[EventEnvelope]]],
                                   ) -> list[BaseException | None]:
        """Append each batch under its (taken) lease and end that lease, all in one
        ``append_many`` (``ReleasingAppend``s: one round trip on Postgres, decision
        0048); report those stored. An answer per write: None (written, the lease
        ended) or the store's refusal for it alone (its lease is then still held:
        the caller releases it, or leaves it to expire if ``Lease.kept`` says so).
        """
        answers = await append_many(self.store, [ReleasingAppend(events, fence=lease.token)
                                                 for lease, events in writes])
        stored: list[EventEnvelope] = []
        for (lease, events), answer in zip(writes, answers, strict=True):
            if answer is None:
                lease.released_by_write()
                stored.extend(events)
            elif isinstance(answer, BaseException):
                lease.write_failed(answer)
                self._refused(events, answer)
        if stored and self.observers is not None:
            self.observers.stored(stored)
        return [a if isinstance(a, BaseException) else None for a in answers]

    async def observe(self, execution_id: str) -> TipObservation:
        """The tip a conditional write compares (``append_if_unchanged`` with no event)."""
        return (await self.store.append_if_unchanged(execution_id, None)).tip

    async def write_if_unchanged(self, event: EventEnvelope,
                                 expect: TipObservation) -> ConditionalAppendResult:
        """Append ``event`` iff the tip still equals ``expect``; report it if it landed."""
        try:
            result = await self.store.append_if_unchanged(event.execution_id, event, expect)
        except BaseException as exc:
            self._refused((event,), exc)
            raise
        if result.appended and self.observers is not None:
            self.observers.stored((event,))
        return result

    def _refused(self, events: Sequence[EventEnvelope], exc: BaseException) -> None:
        # A taken slot is a race its caller settles (an idempotent start, a reopen
        # re-slotting over late outcomes); a cancelled write is the caller's own doing.
        if self.observers is None or not isinstance(exc, Exception) \
                or isinstance(exc, DuplicateSequenceError):
            return
        first = events[0]
        kinds = ", ".join(dict.fromkeys(str(e.type) for e in events))
        self.observers.warner.warn(
            f"write of {kinds} to {first.execution_id!r} at sequence {first.sequence} was "
            f"refused, nothing reported: {type(exc).__name__}: {exc}",
            key=f"write-refused:{first.execution_id}")
