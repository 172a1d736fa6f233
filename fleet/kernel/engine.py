"""The engine behind ``Runtime``: reads, leases, the runs in flight, the writes that wake them.

``Runtime`` is the public face; the engine is the narrow internal API its parts
share, with public names: ``fleet.kernel.migration`` (``resume_as``),
``fleet.kernel.outcomes`` (``record_outcome``), ``fleet.kernel.timers`` and
``fleet.kernel.recovery`` take an ``Engine``, never a ``Runtime``. A ``Run`` sees
it as its ``RunHost``.

Ownership of a lease: a method that takes a ``Lease`` releases it on every
exit (``async with``) unless it passes it on to a run it launched; releasing
twice is a no-op, so a caller may hold the same lease in its own ``async with``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from fleet.kernel.access import AccessGuard
from fleet.kernel.errors import (
    AccessDeniedError,
    ContinueAsNew,
    DuplicateSequenceError,
    ExecutionBusyError,
    ExecutionConflictError,
    ExecutionNotFoundError,
    RunAborted,
)
from fleet.kernel.events import EventEnvelope, EventType, wall_clock_ms
from fleet.kernel.flows import FlowDefinition, FlowRegistry
from fleet.kernel.fold import ExecutionState, apply, fold_log
from fleet.kernel.handback import HandBack
from fleet.kernel.journal import Journal
from fleet.kernel.lease import Lease
from fleet.kernel.observers import Observers, Warner
from fleet.kernel.options import DivergenceMode, RuntimeOptions, RuntimeStats
from fleet.kernel.results import Results
from fleet.kernel.run import Run, StopReason
from fleet.kernel.run_outcome import RunOutcome, Waiting
from fleet.kernel.security import Principal
from fleet.kernel.store.spi import EventStore, FenceGrant, SnapshotStore
from fleet.kernel.values import datetime_from_ms
from fleet.kernel.writes import LogWriter, make_events

# A log that ends on one of these has not been driven since it was (re)opened;
# any other last event means a holder stopped mid-run and a drive is a recovery.
WAKE_EVENTS = frozenset({EventType.EXECUTION_STARTED, EventType.EXECUTION_RESUMED,
                         EventType.TIMER_FIRED, EventType.RECOVERED,
                         EventType.EXECUTION_MIGRATED})
# The outcomes whose cause a result() waiter gets (the run stopped without an end).
_FAILS_WAITERS = frozenset({"aborted", "fenced_out", "diverged_parked"})

RunFuture = asyncio.Future[RunOutcome]


class Engine:
    """One runtime's working parts (see the module).

    Args:
        store: The event store.
        flows: The registered flow versions.
        snapshots: Checkpoints of compacted logs, if any.
        options: The runtime's options.
        divergence: The divergence mode in force (``options.divergence`` resolved).
        holder: This runtime's name on the fences it takes.
        warner: ``on_warn``, rate-limited.
    """

    def __init__(self, store: EventStore, *, flows: FlowRegistry,
                 snapshots: SnapshotStore | None, options: RuntimeOptions,
                 divergence: DivergenceMode, holder: str, warner: Warner) -> None:
        self.store = store
        self.flows = flows
        self.snapshots = snapshots
        self.options = options
        self.divergence: DivergenceMode = divergence
        self.holder = holder
        self.warner = warner
        self.clock: Callable[[], int] = options.clock or wall_clock_ms
        self.stats = RuntimeStats()
        self.observers = Observers(warner, on_event=options.on_event,
                                   on_durable_event=options.on_durable_event)
        self.writer = LogWriter(store, self.observers)
        self.access = AccessGuard(options.access_policy, strict=options.strict,
                                  writer=self.writer, stats=self.stats, warner=warner,
                                  clock=self.clock,
                                  on_execution_denied=options.on_execution_denied)
        self.runs: dict[str, Run] = {}
        self.background: set[asyncio.Task[Any]] = set()
        self.results = Results(self.runs, self.fold)
        self.hand_back = HandBack()
        # Called with the state of a run that parked (the local timers arm here).
        self.on_parked: Callable[[ExecutionState], None] | None = None
        # Called with the state of a run that ended here (a queue's pass: decision 0056).
        self.on_ended: Callable[[ExecutionState], None] | None = None

    # -- what a run reads from its host (RunHost) ------------------------------------
    @property
    def lease_ms(self) -> int:
        return self.options.lease_ms

    @property
    def inline_sleep_max(self) -> float:
        return self.options.inline_sleep_max

    @property
    def handing_back(self) -> bool:
        return self.hand_back.active

    # -- reading ---------------------------------------------------------------------
    async def load(self, execution_id: str) -> tuple[ExecutionState, EventType | None]:
        """Snapshot + tail, and the type of the last event read (None: none read)."""
        base: ExecutionState | None = None
        after = -1
        if self.snapshots is not None:
            snap = await self.snapshots.load(execution_id)
            if snap is not None:
                base = ExecutionState.from_dict(snap.state)
                after = snap.sequence
        events = await self.store.read(execution_id, after=after)
        state = fold_log(events, base) if base is not None else fold_log(events)
        if not state.execution_id:
            state.execution_id = execution_id
        return state, (events[-1].type if events else None)

    async def fold(self, execution_id: str) -> ExecutionState:
        """The folded state of ``execution_id`` (``sequence < 0``: no such execution)."""
        return (await self.load(execution_id))[0]

    # -- leases ----------------------------------------------------------------------
    async def take(self, execution_id: str) -> Lease:
        """The fence of ``execution_id``, superseding whoever holds it."""
        return await Lease.take(self.store, execution_id, holder=self.holder,
                                lease_ms=self.lease_ms, warner=self.warner)

    def deferred(self, execution_id: str) -> Lease:
        """A lease the first write of ``execution_id`` takes (decision 0029)."""
        return Lease.deferred(self.store, execution_id, holder=self.holder,
                              lease_ms=self.lease_ms, warner=self.warner)

    async def take_if_free(self, execution_id: str) -> Lease | None:
        """The fence of ``execution_id`` if no live lease holds it; None otherwise."""
        return await Lease.take_if_free(self.store, execution_id, holder=self.holder,
                                        lease_ms=self.lease_ms, warner=self.warner)

    async def lease_for_start(self, execution_id: str) -> Lease | None:
        """The lease to write a new log under; ``None`` once another start has written it.

        A live lease over an empty log is a start in flight, or one whose write
        and release were both lost (a store outage) and that its caller is now
        retrying: answering for it could name an execution that never comes to
        exist. So wait for the log, or for the lease to lapse and take it.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lease_ms / 1000 + 1.0
        delay = 0.01
        while True:
            lease = await self.take_if_free(execution_id)
            if lease is not None:
                return lease
            if await self.store.head(execution_id) is not None:
                return None
            if loop.time() > deadline:
                raise ExecutionBusyError(f"a start of {execution_id!r} holds its fence and "
                                         "has written nothing yet; retry")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)

    async def why_running(self, state: ExecutionState) -> str:
        """Who drives a running execution right now, for an error that must be true."""
        if state.parked or state.terminal:
            return ""
        run = self.runs.get(state.execution_id)
        if run is not None and run.task is not None and not run.task.done():
            return " (its run is in flight in this runtime and has not parked yet)"
        summary = await self.store.get_execution(state.execution_id)
        if summary is not None and summary.lease_expires_at is not None \
                and summary.lease_expires_at > self.clock():
            return (f" (held by {summary.holder!r} until "
                    f"{datetime_from_ms(summary.lease_expires_at).isoformat()})")
        return " (nobody holds it: a worker or the recovery sweeper will drive it)"

    def lease(self, grant: FenceGrant) -> Lease:
        """A lease over a fence the caller already took (the fleet's worker does)."""
        return Lease(self.store, grant, warner=self.warner)

    # -- runs ------------------------------------------------------------------------
    def journal(self, state: ExecutionState, lease: Lease) -> Journal:
        return Journal(self.store, state, fence=None if lease.grant is None else lease.token,
                       clock=self.clock, warner=self.warner, on_event=self.observers.on_event,
                       on_durable_event=self.observers.on_durable_event, lease=lease)

    async def prepare(self, execution_id: str, lease: Lease) -> Run | RunOutcome:
        """Fold the log under ``lease``: a Run to launch (it takes the lease), or the
        ``nothing_to_do`` outcome of an execution already parked or finished."""
        async with lease:
            state, last_type = await self.load(execution_id)
            if state.sequence < 0:
                raise ExecutionNotFoundError(f"no execution {execution_id!r}")
            if state.terminal or state.parked:
                self.results.settle(state)
                return RunOutcome("nothing_to_do", execution_id, state.sequence, state.status,
                                  waiting=Waiting.from_condition(state.waiting))
            # The structural hash picks the version, then its fingerprint is
            # compared (ADR 0113 D2); a refusal writes nothing.
            definition, allowed = self.flows.pinned(
                execution_id, state.flow_id, state.flow_hash, state.flow_version,
                state.code_hash, allow_code_mismatch=self.options.allow_flow_code_mismatch)
            if allowed is not None:
                self.warner.warn(f"{allowed.message} (driven anyway: allow_flow_code_mismatch)",
                                 key=f"code-mismatch:{execution_id}")
            run_lease = lease.pass_on()
            journal = self.journal(state, run_lease)
            run = Run(self, definition, journal, run_lease)
            if last_type not in WAKE_EVENTS:
                # The log ends mid-run: an earlier holder stopped (died, was fenced out).
                # Counted in stats.recovered once durable (Run.execute).
                run.recovered_at = journal.commit(
                    EventType.RECOVERED, {"by": self.holder, "reason": "drive"}).sequence
            return run

    def launch(self, run: Run) -> asyncio.Task[RunOutcome]:
        """Run ``run`` in the background; the task's result is its outcome."""
        execution_id = run.state.execution_id
        task = asyncio.get_running_loop().create_task(self._drive(run),
                                                      name=f"fleet-run:{execution_id}")
        run.task = task
        self.runs[execution_id] = run
        self.results.forget_abort(execution_id)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def drive(self, execution_id: str, lease: Lease) -> RunFuture:
        """Drive ``execution_id`` under ``lease``: the future of the run's outcome."""
        prepared = await self.prepare(execution_id, lease)
        if isinstance(prepared, Run):
            return self.launch(prepared)
        return _done(prepared)

    async def drive_deferred(self, execution_id: str) -> RunFuture:
        """Drive ``execution_id`` if no live lease holds it, in one read and the run's
        writes: the log is folded without a fence and the run's first write takes it
        (``append_acquiring``, decision 0032). The outcome is ``stepped_aside`` (nothing
        written, no step run) when that write finds a live lease, or when another writer
        took its slot after the read and a second drive (once, never more) met either.
        A run of it in flight here steps aside at once, with no read."""
        prepared = await self._prepare_deferred(execution_id)
        if not isinstance(prepared, Run):
            return _done(prepared)
        prepared.redrive = True
        return self.launch(prepared)

    async def _prepare_deferred(self, execution_id: str) -> Run | RunOutcome:
        """``prepare`` under a deferred lease; ``stepped_aside`` at once, with no read,
        when a run of it is in flight here."""
        here = self.runs.get(execution_id)
        if here is not None and here.task is not None and not here.task.done():
            return RunOutcome("stepped_aside", execution_id, here.journal.durable_seq,
                              here.state.status)
        return await self.prepare(execution_id, self.deferred(execution_id))

    async def _drive_again(self, execution_id: str) -> RunOutcome:
        """The second (and last) deferred drive of a run whose first write found its slot
        taken: whoever wrote there may not drive it (a message ``send`` wrote to a
        running execution, the denial audit), so this one reads the log again."""
        prepared = await self._prepare_deferred(execution_id)
        if not isinstance(prepared, Run):
            return prepared
        task = asyncio.current_task()
        assert task is not None  # called from the run's own task (_drive)
        prepared.task = task
        self.runs[execution_id] = prepared
        self.results.forget_abort(execution_id)
        return await self._drive(prepared)

    async def drive_if_free(self, execution_id: str) -> RunFuture | None:
        """Drive only when no live lease is held; None when someone else holds it."""
        lease = await self.take_if_free(execution_id)
        if lease is None:
            return None
        return await self.drive(execution_id, lease)

    async def _drive(self, run: Run) -> RunOutcome:
        execution_id = run.state.execution_id
        try:
            outcome = await run.execute()
        finally:
            if self.runs.get(execution_id) is run:
                del self.runs[execution_id]
        if run.redrive and outcome.kind == "stepped_aside" \
                and isinstance(outcome.cause, DuplicateSequenceError):
            return await self._drive_again(execution_id)
        if outcome.last_sequence < 0:
            pass  # a start whose first write failed: its caller hears why (begin)
        elif outcome.kind in _FAILS_WAITERS and outcome.cause is not None:
            self.results.fail(execution_id, outcome.cause)
        elif outcome.ended:
            # Only an end the log holds wakes result() waiters: the live state
            # of a run whose last write failed may claim an end that never was.
            self.results.settle(run.state)
        elif outcome.kind == "parked" and self.on_parked is not None:
            self.on_parked(run.state)
        if self.on_ended is not None and run.state.terminal and outcome.last_sequence >= 0:
            self.on_ended(run.state)
        return outcome

    async def stop_local(self, execution_id: str, reason: StopReason) -> None:
        """Stop the run of ``execution_id`` in flight here (if any) and wait for it."""
        run = self.runs.get(execution_id)
        if run is not None and run.task is not None and not run.task.done():
            run.stop = reason
            run.task.cancel()
            await asyncio.wait({run.task})

    # -- writes that start or wake an execution ------------------------------------------
    async def begin(self, execution_id: str, definition: FlowDefinition, lease: Lease,
                    payload: dict[str, Any], *, drive: bool = True) -> RunFuture | None:
        """Write ``EXECUTION_STARTED`` under ``lease``, then drive it here (``drive``).

        None when no run was launched here: ``drive=False``, or another start
        wrote the log first (the start is idempotent by id).
        """
        started = EventEnvelope.make(execution_id, 0, EventType.EXECUTION_STARTED,
                                     self.clock(), payload)
        if drive and lease.grant is None:
            return await self._begin_carried(started, definition, lease)
        async with lease:
            try:
                # Written alone and not driven here: the write ends the lease too.
                await self.writer.write(lease, [started], last=not drive)
            except DuplicateSequenceError:
                return None  # a concurrent start wrote it
            if not drive:
                return None
            state = ExecutionState(execution_id=execution_id)
            apply(state, started)  # in place: fold_log would copy the state first
            run_lease = lease.pass_on()
            return self.launch(Run(self, definition, self.journal(state, run_lease),
                                   run_lease))

    async def _begin_carried(self, started: EventEnvelope, definition: FlowDefinition,
                             lease: Lease) -> RunFuture | None:
        """Launch the run with ``started`` queued in its journal, so the run's first write
        takes the fence and carries the start with the first step's ``STEP_STARTED``
        (decision 0029); return once the start is durable.

        None when the log exists (an idempotent start); ``ExecutionBusyError`` when a
        live lease holds the fence (nothing was written: the caller waits for it).
        """
        state = ExecutionState(execution_id=started.execution_id)
        apply(state, started)
        run_lease = lease.pass_on()
        journal = self.journal(state, run_lease)
        journal.carry_start(started)
        task = self.launch(Run(self, definition, journal, run_lease))
        # One loop turn: the run reaches its first write (a step's STEP_STARTED, a
        # park, its end) and that write carries the start; else the barrier below
        # writes the start alone.
        await asyncio.sleep(0)
        try:
            await journal.barrier(upto=started.sequence)
        except RunAborted as aborted:
            await asyncio.wait({task})
            if isinstance(aborted.cause, DuplicateSequenceError):
                return None  # a concurrent start wrote it
            raise aborted.cause from None
        return task

    async def existing(self, execution_id: str, flow_id: str,
                       principal: Principal | None) -> None:
        """A start found ``execution_id`` taken: fine only for a reader, of the same flow.

        Anyone else gets ``ExecutionConflictError`` (decision 0024): an idempotent
        start must never hand back another tenant's execution, nor one of
        another flow. The refused read is counted and reported as a denial.
        """
        state = await self.fold(execution_id)
        if state.sequence < 0:
            raise ExecutionBusyError(f"execution {execution_id!r} was deleted while this start "
                                     "looked at it; retry")
        try:
            await self.access.check(state, "read", principal, audit=False)
        except AccessDeniedError as exc:
            raise ExecutionConflictError(
                f"execution id {execution_id!r} is taken by another execution; choose another "
                "id (nothing was written)") from exc
        if state.flow_id != flow_id:
            raise ExecutionConflictError(
                f"execution {execution_id!r} exists for flow {state.flow_id!r}, not "
                f"{flow_id!r}; choose another id (nothing was written)")

    async def _check_successor(self, run: Run, next_id: str) -> None:
        state = await self.fold(next_id)
        if state.sequence < 0:
            raise ExecutionBusyError(f"the successor {next_id!r} is being started elsewhere; "
                                     "retry")
        if state.continued_from != run.state.execution_id \
                or state.flow_id != run.definition.flow_id:
            raise ExecutionConflictError(
                f"the successor id {next_id!r} is taken by an execution that was not continued "
                f"from {run.state.execution_id!r}; the run cannot continue into it")

    async def start_successor(self, run: Run, cont: ContinueAsNew) -> None:
        """Start ``cont``'s successor (same flow, owner), unless it exists already.

        An existing successor must be this run's own (a re-drive after a crash
        between the two writes): one continued from elsewhere is a squat, refused
        with ``ExecutionConflictError`` (decision 0024).
        """
        definition = self.flows.latest(run.definition.flow_id) or run.definition
        lease = await self.take_if_free(cont.next_execution_id)
        if lease is None:
            await self._check_successor(run, cont.next_execution_id)
            return
        async with lease:
            if await self.store.head(cont.next_execution_id) is not None:
                await self._check_successor(run, cont.next_execution_id)
                return
            payload: dict[str, Any] = {
                "flowId": definition.flow_id, "flowVersion": definition.version,
                "flowHash": definition.content_hash(self.options.features),
                "input": cont.input, "owner": run.state.owner,
                "continuedFrom": run.state.execution_id}
            if definition.code_fingerprint:
                payload["codeHash"] = definition.code_fingerprint
            await self.begin(cont.next_execution_id, definition, lease, payload)

    async def answer(self, state: ExecutionState, lease: Lease,
                     bodies: Sequence[tuple[EventType, dict[str, Any]]], *,
                     drive: bool = True) -> RunFuture | None:
        """Append what wakes a parked execution (resume, message, timer), then drive it.

        With ``drive=False`` the answer is made durable and the lease released
        (the caller enqueues the drive); None is returned then.
        """
        execution_id = state.execution_id
        async with lease:
            if drive or self.flows.versions(state.flow_id or ""):
                # Judge the code before the answer is written: a refused drive must
                # leave the log exactly as it was (ADR 0113 D2), not hold an answer
                # nobody can consume.
                self.flows.pinned(execution_id, state.flow_id, state.flow_hash,
                                  state.flow_version, state.code_hash,
                                  allow_code_mismatch=self.options.allow_flow_code_mismatch)
            events = make_events(execution_id, state.sequence, self.clock(), bodies)
            await self.writer.write(lease, events, last=not drive)
            if not drive:
                return None
            return await self.drive(execution_id, lease)

    async def close(self) -> None:
        """Wait for the runs and background work of this engine."""
        tasks = [t for t in self.background if not t.done()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _done(outcome: RunOutcome) -> RunFuture:
    """A future that already holds ``outcome`` (no run was launched)."""
    done: RunFuture = asyncio.get_running_loop().create_future()
    done.set_result(outcome)
    return done


__all__ = ["WAKE_EVENTS", "Engine", "RunFuture"]
