"""One drive of one execution: ``Run`` holds its journal and lease, and says how it ended.

The engine creates a ``Run`` per drive and awaits ``Run.execute``, which runs
the flow body under the run's lease and returns a ``RunOutcome``. ``Context``
calls the run's hooks (``FlowRun``): it is where the divergence detector
(ADR 0113 D3) judges the body before new work, where a decider's inner steps
are collected (``innerSteps``), and where a runtime that is handing its runs
back (a worker shutting down) stops a run at its next durable point.

A run ends in one of four ways: a terminal event, a park (gate, long timer,
receive, in-doubt, the divergence gate), an abort (fenced out, a write failed:
nothing more is written), or a stop from outside (cancel, resume_as,
hand-back). Each is one ``RunOutcome`` kind.

A refusal that can never succeed ends the run with ``EXECUTION_FAILED`` and
the typed error (decision 0023): a ``ValidationError`` out of the body (a bad
id, a reserved name, a forged kernel field), a value the log cannot take found
after a step's effect (its output is not JSON, not valid Unicode), a write the
store refused for good (over ``max_event_bytes``), and a run-control exception
the body raised itself instead of asking ``ctx`` (only the interrupts the run
issued are obeyed). Re-driving such a run would only run the same
effects into the same refusal; it is counted in ``RuntimeStats.refused`` and
warned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, Literal, Protocol, TypeVar

from fleet.kernel.context import Context
from fleet.kernel.divergence import JUDGED, DivergenceDetector, skipped_key
from fleet.kernel.errors import (
    ConfigurationError,
    ContinueAsNew,
    DuplicateSequenceError,
    ExecutionBusyError,
    ExecutionConflictError,
    ExecutionParked,
    FleetError,
    FlowReplayDivergenceError,
    HandedBack,
    KernelEventForgeryError,
    ReplayError,
    RunAborted,
    RunInterrupt,
    StaleFenceError,
    ValidationError,
)
from fleet.kernel.events import EventType, ensure_json
from fleet.kernel.flows import FlowDefinition
from fleet.kernel.fold import DIVERGED_GATE, ExecutionState
from fleet.kernel.ids import successor_id
from fleet.kernel.journal import Journal
from fleet.kernel.lease import Lease
from fleet.kernel.observers import Warner
from fleet.kernel.options import DivergenceMode, RuntimeStats
from fleet.kernel.run_outcome import OutcomeKind, RunOutcome, Waiting
from fleet.kernel.values import printable

_INNER_MAX_IDS = 4096
_INNER_MAX_BYTES = 64 * 1024
# The events that end a run (and release its lease): a hand-back lets them through.
_ENDS_RUN = frozenset({EventType.EXECUTION_COMPLETED, EventType.EXECUTION_SUSPENDED,
                       EventType.EXECUTION_CONTINUED})
# A replay fault other than a divergence refusal (which parks): the run stops
# where it is, nothing more is written (decision 0003). A ValidationError no
# longer stops a run: it fails it (decision 0023).
ABORTS_RUN = (ReplayError,)
_I = TypeVar("_I", bound=RunInterrupt)


def error_of(exc: BaseException) -> dict[str, Any]:
    """The recorded form of ``exc`` (``EXECUTION_FAILED`` / ``STEP_FAILED``), always storable:
    its message is cut to 4,000 characters and made valid Unicode."""
    if isinstance(exc, FleetError):
        error = exc.to_dict()
        error["message"] = printable(error["message"], 4000)
        return error
    return {"type": type(exc).__name__, "message": printable(str(exc), 4000),
            "retryable": False}

# Why a run's task was cancelled by the kernel (None: from outside, e.g. a crash drill).
StopReason = Literal["cut", "cancelled", "superseded"]


class RunHost(Protocol):
    """What a run needs from the engine that drives it (``fleet.kernel.engine.Engine``)."""

    @property
    def clock(self) -> Callable[[], int]: ...

    @property
    def warner(self) -> Warner: ...

    @property
    def stats(self) -> RuntimeStats: ...

    @property
    def divergence(self) -> DivergenceMode: ...

    @property
    def inline_sleep_max(self) -> float: ...

    @property
    def lease_ms(self) -> int: ...

    @property
    def handing_back(self) -> bool: ...

    @property
    def background(self) -> set[asyncio.Task[Any]]: ...

    async def start_successor(self, run: Run, cont: ContinueAsNew) -> None:
        """Make ``cont``'s successor exist (idempotent) before the run writes CONTINUED."""

    async def load(self, execution_id: str) -> tuple[ExecutionState, EventType | None]:
        """The durable state of ``execution_id`` (snapshot + tail) and its last event's type."""


