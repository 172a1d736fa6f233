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
from dataclasses import dataclass
from typing import Any

from fleet.kernel.errors import ConfigurationError
from fleet.kernel.events import TERMINAL_EVENT, EventEnvelope, EventType

TerminalReward = Callable[[str, Any], "float | None"]

# The terminal status each terminal event gives (the kernel's one table, inverted).
TERMINAL_STATUS: dict[EventType, str] = {kind: status for status, kind in TERMINAL_EVENT.items()}


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


_READ = frozenset({EventType.EXECUTION_STARTED, EventType.DECISION_RECORDED,
                   EventType.OUTCOME_RECORDED, *TERMINAL_STATUS})


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
    grouped: dict[str, list[EventEnvelope]] = {}
    for ev in events:
        if ev.type in _READ:
            bucket = grouped.get(ev.execution_id)
            if bucket is None:
                grouped[ev.execution_id] = [ev]
            else:
                bucket.append(ev)
    return [_build(execution_id, evs, float(discount), terminal_reward)
            for execution_id, evs in grouped.items()]


def _sequence(ev: EventEnvelope) -> int:
    return ev.sequence


def _build(execution_id: str, evs: list[EventEnvelope], discount: float,
           terminal_reward: TerminalReward) -> Trajectory:
    evs.sort(key=_sequence)  # a log is already in order: one linear pass
    started: EventEnvelope | None = None
    terminal: EventEnvelope | None = None
    decisions: dict[str, EventEnvelope] = {}
    outcomes: list[EventEnvelope] = []
    for ev in evs:
        if ev.type == EventType.DECISION_RECORDED:
            decision_id = str(ev.payload.get("decisionId", ""))
            # The fold keeps the last record of an id; it then sits at its own place.
            decisions.pop(decision_id, None)
            decisions[decision_id] = ev
        elif ev.type == EventType.OUTCOME_RECORDED:
            outcomes.append(ev)
        elif ev.type == EventType.EXECUTION_STARTED:
            started = ev
        elif terminal is None:  # the fold honours the first terminal event only
            terminal = ev
    joined: dict[str, list[Reward]] = {}
    unjoined = 0
    for ev in outcomes:
        p = ev.payload
        decision_id = str(p.get("decisionId", ""))
        if decision_id not in decisions:
            unjoined += 1
            continue
        success = p.get("success")
        joined.setdefault(decision_id, []).append(Reward(
            str(p.get("key", "")), _number(p.get("score")),
            success if isinstance(success, bool) else None))
    status: str | None = None
    final: float | None = None
    if terminal is not None:
        status = TERMINAL_STATUS[terminal.type]
        final = terminal_reward(status, terminal.payload.get("output"))
    n = len(decisions)
    points = []
    for i, (decision_id, ev) in enumerate(decisions.items()):
        p = ev.payload
        policy = p.get("policy") if isinstance(p.get("policy"), dict) else None
        credit = None if final is None else final * discount ** (n - 1 - i)
        points.append(DecisionPoint(
            decision_id=decision_id, sequence=ev.sequence, choice=p.get("choice"),
            policy_name=_text(policy.get("name")) if policy else None,
            policy_version=policy.get("version") if policy else None,
            propensity=_number(policy.get("propensity")) if policy else None,
            alternatives=p.get("alternatives"), context=p.get("context"),
            rewards=tuple(joined.get(decision_id, ())), terminal_credit=credit))
    flow_id = _text(started.payload.get("flowId")) if started is not None else None
    return Trajectory(execution_id, flow_id, status, final, tuple(points), unjoined)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
