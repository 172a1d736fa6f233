"""The estimators by hand (DR, SNDR, PDIS, SNPDIS, IPS), the bootstrap and every refusal."""

from __future__ import annotations

import math
import sys
from fractions import Fraction
from typing import Any

import pytest

from fleet import (
    ConfigurationError,
    EvaluationError,
    InvalidTargetPolicyError,
    TooFewSamplesError,
    WeightOverflowError,
)
from fleet.learning import (
    DEFAULT_MIN_ESS,
    DecisionPoint,
    Reward,
    Trajectory,
    direct_reward,
    evaluate_policy,
    fit_reward_model,
    promotion_gate,
    terminal_credit,
)
from fleet.learning.comparison import (
    compare_policies,
    default_estimators,
    logged_summary,
    summarise_weights,
)
from fleet.learning.evaluation import PolicyEvaluator
from fleet.learning.reward_model import cross_fitted
from fleet.learning.simulation import BANDIT, FLOW


def _decision(choice: Any, p: float | None, reward: float | None, *, segment: str = "s",
              decision_id: str = "d", alternatives: Any = ("a", "b"),
              credit: float | None = None, policy: str = "logging") -> DecisionPoint:
    rewards = () if reward is None else (Reward("k", reward),)
    return DecisionPoint(decision_id, 1, choice, policy, 1, p,
                         None if alternatives is None else list(alternatives),
                         {"segment": segment}, rewards, credit)


def _paths(*decisions: DecisionPoint) -> list[Trajectory]:
    return [Trajectory(f"e{i}", "f", "completed", None, (d,)) for i, d in enumerate(decisions)]


def _target(context: Any, choice: Any, alternatives: Any) -> float:
    return 0.8 if choice == "a" else 0.2


def _model(context: Any, choice: Any) -> float:
    return 0.7 if choice == "a" else 0.1


# Logged: (choice, propensity, reward).
LOGGED = [("a", 0.5, 1.0), ("b", 0.5, 0.0), ("a", 0.25, 0.5), ("b", 0.75, 1.0)]
W = [Fraction(8, 5), Fraction(2, 5), Fraction(16, 5), Fraction(4, 15)]
R = [Fraction(1), Fraction(0), Fraction(1, 2), Fraction(1)]
Q = {"a": Fraction(7, 10), "b": Fraction(1, 10)}
V = Fraction(4, 5) * Q["a"] + Fraction(1, 5) * Q["b"]  # the target's model value: 29/50


def _logged() -> list[Trajectory]:
    return _paths(*(_decision(c, p, r) for c, p, r in LOGGED))


def test_dr_and_sndr_by_hand() -> None:
    terms = [V + w * (r - Q[c]) for w, r, (c, _, _) in zip(W, R, LOGGED, strict=True)]
    dr = evaluate_policy(_logged(), _target, estimator="dr", reward_model=_model)
    assert dr.estimator == "dr"
    assert dr.reward_model == "given"
    assert dr.estimated_value == pytest.approx(float(sum(terms) / 4), abs=1e-12)
    mean = sum(terms) / 4
    assert dr.std_error == pytest.approx(
        math.sqrt(float(sum((t - mean) ** 2 for t in terms))) / 4, rel=1e-12)
    low, high = dr.confidence_interval
    assert dr.estimated_value - low == pytest.approx(high - dr.estimated_value)
    assert high - dr.estimated_value == pytest.approx(1.959964 * dr.std_error, rel=1e-5)
    # IPS and SNIPS of the same decisions ride along, whatever the estimator.
    assert dr.ips == pytest.approx(float(Fraction(13, 15)), abs=1e-12)
    assert dr.snips == pytest.approx(float(Fraction(26, 41)), abs=1e-12)
    assert dr.lift == pytest.approx(dr.estimated_value - 0.625)

    correction = sum(w * (r - Q[c]) for w, r, (c, _, _) in zip(W, R, LOGGED, strict=True))
    sndr = evaluate_policy(_logged(), _target, estimator="sndr", reward_model=_model)
    assert sndr.estimated_value == pytest.approx(float(V + correction / sum(W)), abs=1e-12)
    # A model off by a constant changes DR, not SNDR: the offset cancels.
    def off(context: Any, choice: Any) -> float:
        return _model(context, choice) + 0.4
    assert evaluate_policy(_logged(), _target, estimator="sndr",
                           reward_model=off).estimated_value == pytest.approx(
        sndr.estimated_value, abs=1e-12)
    moved = evaluate_policy(_logged(), _target, estimator="dr", reward_model=off)
    assert moved.estimated_value == pytest.approx(
        dr.estimated_value + 0.4 * (1 - float(sum(W)) / 4), abs=1e-12)


