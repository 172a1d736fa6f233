"""The serial write chain of one run, and its two observers (ADR 0147).

``commit`` folds an event into the live state at once and fires ``on_event``
(immediacy: it can report an event whose write later fails). The write joins
a chain that flushes pending events in order, several per store call when
they queue up. ``on_durable_event`` fires from that chain after a write has
resolved (truth): never for a lost, rejected or fenced write, nor for
anything after one; only this runtime's writes; at most once; in order per
writer. A consumer that throws or returns a failing awaitable never reaches
the run; it is reported through ``on_warn`` at most once a minute
(``fleet.kernel.observers``). Events written outside a run go through
``fleet.kernel.writes.LogWriter`` instead.

A failed write latches: later commits raise ``RunAborted`` and nothing more
is written under this journal, so a fenced-out zombie stops at its next step.
A write the store refused for good (a ``ValidationError``: the events can never
be written) latches the same way; the run then rebases the journal on the
durable state and fails the execution (decision 0023). ``refuse`` latches such a
refusal the kernel found itself, before any write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fleet.kernel.errors import ExecutionBusyError, RunAborted
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.fold import ExecutionState, apply
from fleet.kernel.lease import Lease
from fleet.kernel.observers import EventObserver, Warner, WarnSink, deliver
from fleet.kernel.store.spi import EventStore
from fleet.kernel.writes import append_events, append_under

# The observer types and the warner live in fleet.kernel.observers; they are
# named here too because the fleet packages import them from the journal.
__all__ = ["EventObserver", "Journal", "WarnSink", "Warner", "deliver"]


class Journal:
    """Writes one run's events in order under one fence token.

    Writes happen at barriers: ``commit`` only folds and queues, and the first
    task that needs durability (``barrier``) writes everything queued so far in
    one store call while later callers wait for that write. Every path that
    ends a run passes a barrier, so nothing committed is left unwritten, and a
    run needs no extra task per write.
    """

    __slots__ = ("_error", "_flushing", "_held_reports", "_pending", "_refused", "clock",
                 "durable_seq", "ending", "fence", "lease", "on_durable_event", "on_event",
                 "state", "store", "warner")

    def __init__(self, store: EventStore, state: ExecutionState, *, fence: int | None,
                 clock: Callable[[], int], warner: Warner,
                 on_event: EventObserver | None = None,
                 on_durable_event: EventObserver | None = None,
                 lease: Lease | None = None) -> None:
        self.store = store
        self.state = state
        self.fence = fence
        # The run's lease: writes go under it (taking a deferred one, ending it with the
        # last write: decision 0029). None: under ``fence`` (a dry replay's copy).
        self.lease = lease
        # Events whose on_event waits for their write (a start's EXECUTION_STARTED and
        # what was committed before it was stored); None: on_event fires at commit.
        self._held_reports: list[EventEnvelope] | None = None
        self.clock = clock
        self.warner = warner
        self.on_event = on_event
        self.on_durable_event = on_durable_event
        self.durable_seq = state.sequence
        self._pending: list[EventEnvelope] = []
        self._flushing: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._refused: tuple[EventEnvelope, ...] = ()
        # The write that ends the run (and its lease) has begun.
        self.ending = False

    @property
    def failed(self) -> BaseException | None:
        return self._error

    @property
    def refused(self) -> tuple[EventEnvelope, ...]:
        """The events of the write that failed (none when the kernel refused first)."""
        return self._refused

    def refuse(self, exc: BaseException) -> RunAborted:
        """Latch ``exc``, a refusal the kernel found before writing (a step's output the
        log cannot take): nothing more is written. The caller raises what this returns."""
        if self._error is None:
            self._error = exc
            self._pending.clear()
            self._refused = ()
        return RunAborted(self._error)

    def rebase(self, state: ExecutionState) -> None:
        """Drop a latched refusal and continue from ``state``, the durable state re-read.

        What was committed after the durable head (the refused events and what
        followed them) is forgotten; the run writes its end from here.
        """
        self._error = None
        self._pending.clear()
        self._refused = ()
        self.state = state
        self.durable_seq = state.sequence

    def commit(self, type: EventType, payload: dict[str, Any], *, kernel: bool = True,
               metadata: dict[str, Any] | None = None) -> EventEnvelope:
        """Fold an event now and queue its write (written at the next barrier)."""
        if self._error is not None:
            raise RunAborted(self._error)
        event = EventEnvelope.make(self.state.execution_id, self.state.sequence + 1, type,
                                   self.clock(), payload, kernel=kernel, metadata=metadata)
        apply(self.state, event)
        if self._held_reports is not None:
            self._held_reports.append(event)
        elif self.on_event is not None:
            deliver(self.on_event, event, self.warner, "on_event")
        self._pending.append(event)
        return event

    def carry_start(self, started: EventEnvelope) -> None:
        """Queue a new execution's ``EXECUTION_STARTED`` (already folded into the state)
        so the run's first write carries it (decision 0029).

        As for any write outside a run (decision 0015), ``on_event`` hears of it once
        it is stored; so do the events the run commits before that write (their
        ``on_event`` waits for it, in sequence order).
        """
        self.durable_seq = started.sequence - 1
        self._pending.append(started)
        self._held_reports = [started]

    async def barrier(self, *, upto: int | None = None, last: bool = False) -> None:
        """Wait until everything committed so far (or through ``upto``) is durable, or
        raise RunAborted. ``last``: nothing more is written under the lease, so the
        write that carries the end also ends the lease (decision 0029)."""
        target = self.state.sequence if upto is None else upto
        while True:
            if self.durable_seq >= target:
                return  # (a later write may have failed since: not this barrier's)
            if self._error is not None:
                raise RunAborted(self._error)
            if self._flushing is not None:
                # Another task is writing: wait for it, then look again.
                await asyncio.shield(self._flushing)
                continue
            await self._flush_once(last=last)

    async def hold(self) -> None:
        """Make sure the run holds its fence before code that acts outside a step runs
        (a decider, a successor's start): a no-op once the lease is taken. A deferred
        lease not taken yet (decision 0032) is taken by writing what is pending, or,
        with nothing pending, alone (``acquire_fence_if``). ``RunAborted``
        (``ExecutionBusyError``) when a live lease is held: nothing is written then."""
        lease = self.lease
        while lease is not None and lease.grant is None:
            if self._error is not None:
                raise RunAborted(self._error)
            if self._flushing is not None:
                await asyncio.shield(self._flushing)
            elif self.durable_seq < self.state.sequence:
                await self.barrier()
            else:
                await self._take_alone(lease)

    async def _take_alone(self, lease: Lease) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._flushing = done  # a write waits for the fence rather than race it
        try:
            if not await lease.take_deferred():
                raise ExecutionBusyError(f"execution {lease.execution_id!r} is held by a live "
                                         "lease; nothing was written, retry")
        except BaseException as exc:
            self._error = exc
            self._refused = ()
            self._pending.clear()
            if isinstance(exc, Exception):
                raise RunAborted(exc) from exc
            raise
        finally:
            self._flushing = None
            done.set_result(None)

    async def _flush_once(self, *, last: bool = False) -> None:
        self.ending = self.ending or last
        batch, self._pending = self._pending, []
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._flushing = done
        try:
            if self.lease is not None:
                await append_under(self.lease, batch, last=last)
            else:
                await append_events(self.store, batch, fence=self.fence)
        except BaseException as exc:  # latch every kind of failure, then re-raise
            # Latch: a lost, rejected, fenced or interrupted write ends this
            # journal; nothing after it is written or reported as durable.
            self._error = exc
            self._refused = tuple(batch)
            self._pending.clear()
            if isinstance(exc, Exception):
                raise RunAborted(exc) from exc
            raise
        else:
            self.durable_seq = batch[-1].sequence
            held = self._held_reports
            if held is not None:
                self._held_reports = None
                if self.on_event is not None:
                    for event in held:
                        deliver(self.on_event, event, self.warner, "on_event")
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
