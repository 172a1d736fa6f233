"""The demo's offline evaluation: better policies for its two decisions, IPS, SNIPS and DR.

``evaluate(paths)`` evaluates ``agent.better_style`` and ``agent.better_discount``
on the runs' decisions with ``fleet.learning.PolicyEvaluator`` (the logs read
once per target): SNIPS is the estimate the gate judges; DR (doubly robust,
its reward model fitted on the same logs, cross-fitted) is shown beside it.
It returns the summary's ``evaluation`` and the rows of the demo's table.

The gate asks for an effective sample size of ``DEMO_MIN_ESS`` (10), not the
library's ``DEFAULT_MIN_ESS`` (100): 30 runs can never reach 100, and the demo
shows what the gate says rather than a foregone "hold". docs/learning.md
explains the default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleet.examples import agent
from fleet.kernel.errors import EvaluationError
from fleet.learning import DEFAULT_MIN_ESS, promotion_gate
from fleet.learning.evaluation import PolicyEvaluator
from fleet.learning.trajectories import Trajectory

#: The gate's effective sample size in the demo (see the module docstring).
DEMO_MIN_ESS = 10.0

#: The target policy of each decision the demo evaluates.
TARGETS = {"reply_style": ("better_style", agent.better_style),
           "discount": ("better_discount", agent.better_discount)}

#: One line for each figure of the offline evaluation (``fleet.learning.evaluation``).
ESTIMATORS: dict[str, str] = {
    "logging policy earned": "the mean reward of what the logging policy chose",
    "IPS": "sum(w x reward) / n: what the target would earn; unbiased, noisy when "
           "some w are large",
    "SNIPS": "sum(w x reward) / sum(w): IPS normalised by the weights; slightly "
             "biased, much steadier (the gate uses it)",
    "DR": "doubly robust: a reward model's value of the target's choices, corrected by "
          "the weighted errors of the model on the logged ones; unbiased when the "
          "propensities are right, steadier than SNIPS when the model is good "
          "(here: cell means fitted on these runs, cross-fitted)",
    "ESS": "effective sample size, sum(w)^2 / sum(w^2): how many decisions the "
           f"estimate is worth; few means trust it less (the default gate asks "
           f"{DEFAULT_MIN_ESS:g}, the demo {DEMO_MIN_ESS:g})",
}


def evaluate(paths: list[Trajectory]) -> tuple[dict[str, Any], list[list[str]]]:
    """The summary's ``evaluation`` (per decision: the SNIPS evaluation, its gate and
    the DR estimate) and the rows of the table the demo shows."""
    results: dict[str, Any] = {}
    for decision_id, (name, target) in TARGETS.items():
        evaluator = PolicyEvaluator(paths, target, decision_id=decision_id)
        result = evaluator.evaluate("snips")
        gate = promotion_gate(result, min_lift=0.0, min_ess=DEMO_MIN_ESS)
        try:
            doubly: dict[str, Any] = evaluator.evaluate("dr").to_dict()
        except EvaluationError as exc:  # too few runs to cross-fit its model
            doubly = {"error": f"{type(exc).__name__}: {exc.message}"}
        results[decision_id] = {"target": f"fleet.examples.agent:{name}", **result.to_dict(),
                                "gate_passed": gate.passed, "gate_reasons": list(gate.reasons),
                                "dr": doubly}

    def row(label: str, show: Callable[[dict[str, Any]], str]) -> list[str]:
        return [label, *(show(r) for r in results.values())]

    def from_dr(show: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], str]:
        return lambda r: show(r["dr"]) if "error" not in r["dr"] else r["dr"]["error"]

    rows = [
        row("target policy", lambda r: str(r["target"]).rpartition(":")[2]),
        row("decisions evaluated", lambda r: str(r["samples"])),
        row("logging policy earned", lambda r: f"{r['logged_value']:.3f}"),
        row("IPS estimate", lambda r: f"{r['ips']:.3f}"),
        row("SNIPS estimate", lambda r: f"{r['snips']:.3f}"),
        row("95% interval (SNIPS)", lambda r: "[{:.3f}, {:.3f}]".format(
            *r["confidence_interval"])),
        row("DR estimate", from_dr(lambda d: f"{d['estimated_value']:.3f}")),
        row("95% interval (DR)", from_dr(lambda d: "[{:.3f}, {:.3f}]".format(
            *d["confidence_interval"]))),
        row("effective sample size (ESS)", lambda r: f"{r['effective_sample_size']:.1f}"),
        row("lift (SNIPS)", lambda r: f"{r['lift']:+.3f}"),
        row("promotion gate", lambda r: "pass" if r["gate_passed"] else
            "hold: " + "; ".join(r["gate_reasons"]))]
    return results, rows


__all__ = ["DEMO_MIN_ESS", "ESTIMATORS", "TARGETS", "evaluate"]
