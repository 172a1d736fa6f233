"""Trajectories: per execution, its decisions in order with the rewards they earned.

A trajectory is read off events: ``DECISION_RECORDED`` gives a decision (its
choice, context, alternatives and the logging policy's propensity),
``OUTCOME_RECORDED`` joins a reward to it by ``decisionId`` (direct credit),
and the execution's terminal event gives the terminal outcome, which may be
credited back to every decision with a discount (terminal credit).

A late outcome (ADR 0116, ``Runtime.record_outcome``) is an ``OUTCOME_RECORDED``
like any other: it is a direct reward exactly as an in-run one is, with no
join and no special case. Provenance (``late``, ``recordedBy``) is not part of a
trajectory; ``fleet.analytics.outcome_records`` reports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fleet.kernel.errors import ConfigurationError
from fleet.kernel.events import EventEnvelope, EventType

TerminalReward = Callable[[str, Any], "float | None"]

TERMINAL_STATUS: dict[EventType, str] = {
    EventType.EXECUTION_COMPLETED: "completed",
    EventType.EXECUTION_FAILED: "failed",
    EventType.EXECUTION_CANCELLED: "cancelled",
    EventType.EXECUTION_CONTINUED: "continued",
}


@dataclass(frozen=True, slots=True)
class Reward:
    """One reward joined to a decision: an ``OUTCOME_RECORDED`` under ``key``."""

    key: str
    score: float | None = None
    success: bool | None = None

    @property
    def value(self) -> float | None:
        """The score, else the success flag as 1.0 / 0.0, else None."""
        if self.score is not None:
            return float(self.score)
        if self.success is not None:
            return 1.0 if self.success else 0.0
        return None


@dataclass(frozen=True, slots=True)
class DecisionPoint:
    """One decision of a trajectory, as the logging policy made it.

    ``sequence`` is where the decision sits in its execution's log (for a
    decision a checkpoint absorbed, the sequence the fold stamped on it, ADR
    0128). ``terminal_credit`` is the terminal reward discounted by the number
    of decisions that follow this one; None when the execution has no terminal
    reward.
    """

    decision_id: str
    sequence: int
    choice: Any
    policy_name: str | None
    policy_version: str | int | None
    propensity: float | None
    alternatives: Any
    context: Any
    rewards: tuple[Reward, ...] = ()
    terminal_credit: float | None = None


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One execution's decisions in sequence order, their rewards and its end.

    ``status`` is the terminal status (``completed``, ``failed``, ``cancelled``,
    ``continued``) or None for an execution that has not finished.
    ``unjoined`` counts outcomes naming a decision the events do not hold.
    """

    execution_id: str
    flow_id: str | None
    status: str | None
    terminal_reward: float | None
    decisions: tuple[DecisionPoint, ...]
    unjoined: int = 0


def success_reward(status: str, output: Any) -> float | None:
    """The default terminal reward: 1.0 completed, 0.0 failed or cancelled.

    A ``continued`` execution has no verdict of its own (its chain goes on in
    the next generation), so it has no terminal reward.
    """
    if status == "completed":
        return 1.0
    if status in ("failed", "cancelled"):
        return 0.0
    return None


@dataclass(slots=True)
class _Builder:
    execution_id: str
    started: EventEnvelope | None = None
    terminal: EventEnvelope | None = None
    decisions: dict[str, EventEnvelope] = field(default_factory=dict)
    outcomes: list[EventEnvelope] = field(default_factory=list)


def trajectories(events: Iterable[EventEnvelope], *, discount: float = 1.0,
                 terminal_reward: TerminalReward = success_reward) -> list[Trajectory]:
    """Build one trajectory per execution from its events.

    The events may hold several executions, in any order; each execution's
    events are read in sequence order. Only ``EXECUTION_STARTED``,
    ``DECISION_RECORDED``, ``OUTCOME_RECORDED`` and terminal events are read.
    For a log that was compacted, pass ``evidence_events(state, log)`` rather
    than the log: the checkpoint holds the decisions it absorbed.

    Args:
        events: The events of one or more executions.
        discount: The factor in ``[0, 1]`` by which the terminal reward shrinks
            per decision between a decision and the end; only this reads the
            order of decisions.
        terminal_reward: Maps ``(status, output)`` of the first terminal event
            (the one the fold honours) to a reward, or None for no credit.

    Returns:
        The trajectories, in the order their executions first appear.

    Raises:
        ConfigurationError: ``discount`` is not a finite number in ``[0, 1]``.
    """
    if (isinstance(discount, bool) or not isinstance(discount, (int, float))
            or not math.isfinite(discount) or not 0.0 <= discount <= 1.0):
        raise ConfigurationError(f"discount must be a number in [0, 1], got {discount!r}")
    builders: dict[str, _Builder] = {}
    for ev in events:
        b = builders.get(ev.execution_id)
        if b is None:
            b = builders[ev.execution_id] = _Builder(ev.execution_id)
        if ev.type == EventType.DECISION_RECORDED:
            decision_id = str(ev.payload.get("decisionId", ""))
            seen = b.decisions.get(decision_id)
            # The fold keeps the last record of an id; so does a trajectory.
            if seen is None or seen.sequence <= ev.sequence:
                b.decisions[decision_id] = ev
        elif ev.type == EventType.OUTCOME_RECORDED:
            b.outcomes.append(ev)
        elif ev.type in TERMINAL_STATUS:
            # The fold honours the first terminal event; later ones change nothing.
            if b.terminal is None or ev.sequence < b.terminal.sequence:
                b.terminal = ev
        elif ev.type == EventType.EXECUTION_STARTED:
            b.started = ev
    return [_build(b, float(discount), terminal_reward) for b in builders.values()]


def _build(b: _Builder, discount: float, terminal_reward: TerminalReward) -> Trajectory:
    joined: dict[str, list[Reward]] = {d: [] for d in b.decisions}
    unjoined = 0
    for ev in sorted(b.outcomes, key=lambda e: e.sequence):
        p = ev.payload
        rewards = joined.get(str(p.get("decisionId", "")))
        if rewards is None:
            unjoined += 1
            continue
        rewards.append(Reward(str(p.get("key", "")), _number(p.get("score")),
                              p["success"] if isinstance(p.get("success"), bool) else None))
    status: str | None = None
    final: float | None = None
    if b.terminal is not None:
        status = TERMINAL_STATUS[b.terminal.type]
        final = terminal_reward(status, b.terminal.payload.get("output"))
    ordered = sorted(b.decisions.items(), key=lambda kv: kv[1].sequence)
    n = len(ordered)
    points = []
    for i, (decision_id, ev) in enumerate(ordered):
        p = ev.payload
        policy = p.get("policy") if isinstance(p.get("policy"), dict) else None
        credit = None if final is None else final * discount ** (n - 1 - i)
        points.append(DecisionPoint(
            decision_id=decision_id, sequence=ev.sequence, choice=p.get("choice"),
            policy_name=_text(policy.get("name")) if policy else None,
            policy_version=policy.get("version") if policy else None,
            propensity=_number(policy.get("propensity")) if policy else None,
            alternatives=p.get("alternatives"), context=p.get("context"),
            rewards=tuple(joined[decision_id]), terminal_credit=credit))
    flow_id = _text(b.started.payload.get("flowId")) if b.started is not None else None
    return Trajectory(b.execution_id, flow_id, status, final, tuple(points), unjoined)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
