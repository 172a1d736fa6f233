"""Off-policy evaluation of a target policy on logged decisions, and a promotion gate.

Each priced decision (``fleet.learning.units``) has an importance weight
``w = pi_target(choice | context) / propensity`` (the propensity is what the
logging policy recorded with the decision) and a reward ``r``. Over ``n``
units, ``evaluate_policy(..., estimator=)`` gives:

- ``"ips"``: ``sum(w * r) / n``; unbiased when the logged propensities are right,
  noisy when some weights are large;
- ``"snips"`` (the default): ``sum(w * r) / sum(w)``; self-normalised: a little
  bias, much less variance;
- ``"dr"`` (doubly robust): ``sum(v + w * (r - q)) / n`` with a reward model
  ``q(context, choice)`` and ``v = sum over the alternatives a of
  pi_target(a | context) * q(context, a)``; unbiased when the propensities are
  right whatever the model, and the better the model the smaller its error. The
  model is ``reward_model=`` or, when none is given, cell means fitted on the
  logs with cross-fitting (``fleet.learning.reward_model``);
- ``"sndr"`` (self-normalised DR): ``sum(v) / n + sum(w * (r - q)) / sum(w)``;
  a wrong model hurts it far less than it hurts plain DR;
- ``"pdis"`` (per-decision importance sampling), for flows with several
  decisions: the unit is a trajectory, and the reward at its decision ``t`` is
  weighted by ``rho_t``, the product of the weights of decisions 1 to ``t``
  (``sum over units and t of rho_t * r_t / n``); with ``reward=terminal_credit``
  the terminal reward counts once, weighted by every ratio;
- ``"snpdis"``: PDIS self-normalised at each step (``sum_t sum(rho_t * r_t) /
  sum(rho_t)``).

Besides the chosen estimate, every evaluation reports ``ips`` and ``snips``
(for PDIS: ``pdis`` and ``snpdis``) of the same units, the logged value (the
mean reward the logging policy earned), ``lift = estimated_value -
logged_value`` and:

- the **effective sample size**, ``ESS = sum(w) ** 2 / sum(w ** 2)`` (Kish's)
  over the units' weights (for PDIS each trajectory's whole product): how many
  decisions made by the target itself the estimate is worth. It is the one
  definition every surface shows (``fleet learn eval``, ``fleet learn report``,
  the demo). ``promotion_gate`` asks for ``DEFAULT_MIN_ESS`` (100) unless told
  otherwise; docs/learning.md says why;
- a **reward** is ``reward(trajectory, decision)``: by default ``direct_reward``,
  the sum of the rewards joined to the decision (each its score, else its
  success flag as 1 / 0), the definition ``fleet learn report`` uses too;
- the **interval** at ``confidence``: normal around the estimate with the
  influence-function standard error, or with ``bootstrap=N`` the percentile
  interval of ``N`` resamples of the units (``seed=`` repeats it); see
  ``fleet.learning.estimators``. It is approximate: with few units or heavy
  weights (a low ESS) it is too narrow, which is why the gate asks for an ESS.

A score of 1.7e308 is finite, but sums to infinity; ``record_outcome`` bounds
scores at 1e9, and this module refuses to report an estimate built from a
non-finite accumulator (ADR 0116, review round 1, "Score bound").
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from fleet.kernel.errors import (
    ConfigurationError,
    EvaluationError,
    TooFewSamplesError,
    WeightOverflowError,
)
from fleet.learning.estimators import (
    Estimate,
    check_resamples,
    estimate,
    mean_form,
    offset_ratio_form,
    ratio_form,
    ratio_sum_form,
)
from fleet.learning.reward_model import FOLDS, CellMeans, RewardModel, cross_fitted
from fleet.learning.trajectories import DecisionPoint, Trajectory
from fleet.learning.units import (
    DecisionUnit,
    RewardFn,
    TargetPolicy,
    Targets,
    decision_units,
    trajectory_units,
)

#: Every estimator ``evaluate_policy`` knows, in the order reports show them.
ESTIMATORS = ("ips", "snips", "dr", "sndr", "pdis", "snpdis")
#: The estimators whose unit is a trajectory.
TRAJECTORY_ESTIMATORS = ("pdis", "snpdis")
#: The estimators that use a reward model.
MODEL_ESTIMATORS = ("dr", "sndr")
#: The effective sample size the promotion gate asks for unless told otherwise
#: (``fleet learn eval --min-ess`` too); docs/learning.md explains the figure.
DEFAULT_MIN_ESS = 100.0


def direct_reward(trajectory: Trajectory, decision: DecisionPoint) -> float | None:
    """The default reward: the sum of the rewards joined to the decision.

    A reward's value is its score, else its success flag as 1.0 / 0.0. None
    (the decision is skipped) when no reward joined it.
    """
    values = [v for v in (r.value for r in decision.rewards) if v is not None]
    return math.fsum(values) if values else None


def terminal_credit(trajectory: Trajectory, decision: DecisionPoint) -> float | None:
    """The decision's discounted share of the execution's terminal reward.

    With ``estimator="pdis"`` it means the terminal reward itself, counted once
    at the trajectory's end (discounted to its first decision).
    """
    return decision.terminal_credit


@dataclass(frozen=True, slots=True)
class PolicyEvaluation:
    """What ``evaluate_policy`` found; ``promotion_gate`` judges it.

    ``estimated_value`` is the ``estimator``'s; ``std_error`` its
    influence-function standard error; ``confidence_interval`` is ``interval``
    (``"normal"``, or ``"bootstrap"`` of ``bootstrap`` resamples). ``ips`` and
    ``snips`` are the plain and self-normalised importance-sampling estimates of
    the same units (PDIS and its self-normalised form for the trajectory
    estimators). ``reward_model`` says which model DR used.
    """

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
    estimator: str = "snips"
    interval: str = "normal"
    bootstrap: int = 0
    reward_model: str | None = None

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


def evaluate_policy(trajectories: Iterable[Trajectory], target_policy: Targets, *,
                    estimator: str = "snips", reward: RewardFn = direct_reward,
                    policy: str | None = None, decision_id: str | None = None,
                    confidence: float = 0.95, reward_model: RewardModel | None = None,
                    bootstrap: int = 0, seed: int | None = None) -> PolicyEvaluation:
    """Estimate what ``target_policy`` would earn on the logged decisions.

    A decision takes part when it matches the filters, the target answers for
    it, it carries a logged propensity and ``reward`` gives it a value; one that
    matches but has no propensity or no reward is counted in ``skipped`` (for
    PDIS, the unit counted is a trajectory). ``PolicyEvaluator`` evaluates one
    target with several estimators and reads the logs once.

    Args:
        trajectories: From ``trajectories(...)``.
        target_policy: ``(context, choice, alternatives) -> probability`` in
            ``[0, 1]`` that the new policy makes the logged choice; or a mapping
            of decision ids to such functions (a decision it does not name is
            not evaluated, or for PDIS keeps the logging policy).
        estimator: One of ``ESTIMATORS``; the module docstring gives each formula.
        reward: The reward of a decision; ``direct_reward`` (the joined
            rewards, late ones included) by default, ``terminal_credit`` for
            the discounted terminal reward, or any callable.
        policy: Evaluate only decisions the named logging policy made.
        decision_id: Evaluate only decisions with this id.
        confidence: The confidence level of the interval, in ``(0, 1)``.
        reward_model: For ``dr`` / ``sndr``: ``(context, choice) -> expected
            reward``. None fits cell means on the logs, cross-fitted.
        bootstrap: 0 for the normal interval; N for the percentile interval of
            N resamples (at least 5 beyond each end: 200 at 95%).
        seed: The bootstrap's seed (None: a fresh one each call).

    Returns:
        The estimates; see the module docstring for the formulas.

    Raises:
        InvalidTargetPolicyError: the target gave something that is not a
            probability, or probabilities over a decision's alternatives that
            do not sum to 1.
        WeightOverflowError: an importance weight (or a product of them) whose
            square is past the float range.
        TooFewSamplesError: no decision could be evaluated; fewer than 2 units
            (10 for a bootstrap, 10 to cross-fit a reward model).
        EvaluationError: a logged propensity outside ``(0, 1]``; a reward or a
            model's prediction that is not a number; DR on a decision that does
            not list its alternatives; the target gives every logged choice
            probability 0; a reward or weight accumulator is not finite.
        ConfigurationError: an unknown estimator; ``confidence`` not in
            ``(0, 1)``; ``bootstrap`` too small for the interval; a
            ``reward_model`` that is not callable.
    """
    _check(estimator, confidence, reward_model, bootstrap)
    evaluator = PolicyEvaluator(trajectories, target_policy, reward=reward, policy=policy,
                                decision_id=decision_id)
    return evaluator.evaluate(estimator, confidence=confidence, reward_model=reward_model,
                              bootstrap=bootstrap, seed=seed)


def _check(estimator: str, confidence: float, reward_model: RewardModel | None,
           bootstrap: int) -> None:
    if not (isinstance(confidence, float) and 0.0 < confidence < 1.0):
        raise ConfigurationError(f"confidence must be a float in (0, 1), got {confidence!r}")
    if estimator not in ESTIMATORS:
        raise ConfigurationError(f"estimator must be one of {', '.join(ESTIMATORS)}; got "
                                 f"{estimator!r}")
    if reward_model is not None and not callable(reward_model):
        raise ConfigurationError(f"reward_model must be a callable (context, choice) -> "
                                 f"expected reward, got {reward_model!r}")
    check_resamples(bootstrap, confidence)


@dataclass(frozen=True, slots=True)
class _Units:
    """The units of one kind, their weights and what every estimator of them shares."""

    units: list[Any]
    skipped: int
    weights: list[float]
    returns: list[float]  # each unit's reward (a trajectory's: the sum of its rewards)
    plain: float  # IPS, or PDIS
    normalised: float  # SNIPS, or SNPDIS
    ess: float
    columns: dict[str, list[list[float]]]


class PolicyEvaluator:
    """One target policy on one set of logs, evaluated with any of ``ESTIMATORS``.

    The logs are read once per kind of unit (decisions, trajectories) and DR's
    reward model fitted once per model, whichever estimators are asked for;
    ``evaluate_policy`` is ``PolicyEvaluator(...).evaluate(...)``::

        evaluator = PolicyEvaluator(paths, target, decision_id="discount")
        snips, dr = evaluator.evaluate("snips"), evaluator.evaluate("dr")

    The arguments are ``evaluate_policy``'s; so are the errors, raised by
    ``evaluate``.
    """

    def __init__(self, trajectories: Iterable[Trajectory], target_policy: Targets, *,
                 reward: RewardFn = direct_reward, policy: str | None = None,
                 decision_id: str | None = None) -> None:
        self.paths = list(trajectories)
        self.target_policy = target_policy
        self.reward = reward
        self.policy = policy
        self.decision_id = decision_id
        self._decisions: _Units | None = None
        self._trajectories: _Units | None = None
        self._models: dict[Any, tuple[list[float], list[float], str]] = {}

    def evaluate(self, estimator: str = "snips", *, confidence: float = 0.95,
                 reward_model: RewardModel | None = None, bootstrap: int = 0,
                 seed: int | None = None) -> PolicyEvaluation:
        """The estimate of ``estimator``; see ``evaluate_policy``."""
        _check(estimator, confidence, reward_model, bootstrap)
        model = None
        if estimator in TRAJECTORY_ESTIMATORS:
            data = self._trajectory_units()
            form = mean_form() if estimator == "pdis" else ratio_sum_form(
                len(data.columns["snpdis"]) // 2)
            columns = data.columns[estimator]
        else:
            data = self._decision_units()
            weights, rewards = data.weights, data.returns
            form = {"ips": mean_form(), "snips": ratio_form()}.get(estimator, mean_form())
            columns = data.columns.get(estimator, [])
            if estimator in MODEL_ESTIMATORS:
                v, q, model = self._model_terms(data, reward_model)
                correction = [w * (r - qi) for w, r, qi in zip(weights, rewards, q, strict=True)]
                if estimator == "dr":
                    columns = [[vi + c for vi, c in zip(v, correction, strict=True)]]
                else:
                    columns, form = [v, correction, weights], offset_ratio_form()
        found = estimate(columns, form, confidence=confidence, bootstrap=bootstrap, seed=seed)
        n = len(data.units)
        return _result(found, estimator, n, data.skipped, data.plain, data.normalised,
                       data.ess, math.fsum(data.returns) / n, max(data.weights), confidence,
                       bootstrap, model)

    def decision_weights(self) -> list[float]:
        """The importance weights of the evaluated decisions (for a weight histogram).

        Raises:
            The errors of ``evaluate`` that reading the decisions can raise.
        """
        return list(self._decision_units().weights)

    def _decision_units(self) -> _Units:
        if self._decisions is None:
            units, skipped = decision_units(self.paths, self.target_policy, self.reward,
                                            policy=self.policy, decision_id=self.decision_id)
            weights = [u.weight for u in units]
            rewards = [u.reward for u in units]
            wr = [w * r for w, r in zip(weights, rewards, strict=True)]
            sum_w, ess = _weights(weights, rewards, wr, skipped)
            n = len(units)
            self._decisions = _Units(units, skipped, weights, rewards, math.fsum(wr) / n,
                                     math.fsum(wr) / sum_w, ess,
                                     {"ips": [wr], "snips": [wr, weights]})
        return self._decisions

    def _trajectory_units(self) -> _Units:
        if self._trajectories is None:
            units, skipped = trajectory_units(
                self.paths, self.target_policy, self.reward, policy=self.policy,
                decision_id=self.decision_id, terminal=self.reward is terminal_credit)
            weights = [u.weight for u in units]
            returns = [math.fsum(u.rewards) for u in units]
            per_unit = [math.fsum(rho * r for rho, r in zip(u.ratios, u.rewards, strict=True))
                        for u in units]
            _, ess = _weights(weights, returns, per_unit, skipped)
            n = len(units)
            steps = max(len(u.ratios) for u in units)
            stepped: list[list[float]] = []
            for t in range(steps):
                rho = [_at(u.ratios, t, u.ratios[-1]) for u in units]
                stepped += [[p * _at(u.rewards, t, 0.0) for p, u in zip(rho, units,
                                                                        strict=True)], rho]
            snpdis = ratio_sum_form(steps).value([math.fsum(col) / n for col in stepped])
            self._trajectories = _Units(units, skipped, weights, returns,
                                        math.fsum(per_unit) / n, snpdis, ess,
                                        {"pdis": [per_unit], "snpdis": stepped})
        return self._trajectories

    def _model_terms(self, data: _Units, given: RewardModel | None) -> tuple[
            list[float], list[float], str]:
        """Each unit's ``v`` (the target's expected model reward) and ``q`` (the model's
        reward for the logged choice), and which model gave them; once per model."""
        try:
            return self._models[given]
        except (KeyError, TypeError):  # not yet, or a model that is not hashable
            pass
        units: list[DecisionUnit] = data.units
        missing = next((u for u in units if u.options is None), None)
        if missing is not None:
            raise EvaluationError(
                f"{missing.where} does not list its alternatives with the logged choice among "
                "them; doubly robust estimation takes the target's expectation of the reward "
                "model over them (log Decision(alternatives=...), or use snips)")
        if given is None:
            models: list[RewardModel] = list(cross_fitted(
                [(u.context, u.choice, u.reward) for u in units]))
            label = f"cell means, {FOLDS}-fold cross-fitted"
        else:
            models, label = [given] * len(units), "given"
        v: list[float] = []
        q: list[float] = []
        for u, model in zip(units, models, strict=True):
            assert u.options is not None  # checked above
            choices = [a for a, _ in u.options]
            raw = (model.predict(u.context, choices) if isinstance(model, CellMeans)
                   else [model(u.context, a) for a in choices])
            predicted = [_prediction(value, u, a) for value, a in zip(raw, choices,
                                                                      strict=True)]
            v.append(math.fsum(p * value for (_, p), value in zip(u.options, predicted,
                                                                   strict=True)))
            q.append(predicted[u.logged])
        found = (v, q, label)
        try:
            self._models[given] = found
        except TypeError:
            pass
        return found


def _at(values: tuple[float, ...], t: int, past_the_end: float) -> float:
    # A trajectory that ended before step t stays where it ended: its ratio holds
    # and it earns nothing more (the absorbing state of a fixed horizon).
    return values[t] if t < len(values) else past_the_end


def _weights(weights: list[float], rewards: list[float], weighted: list[float],
             skipped: int) -> tuple[float, float]:
    """``sum(w)`` and the ESS, once every accumulator is finite and some weight is not 0."""
    if not weights:
        raise TooFewSamplesError(f"no decision could be evaluated ({skipped} skipped: no "
                                 "logged propensity or no reward joined)")
    sum_w, sum_w2 = _total(weights), _total([w * w for w in weights])
    if not (math.isfinite(sum_w) and math.isfinite(sum_w2)):
        raise WeightOverflowError(
            f"non-finite: the importance weights sum to {sum_w!r} and their squares to "
            f"{sum_w2!r} over {len(weights)} units; the logged propensities are too small "
            "for this target")
    _require_finite({"sum(w*r)": _total(weighted), "sum(r)": _total(rewards)})
    if sum_w == 0.0:
        raise EvaluationError("the target policy gives probability 0 to every logged "
                              "choice; the logs hold no evidence about it")
    return sum_w, (sum_w * sum_w) / sum_w2


def _prediction(value: Any, u: DecisionUnit, choice: Any) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value)):
        raise EvaluationError(f"reward_model gave {value!r} for choice {choice!r} in "
                              f"context {u.context!r}; it must return a finite number")
    return float(value)


def _result(found: Estimate, estimator: str, n: int, skipped: int, ips: float, snips: float,
            ess: float, logged: float, max_weight: float, confidence: float, bootstrap: int,
            model: str | None) -> PolicyEvaluation:
    result = PolicyEvaluation(
        samples=n, skipped=skipped, ips=ips, snips=snips, effective_sample_size=ess,
        logged_value=logged, estimated_value=found.value, lift=found.value - logged,
        std_error=found.std_error, confidence_interval=found.interval,
        confidence=confidence, max_weight=max_weight, estimator=estimator,
        interval=found.method, bootstrap=bootstrap, reward_model=model)
    _require_finite({"ips": ips, "snips": snips, "effective_sample_size": ess,
                     "lift": result.lift, "interval": found.interval[1] - found.interval[0]})
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
                kind = (str(d.decision_id), str(d.policy_name))
                kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def promotion_gate(evaluation: PolicyEvaluation, *, min_lift: float = 0.0,
                   min_ess: float = DEFAULT_MIN_ESS) -> GateResult:
    """Decide whether the evaluated policy may replace the logging one.

    It fails when the lift, estimated value, logged value or effective sample
    size is not finite (``nan < min_lift`` is False, so a NaN would otherwise
    pass), when the lift is below ``min_lift``, or when the effective sample
    size is below ``min_ess``.

    Args:
        evaluation: From ``evaluate_policy`` (or built by hand).
        min_lift: The least ``estimated_value - logged_value`` to accept.
        min_ess: The least effective sample size to trust the estimate
            (``DEFAULT_MIN_ESS``, 100: below it the intervals of the simulations in
            docs/learning.md cover the truth less often than they say).

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


__all__ = ["DEFAULT_MIN_ESS", "ESTIMATORS", "GateResult", "PolicyEvaluation", "PolicyEvaluator",
           "RewardFn",
           "TargetPolicy", "Targets", "decision_kinds", "direct_reward", "evaluate_policy",
           "promotion_gate", "terminal_credit"]