def test_ips_interval_and_every_estimator_on_the_same_units() -> None:
    ips = evaluate_policy(_logged(), _target, estimator="ips", confidence=0.9)
    terms = [w * r for w, r in zip(W, R, strict=True)]
    mean = sum(terms) / 4
    assert ips.estimated_value == pytest.approx(float(mean))
    assert ips.std_error == pytest.approx(
        math.sqrt(float(sum((t - mean) ** 2 for t in terms))) / 4, rel=1e-12)
    assert ips.confidence == 0.9
    assert ips.effective_sample_size == pytest.approx(float(sum(W) ** 2 / sum(w * w for w in W)))
    evaluator = PolicyEvaluator(_logged(), _target)
    for estimator in ("ips", "snips", "dr", "sndr"):
        one = evaluator.evaluate(estimator, reward_model=_model)
        assert one == evaluate_policy(_logged(), _target, estimator=estimator,
                                      reward_model=_model)
    assert evaluator.decision_weights() == pytest.approx([float(w) for w in W])


def _flow(first: tuple[str, float], second: tuple[str, float], won: float | None,
          eid: str, direct: tuple[float | None, float | None] = (None, None)) -> Trajectory:
    one = DecisionPoint("offer", 1, first[0], "offers", 1, first[1], ["x", "y"], {"n": 1},
                        () if direct[0] is None else (Reward("k", direct[0]),), won)
    two = DecisionPoint("price", 2, second[0], "prices", 1, second[1], ["lo", "hi"], {"n": 2},
                        () if direct[1] is None else (Reward("k", direct[1]),), won)
    return Trajectory(eid, "f", "completed" if won else "failed", won, (one, two))


def _offer(context: Any, choice: Any, alternatives: Any) -> float:
    return 0.9 if choice == "x" else 0.1


def _price(context: Any, choice: Any, alternatives: Any) -> float:
    return 0.5


def test_pdis_and_its_self_normalised_form_by_hand() -> None:
    paths = [_flow(("x", 0.5), ("lo", 0.25), 1.0, "t1"), _flow(("y", 0.5), ("hi", 0.75), 0.0, "t2"),
             _flow(("x", 0.25), ("hi", 0.5), 1.0, "t3")]
    targets = {"offer": _offer, "price": _price}
    rho = [Fraction(9, 5) * 2, Fraction(1, 5) * Fraction(2, 3), Fraction(18, 5) * 1]
    won = [1, 0, 1]
    pdis = evaluate_policy(paths, targets, estimator="pdis", reward=terminal_credit)
    assert pdis.samples == 3
    assert pdis.estimated_value == pytest.approx(float(sum(r * w for r, w in zip(
        rho, won, strict=True)) / 3), abs=1e-12)
    assert pdis.effective_sample_size == pytest.approx(float(sum(rho) ** 2 / sum(
        r * r for r in rho)))
    assert pdis.max_weight == pytest.approx(float(rho[2]))
    assert pdis.logged_value == pytest.approx(2 / 3)
    snpdis = evaluate_policy(paths, targets, estimator="snpdis", reward=terminal_credit)
    assert snpdis.estimated_value == pytest.approx(float(sum(r * w for r, w in zip(
        rho, won, strict=True)) / sum(rho)), abs=1e-12)
    assert (snpdis.ips, snpdis.snips) == (pdis.estimated_value, snpdis.estimated_value)

    # Rewards at each decision: each weighted by the ratios up to its own decision.
    direct = [_flow(("x", 0.5), ("lo", 0.25), None, "u1", (1.0, 2.0)),
              _flow(("y", 0.5), ("hi", 0.75), None, "u2", (0.0, 3.0))]
    first = [Fraction(9, 5), Fraction(1, 5)]
    both = [Fraction(18, 5), Fraction(2, 15)]
    value = evaluate_policy(direct, targets, estimator="pdis").estimated_value
    assert value == pytest.approx(float((first[0] * 1 + both[0] * 2 + first[1] * 0
                                         + both[1] * 3) / 2), abs=1e-12)
    normalised = evaluate_policy(direct, targets, estimator="snpdis").estimated_value
    assert normalised == pytest.approx(float(
        (first[0] * 1 + first[1] * 0) / sum(first) + (both[0] * 2 + both[1] * 3) / sum(both)),
        abs=1e-12)
    # A decision the mapping does not name keeps the logging policy (ratio 1).
    only_offer = evaluate_policy(paths, {"offer": _offer}, estimator="pdis",
                                 reward=terminal_credit)
    assert only_offer.estimated_value == pytest.approx((1.8 + 0.2 * 0 + 3.6) / 3, abs=1e-12)


