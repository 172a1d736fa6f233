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
from fleet.kernel.divergence import JUDGED, DivergenceDetector
from fleet.kernel.errors import (
    ConfigurationError,
    ContinueAsNew,
    ExecutionConflictError,
    ExecutionParked,
    FleetError,
    FlowReplayDivergenceError,
    HandedBack,
    KernelEventForgeryError,
    ReplayError,
    RunAborted,
    RunInterrupt,
    ValidationError,
)
from fleet.kernel.events import EventType
from fleet.kernel.flow_run import RunServices
from fleet.kernel.flows import FlowDefinition
from fleet.kernel.fold import ExecutionState
from fleet.kernel.ids import successor_id
from fleet.kernel.journal import Journal
from fleet.kernel.lease import Lease
from fleet.kernel.observers import Warner
from fleet.kernel.options import DivergenceMode, RuntimeStats
from fleet.kernel.run_endings import RunEndings
from fleet.kernel.run_outcome import RunOutcome, Waiting
from fleet.kernel.typed import from_log, input_adapter, return_adapter, to_log

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


# Why a run's task was cancelled by the kernel (None: from outside, e.g. a crash drill).
StopReason = Literal["cut", "cancelled", "superseded", "deadline"]


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

    @property
    def services(self) -> RunServices | None:
        """Child flows and messages (``fleet.kernel.family``); None: not offered."""


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


class Run(RunEndings):
    """One drive of one execution: the journal, the lease, the body's bookkeeping.

    Args:
        host: The engine driving it (a ``RunHost``).
        definition: The flow version pinned for this drive.
        journal: The run's write chain over the folded state.
        lease: The execution's fence, released when ``execute`` returns; None for a
            dry replay (``replay_check``), which never calls ``execute``.
    """

    host: RunHost

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
        # The tasks of this run unwinding from a park (or another stop), and what from.
        self._unwinding: dict[asyncio.Task[Any], RunInterrupt] = {}
        # Recorded cancel deliveries raised again in this drive (cancel_delivery).
        self.cancel_used: dict[tuple[str, str], int] = {}
        # Whether the body asked to continue as new (its unreceived messages move on).
        self.continuing = False
        # Whether the body re-runs what an earlier drive did (ctx.log is silent then).
        self.replaying = journal.state.sequence > 0
        self._woke_after = journal.state.run_seq
        # The updates replied to, and the messages taken per key, in this drive.
        self.replied: set[str] = set()
        self.received: dict[str, int] = {}

    def issue(self, interrupt: _I) -> _I:
        """Mark ``interrupt`` as raised by the kernel for this run (``Context``, the hand-back).

        Only an issued park, continuation or hand-back is obeyed: flow code that
        raises ``ExecutionParked`` (say on ``__fleet_diverged__``) or
        ``ContinueAsNew`` itself fails its run instead (decision 0023). The task that
        raises it unwinds from then on: a ``Context`` call it makes raises it again.
        """
        self._issued.append(interrupt)
        self.unwind(interrupt)
        if isinstance(interrupt, ContinueAsNew):
            self.continuing = True  # a message now waits for the successor (delivery)
        return interrupt

    @property
    def services(self) -> RunServices:
        services = self.host.services
        if services is None:
            raise ConfigurationError("this runtime offers no child flows or messages to other "
                                     "executions (a dry replay)")
        return services

    def state_body(self) -> Callable[..., Any]:
        """The body of the flow version this drive runs (its annotations type the input)."""
        return self.definition.body

    def saw_answer(self, seq: float) -> None:
        if seq > self._woke_after:
            self.replaying = False

    def unwind(self, interrupt: RunInterrupt) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._unwinding.setdefault(task, interrupt)

    def check_unwinding(self) -> None:
        task = asyncio.current_task()
        if task is not None and self._unwinding:
            stop = self._unwinding.get(task)
            if stop is not None:
                raise stop

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
                                   tasks=self.host.background, on_lost=self._fenced_out)
        deadline = self._arm_deadline()
        async with lease:
            try:
                return await self._run_body()
            finally:
                renewal.stop()
                if deadline is not None:
                    deadline.cancel()
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

    def _arm_deadline(self) -> asyncio.TimerHandle | None:
        """Stop this run where it is when the flow's deadline passes (it then fails)."""
        due = self.state.deadline_at
        if due is None or self.task is None:
            return None
        task = self.task

        def expire() -> None:
            if not task.done() and self.stop is None:
                self.stop = "deadline"
                task.cancel()

        delay = max(0.0, (due - self.clock()) / 1000)
        return asyncio.get_running_loop().call_later(delay, expire)

    def _fenced_out(self) -> None:
        """Another holder took the fence (a cancel, a recovery elsewhere): stop now, where
        the run is (an async step body is cancelled), not at the next refused write."""
        task = self.task
        if task is not None and not task.done() and self.stop is None \
                and not self.journal.ending:
            self.stop = "superseded"
            task.cancel()

    def _alive(self) -> bool:
        return self.journal.failed is None and (self.task is None or not self.task.done())

    async def _run_body(self) -> RunOutcome:
        host, state, journal, stats = self.host, self.state, self.journal, self.host.stats
        try:
            if state.deadline_at is not None and host.clock() > state.deadline_at:
                return await self._end_deadline()
            try:
                output = await self._call_body()
                output = to_log(output, f"the output of flow {state.flow_id!r}",
                                return_adapter(self.definition.body))
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
            except asyncio.CancelledError as exc:
                if self._cancelled_from_outside():
                    raise
                return await self._end_cancelled(exc)
            except (RunAborted, HandedBack):
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
            if self.stop == "deadline":
                return await self._end_deadline()
            if self.stop == "cut":
                # hand_back_now: stopped where it was (a step running is left in
                # doubt for the next holder); the lease is released on the way out.
                stats.handed_back += 1
                return self.outcome("handed_back")
            stats.aborted += 1
            return self.outcome("cancelled" if self.stop == "cancelled" else "fenced_out")

    async def _call_body(self) -> Any:
        """Run the flow body; a park (or other stop) it swallowed stops it all the same.

        A body that catches its park (``except BaseException``) and returns, or raises
        something else, is still parked: the park is what stopped it (decision 0033).
        """
        task = asyncio.current_task()
        try:
            body = self.definition.body
            given = from_log(self.state.input, input_adapter(body),
                             f"the input of flow {self.state.flow_id!r}")
            output = await body(Context(self), given)
        except BaseException as exc:
            stop = self._unwinding.get(task) if task is not None else None
            if stop is None or exc is stop or (isinstance(exc, asyncio.CancelledError)
                                               and self._cancelled_from_outside()):
                raise
            raise stop from None
        stop = self._unwinding.get(task) if task is not None else None
        if stop is not None:
            raise stop
        return output

    def _cancelled_from_outside(self) -> bool:
        """Whether this run's task is being cancelled by the kernel or the host (a stop,
        a hand-back cut, a crash drill), not by a cancellation the flow let out."""
        task = asyncio.current_task()
        return self.stop is not None or task is None or task.cancelling() > 0

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
        self.replaying = False
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
