"""Simulated logs with a known truth: how well each estimator does, measured.

Two worlds whose true value under a target policy is known exactly:

- ``Bandit``: one decision among 3 arms in 3 segments, rewards a score around
  each arm's mean in the segment; the logging policy is epsilon-greedy around
  arm ``a``; the target picks each segment's best arm with probability 0.8.
- ``TwoStepFlow``: an offer (2 choices), then a discount (3 choices, its context
  holding the offer), then a terminal reward (completed 1, failed 0) whose
  chance depends on the segment and both choices.

``study`` draws many independent logs of each (seed ``i`` for replication
``i``), evaluates them with every estimator, and measures how often the
interval held the truth (``coverage``), the root mean squared error, the mean
interval width and the mean effective sample size. ``table`` renders the
figures as docs/learning.md shows them (tests/learning/test_simulated_truth.py
checks both the nominal coverage and that the docs' table is this one)::

    from fleet.learning.simulation import study, table
    print(table(study()))
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fleet.kernel.errors import EvaluationError
from fleet.learning.evaluation import PolicyEvaluator, direct_reward, terminal_credit
from fleet.learning.trajectories import DecisionPoint, Reward, Trajectory
from fleet.learning.units import TargetPolicy

ARMS = ("a", "b", "c")


def _epsilon_greedy(choices: tuple[Any, ...], greedy: Any, epsilon: float,
                    choice: Any) -> float:
    return epsilon / len(choices) + (1.0 - epsilon if choice == greedy else 0.0)


def _soft(best: Any, choices: tuple[Any, ...], p_best: float, choice: Any) -> float:
    return p_best if choice == best else (1.0 - p_best) / (len(choices) - 1)


def _draw(rng: random.Random, table: Mapping[Any, float]) -> Any:
    u, acc = rng.random(), 0.0
    for value, p in table.items():
        acc += p
        if u < acc:
            return value
    return next(reversed(table))


@dataclass(frozen=True, slots=True)
class Bandit:
    """A 3-arm contextual bandit; a reward is a score, the arm's mean in the segment
    plus uniform noise of +-``noise`` (a CSAT-like score that stays in [0, 1])."""

    segments: Mapping[str, float]
    means: Mapping[str, Mapping[str, float]]
    epsilon: float = 0.5
    noise: float = 0.1

    def logging(self, segment: str, arm: str) -> float:
        """The logging policy's propensity: epsilon-greedy around arm ``a``."""
        return _epsilon_greedy(ARMS, "a", self.epsilon, arm)

    def target(self, context: Any, choice: Any, alternatives: Any) -> float:
        """The target: the segment's best arm with probability 0.8."""
        row = self.means[context["segment"]]
        return _soft(max(ARMS, key=lambda a: row[a]), ARMS, 0.8, choice)

    def model(self, context: Any, choice: Any) -> float:
        """The right reward model: the true mean."""
        return self.means[context["segment"]][choice]

    def offset_model(self, context: Any, choice: Any) -> float:
        """A miscalibrated reward model: the true mean plus 0.3 (right preferences, the
        wrong level)."""
        return self.means[context["segment"]][choice] + 0.3

    def reversed_model(self, context: Any, choice: Any) -> float:
        """A wrong reward model: every preference reversed (``1 - mean``)."""
        return 1.0 - self.means[context["segment"]][choice]

    def truth(self) -> float:
        """The target's true value."""
        return math.fsum(share * self.target({"segment": s}, a, None) * self.means[s][a]
                         for s, share in self.segments.items() for a in ARMS)

    def logs(self, n: int, seed: int) -> list[Trajectory]:
        """``n`` logged decisions, each one execution, drawn with ``seed``."""
        rng = random.Random(seed)
        out = []
        for i in range(n):
            segment = _draw(rng, self.segments)
            arm = _draw(rng, {a: self.logging(segment, a) for a in ARMS})
            score = self.means[segment][arm] + rng.uniform(-self.noise, self.noise)
            decision = DecisionPoint(
                "arm", 1, arm, "eps-greedy", 1, self.logging(segment, arm), list(ARMS),
                {"segment": segment}, (Reward("csat", score),))
            out.append(Trajectory(f"b{i}", "bandit", "completed", None, (decision,)))
        return out


OFFERS = ("trial", "demo")
DISCOUNTS = (0, 10, 20)


