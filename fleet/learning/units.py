"""What the estimators evaluate, read off trajectories and checked: decisions or trajectories.

A decision is *priced* when it matches the filters (``policy``, ``decision_id``)
and the target answers for it (a callable answers for every decision; a
mapping for the decision ids it names). Its importance weight is
``w = target(context, choice, alternatives) / propensity``.

- Single-decision estimators (IPS, SNIPS, DR) take each priced decision as a
  unit with its weight and reward; one without a propensity or a reward is
  skipped (counted).
- PDIS takes each trajectory holding a priced decision as a unit: step ``t``
  has the ratio ``rho_t = w_1 * ... * w_t`` (a decision the target does not
  price keeps the logging policy: its ``w`` is 1) and the reward the decision
  earned. With ``reward=terminal_credit`` the trajectory's terminal reward
  counts once, at its last decision (discounted to the first one, as
  ``trajectories(discount=)`` says), weighted by every ratio.

The target's answer must be a probability. Where a decision lists its
alternatives and the logged choice is one of them, the target's answers over
them must also sum to 1 (within 1e-6): a target that is not a distribution
gives weights that estimate nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fleet.kernel.errors import EvaluationError, InvalidTargetPolicyError, WeightOverflowError
from fleet.learning.reward_model import key
from fleet.learning.trajectories import DecisionPoint, Trajectory

TargetPolicy = Callable[[Any, Any, Any], float]
"""``(context, choice, alternatives) -> probability`` the target policy gives the logged choice."""

Targets = TargetPolicy | Mapping[str, TargetPolicy]

RewardFn = Callable[[Trajectory, DecisionPoint], "float | None"]
"""``(trajectory, decision) -> reward``; None leaves the decision out."""

#: How far from 1 a target's probabilities over a decision's alternatives may sum.
SUM_TOLERANCE = 1e-6


@dataclass(frozen=True, slots=True)
class DecisionUnit:
    """A priced decision: its weight and reward, and (when its alternatives are listed
    and hold the logged choice) the target's probability of each alternative."""

    weight: float
    reward: float
    context: Any
    choice: Any
    options: tuple[tuple[Any, float], ...] | None
    logged: int  # the logged choice's place among the options
    where: str  # "decision 'x' in 'execution-1'", for messages


@dataclass(frozen=True, slots=True)
class TrajectoryUnit:
    """A trajectory for PDIS: the cumulative ratio and the reward at each decision."""

    ratios: tuple[float, ...]
    rewards: tuple[float, ...]

    @property
    def weight(self) -> float:
        """The product of every ratio (the weight of the trajectory's end)."""
        return self.ratios[-1]


def target_for(targets: Targets, d: DecisionPoint) -> TargetPolicy | None:
    """The target that prices ``d`` (None: it keeps the logging policy)."""
    if isinstance(targets, Mapping):
        return targets.get(str(d.decision_id))
    return targets


def decision_units(paths: Iterable[Trajectory], targets: Targets, reward: RewardFn, *,
                   policy: str | None,
                   decision_id: str | None) -> tuple[list[DecisionUnit], int]:
    """The priced decisions with a propensity and a reward, and how many were skipped.

    Raises:
        InvalidTargetPolicyError: the target's answer is not a probability, or its
            answers over the alternatives do not sum to 1.
        EvaluationError: a logged propensity outside ``(0, 1]``; a reward that is not
            a number.
        WeightOverflowError: a weight or its square past the float range.
    """
    units: list[DecisionUnit] = []
    skipped = 0
    for path in paths:
        for d in path.decisions:
            target = _priced(targets, d, policy, decision_id)
            if target is None:
                continue
            value = reward(path, d) if d.propensity is not None else None
            if d.propensity is None or value is None:
                skipped += 1
                continue
            weight, options, logged = _weight(target, path, d)
            units.append(DecisionUnit(weight, _reward(value, path, d), d.context, d.choice,
                                      options, logged,
                                      f"decision {d.decision_id!r} in {path.execution_id!r}"))
    return units, skipped