class _InnerSteps:
    """The step ids a decider runs, recorded on its DECISION_RECORDED (ADR 0113)."""

    __slots__ = ("bytes", "ids", "overflow", "start_seq")

    def __init__(self, start_seq: int) -> None:
        self.start_seq = start_seq
        self.ids: list[str] = []
        self.bytes = 0
        self.overflow = False

    def add(self, step_id: str) -> None:
        size = len(step_id.encode()) + 3
        if self.overflow or len(self.ids) >= _INNER_MAX_IDS or self.bytes + size > _INNER_MAX_BYTES:
            self.overflow = True
            return
        self.ids.append(step_id)
        self.bytes += size

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"innerSteps": list(self.ids)}
        if self.overflow:
            out["innerStepsOverflow"] = True
            out["innerFrom"] = self.start_seq
        return out

    def close(self) -> None:
        _OPEN_DECISIONS.set(tuple(o for o in _OPEN_DECISIONS.get() if o[1] is not self))


# The deciders open in the current task and the tasks it starts, so a step a
# sibling parallel branch runs meanwhile is not counted as a decider's own.
_OPEN_DECISIONS: ContextVar[tuple[tuple[Run, _InnerSteps], ...]] = ContextVar(
    "fleet_open_decisions", default=())


def _forged(interrupt: BaseException) -> KernelEventForgeryError:
    return KernelEventForgeryError(
        f"the flow raised {type(interrupt).__name__} itself: run control belongs to the kernel "
        "(park with ctx.wait, ctx.sleep or ctx.receive; continue with ctx.continue_as_new); "
        "the reserved gates are the runtime's")


class ReplayFrontier(RunInterrupt):
    """A dry replay reached work the log does not hold; it stops before doing it."""

    def __init__(self, kind: EventType, ident: str | None) -> None:
        super().__init__(f"{kind} {ident or ''}".strip())
        self.kind = kind
        self.ident = ident