@dataclass(frozen=True, slots=True)
class TwoStepFlow:
    """An offer, then a discount, then a terminal reward (completed or failed)."""

    segments: Mapping[str, float]
    converts: Mapping[tuple[str, str, int], float]

    def logging_offer(self, offer: str) -> float:
        """The logging policy of the offer: trial 0.6, demo 0.4."""
        return 0.6 if offer == "trial" else 0.4

    def logging_discount(self, discount: int) -> float:
        """The logging policy of the discount: epsilon-greedy (0.75) around 0."""
        return _epsilon_greedy(DISCOUNTS, 0, 0.75, discount)

    def best_offer(self, segment: str) -> str:
        return "demo" if segment == "new" else "trial"

    def best_discount(self, segment: str, offer: str) -> int:
        return max(DISCOUNTS, key=lambda d: (self.converts[(segment, offer, d)], -d))

    def targets(self) -> dict[str, TargetPolicy]:
        """The target of each decision: its best choice with probability 0.7 / 0.6."""
        def offer(context: Any, choice: Any, alternatives: Any) -> float:
            return _soft(self.best_offer(context["segment"]), OFFERS, 0.7, choice)

        def discount(context: Any, choice: Any, alternatives: Any) -> float:
            best = self.best_discount(context["segment"], context["offer"])
            return _soft(best, DISCOUNTS, 0.6, choice)

        return {"offer": offer, "discount": discount}

    def truth(self) -> float:
        """The target's true chance of completing."""
        t = self.targets()
        return math.fsum(
            share * t["offer"]({"segment": s}, o, None)
            * t["discount"]({"segment": s, "offer": o}, d, None) * self.converts[(s, o, d)]
            for s, share in self.segments.items() for o in OFFERS for d in DISCOUNTS)

    def logs(self, n: int, seed: int) -> list[Trajectory]:
        """``n`` logged executions (two decisions and a terminal reward each)."""
        rng = random.Random(seed)
        out = []
        for i in range(n):
            segment = _draw(rng, self.segments)
            offer = _draw(rng, {o: self.logging_offer(o) for o in OFFERS})
            discount = _draw(rng, {d: self.logging_discount(d) for d in DISCOUNTS})
            won = 1.0 if rng.random() < self.converts[(segment, offer, discount)] else 0.0
            first = DecisionPoint("offer", 1, offer, "offers", 1, self.logging_offer(offer),
                                  list(OFFERS), {"segment": segment}, terminal_credit=won)
            second = DecisionPoint("discount", 2, discount, "discounts", 1,
                                   self.logging_discount(discount), list(DISCOUNTS),
                                   {"segment": segment, "offer": offer}, terminal_credit=won)
            out.append(Trajectory(f"f{i}", "flow", "completed" if won else "failed", won,
                                  (first, second)))
        return out


BANDIT = Bandit(
    segments={"startup": 0.5, "smb": 0.3, "enterprise": 0.2},
    means={"startup": {"a": 0.15, "b": 0.35, "c": 0.25},
           "smb": {"a": 0.45, "b": 0.30, "c": 0.60},
           "enterprise": {"a": 0.85, "b": 0.55, "c": 0.65}})

FLOW = TwoStepFlow(
    segments={"new": 0.6, "returning": 0.4},
    converts={("new", "trial", 0): 0.20, ("new", "trial", 10): 0.30, ("new", "trial", 20): 0.35,
              ("new", "demo", 0): 0.35, ("new", "demo", 10): 0.55, ("new", "demo", 20): 0.50,
              ("returning", "trial", 0): 0.50, ("returning", "trial", 10): 0.55,
              ("returning", "trial", 20): 0.70, ("returning", "demo", 0): 0.40,
              ("returning", "demo", 10): 0.45, ("returning", "demo", 20): 0.45})


@dataclass(frozen=True, slots=True)
class Row:
    """One estimator's record over a study's replications."""

    world: str
    label: str
    n: int
    replications: int
    truth: float
    coverage: float
    rmse: float
    bias: float
    width: float
    ess: float


@dataclass(frozen=True, slots=True)
class Case:
    """What a row of the study evaluates: an estimator with its arguments."""

    label: str
    estimator: str
    arguments: Mapping[str, Any]


