"""Off-policy evaluation of a target policy on logged decisions, and a promotion gate.

Each evaluated decision contributes an importance weight
``w = pi_target(choice | context) / propensity`` (the propensity is what the
logging policy recorded with the decision) and a reward ``r``. Over ``n``
decisions:

- IPS  ``= sum(w * r) / n`` (unbiased when the logged propensities are right);
- SNIPS ``= sum(w * r) / sum(w)`` (self-normalised: a little bias, much less
  variance; this is the ``estimated_value``);
- effective sample size ``= sum(w) ** 2 / sum(w ** 2)``;
- logged value ``= sum(r) / n`` (what the logging policy earned);
- lift ``= estimated_value - logged_value`` (an absolute difference).

The confidence interval is a normal approximation around SNIPS with the
delta-method standard error ``sqrt(sum((w * (r - snips)) ** 2)) / sum(w)``. It
is approximate: with few samples or heavy weights (a low effective sample
size) it is too narrow, which is why the gate also asks for an ESS.

A score of 1.7e308 is finite, but sums to infinity; ``record_outcome`` bounds
scores at 1e9, and this module refuses to report an estimate built from a
non-finite accumulator (ADR 0116, review round 1, "Score bound").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any

from fleet.kernel.errors import ConfigurationError, EvaluationError
from fleet.learning.trajectories import DecisionPoint, Trajectory

TargetPolicy = Callable[[Any, Any, Any], float]
"""``(context, choice, alternatives) -> probability`` the target policy gives the logged choice."""

RewardFn = Callable[[Trajectory, DecisionPoint], "float | None"]
"""``(trajectory, decision) -> reward``; None leaves the decision out."""


def direct_reward(trajectory: Trajectory, decision: DecisionPoint) -> float | None:
    """The default reward: the sum of the rewards joined to the decision.

    A reward's value is its score, else its success flag as 1.0 / 0.0. None
    (the decision is skipped) when no reward joined it.
    """
    values = [v for v in (r.value for r in decision.rewards) if v is not None]
    return math.fsum(values) if values else None


def terminal_credit(trajectory: Trajectory, decision: DecisionPoint) -> float | None:
    """The decision's discounted share of the execution's terminal reward."""
    return decision.terminal_credit


@dataclass(frozen=True, slots=True)
class PolicyEvaluation:
    """What ``evaluate_policy`` found; ``promotion_gate`` judges it."""

    samples: int
    skipped: int
    ips: float
    snips: float
    effective_sample_size: float
    logged_value: float
    estimated_value: float
    lift: float
    std_error: float
    confidence_interval: tuple[float, float]
    confidence: float
    max_weight: float

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (for ``--json`` output and reports)."""
        out = asdict(self)
        out["confidence_interval"] = list(self.confidence_interval)
        return out


@dataclass(frozen=True, slots=True)
class GateResult:
    """``passed`` is True only when ``reasons`` is empty."""

    passed: bool
    reasons: tuple[str, ...] = ()


def evaluate_policy(trajectories: Iterable[Trajectory], target_policy: TargetPolicy, *,
                    reward: RewardFn = direct_reward, policy: str | None = None,
                    decision_id: str | None = None,
                    confidence: float = 0.95) -> PolicyEvaluation:
    """Estimate what ``target_policy`` would earn on the logged decisions.

    A decision takes part when it matches the filters, carries a logged
    propensity and ``reward`` gives it a value; one that matches but has no
    propensity or no reward is counted in ``skipped``.

    Args:
        trajectories: From ``trajectories(...)``.
        target_policy: ``(context, choice, alternatives) -> probability`` in
            ``[0, 1]`` that the new policy makes the logged choice.
        reward: The reward of a decision; ``direct_reward`` (the joined
            rewards, late ones included) by default, ``terminal_credit`` for
            the discounted terminal reward, or any callable.
        policy: Evaluate only decisions the named logging policy made.
        decision_id: Evaluate only decisions with this id.
        confidence: The confidence level of the interval, in ``(0, 1)``.

    Returns:
        The estimates; see the module docstring for the formulas.

    Raises:
        EvaluationError: no decision could be evaluated; a logged propensity
            outside ``(0, 1]``; a target probability outside ``[0, 1]``; a
            reward that is not a number; the target gives every logged choice
            probability 0; a reward or weight accumulator is not finite.
        ConfigurationError: ``confidence`` is not in ``(0, 1)``.
    """
    if not (isinstance(confidence, float) and 0.0 < confidence < 1.0):
        raise ConfigurationError(f"confidence must be a float in (0, 1), got {confidence!r}")
    weights: list[float] = []
    rewards: list[float] = []
    skipped = 0
    for path in trajectories:
        for d in path.decisions:
            if (policy is not None and d.policy_name != policy) or (
                    decision_id is not None and d.decision_id != decision_id):
                continue
            value = reward(path, d) if d.propensity is not None else None
            if d.propensity is None or value is None:
                skipped += 1
                continue
            weights.append(_probability(target_policy(d.context, d.choice, d.alternatives),
                                        path, d) / _propensity(d.propensity, path, d))
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise EvaluationError(f"reward of decision {d.decision_id!r} in "
                                      f"{path.execution_id!r} is {value!r}, not a number")
            rewards.append(float(value))
    n = len(weights)
    if n == 0:
        raise EvaluationError(f"no decision could be evaluated ({skipped} skipped: no "
                              "logged propensity or no reward joined)")
    acc = {
        "sum(w)": _total(weights),
        "sum(w*r)": _total([w * r for w, r in zip(weights, rewards, strict=True)]),
        "sum(w^2)": _total([w * w for w in weights]),
        "sum(r)": _total(rewards),
    }
    _require_finite(acc)
    sum_w, sum_wr, sum_w2, sum_r = acc.values()
    if sum_w == 0.0:
        raise EvaluationError("the target policy gives probability 0 to every logged "
                              "choice; the logs hold no evidence about it")
    snips = sum_wr / sum_w
    resid = _total([(w * (r - snips)) * (w * (r - snips))
                    for w, r in zip(weights, rewards, strict=True)])
    _require_finite({"sum((w*(r-snips))^2)": resid})
    std_error = math.sqrt(resid) / sum_w
    half = NormalDist().inv_cdf(0.5 + confidence / 2.0) * std_error
    logged = sum_r / n
    result = PolicyEvaluation(
        samples=n, skipped=skipped, ips=sum_wr / n, snips=snips,
        effective_sample_size=(sum_w * sum_w) / sum_w2, logged_value=logged,
        estimated_value=snips, lift=snips - logged, std_error=std_error,
        confidence_interval=(snips - half, snips + half), confidence=confidence,
        max_weight=max(weights))
    _require_finite({"ips": result.ips, "effective_sample_size": result.effective_sample_size,
                     "lift": result.lift, "interval": half})
    return result