def trajectory_units(paths: Iterable[Trajectory], targets: Targets, reward: RewardFn, *,
                     policy: str | None, decision_id: str | None,
                     terminal: bool) -> tuple[list[TrajectoryUnit], int]:
    """The trajectories holding a priced decision, and how many were skipped (a priced
    decision without a propensity, no reward at all, or no terminal reward).

    Raises:
        The errors of ``decision_units``.
    """
    units: list[TrajectoryUnit] = []
    skipped = 0
    for path in paths:
        priced = [_priced(targets, d, policy, decision_id) for d in path.decisions]
        if all(t is None for t in priced):
            continue
        if any(t is not None and d.propensity is None
               for t, d in zip(priced, path.decisions, strict=True)):
            skipped += 1
            continue
        if terminal:
            credit = path.decisions[0].terminal_credit
            if credit is None:
                skipped += 1
                continue
            rewards = [0.0] * (len(path.decisions) - 1) + [_reward(credit, path,
                                                                   path.decisions[0])]
        else:
            values = [reward(path, d) for d in path.decisions]
            if all(v is None for v in values):
                skipped += 1
                continue
            rewards = [0.0 if v is None else _reward(v, path, d)
                       for v, d in zip(values, path.decisions, strict=True)]
        ratios: list[float] = []
        rho = 1.0
        for target, d in zip(priced, path.decisions, strict=True):
            if target is not None:
                rho *= _weight(target, path, d)[0]
                if not math.isfinite(rho * rho):
                    raise WeightOverflowError(
                        f"non-finite: the product of the importance weights of "
                        f"{path.execution_id!r} up to decision {d.decision_id!r} is {rho!r} "
                        "and its square overflows; the logged propensities are too small for "
                        "this target over so many decisions")
            ratios.append(rho)
        units.append(TrajectoryUnit(tuple(ratios), tuple(rewards)))
    return units, skipped


def _priced(targets: Targets, d: DecisionPoint, policy: str | None,
            decision_id: str | None) -> TargetPolicy | None:
    if (policy is not None and d.policy_name != policy) or (
            decision_id is not None and d.decision_id != decision_id):
        return None
    return target_for(targets, d)


def _weight(target: TargetPolicy, path: Trajectory,
            d: DecisionPoint) -> tuple[float, tuple[tuple[Any, float], ...] | None, int]:
    p = _probability(target(d.context, d.choice, d.alternatives), path, d, d.choice)
    propensity = _propensity(d.propensity, path, d)
    weight = p / propensity
    if not math.isfinite(weight * weight):
        raise WeightOverflowError(
            f"non-finite: decision {d.decision_id!r} in {path.execution_id!r} has importance "
            f"weight {weight!r} (target {p!r} / propensity {propensity!r}) and its square "
            "overflows; a propensity this small cannot be evaluated against")
    options, logged = _options(target, path, d, p)
    return weight, options, logged


def _options(target: TargetPolicy, path: Trajectory, d: DecisionPoint,
             p_logged: float) -> tuple[tuple[tuple[Any, float], ...] | None, int]:
    """The target's probability of each alternative, and the logged choice's place."""
    alternatives = d.alternatives
    if not isinstance(alternatives, list) or not alternatives:
        return None, 0
    chosen = key(d.choice)
    distinct = {key(a): a for a in alternatives}
    if chosen not in distinct:
        return None, 0
    options = tuple((a, p_logged if k == chosen else _probability(
        target(d.context, a, alternatives), path, d, a)) for k, a in distinct.items())
    total = math.fsum(p for _, p in options)
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise InvalidTargetPolicyError(
            f"target_policy's probabilities over the {len(options)} alternatives of decision "
            f"{d.decision_id!r} in {path.execution_id!r} sum to {total:.6g}, not 1; a target "
            "policy must be a distribution over a decision's alternatives")
    return options, list(distinct).index(chosen)


def _probability(value: Any, path: Trajectory, d: DecisionPoint, choice: Any) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0.0 <= value <= 1.0):
        raise InvalidTargetPolicyError(
            f"target_policy gave {value!r} for choice {choice!r} of decision "
            f"{d.decision_id!r} in {path.execution_id!r}; it must return a probability "
            "in [0, 1]")
    return float(value)


def _propensity(value: float | None, path: Trajectory, d: DecisionPoint) -> float:
    if value is None or not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise EvaluationError(
            f"decision {d.decision_id!r} in {path.execution_id!r} logged propensity "
            f"{value!r}, outside (0, 1]")
    return value


def _reward(value: Any, path: Trajectory, d: DecisionPoint) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EvaluationError(f"reward of decision {d.decision_id!r} in "
                              f"{path.execution_id!r} is {value!r}, not a number")
    return float(value)