class Run:
    """One drive of one execution: the journal, the lease, the body's bookkeeping.

    Args:
        host: The engine driving it (a ``RunHost``).
        definition: The flow version pinned for this drive.
        journal: The run's write chain over the folded state.
        lease: The execution's fence, released when ``execute`` returns; None for a
            dry replay (``replay_check``), which never calls ``execute``.
    """

    def __init__(self, host: RunHost, definition: FlowDefinition, journal: Journal,
                 lease: Lease | None = None) -> None:
        self.host = host
        self.definition = definition
        self.journal = journal
        self.state: ExecutionState = journal.state
        self.lease = lease
        self.clock = host.clock
        self.inline_sleep_max = host.inline_sleep_max
        self.asked_steps: set[str] = set()
        self.asked_decisions: set[str] = set()
        self.task: asyncio.Task[RunOutcome] | None = None
        # Built from the fold this drive starts from (ADR 0113 D3).
        self.detector = DivergenceDetector.for_state(journal.state, host.divergence,
                                                     visited=self.asked_steps)
        # A dry replay (replay_check) stops at the first live new work, judged.
        self.stop_at_frontier = False
        # Set by the kernel before it cancels this run's task (hand-back, cancel, resume_as).
        self.stop: StopReason | None = None
        # Whether the re-run is past any refusal of its replay: at once unless the
        # detector refuses (fail mode), else once it accepted judged live work
        # (``past_replay``: recovery counts a refused re-drive as failed, ADR 0113).
        self._accepted = self.detector is None or self.detector.mode != "fail"
        self._past_replay: asyncio.Future[None] | None = None
        # The run-control interrupts the kernel raised for this run (``issue``).
        self._issued: list[RunInterrupt] = []
        # The sequence of the RECOVERED this drive committed (counted once durable).
        self.recovered_at: int | None = None
        # Drive once more if the first write of a deferred lease finds its slot taken.
        self.redrive = False

    def issue(self, interrupt: _I) -> _I:
        """Mark ``interrupt`` as raised by the kernel for this run (``Context``, the hand-back).

        Only an issued park, continuation or hand-back is obeyed: flow code that
        raises ``ExecutionParked`` (say on ``__fleet_diverged__``) or
        ``ContinueAsNew`` itself fails its run instead (decision 0023).
        """
        self._issued.append(interrupt)
        return interrupt

    def _was_issued(self, interrupt: BaseException) -> bool:
        return any(issued is interrupt for issued in self._issued)

    # -- executing ------------------------------------------------------------------
    async def execute(self) -> RunOutcome:
        """Run the body under this run's lease until it stops; how it stopped.

        The lease is released on the way out, unless a write under it failed in
        a way that keeps it (``Lease.write_failed``: fenced out, or interrupted).
        A cancellation from outside the kernel propagates (``CancelledError``).
        """
        lease = self.lease
        if lease is None:
            raise ConfigurationError("a run built without a lease (a dry replay) cannot "
                                     "execute")
        self.host.stats.drives += 1
        renewal = lease.keep_alive(lease_ms=self.host.lease_ms, alive=self._alive,
                                   tasks=self.host.background)
        async with lease:
            try:
                return await self._run_body()
            finally:
                renewal.stop()
                if self.journal.failed is not None:
                    lease.write_failed(self.journal.failed)
                if self.recovered_at is not None \
                        and self.journal.durable_seq >= self.recovered_at:
                    # Counted once the log holds it: a drive that stepped aside wrote none.
                    self.host.stats.recovered += 1

    def past_replay(self) -> asyncio.Future[None]:
        """Resolved once the re-run is past the refusal of its replay (ADR 0113).

        At once when nothing can refuse it (no detector, or one that only warns);
        in ``fail`` mode once its first judged live work (a step, an in-doubt step,
        a park, a continuation, the end) was accepted. A refusal comes before that,
        so a caller waiting on this or on the run's end learns whether the replay
        was refused without waiting for the live work. (A refusal is still possible
        later in two narrow cases: a parallel scope's set compared at its close,
        and frames ranked after a restarted recorded step.)
        """
        if self._past_replay is None:
            self._past_replay = asyncio.get_running_loop().create_future()
            if self._accepted:
                self._past_replay.set_result(None)
        return self._past_replay

    def _accept(self) -> None:
        self._accepted = True
        if self._past_replay is not None and not self._past_replay.done():
            self._past_replay.set_result(None)

    def _alive(self) -> bool:
        return self.journal.failed is None and (self.task is None or not self.task.done())

    async def _run_body(self) -> RunOutcome:
        host, state, journal, stats = self.host, self.state, self.journal, self.host.stats
        try:
            if state.deadline_at is not None and host.clock() > state.deadline_at:
                error = {"type": "DeadlineExceeded", "message": "the flow's deadline passed",
                         "retryable": False}
                journal.commit(EventType.EXECUTION_FAILED, {"error": error})
                await journal.barrier(last=True)
                stats.failed += 1
                return self.outcome("failed", error=error)
            try:
                output = await self.definition.body(Context(self), state.input)
                output = ensure_json(output, f"the output of flow {state.flow_id!r}")
                await self.before_new_work(EventType.EXECUTION_COMPLETED, None)
                journal.commit(EventType.EXECUTION_COMPLETED, {"output": output})
                await journal.barrier(last=True)
                stats.completed += 1
                return self.outcome("completed")
            except ExecutionParked as park:
                if not self._was_issued(park):
                    return await self._fail(_forged(park))
                try:
                    await self.before_new_work(EventType.EXECUTION_SUSPENDED, None)
                except FlowReplayDivergenceError as diverged:
                    return await self._park_diverged(diverged)
                journal.commit(EventType.EXECUTION_SUSPENDED, {"condition": park.condition})
                await journal.barrier(last=True)
                stats.parked += 1
                return self.outcome("parked", waiting=Waiting.from_condition(park.condition))
            except FlowReplayDivergenceError as diverged:
                return await self._park_diverged(diverged)
            except ContinueAsNew as cont:
                if not self._was_issued(cont):
                    return await self._fail(_forged(cont))
                # The successor exists before the CONTINUED that names it: a crash in
                # between re-drives this run, which finds the successor and only
                # writes CONTINUED; a reader following the chain never finds a gap.
                # The successor is started under this run's fence (taken now if it
                # was deferred and nothing was written yet: decision 0032).
                await journal.barrier()
                await journal.hold()
                try:
                    await host.start_successor(self, cont)
                except ExecutionConflictError as exc:
                    return await self._fail(exc, refused=True)
                except FleetError as exc:
                    stats.aborted += 1
                    host.warner.warn(f"run of {state.execution_id!r} stopped: its successor "
                                     f"could not be started: {type(exc).__name__}: {exc}")
                    return self.outcome("aborted", cause=exc)
                journal.commit(EventType.EXECUTION_CONTINUED,
                               {"nextExecutionId": cont.next_execution_id, "input": cont.input})
                await journal.barrier(last=True)
                return self.outcome("continued", next_execution_id=cont.next_execution_id)
            except ValidationError as exc:
                if self.refused is not None:
                    return await self._park_diverged(self.refused)
                # A refusal that can never succeed: the same code would refuse it
                # again on every drive (decision 0023). What the run committed
                # before the faulty call is true and stays.
                return await self._fail(exc)
            except ABORTS_RUN as exc:
                # What the run committed before the faulty call is true and
                # stays; the faulty call itself wrote nothing.
                await journal.barrier()
                stats.aborted += 1
                host.warner.warn(f"run of {state.execution_id!r} stopped, nothing written: "
                                 f"{type(exc).__name__}: {exc}")
                return self.outcome("aborted", cause=exc)
            except (RunAborted, HandedBack, asyncio.CancelledError):
                raise
            except RunInterrupt as exc:
                # Run control the kernel never raises in a live run (ReplayFrontier):
                # the body raised it itself.
                return await self._fail(_forged(exc))
            except Exception as exc:  # noqa: BLE001 - the flow's own failure
                if self.refused is not None:
                    # The body caught the refusal and failed instead: the refusal
                    # stands (it latches, and never fails the execution: note 2).
                    return await self._park_diverged(self.refused)
                return await self._fail(exc)
        except RunAborted as aborted:
            failed = self.journal.failed
            if failed is None or aborted.cause is not failed:
                return await self._fail(_forged(aborted))
            if isinstance(failed, ValidationError):
                # The log refused a write for good (or the kernel found a value it
                # cannot take after an effect): fail on what is durable.
                return await self._fail_on_durable(failed)
            return self._lost_write(aborted.cause)
        except HandedBack as back:
            if not self._was_issued(back):
                return await self._fail(_forged(back))
            # Stopped before new work: write what it committed, then let go.
            try:
                await journal.barrier()
            except RunAborted as aborted:
                return self._lost_write(aborted.cause)
            stats.handed_back += 1
            return self.outcome("handed_back")
        except asyncio.CancelledError:
            await journal.close()
            task = asyncio.current_task()
            if self.stop is None or task is None:
                stats.aborted += 1
                raise  # cancelled from outside the kernel: not an outcome
            task.uncancel()
            if self.stop == "cut":
                # hand_back_now: stopped where it was (a step running is left in
                # doubt for the next holder); the lease is released on the way out.
                stats.handed_back += 1
                return self.outcome("handed_back")
            stats.aborted += 1
            return self.outcome("cancelled" if self.stop == "cancelled" else "fenced_out")

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

    # -- the divergence detector's hooks ------------------------------------------
    async def before_new_work(self, kind: EventType, ident: str | None,
                              scope: str | None = None) -> None:
        """Judge the body before it appends new work; raises in ``fail`` mode.

        A runtime that is handing its runs back stops the run here, before the
        new work: everything it committed so far is a durable point. (Not before
        the event that ends the run: that one lets go as well.)
        """
        if self.host.handing_back and kind not in _ENDS_RUN:
            raise self.issue(HandedBack(f"{kind} {ident or ''}".strip()))
        d = self.detector
        if d is None:
            if self.stop_at_frontier:
                raise ReplayFrontier(kind, ident)
            return
        if d.latched is not None:
            # The failure latches: a body that swallowed the refusal is refused again.
            raise d.refusal(d.latched.skipped)
        if d.reported:
            return  # warn mode reports once, then stops judging
        if d.awaits_siblings(kind, ident, scope):  # before any new effect (issue 25 item 14)
            await d.let_siblings_replay(scope or "")
            if d.latched is not None:
                raise d.refusal(d.latched.skipped)
        skipped = d.judge(kind, ident, scope)
        if skipped:
            self._diverged(skipped)
        if self.stop_at_frontier:
            raise ReplayFrontier(kind, ident)
        if not self._accepted and kind in JUDGED:
            self._accept()

    @property
    def refused(self) -> FlowReplayDivergenceError | None:
        """The refusal this drive latched (fail mode), or None."""
        return self.detector.latched if self.detector is not None else None

    def _diverged(self, skipped: list[str]) -> None:
        d = self.detector
        assert d is not None
        error = d.refusal(skipped)
        if d.mode == "fail":
            d.latched = error
            raise error
        d.reported = True
        self.host.stats.divergence_warnings += 1
        self.host.warner.warn(f"execution {self.state.execution_id!r}: {error} "
                              "(divergence='warn': proceeding)")

    def serve_decision(self, decision_id: str, recorded: dict[str, Any]) -> None:
        if self.detector is not None:
            self.detector.serve_decision(decision_id, recorded)

    def open_scope(self, scope: str, branches: Sequence[Any]) -> None:
        if self.detector is not None:
            start = self.state.scopes.get(scope, {}).get("startSeq")
            self.detector.open_scope(scope, start, branches)

    async def close_scope(self, scope: str) -> None:
        d = self.detector
        if d is None:
            return
        skipped = d.close_scope(scope)
        if skipped and d.latched is None and not d.reported:
            self._diverged(skipped)

    def note_step(self, step_id: str, scope: str | None = None) -> None:
        # The detector reads asked_steps itself; a scope needs bookkeeping.
        if self.detector is not None and scope is not None:
            self.detector.visit(step_id, scope)
        for run, inner in _OPEN_DECISIONS.get():
            if run is self:
                inner.add(step_id)

    def open_decision(self, decision_id: str) -> _InnerSteps:
        inner = _InnerSteps(self.state.sequence + 1)
        _OPEN_DECISIONS.set((*_OPEN_DECISIONS.get(), (self, inner)))
        return inner

    def successor_id(self) -> str:
        return successor_id(self.state.execution_id)