def decision_kinds(trajectories: Iterable[Trajectory], *, policy: str | None = None,
                   decision_id: str | None = None) -> dict[tuple[str, str], int]:
    """``{(decision id, logging policy name): decisions}`` among those the filters keep.

    A target policy answers for one kind of decision (its choices, its context):
    ``evaluate_policy`` over decisions of several kinds feeds it choices it was
    never meant to price. Callers check this first (``fleet learn eval`` refuses
    several kinds without a filter).
    """
    kinds: dict[tuple[str, str], int] = {}
    for path in trajectories:
        for d in path.decisions:
            if (policy is None or d.policy_name == policy) and (
                    decision_id is None or d.decision_id == decision_id):
                key = (str(d.decision_id), str(d.policy_name))
                kinds[key] = kinds.get(key, 0) + 1
    return kinds


def promotion_gate(evaluation: PolicyEvaluation, *, min_lift: float = 0.0,
                   min_ess: float = 100.0) -> GateResult:
    """Decide whether the evaluated policy may replace the logging one.

    It fails when the lift, estimated value, logged value or effective sample
    size is not finite (``nan < min_lift`` is False, so a NaN would otherwise
    pass), when the lift is below ``min_lift``, or when the effective sample
    size is below ``min_ess``.

    Args:
        evaluation: From ``evaluate_policy`` (or built by hand).
        min_lift: The least ``estimated_value - logged_value`` to accept.
        min_ess: The least effective sample size to trust the estimate.

    Returns:
        ``GateResult(passed, reasons)``; every failed check adds a reason.

    Raises:
        ConfigurationError: a threshold is not a finite number.
    """
    for name, threshold in (("min_lift", min_lift), ("min_ess", min_ess)):
        if (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                or not math.isfinite(threshold)):
            raise ConfigurationError(f"{name} must be a finite number, got {threshold!r}")
    reasons: list[str] = []
    checked = {"lift": evaluation.lift, "estimated_value": evaluation.estimated_value,
               "logged_value": evaluation.logged_value,
               "effective_sample_size": evaluation.effective_sample_size}
    for name, value in checked.items():
        if not _finite(value):
            reasons.append(f"{name} is {value!r}, not a finite number")
    if _finite(evaluation.lift) and evaluation.lift < min_lift:
        reasons.append(f"lift {evaluation.lift:.6g} is below min_lift {min_lift:.6g}")
    ess = evaluation.effective_sample_size
    if _finite(ess) and ess < min_ess:
        reasons.append(f"effective sample size {ess:.6g} is below min_ess {min_ess:.6g}")
    return GateResult(not reasons, tuple(reasons))


def _probability(value: Any, path: Trajectory, d: DecisionPoint) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0.0 <= value <= 1.0):
        raise EvaluationError(
            f"target_policy gave {value!r} for decision {d.decision_id!r} in "
            f"{path.execution_id!r}; it must return a probability in [0, 1]")
    return float(value)


def _propensity(value: float, path: Trajectory, d: DecisionPoint) -> float:
    if not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise EvaluationError(
            f"decision {d.decision_id!r} in {path.execution_id!r} logged propensity "
            f"{value!r}, outside (0, 1]")
    return value


def _finite(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _total(values: list[float]) -> float:
    try:
        return math.fsum(values)
    except OverflowError:  # an intermediate sum past the float range
        return math.inf
    except ValueError:  # inf + -inf
        return math.nan


def _require_finite(accumulators: dict[str, float]) -> None:
    bad = {k: v for k, v in accumulators.items() if not math.isfinite(v)}
    if bad:
        raise EvaluationError(
            f"non-finite accumulator(s) {bad}: a reward or an importance weight is too "
            "large (record_outcome bounds scores at 1e9; check custom rewards and tiny "
            "propensities)")
