"""``record_outcome``: a reward for a past decision of a finished execution (ADR 0116).

A late outcome is one conditional append (``append_if_unchanged``): it never
takes a fence, so it can never displace a holder; a holder or another writer
that moves the tip makes it re-observe and re-judge, within a bound.

Order of checks, exactly as the record states: not found; authorise
``annotate`` against the recorded owner; shape; then, inside the conditional
loop: terminal, the decision exists, ``(decision_id, key)`` idempotent (a
duplicate is answered even at the cap), the per-execution cap; last, the
slot: a finished log an older kernel compacted (its terminal event folded
into the checkpoint, or its fold above the stored head) is refused until
``fleet repair terminal-event`` restores the end. A denial appends nothing.
Every refusal inside the loop is confirmed against a fresh observation of the
tip: a log deleted meanwhile is not found, a log that moved is judged again.

Cost (issue 25 item 12): one observation of the tip serves authorisation and the
judgement, and what the judgement needs of a finished execution is remembered, so a
reward reads only what was appended since the last (``fleet.kernel.outcome_folds``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleet.kernel.engine import Engine
from fleet.kernel.errors import (
    ExecutionNotFoundError,
    ExecutionNotTerminalError,
    OutcomeContendedError,
    OutcomeRefusedError,
)
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.outcome_folds import Judged, observe, observe_settled
from fleet.kernel.security import Principal, check_outcome_shape

MAX_LATE_OUTCOMES = 1024
MAX_ATTEMPTS = 8


@dataclass(frozen=True, slots=True)
class OutcomeResult:
    """``appended`` is False for a duplicate; ``sequence`` is where the outcome sits."""

    appended: bool
    sequence: int | None = None


async def record_outcome(engine: Engine, execution_id: str, *, decision_id: str, key: str,
                         score: float | None = None, success: bool | None = None,
                         principal: Principal | None = None,
                         system: bool = False) -> OutcomeResult:
    """Attach a late outcome (see the module); written by ``LogWriter.write_if_unchanged``."""
    store = engine.store
    if not callable(getattr(store, "append_if_unchanged", None)):  # nor can it observe
        raise OutcomeRefusedError(
            f"{type(store).__name__} has no append_if_unchanged; a late outcome is written "
            "only by a conditional append, never by a plain one")
    tip, observed = await observe_settled(engine, execution_id)
    await engine.access.check(observed.who, "annotate", principal, audit=False,
                              system=system)
    check_outcome_shape(key, score, success, decision_id)
    recorded_by = "system" if system else (principal.actor if principal else "anonymous")
    body: dict[str, Any] = {"decisionId": decision_id, "key": key}
    if score is not None:
        body["score"] = score
    if success is not None:
        body["success"] = success
    body["recordedBy"] = recorded_by
    body["late"] = True

    for attempt in range(MAX_ATTEMPTS):
        if attempt:
            tip = await engine.writer.observe(execution_id)
            if tip.head is None:
                raise ExecutionNotFoundError(f"no execution {execution_id!r}")
            again = await observe(engine, execution_id, tip)
            if again is None:  # the log grew between the observation and the read
                continue
            observed = again
        head = observed.head
        if tip.anchor is None:
            raise OutcomeRefusedError(
                f"{type(store).__name__} returned no creation anchor for {execution_id!r}; "
                "a store or decorator must forward it")
        try:
            _judge(observed, execution_id, decision_id, key, score, success)
            if _duplicate(observed, decision_id, key, score, success):
                return OutcomeResult(False)
            _check_slot(observed, execution_id, head)
        except (ExecutionNotTerminalError, OutcomeRefusedError):
            # A refusal is judged on a read made after the observation: confirm the
            # log it read is still the one observed. A delete in between reads as an
            # empty (or checkpoint-only) log, which is "gone", not "pending" (issue
            # 13 item 6); a log that moved is judged again.
            now = await engine.writer.observe(execution_id)
            if now.head is None:
                raise ExecutionNotFoundError(f"no execution {execution_id!r}") from None
            if (now.head, now.fence, now.anchor) != (tip.head, tip.fence, tip.anchor):
                continue
            raise
        event = EventEnvelope.make(execution_id, head + 1, EventType.OUTCOME_RECORDED,
                                   engine.clock(), dict(body))
        result = await engine.writer.write_if_unchanged(event, tip)
        if result.appended:
            return OutcomeResult(True, event.sequence)
        if result.reason == "gone":
            raise ExecutionNotFoundError(f"no execution {execution_id!r}")
    raise OutcomeContendedError(
        f"the log of {execution_id!r} kept moving ({MAX_ATTEMPTS} tries); retry later")


def _check_slot(observed: Judged, execution_id: str, head: int) -> None:
    """Refuse a finished log an older kernel compacted (ADR 0116 round 3 P3 item 1,
    round 4 item 5): the outcome's one valid slot is ``head + 1``, and a log whose
    terminal event was folded into its checkpoint could not date its end after it."""
    state = observed.who
    repair = "run `fleet repair terminal-event` (LogLifecycle.restore_terminal_event) first"
    if state.sequence > head:
        raise OutcomeRefusedError(
            f"execution {execution_id!r} folds to sequence {state.sequence} above its "
            f"stored head {head} (compacted by an older kernel); {repair}")
    if state.terminal and not observed.terminal_on_log:
        # Only a checkpoint taken AT the terminal event leaves a terminal fold with no
        # terminal event above it; this kernel's compaction stops just below it (Q3).
        # Appending here would leave retention nothing to date the end from but the
        # late outcome itself.
        raise OutcomeRefusedError(
            f"execution {execution_id!r} is {state.status} but its terminal event was "
            f"compacted into the checkpoint at sequence {observed.checkpoint} by an older "
            f"kernel; {repair}")


def _judge(judged: Judged, execution_id: str, decision_id: str, key: str,
           score: float | None, success: bool | None) -> None:
    state = judged.who
    if not state.terminal:
        raise ExecutionNotTerminalError(
            f"execution {execution_id!r} is {state.status}; a live run records its own "
            "outcomes with ctx.outcome, late ones attach once it has finished")
    if decision_id not in judged.decisions:
        raise OutcomeRefusedError(
            f"execution {execution_id!r} made no decision {decision_id!r}; an outcome must "
            "name a decision the log holds")
    if judged.late >= MAX_LATE_OUTCOMES and not _duplicate(judged, decision_id, key, score,
                                                            success):
        raise OutcomeRefusedError(
            f"execution {execution_id!r} already holds {MAX_LATE_OUTCOMES} late outcomes")


def _duplicate(judged: Judged, decision_id: str, key: str, score: float | None,
               success: bool | None) -> bool:
    existing = judged.recorded.get((decision_id, key))
    if existing is None:
        return False
    if existing == (score, success):
        return True
    raise OutcomeRefusedError(
        f"outcome {key!r} for decision {decision_id!r} is already recorded with "
        f"score={existing[0]!r} success={existing[1]!r}; the "
        "log is append-only: record a correction under a new key")
