"""Flat records of decisions and outcomes, for analysis (a DataFrame, a warehouse).

These read the events they are given and nothing else. A compacted execution's
decisions and outcomes at or below its checkpoint are no longer on the log:
they are in the checkpoint's folded state. To cover such executions, build the
input with ``fleet.learning.evidence_events(state, log)`` (ADR 0116 round 4
item 6) rather than passing the log read from the store.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from fleet.kernel.events import EventEnvelope, EventType


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One ``DECISION_RECORDED``, flattened; policy fields are None without a policy."""

    execution_id: str
    decision_id: str
    sequence: int
    timestamp: int
    choice: Any
    policy_name: str | None
    policy_version: str | int | None
    propensity: float | None
    alternatives: Any
    context: Any

    def to_dict(self) -> dict[str, Any]:
        """A plain dict, one row."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class OutcomeRecord:
    """One ``OUTCOME_RECORDED``, flattened.

    ``late`` and ``recorded_by`` are read only from a kernel-stamped envelope,
    as the fold does: a flow cannot make a pipeline trust a forged one.
    """

    execution_id: str
    decision_id: str
    key: str
    score: float | None
    success: bool | None
    sequence: int
    timestamp: int
    late: bool
    recorded_by: str | None

    def to_dict(self) -> dict[str, Any]:
        """A plain dict, one row."""
        return asdict(self)


def decision_records(events: Iterable[EventEnvelope]) -> list[DecisionRecord]:
    """One record per ``DECISION_RECORDED`` in ``events``, in the order given.

    A compacted execution's absorbed decisions are in its checkpoint, not on
    the log: pass ``evidence_events(state, log)`` to include them.

    Args:
        events: Events of one or more executions.

    Returns:
        The decision records.
    """
    out = []
    for ev in events:
        if ev.type != EventType.DECISION_RECORDED:
            continue
        p = ev.payload
        raw = p.get("policy")
        policy: dict[str, Any] = raw if isinstance(raw, dict) else {}
        name, version, propensity = (policy.get("name"), policy.get("version"),
                                     policy.get("propensity"))
        out.append(DecisionRecord(
            execution_id=ev.execution_id, decision_id=str(p.get("decisionId", "")),
            sequence=ev.sequence, timestamp=ev.timestamp, choice=p.get("choice"),
            policy_name=name if isinstance(name, str) else None,
            policy_version=version if isinstance(version, (str, int)) else None,
            propensity=_number(propensity), alternatives=p.get("alternatives"),
            context=p.get("context")))
    return out


def outcome_records(events: Iterable[EventEnvelope]) -> list[OutcomeRecord]:
    """One record per ``OUTCOME_RECORDED`` in ``events``, in the order given.

    In-run and late outcomes alike; ``late`` tells them apart. A compacted
    execution's absorbed outcomes are in its checkpoint, not on the log: pass
    ``evidence_events(state, log)`` to include them.

    Args:
        events: Events of one or more executions.

    Returns:
        The outcome records.
    """
    out = []
    for ev in events:
        if ev.type != EventType.OUTCOME_RECORDED:
            continue
        p = ev.payload
        by = p.get("recordedBy") if ev.kernel else None
        out.append(OutcomeRecord(
            execution_id=ev.execution_id, decision_id=str(p.get("decisionId", "")),
            key=str(p.get("key", "")), score=_number(p.get("score")),
            success=p["success"] if isinstance(p.get("success"), bool) else None,
            sequence=ev.sequence, timestamp=ev.timestamp,
            late=ev.kernel and p.get("late") is True,
            recorded_by=by if isinstance(by, str) else None))
    return out


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
