"""How a run ends when it does not simply complete: ``RunEndings``, a part of ``Run``.

A failure written (``EXECUTION_FAILED``, with the typed error), on the durable
state when the log refused a write for good (decision 0023); a divergence refusal
parked on the reserved gate (ADR 0113); a cancellation the flow let out
(``EXECUTION_CANCELLED``, decision 0033); a write lost (fenced out, stepped aside:
decision 0032). Each returns the run's ``RunOutcome``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from fleet.kernel.divergence import skipped_key
from fleet.kernel.errors import (
    DuplicateSequenceError,
    ExecutionBusyError,
    FleetError,
    FlowReplayDivergenceError,
    RunAborted,
    StaleFenceError,
    ValidationError,
)
from fleet.kernel.events import EventType
from fleet.kernel.fold import DIVERGED_GATE, ExecutionState
from fleet.kernel.journal import Journal
from fleet.kernel.lease import Lease
from fleet.kernel.observers import Warner
from fleet.kernel.options import RuntimeStats
from fleet.kernel.run_outcome import OutcomeKind, RunOutcome, Waiting
from fleet.kernel.values import printable


def error_of(exc: BaseException) -> dict[str, Any]:
    """The recorded form of ``exc`` (``EXECUTION_FAILED`` / ``STEP_FAILED``), always storable:
    its message is cut to 4,000 characters and made valid Unicode."""
    if isinstance(exc, FleetError):
        error = exc.to_dict()
        error["message"] = printable(error["message"], 4000)
        return error
    return {"type": type(exc).__name__, "message": printable(str(exc), 4000),
            "retryable": False}


DEADLINE_ERROR: dict[str, Any] = {"type": "DeadlineExceeded",
                                  "message": "the flow's deadline passed", "retryable": False}


def deadline_bodies(state: ExecutionState) -> list[tuple[EventType, dict[str, Any]]]:
    """What a deadline writes: the steps in flight cancelled, then the failure."""
    bodies: list[tuple[EventType, dict[str, Any]]] = [
        (EventType.STEP_CANCELLED, {"stepId": step_id, "reason": "deadline"})
        for step_id, frame in state.frames.items()
        if frame.status in ("started", "retrying", "indoubt")]
    bodies.append((EventType.EXECUTION_FAILED, {"error": dict(DEADLINE_ERROR)}))
    return bodies


class EndingHost(Protocol):
    """What the endings use of the engine that drives the run."""

    @property
    def warner(self) -> Warner: ...

    @property
    def stats(self) -> RuntimeStats: ...

    async def load(self, execution_id: str) -> tuple[ExecutionState, EventType | None]: ...


class RunEndings:
    """The ways a ``Run`` ends besides completing (see the module)."""

    host: EndingHost
    journal: Journal
    state: ExecutionState
    lease: Lease | None

    async def _end_cancelled(self, exc: asyncio.CancelledError) -> RunOutcome:
        """The body let ``asyncio.CancelledError`` out: it ends ``cancelled`` when a
        cancellation was requested (decision 0033); a flow that cancels itself with no
        request fails, naming that."""
        cancel = self.state.cancel
        if cancel is None:
            return await self._fail(exc, {
                "type": "CancelledError", "retryable": False,
                "message": "the flow raised asyncio.CancelledError but no cancellation was "
                           "requested (runtime.cancel); a flow ends itself by returning or "
                           "raising another exception"})
        self.journal.commit(EventType.EXECUTION_CANCELLED,
                            {"reason": str(cancel.get("reason") or "")})
        try:
            await self.journal.barrier(last=True)
        except RunAborted as aborted:
            return self._lost_write(aborted.cause)
        self.host.stats.cancelled += 1
        return self.outcome("cancelled")

    def outcome(self, kind: OutcomeKind, *, waiting: Waiting | None = None,
                cause: BaseException | None = None, error: dict[str, Any] | None = None,
                next_execution_id: str | None = None) -> RunOutcome:
        """This run's outcome of ``kind``, with the last sequence it made durable."""
        return RunOutcome(kind, self.state.execution_id, self.journal.durable_seq,
                          self.state.status, waiting=waiting, cause=cause, error=error,
                          next_execution_id=next_execution_id)

    def _lost_write(self, cause: BaseException) -> RunOutcome:
        """A write failed with ``cause``: how the run stopped (counted)."""
        if self.stepped_aside(cause):
            # Not a run of the execution: its holder drives it (decision 0032).
            self.host.stats.drives -= 1
            return self.outcome("stepped_aside", cause=cause)
        self.host.stats.aborted += 1
        kind: OutcomeKind = "fenced_out" if isinstance(cause, StaleFenceError) else "aborted"
        return self.outcome(kind, cause=cause)

    def stepped_aside(self, cause: BaseException) -> bool:
        """Whether the write that failed with ``cause`` was the first of a deferred lease,
        refused before anything was written: a live lease is held elsewhere
        (``ExecutionBusyError``), or another writer took the slot after this drive read
        the log (``DuplicateSequenceError``). Decision 0032."""
        lease = self.lease
        return lease is not None and lease.grant is None and isinstance(
            cause, (ExecutionBusyError, DuplicateSequenceError))

    async def _fail(self, cause: BaseException, error: dict[str, Any] | None = None, *,
                    rebased: bool = False, refused: bool | None = None) -> RunOutcome:
        """Write ``EXECUTION_FAILED`` with ``cause`` (or ``error``); how the run ended.

        A ``ValidationError`` cause (or ``refused=True``) is a refusal that can
        never succeed: counted in ``refused`` and warned. If the write itself is
        refused for good (an event committed before it cannot be stored), the
        failure is written alone on the durable state instead.
        """
        stats = self.host.stats
        error = error if error is not None else error_of(cause)
        try:
            self.journal.commit(EventType.EXECUTION_FAILED, {"error": error})
            await self.journal.barrier(last=True)
        except RunAborted as aborted:
            failed = self.journal.failed
            if not rebased and isinstance(failed, ValidationError) and aborted.cause is failed:
                return await self._fail_on_durable(failed)
            return self._lost_write(aborted.cause)
        stats.failed += 1
        if refused or (refused is None and isinstance(cause, ValidationError)):
            stats.refused += 1
            self.host.warner.warn(
                f"execution {self.state.execution_id!r} FAILED: {error['type']}: "
                f"{error['message']} (a refusal that can never succeed ends the run; "
                "decision 0023)", key=f"refused:{self.state.execution_id}")
        return self.outcome("failed", error=error, cause=cause)

    async def _fail_on_durable(self, cause: ValidationError) -> RunOutcome:
        """The log refused a write for good: fail the execution on its durable state.

        The refused events (and what the run committed after them) are dropped;
        a step whose result they held stays started in the log, its effect done
        once, and the execution fails naming it. Re-read from the store, so the
        failure lands right after what the log holds.
        """
        refused = self.journal.refused
        eid = self.state.execution_id
        if self.journal.durable_seq < 0:
            # The refused write carried the start (decision 0029): there is no log to
            # fail; the caller of start hears the refusal.
            self.host.stats.aborted += 1
            return self.outcome("aborted", cause=cause)
        try:
            state, _ = await self.host.load(eid)
        except Exception as exc:  # noqa: BLE001 - the refusal stands; the run stops
            self.host.stats.aborted += 1
            self.host.warner.warn(f"run of {eid!r} stopped after a refused write "
                                  f"({cause.message}); re-reading the log failed: "
                                  f"{type(exc).__name__}: {exc}")
            return self.outcome("aborted", cause=cause)
        if state.terminal or state.sequence != self.journal.durable_seq:
            self.host.stats.aborted += 1
            return self.outcome("aborted", cause=cause)
        self.journal.rebase(state)
        self.state = state
        error = error_of(cause)
        steps = [str(e.payload.get("stepId")) for e in refused
                 if e.type in (EventType.STEP_COMPLETED, EventType.STEP_FAILED)]
        if steps:
            error["message"] = printable(
                f"the result of step {steps[0]!r} could not be recorded (its effect ran): "
                f"{error['message']}", 4000)
        return await self._fail(cause, error, rebased=True)

    async def _end_deadline(self) -> RunOutcome:
        """The flow's deadline passed (at the drive's start, or while it ran): the steps
        in flight are recorded cancelled and the execution fails with
        ``DeadlineExceeded`` (``fleet.kernel.deadlines``)."""
        for type_, body in deadline_bodies(self.state):
            self.journal.commit(type_, body)
        try:
            await self.journal.barrier(last=True)
        except RunAborted as aborted:
            return self._lost_write(aborted.cause)
        self.host.stats.failed += 1
        return self.outcome("failed", error=dict(DEADLINE_ERROR))

    async def _park_diverged(self, error: FlowReplayDivergenceError) -> RunOutcome:
        """Park a refused re-run on the reserved gate; nothing else is appended.

        The execution is left as a crash would leave it, but parked, so neither
        recovery nor timers re-drive it; ``retry_diverged`` resumes it once the
        code is fixed, pinned, listed in ``compatible_with`` or migrated.
        """
        eid = self.state.execution_id
        condition = {"on": DIVERGED_GATE, "kind": "diverged",
                     "correlationKey": skipped_key(error.skipped)}
        lost: BaseException | None = None
        try:
            self.journal.commit(EventType.EXECUTION_SUSPENDED, {"condition": condition})
            await self.journal.barrier(last=True)
            error.parked = True
        except RunAborted as aborted:
            lost = aborted.cause
            if self.stepped_aside(lost):
                return self._lost_write(lost)  # another holder drives it: not refused here
        self.host.stats.divergence_parked += 1
        if error.parked:
            self.host.warner.warn(f"execution {eid!r} PARKED on {DIVERGED_GATE}: {error}")
            return self.outcome("diverged_parked", waiting=Waiting.from_condition(condition),
                                cause=error)
        assert lost is not None
        self.host.warner.warn(f"execution {eid!r} REFUSED and NOT parked "
                              f"({type(lost).__name__}: {lost}): {error}")
        kind: OutcomeKind = "fenced_out" if isinstance(lost, StaleFenceError) else "aborted"
        return self.outcome(kind, cause=error)


__all__ = ["DEADLINE_ERROR", "EndingHost", "RunEndings", "deadline_bodies", "error_of"]
