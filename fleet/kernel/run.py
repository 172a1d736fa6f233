"""One drive of one execution: ``Run`` holds its journal and the body's bookkeeping.

The runtime creates a ``Run`` per drive; ``Context`` calls its hooks. It is
where the divergence detector (ADR 0113 D3) judges the body before new work,
where a decider's inner steps are collected (``innerSteps``), and where a
runtime that is handing its runs back (a worker shutting down) stops a run at
its next durable point.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from fleet.kernel.divergence import DivergenceDetector
from fleet.kernel.errors import FlowReplayDivergenceError, HandedBack, RunInterrupt
from fleet.kernel.events import EventType
from fleet.kernel.flows import FlowDefinition
from fleet.kernel.fold import ExecutionState
from fleet.kernel.journal import Journal
from fleet.kernel.store.spi import FenceGrant

if TYPE_CHECKING:
    from fleet.kernel.runtime import Runtime

_INNER_MAX_IDS = 4096
_INNER_MAX_BYTES = 64 * 1024
# The events that end a run (and release its lease): a hand-back lets them through.
_ENDS_RUN = frozenset({EventType.EXECUTION_COMPLETED, EventType.EXECUTION_SUSPENDED,
                       EventType.EXECUTION_CONTINUED})


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


# The deciders open in the current task and the tasks it starts, so a step a
# sibling parallel branch runs meanwhile is not counted as a decider's own.
_OPEN_DECISIONS: ContextVar[tuple[tuple[Run, _InnerSteps], ...]] = ContextVar(
    "fleet_open_decisions", default=())


class ReplayFrontier(RunInterrupt):
    """A dry replay reached work the log does not hold; it stops before doing it."""

    def __init__(self, kind: EventType, ident: str | None) -> None:
        super().__init__(f"{kind} {ident or ''}".strip())
        self.kind = kind
        self.ident = ident


class Run:
    """One drive of one execution: the journal, the body's bookkeeping."""

    def __init__(self, runtime: Runtime, definition: FlowDefinition, journal: Journal,
                 grant: FenceGrant) -> None:
        self.runtime = runtime
        self.definition = definition
        self.journal = journal
        self.state: ExecutionState = journal.state
        self.grant = grant
        self.clock = runtime.clock
        self.inline_sleep_max = runtime.inline_sleep_max
        self.asked_steps: set[str] = set()
        self.asked_decisions: set[str] = set()
        self.task: asyncio.Task[Any] | None = None
        # Built from the fold this drive starts from (ADR 0113 D3).
        self.detector = DivergenceDetector.for_state(journal.state, runtime.divergence,
                                                     visited=self.asked_steps)
        # A dry replay (replay_check) stops at the first live new work, judged.
        self.stop_at_frontier = False
        # Set by Runtime.hand_back_now: a cancellation of this run hands it back.
        self.cut = False

    # -- the divergence detector's hooks ------------------------------------------
    async def before_new_work(self, kind: EventType, ident: str | None,
                              scope: str | None = None) -> None:
        """Judge the body before it appends new work; raises in ``fail`` mode.

        A runtime that is handing its runs back stops the run here, before the
        new work: everything it committed so far is a durable point. (Not before
        the event that ends the run: that one lets go as well.)
        """
        if self.runtime.handing_back and kind not in _ENDS_RUN:
            raise HandedBack(f"{kind} {ident or ''}".strip())
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
        skipped = d.judge(kind, ident, scope)
        if skipped:
            self._diverged(skipped)
        if self.stop_at_frontier:
            raise ReplayFrontier(kind, ident)

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
        self.runtime.divergence_warnings += 1
        self.runtime.warner.warn(f"execution {self.state.execution_id!r}: {error} "
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

    def close_decision(self, inner: _InnerSteps) -> None:
        _OPEN_DECISIONS.set(tuple(o for o in _OPEN_DECISIONS.get() if o[1] is not inner))

    def successor_id(self) -> str:
        base, _, gen = self.state.execution_id.rpartition("~")
        if base and gen.isdigit():
            return f"{base}~{int(gen) + 1}"
        return f"{self.state.execution_id}~1"