def test_a_mapping_target_evaluates_only_the_decisions_it_names() -> None:
    paths = [_flow(("x", 0.5), ("lo", 0.5), 1.0, f"t{i}", (1.0, 0.0)) for i in range(4)]
    by_name = evaluate_policy(paths, {"offer": _offer}, estimator="snips")
    assert by_name.samples == 4  # the price decisions are not evaluated
    assert by_name.estimated_value == pytest.approx(1.0)


def test_bootstrap_is_repeatable_with_a_seed_and_brackets_the_estimate() -> None:
    paths = BANDIT.logs(300, seed=1)
    a = evaluate_policy(paths, BANDIT.target, bootstrap=200, seed=7)
    b = evaluate_policy(paths, BANDIT.target, bootstrap=200, seed=7)
    c = evaluate_policy(paths, BANDIT.target, bootstrap=200, seed=8)
    normal = evaluate_policy(paths, BANDIT.target)
    assert a.interval == "bootstrap"
    assert a.bootstrap == 200
    assert a.confidence_interval == b.confidence_interval
    assert a.confidence_interval != c.confidence_interval
    low, high = a.confidence_interval
    assert low < a.estimated_value < high
    # The percentile interval and the normal one agree roughly on 300 decisions.
    n_low, n_high = normal.confidence_interval
    assert (high - low) == pytest.approx(n_high - n_low, rel=0.25)
    for estimator in ("ips", "dr", "sndr"):
        boot = evaluate_policy(paths, BANDIT.target, estimator=estimator, bootstrap=200, seed=1)
        assert boot.confidence_interval[0] < boot.estimated_value < boot.confidence_interval[1]
    flow = evaluate_policy(FLOW.logs(200, seed=1), FLOW.targets(), estimator="snpdis",
                           reward=terminal_credit, bootstrap=200, seed=3)
    assert flow.confidence_interval[0] < flow.estimated_value < flow.confidence_interval[1]


# ------------------------------------------------------------------- refusals
def test_a_target_that_is_not_a_probability_is_refused() -> None:
    for bad in (1.5, -0.1, math.nan, True, "0.5", None):
        def target(c: Any, ch: Any, a: Any, bad: Any = bad) -> Any:
            return bad
        with pytest.raises(InvalidTargetPolicyError, match="probability in"):
            evaluate_policy(_logged(), target)
    # Each answer a probability, but not a distribution over the alternatives.
    with pytest.raises(InvalidTargetPolicyError, match=r"sum to 1\.6, not 1"):
        evaluate_policy(_logged(), lambda c, ch, a: 0.8)
    # ... refused for PDIS too, and for every estimator.
    with pytest.raises(InvalidTargetPolicyError, match="sum to"):
        evaluate_policy([_flow(("x", 0.5), ("lo", 0.5), 1.0, "t")],
                        {"offer": lambda c, ch, a: 0.9}, estimator="pdis",
                        reward=terminal_credit)
    assert issubclass(InvalidTargetPolicyError, EvaluationError)
    assert InvalidTargetPolicyError.code == "invalid_target_policy"