def bandit_cases(bandit: Bandit = BANDIT, *, bootstrap: int = 200) -> list[Case]:
    """The bandit's rows: IPS, SNIPS (normal and bootstrap), DR and SNDR with the right
    model, the fitted one and two wrong ones."""
    return [
        Case("IPS", "ips", {}),
        Case("SNIPS", "snips", {}),
        Case(f"SNIPS, bootstrap {bootstrap}", "snips", {"bootstrap": bootstrap}),
        Case("DR, right model", "dr", {"reward_model": bandit.model}),
        Case("SNDR, right model", "sndr", {"reward_model": bandit.model}),
        Case("DR, fitted model (cross-fitted)", "dr", {}),
        Case("SNDR, fitted model (cross-fitted)", "sndr", {}),
        Case("DR, model off by +0.3", "dr", {"reward_model": bandit.offset_model}),
        Case("SNDR, model off by +0.3", "sndr", {"reward_model": bandit.offset_model}),
        Case("DR, model reversed", "dr", {"reward_model": bandit.reversed_model}),
        Case("SNDR, model reversed", "sndr", {"reward_model": bandit.reversed_model}),
    ]


def flow_cases(*, bootstrap: int = 200) -> list[Case]:
    """The two-step flow's rows: PDIS and its self-normalised form, and a bootstrap."""
    return [Case("PDIS", "pdis", {}), Case("SNPDIS", "snpdis", {}),
            Case(f"SNPDIS, bootstrap {bootstrap}", "snpdis", {"bootstrap": bootstrap})]


def run(world: str, logs: Callable[[int, int], list[Trajectory]], target: Any, truth: float,
        cases: list[Case], *, n: int, replications: int, confidence: float,
        reward: Any = None) -> list[Row]:
    """Evaluate ``replications`` logs of ``n`` units with each case; a row per case."""
    found: dict[str, list[tuple[float, float, float, float]]] = {c.label: [] for c in cases}
    for seed in range(replications):
        evaluator = PolicyEvaluator(logs(n, seed), target, reward=reward or direct_reward)
        for case in cases:
            try:
                ev = evaluator.evaluate(case.estimator, confidence=confidence, seed=seed,
                                        **case.arguments)
            except EvaluationError:  # a log too thin for it: counted as a miss
                found[case.label].append((math.nan, math.nan, math.nan, 0.0))
                continue
            found[case.label].append((ev.estimated_value, *ev.confidence_interval,
                                      ev.effective_sample_size))
    rows = []
    for case in cases:
        seen = found[case.label]
        ok = [(v, lo, hi, e) for v, lo, hi, e in seen if math.isfinite(v)]
        rows.append(Row(
            world, case.label, n, replications, truth,
            coverage=sum(1 for _, lo, hi, _ in ok if lo <= truth <= hi) / replications,
            rmse=math.sqrt(math.fsum((v - truth) ** 2 for v, *_ in ok) / max(len(ok), 1)),
            bias=math.fsum(v - truth for v, *_ in ok) / max(len(ok), 1),
            width=math.fsum(hi - lo for _, lo, hi, _ in ok) / max(len(ok), 1),
            ess=math.fsum(e for *_, e in seen) / replications))
    return rows


def study(*, replications: int = 400, confidence: float = 0.9, bandit_n: int = 500,
          small_n: int = 60, flow_n: int = 600, bootstrap: int = 200) -> list[Row]:
    """The study docs/learning.md reports: the bandit at ``bandit_n`` decisions and at
    ``small_n`` (a low ESS), and the two-step flow at ``flow_n`` executions."""
    truth = BANDIT.truth()
    rows = run("3-arm bandit", BANDIT.logs, BANDIT.target, truth,
               bandit_cases(bootstrap=bootstrap), n=bandit_n, replications=replications,
               confidence=confidence)
    rows += run("3-arm bandit", BANDIT.logs, BANDIT.target, truth,
                [Case("SNIPS", "snips", {}), Case("DR, fitted model (cross-fitted)", "dr", {})],
                n=small_n, replications=replications, confidence=confidence)
    rows += run("2-decision flow", FLOW.logs, FLOW.targets(), FLOW.truth(),
                flow_cases(bootstrap=bootstrap), n=flow_n, replications=replications,
                confidence=confidence, reward=terminal_credit)
    return rows


def table(rows: list[Row]) -> str:
    """The rows as the Markdown table docs/learning.md shows."""
    lines = ["| world | n | estimator | coverage | RMSE | bias | width | ESS |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r.world} | {r.n} | {r.label} | {r.coverage:.1%} | {r.rmse:.4f} | "
              f"{r.bias:+.4f} | {r.width:.4f} | {r.ess:.0f} |" for r in rows]
    return "\n".join(lines)
