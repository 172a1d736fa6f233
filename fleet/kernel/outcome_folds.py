"""What judging a late outcome needs of an execution, read once and then kept up to date.

``record_outcome`` (``fleet.kernel.outcomes``) judges a reward on an execution's owner,
status, decision ids and the outcomes it already holds. Reading and folding the
whole log for each reward made a reward for a decision of a long log, or of one near
the outcome cap, cost all of it, twice (issue 25 item 12). Here one observation of
the tip serves authorisation and the judgement alike, and a finished execution's
``Judged`` (only those facts: the recorded values keyed by ``(decision_id, key)``, the
late count) is remembered per runtime (``SEEN_EXECUTIONS``, least recently used out):
the next reward of it reads only the events appended since (none when nothing moved)
and applies them in O(events). Anything but late outcomes and denial audits there (a
reopen by ``resume_as``), a hole, or a log re-created under its id folds it whole
again; so does a runtime's first reward of it, from its checkpoint as before.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fleet.kernel.engine import Engine
from fleet.kernel.errors import ExecutionNotFoundError, OutcomeContendedError
from fleet.kernel.events import TERMINAL_TYPES, EventEnvelope, EventType
from fleet.kernel.fold import ExecutionState, fold_log
from fleet.kernel.store.spi import TipObservation

__all__ = ["SEEN_EXECUTIONS", "Judged", "observe", "observe_settled"]

SEEN_EXECUTIONS = 256
MAX_ATTEMPTS = 8
# What may follow a remembered fold and be applied to it alone.
_AFTER_THE_END = frozenset({EventType.OUTCOME_RECORDED, EventType.EXECUTION_DENIED})


@dataclass(frozen=True, slots=True)
class Judged:
    """An execution as a late outcome is judged on, at an observed head."""

    who: ExecutionState              # id, status, sequence, owner: no frames, no outcomes
    decisions: frozenset[str]
    recorded: Mapping[tuple[Any, Any], tuple[Any, Any]]  # (decision, key) -> first value
    late: int                        # late outcomes held (the cap counts these)
    checkpoint: int | None           # the sequence of the checkpoint folded in, if any
    terminal_on_log: bool            # a terminal event was read (above the checkpoint)
    head: int = -1                   # the head it was read at
    anchor: str | None = None        # the log it was read from

    @classmethod
    def of(cls, state: ExecutionState, checkpoint: int | None,
           terminal_on_log: bool) -> Judged:
        recorded: dict[tuple[Any, Any], tuple[Any, Any]] = {}
        for o in state.outcomes:
            recorded.setdefault((o.get("decisionId"), o.get("key")),
                                (o.get("score"), o.get("success")))
        who = ExecutionState(execution_id=state.execution_id, status=state.status,
                             sequence=state.sequence, flow_id=state.flow_id,
                             owner=state.owner)
        return cls(who, frozenset(state.decisions), recorded,
                   sum(1 for o in state.outcomes if o.get("late")), checkpoint,
                   terminal_on_log)

    def extended(self, events: Sequence[EventEnvelope], head: int) -> Judged:
        """With ``events`` (late outcomes and audits only) applied, as the fold would."""
        recorded, late = dict(self.recorded), self.late
        for e in events:
            if e.type is EventType.OUTCOME_RECORDED:
                p = e.payload if isinstance(e.payload, dict) else {}
                recorded.setdefault((p.get("decisionId"), p.get("key")),
                                    (p.get("score"), p.get("success")))
                late += bool(e.kernel and p.get("late") is True)
        who = replace(self.who, sequence=max(self.who.sequence, head))
        return replace(self, who=who, recorded=recorded, late=late, head=head)


class _Seen:
    """The ``Judged`` of the finished executions a runtime last rewarded (an LRU)."""

    def __init__(self) -> None:
        self.judged: OrderedDict[str, Judged] = OrderedDict()

    def get(self, execution_id: str, tip: TipObservation) -> Judged | None:
        known = self.judged.get(execution_id)
        if known is None or known.anchor != tip.anchor or tip.head is None \
                or known.head > tip.head:
            return None
        self.judged.move_to_end(execution_id)
        return known

    def keep(self, execution_id: str, judged: Judged) -> None:
        known = self.judged.get(execution_id)
        if known is not None and known.anchor == judged.anchor and known.head > judged.head:
            return  # a concurrent reward saw more of it
        self.judged[execution_id] = judged
        self.judged.move_to_end(execution_id)
        while len(self.judged) > SEEN_EXECUTIONS:
            self.judged.popitem(last=False)


_SEEN: weakref.WeakKeyDictionary[Engine, _Seen] = weakref.WeakKeyDictionary()


async def observe_settled(engine: Engine, execution_id: str) -> tuple[TipObservation, Judged]:
    """An observation of the tip and the execution at it (none: ``ExecutionNotFoundError``)."""
    for _ in range(MAX_ATTEMPTS):
        tip = await engine.writer.observe(execution_id)
        if tip.head is None:
            raise ExecutionNotFoundError(f"no execution {execution_id!r}")
        judged = await observe(engine, execution_id, tip)
        if judged is not None:
            return tip, judged
    raise OutcomeContendedError(
        f"the log of {execution_id!r} kept moving ({MAX_ATTEMPTS} tries); retry later")


async def observe(engine: Engine, execution_id: str, tip: TipObservation) -> Judged | None:
    """The execution at ``tip`` (None: the log grew past it), from what is remembered and
    the events appended since when they are late outcomes and audits only; else whole."""
    assert tip.head is not None
    seen = _SEEN.get(engine)
    if seen is None:
        seen = _SEEN[engine] = _Seen()
    known = seen.get(execution_id, tip)
    if known is not None:
        if known.head == tip.head:
            return known
        events = await engine.store.read(execution_id, after=known.head)
        if events and events[-1].sequence > tip.head:
            return None
        if [e.sequence for e in events] == list(range(known.head + 1, tip.head + 1)) \
                and all(e.type in _AFTER_THE_END for e in events):
            judged = known.extended(events, tip.head)
            seen.keep(execution_id, judged)
            return judged
    folded = await _fold_to(engine, execution_id, tip.head)
    if folded is None:
        return None
    judged = replace(folded, head=tip.head, anchor=tip.anchor)
    if judged.who.terminal and tip.anchor is not None:
        seen.keep(execution_id, judged)
    return judged


async def _fold_to(engine: Engine, execution_id: str, head: int) -> Judged | None:
    """Checkpoint + the events above it, as of ``head``; None if the log grew past it.

    A checkpoint ABOVE ``head`` is folded too, never ignored: that is the shape a
    store without a high-water head keeps after an older kernel compacted a
    finished log, and ``outcomes._check_slot`` refuses it (ignoring it folded
    sequence 0 alone and answered "not terminal").
    """
    base: ExecutionState | None = None
    after = -1
    if engine.snapshots is not None:
        snap = await engine.snapshots.load(execution_id)
        if snap is not None:
            base = ExecutionState.from_dict(snap.state)
            after = snap.sequence
    events = await engine.store.read(execution_id, after=after)
    if events and events[-1].sequence > head:
        return None
    return Judged.of(fold_log(events, base), None if base is None else after,
                     any(e.type in TERMINAL_TYPES for e in events))
