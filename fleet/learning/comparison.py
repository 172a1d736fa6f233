"""Policies compared side by side: every estimator, the weights, the gate; the logged summary.

What ``fleet learn report`` shows (as a table, ``--json`` or ``--html``):

- ``logged_summary``: per logging policy (name and version), its decisions, the
  mean propensity and the logged value, the reward defined as everywhere
  (``direct_reward`` by default: the sum of a decision's joined rewards), over
  the decisions ``evaluate_policy`` would take (a propensity and a reward);
- ``compare_policies``: per target policy, an evaluation with each estimator
  (one that cannot be computed, e.g. DR on decisions without alternatives,
  says why instead), the distribution of the importance weights, the
  effective sample size and the promotion gate on one estimator.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet.kernel.errors import ConfigurationError, EvaluationError
from fleet.learning.estimators import quantile
from fleet.learning.evaluation import (
    DEFAULT_MIN_ESS,
    ESTIMATORS,
    TRAJECTORY_ESTIMATORS,
    GateResult,
    PolicyEvaluation,
    PolicyEvaluator,
    direct_reward,
    promotion_gate,
    terminal_credit,
)
from fleet.learning.reward_model import RewardModel
from fleet.learning.trajectories import Trajectory
from fleet.learning.units import RewardFn, Targets


@dataclass(frozen=True, slots=True)
class WeightSummary:
    """The importance weights of the evaluated decisions: how heavy their tail is.

    ``bins`` are ``(low, high, count)`` with edges at powers of two (a weight of
    exactly 0 has a bin of its own, ``(0, 0, count)``).
    """

    count: int
    zero: int
    mean: float
    median: float
    p90: float
    p99: float
    max: float
    effective_sample_size: float
    bins: tuple[tuple[float, float, int], ...]

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (``bins`` as lists)."""
        return {"count": self.count, "zero": self.zero, "mean": self.mean,
                "median": self.median, "p90": self.p90, "p99": self.p99, "max": self.max,
                "effective_sample_size": self.effective_sample_size,
                "bins": [list(b) for b in self.bins]}