def test_weights_that_overflow_are_refused() -> None:
    tiny = _paths(*(_decision("a", 1e-300, 1.0, alternatives=None) for _ in range(3)))
    with pytest.raises(WeightOverflowError, match="non-finite") as raised:
        evaluate_policy(tiny, lambda c, ch, a: 1.0)
    assert "e0" in raised.value.message
    # A product of weights over many decisions overflows though each weight is finite.
    decisions = tuple(DecisionPoint(f"d{k}", k, "a", "p", 1, 1e-20, None, None,
                                    terminal_credit=1.0) for k in range(20))
    long = [Trajectory(f"t{i}", "f", "completed", 1.0, decisions) for i in range(3)]
    assert all(math.isfinite(1.0 / d.propensity) for d in decisions)  # type: ignore[operator]
    with pytest.raises(WeightOverflowError, match="product of the importance weights"):
        evaluate_policy(long, lambda c, ch, a: 1.0, estimator="pdis", reward=terminal_credit)
    # Each square finite, their sum past the float range.
    many = _paths(*(_decision("a", 1e-154, 1.0, alternatives=None) for _ in range(200)))
    with pytest.raises(WeightOverflowError, match="squares to inf over 200 units"):
        evaluate_policy(many, lambda c, ch, a: 1.0)
    assert WeightOverflowError.code == "weight_overflow"


def test_too_few_samples_for_the_interval_asked_are_refused() -> None:
    one = _paths(_decision("a", 0.5, 1.0))
    with pytest.raises(TooFewSamplesError, match="needs at least 2"):
        evaluate_policy(one, _target)
    with pytest.raises(TooFewSamplesError, match="no decision could be evaluated"):
        evaluate_policy(_paths(_decision("a", None, 1.0)), _target)
    # A bootstrap needs 10 units; the fitted reward model 10 (5 folds of 2).
    with pytest.raises(TooFewSamplesError, match="a bootstrap needs at least 10"):
        evaluate_policy(_logged(), _target, bootstrap=200, seed=1)
    with pytest.raises(TooFewSamplesError, match="5-fold cross-fitting needs at least 10"):
        evaluate_policy(_logged(), _target, estimator="dr")
    # Too few resamples for the confidence asked: refused before any data is read.
    with pytest.raises(ConfigurationError, match="at least 200"):
        evaluate_policy(_logged(), _target, bootstrap=50)
    with pytest.raises(ConfigurationError, match="at least 100"):
        evaluate_policy(_logged(), _target, bootstrap=99, confidence=0.9)
    assert TooFewSamplesError.code == "too_few_samples"


def test_unusable_arguments_and_models_are_refused() -> None:
    for bad in ("DR", "wis", ""):
        with pytest.raises(ConfigurationError, match="estimator must be one of"):
            evaluate_policy(_logged(), _target, estimator=bad)
    with pytest.raises(ConfigurationError, match="reward_model must be a callable"):
        evaluate_policy(_logged(), _target, estimator="dr", reward_model=0.5)  # type: ignore[arg-type]
    for resamples in (-1, 1.5, True):
        with pytest.raises(ConfigurationError, match="bootstrap must be an int"):
            evaluate_policy(_logged(), _target, bootstrap=resamples)  # type: ignore[arg-type]
    with pytest.raises(EvaluationError, match="reward_model gave nan"):
        evaluate_policy(_logged(), _target, estimator="dr",
                        reward_model=lambda c, ch: math.nan)
    # DR needs the alternatives to take the target's expectation of the model.
    bare = _paths(*(_decision(c, p, r, alternatives=None) for c, p, r in LOGGED))
    assert evaluate_policy(bare, _target).samples == 4  # SNIPS does not
    with pytest.raises(EvaluationError, match="does not list its alternatives"):
        evaluate_policy(bare, _target, estimator="dr", reward_model=_model)
    three = _paths(*(_decision(c, p, r, alternatives=("a", "b", "c")) for c, p, r in LOGGED))
    with pytest.raises(EvaluationError, match="probability 0"):
        evaluate_policy(three, lambda c, ch, a: 0.0 if ch in ("a", "b") else 1.0)


