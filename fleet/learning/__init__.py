"""Learning from logged decisions: trajectories, evidence, off-policy evaluation.

Everything here reads what the kernel logged (``DECISION_RECORDED`` with the
logging policy's propensity, ``OUTCOME_RECORDED`` rewards, late ones included,
and the terminal event) and imports nothing of fleet but ``fleet.kernel``::

    state = await runtime.load_state(execution_id)
    log = await store.read(execution_id)
    paths = trajectories(evidence_events(state, log))
    report = evaluate_policy(paths, new_policy, estimator="dr")
    verdict = promotion_gate(report, min_lift=0.01)

docs/learning.md is the guide: the estimators, which to trust when, and what
the simulations with a known truth measured.
"""

from fleet.learning.collect import (
    Collected,
    collect_evidence,
    collect_trajectories,
    looks_compacted,
)
from fleet.learning.comparison import PolicyComparison, compare_policies, logged_summary
from fleet.learning.evaluation import (
    DEFAULT_MIN_ESS,
    ESTIMATORS,
    GateResult,
    PolicyEvaluation,
    PolicyEvaluator,
    RewardFn,
    TargetPolicy,
    direct_reward,
    evaluate_policy,
    promotion_gate,
    terminal_credit,
)
from fleet.learning.evidence import evidence_events
from fleet.learning.export import DecisionRow, decision_rows, write_csv, write_parquet
from fleet.learning.reward_model import CellMeans, RewardModel, fit_reward_model
from fleet.learning.trajectories import (
    DecisionPoint,
    Reward,
    TerminalReward,
    Trajectory,
    success_reward,
    trajectories,
)

__all__ = [
    "DEFAULT_MIN_ESS",
    "ESTIMATORS",
    "CellMeans",
    "Collected",
    "DecisionPoint",
    "DecisionRow",
    "GateResult",
    "PolicyComparison",
    "PolicyEvaluation",
    "PolicyEvaluator",
    "Reward",
    "RewardFn",
    "RewardModel",
    "TargetPolicy",
    "TerminalReward",
    "Trajectory",
    "collect_evidence",
    "collect_trajectories",
    "compare_policies",
    "decision_rows",
    "direct_reward",
    "evaluate_policy",
    "evidence_events",
    "fit_reward_model",
    "logged_summary",
    "looks_compacted",
    "promotion_gate",
    "success_reward",
    "terminal_credit",
    "trajectories",
    "write_csv",
    "write_parquet",
]