@dataclass(frozen=True, slots=True)
class PolicyComparison:
    """One target policy under every estimator asked for."""

    name: str
    evaluations: dict[str, PolicyEvaluation]
    errors: dict[str, str] = field(default_factory=dict)
    weights: WeightSummary | None = None
    gate_estimator: str = "snips"
    gate: GateResult | None = None

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (what ``fleet learn report --json`` prints per target)."""
        return {"policy": self.name,
                "estimates": {k: v.to_dict() for k, v in self.evaluations.items()},
                "errors": dict(self.errors),
                "weights": None if self.weights is None else self.weights.to_dict(),
                "gate": None if self.gate is None else {
                    "estimator": self.gate_estimator, "passed": self.gate.passed,
                    "reasons": list(self.gate.reasons)}}


def summarise_weights(weights: Sequence[float]) -> WeightSummary:
    """The distribution of ``weights`` (not empty)."""
    ordered = sorted(weights)
    total, squares = math.fsum(ordered), math.fsum(w * w for w in ordered)
    bins: dict[int, int] = {}
    zero = 0
    for w in ordered:
        if w == 0.0:
            zero += 1
        else:
            exponent = math.ceil(math.log2(w))  # w in (2^(e-1), 2^e]
            bins[exponent] = bins.get(exponent, 0) + 1
    edges = [(0.0, 0.0, zero)] if zero else []
    if bins:
        edges += [(2.0 ** (e - 1), 2.0 ** e, bins.get(e, 0))
                  for e in range(min(bins), max(bins) + 1)]
    return WeightSummary(
        count=len(ordered), zero=zero, mean=total / len(ordered),
        median=quantile(ordered, 0.5), p90=quantile(ordered, 0.9),
        p99=quantile(ordered, 0.99), max=ordered[-1],
        effective_sample_size=total * total / squares if squares else 0.0,
        bins=tuple(edges))


def default_estimators(paths: Iterable[Trajectory],
                       reward: RewardFn = direct_reward) -> tuple[str, ...]:
    """IPS, SNIPS, DR and SNDR; PDIS and SNPDIS too for a terminal reward
    (``terminal_credit``) when some trajectory holds several decisions (with the
    rewards joined to each decision, a trajectory's return is another quantity
    than a decision's reward: ask for them by name)."""
    several = reward is terminal_credit and any(len(p.decisions) > 1 for p in paths)
    return tuple(e for e in ESTIMATORS if several or e not in TRAJECTORY_ESTIMATORS)


def compare_policies(trajectories: Iterable[Trajectory], targets: Mapping[str, Targets], *,
                     estimators: Sequence[str] | None = None, reward: RewardFn = direct_reward,
                     policy: str | None = None, decision_id: str | None = None,
                     confidence: float = 0.95, reward_model: RewardModel | None = None,
                     bootstrap: int = 0, seed: int | None = None,
                     gate_estimator: str = "snips", min_lift: float = 0.0,
                     min_ess: float = DEFAULT_MIN_ESS) -> list[PolicyComparison]:
    """Evaluate each of ``targets`` (by name) with every estimator; one comparison each.

    An estimator that cannot be computed for a target (an ``EvaluationError``)
    is reported in ``errors`` with its message; the others still are. The gate
    judges ``gate_estimator``'s evaluation, when it could be computed.

    Raises:
        ConfigurationError: an unknown estimator, or an argument of
            ``evaluate_policy`` that is unusable (checked once, up front).
    """
    paths = list(trajectories)
    chosen = (tuple(estimators) if estimators is not None
              else default_estimators(paths, reward))
    unknown = [e for e in (*chosen, gate_estimator) if e not in ESTIMATORS]
    if unknown:
        raise ConfigurationError(f"unknown estimator(s) {unknown}; known: "
                                 f"{', '.join(ESTIMATORS)}")
    out = []
    for name, target in targets.items():
        evaluator = PolicyEvaluator(paths, target, reward=reward, policy=policy,
                                    decision_id=decision_id)
        evaluations: dict[str, PolicyEvaluation] = {}
        errors: dict[str, str] = {}
        for estimator in chosen:
            try:
                evaluations[estimator] = evaluator.evaluate(
                    estimator, confidence=confidence, reward_model=reward_model,
                    bootstrap=bootstrap, seed=seed)
            except EvaluationError as exc:
                errors[estimator] = f"{type(exc).__name__}: {exc.message}"
        try:
            weights = summarise_weights(evaluator.decision_weights())
        except EvaluationError:
            weights = None
        judged = evaluations.get(gate_estimator)
        gate = (promotion_gate(judged, min_lift=min_lift, min_ess=min_ess)
                if judged is not None else None)
        out.append(PolicyComparison(name, evaluations, errors, weights, gate_estimator, gate))
    return out


def logged_summary(trajectories: Iterable[Trajectory], *,
                   reward: RewardFn = direct_reward) -> list[dict[str, Any]]:
    """Per logging policy (name, version): decisions, those with a propensity, those
    rewarded, the mean propensity and the logged value, in first-seen order.

    ``logged_value`` is what ``evaluate_policy(..., policy=name).logged_value``
    reports for a policy of one version: the mean reward over its decisions
    that have a propensity and a reward.
    """
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for path in trajectories:
        for d in path.decisions:
            k = (str(d.policy_name), str(d.policy_version))
            row = rows.setdefault(k, {"policy": k[0], "version": k[1], "decisions": 0,
                                      "with_propensity": 0, "rewarded": 0,
                                      "propensities": [], "rewards": []})
            row["decisions"] += 1
            if d.propensity is None:
                continue
            row["with_propensity"] += 1
            row["propensities"].append(d.propensity)
            value = reward(path, d)
            if value is not None:
                row["rewarded"] += 1
                row["rewards"].append(float(value))
    out = []
    for row in rows.values():
        propensities, rewards = row.pop("propensities"), row.pop("rewards")
        row["mean_propensity"] = (math.fsum(propensities) / len(propensities)
                                  if propensities else None)
        row["logged_value"] = math.fsum(rewards) / len(rewards) if rewards else None
        out.append(row)
    return out