# ------------------------------------------------------------- the reward model
def test_the_fitted_model_shrinks_cells_and_is_cross_fitted() -> None:
    model = fit_reward_model([({"s": 1}, "a", 1.0), ({"s": 1}, "a", 1.0), ({"s": 2}, "a", 0.0),
                              ({"s": 2}, "b", 0.5)])
    arm_a = (2.0 + 2 * 0.625) / (3 + 2)
    assert model({"s": 1}, "a") == pytest.approx((2.0 + 2 * arm_a) / 4)
    assert model({"s": 9}, "a") == pytest.approx(arm_a)  # an unseen context: the arm's mean
    assert model({"s": 9}, "z") == pytest.approx(0.625)  # an unseen choice: the mean of all
    kinds = fit_reward_model([(None, 1, 1.0), (None, "1", 0.0), (None, True, 0.5)])
    assert kinds(None, 1) > kinds(None, True) > kinds(None, "1")  # three choices, not one
    samples = [({"s": 1}, "a", float(i)) for i in range(10)]
    models = cross_fitted(samples)
    for i, m in enumerate(models):  # unit i is predicted without its own reward
        others = [float(j) for j in range(10) if j % 5 != i % 5]
        assert m.mean == pytest.approx(sum(others) / len(others))
    with pytest.raises(TooFewSamplesError):
        cross_fitted(samples[:9])


# ------------------------------------------------- the comparison and the summary
def test_compare_policies_reports_each_estimator_or_why_not() -> None:
    paths = BANDIT.logs(200, seed=2)
    [good, broken] = compare_policies(paths, {"good": BANDIT.target,
                                              "broken": lambda c, ch, a: 0.9})
    assert list(good.evaluations) == ["ips", "snips", "dr", "sndr"]
    assert good.errors == {}
    assert good.gate is not None
    assert good.gate.passed == promotion_gate(good.evaluations["snips"]).passed
    assert good.weights is not None
    assert good.weights.count == 200
    assert good.weights.effective_sample_size == pytest.approx(
        good.evaluations["snips"].effective_sample_size)
    assert sum(b[2] for b in good.weights.bins) == 200
    assert broken.evaluations == {}
    assert set(broken.errors) == {"ips", "snips", "dr", "sndr"}
    assert all(e.startswith("InvalidTargetPolicyError: ") for e in broken.errors.values())
    assert broken.gate is None
    assert broken.to_dict()["gate"] is None
    with pytest.raises(ConfigurationError, match="unknown estimator"):
        compare_policies(paths, {"good": BANDIT.target}, estimators=["snips", "magic"])
    flows = FLOW.logs(50, seed=1)
    assert default_estimators(flows, terminal_credit)[-2:] == ("pdis", "snpdis")
    assert "pdis" not in default_estimators(flows, direct_reward)
    assert "pdis" not in default_estimators(paths, terminal_credit)


def test_weight_bins_double_and_zero_has_its_own() -> None:
    summary = summarise_weights([0.0, 0.1, 0.3, 1.0, 1.5, 6.0])
    assert summary.zero == 1
    assert summary.bins == ((0.0, 0.0, 1), (0.0625, 0.125, 1), (0.125, 0.25, 0),
                            (0.25, 0.5, 1), (0.5, 1.0, 1), (1.0, 2.0, 1), (2.0, 4.0, 0),
                            (4.0, 8.0, 1))
    assert summary.max == 6.0
    assert summary.effective_sample_size == pytest.approx(8.9 ** 2 / (0.01 + 0.09 + 1 + 2.25
                                                                      + 36))


def test_the_logged_summary_is_evaluate_policys_logged_value() -> None:
    # Two rewards joined to one decision are summed (direct_reward), here as there:
    # issue 29 item 9 saw the report average them where eval summed them.
    twice = [DecisionPoint("d", 1, c, "logging", 1, p, ["a", "b"], {"segment": "s"},
                           (Reward("csat:1", r), Reward("csat:2", r))) for c, p, r in LOGGED]
    paths = [*_paths(*twice), *_paths(_decision("a", None, 1.0, policy="other"))]
    [row, other] = logged_summary(paths)
    ev = evaluate_policy(paths, _target, policy="logging")
    assert row["logged_value"] == pytest.approx(ev.logged_value) == pytest.approx(1.25)
    assert (row["decisions"], row["with_propensity"], row["rewarded"]) == (4, 4, 4)
    assert row["mean_propensity"] == pytest.approx(0.5)
    assert (other["decisions"], other["with_propensity"], other["logged_value"]) == (1, 0, None)
    assert DEFAULT_MIN_ESS == 100.0
    assert promotion_gate(ev).reasons[-1].endswith("below min_ess 100")


def test_missing_pyarrow_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from fleet import MissingDependencyError
    from fleet.learning.export import write_parquet
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'fleet\[learn\]'"):
        write_parquet([], tmp_path / "x.parquet")
    assert not (tmp_path / "x.parquet").exists()
