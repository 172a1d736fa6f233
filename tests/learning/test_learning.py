"""fleet.learning: trajectories, evidence after compaction, off-policy evaluation, the gate."""

from __future__ import annotations

import math
import random
from fractions import Fraction
from typing import Any

import pytest

from fleet import (
    ConfigurationError,
    Context,
    Decision,
    EvaluationError,
    EventEnvelope,
    EventType,
    MemoryEventStore,
    MemorySnapshotStore,
    Policy,
    Principal,
    Runtime,
    flow,
    fold_log,
)
from fleet.kernel.fold import ExecutionState
from fleet.kernel.store.spi import Snapshot
from fleet.learning import (
    PolicyEvaluation,
    Reward,
    Trajectory,
    evaluate_policy,
    evidence_events,
    promotion_gate,
    terminal_credit,
    trajectories,
)

ALICE = Principal("alice", tenant="acme")


@flow("offer")
async def offer(ctx: Context, spec: dict[str, Any]) -> Any:
    choice = await ctx.decide("offer", lambda: Decision(
        spec["choice"], policy=Policy("logging", 1, spec["p"]), alternatives=["a", "b"],
        context={"segment": spec.get("segment", "smb")}))
    if spec.get("in_run") is not None:
        await ctx.outcome("offer", "conv", score=spec["in_run"])
    return choice


@flow("plan")
async def plan(ctx: Context, _: Any) -> str:
    # Ids chosen so that key order lies: "10" and "2" look like array indices
    # (JS lists them first, ascending) and jsonb sorts keys by length.
    for i, decision_id in enumerate(["10", "2", "b", "a"]):
        await ctx.step(f"work-{i}", lambda n: n, i)
        await ctx.decide(decision_id, lambda d=decision_id, i=i: Decision(
            f"arm-{d}", policy=Policy("ranker", 2, 0.25 * (i + 1)), alternatives=["x", "y"],
            context={"i": i}))
    await ctx.outcome("2", "clicks", score=3.0)
    return "done"


def _offer_target(context: Any, choice: Any, alternatives: Any) -> float:
    return 0.8 if choice == "a" else 0.2


# ------------------------------------------------------------------ closed form
async def test_closed_form_ips_snips_ess_from_late_rewards() -> None:
    store = MemoryEventStore()
    runtime = Runtime(store, flows=[offer])
    logged = [("a", 0.5, 1.0), ("b", 0.5, 0.0), ("a", 0.25, 0.5), ("b", 0.75, 1.0)]
    events: list[EventEnvelope] = []
    for i, (choice, p, reward) in enumerate(logged):
        handle = await runtime.start("offer", {"choice": choice, "p": p}, principal=ALICE,
                                     execution_id=f"x{i}")
        assert await handle.result() == choice
        result = await runtime.record_outcome(f"x{i}", decision_id="offer", key="conv",
                                              score=reward, principal=ALICE)
        assert result.appended
        state = await runtime.load_state(f"x{i}", principal=ALICE)
        events += evidence_events(state, await store.read(f"x{i}"))
    report = evaluate_policy(trajectories(events), _offer_target)

    # By hand: weights 8/5, 2/5, 16/5, 4/15; rewards 1, 0, 1/2, 1.
    w = [Fraction(8, 5), Fraction(2, 5), Fraction(16, 5), Fraction(4, 15)]
    r = [Fraction(1), Fraction(0), Fraction(1, 2), Fraction(1)]
    assert sum(w) == Fraction(82, 15)
    assert report.samples == 4
    assert report.skipped == 0
    assert report.ips == pytest.approx(float(Fraction(13, 15)), abs=1e-12)
    assert report.snips == pytest.approx(float(Fraction(26, 41)), abs=1e-12)
    assert report.estimated_value == report.snips
    assert report.to_dict()["confidence_interval"] == list(report.confidence_interval)
    assert report.effective_sample_size == pytest.approx(float(Fraction(1681, 733)), abs=1e-12)
    assert report.logged_value == pytest.approx(0.625, abs=1e-12)
    assert report.lift == pytest.approx(float(Fraction(3, 328)), abs=1e-12)
    assert report.max_weight == pytest.approx(3.2)
    resid = sum((wi * (ri - Fraction(26, 41))) ** 2 for wi, ri in zip(w, r, strict=True))
    assert report.std_error == pytest.approx(math.sqrt(resid) / float(sum(w)), rel=1e-12)
    low, high = report.confidence_interval
    assert low < report.snips < high
    assert high - report.snips == pytest.approx(1.959964 * report.std_error, rel=1e-5)


# ---------------------------------------------------------------- the bandit
SEGMENTS = {"smb": 0.6, "ent": 0.4}
MEAN = {("smb", "a"): 0.30, ("smb", "b"): 0.50, ("ent", "a"): 0.60, ("ent", "b"): 0.40}
BEST = {"smb": "b", "ent": "a"}


def _logging_policy(segment: str, arm: str) -> float:
    # epsilon-greedy (epsilon 0.3) around arm "a" everywhere.
    return 0.85 if arm == "a" else 0.15


def _smart(context: Any, choice: Any, alternatives: Any) -> float:
    return 0.95 if choice == BEST[context["segment"]] else 0.05


def _naive(context: Any, choice: Any, alternatives: Any) -> float:
    return 0.05 if choice == BEST[context["segment"]] else 0.95


def _true_value(target: Any) -> float:
    return math.fsum(share * target({"segment": s}, arm, None) * MEAN[(s, arm)]
               for s, share in SEGMENTS.items() for arm in ("a", "b"))


def _logged_execution(eid: str, segment: str, arm: str, p: float, won: bool,
                      t0: int) -> list[EventEnvelope]:
    def ev(seq: int, type: EventType, payload: dict[str, Any]) -> EventEnvelope:
        return EventEnvelope.make(eid, seq, type, t0 + seq, payload)
    return [
        ev(0, EventType.EXECUTION_STARTED, {"flowId": "offer", "flowVersion": 1,
                                            "flowHash": "sha256:0", "input": None}),
        ev(1, EventType.DECISION_RECORDED, {
            "decisionId": "offer", "choice": arm, "alternatives": ["a", "b"],
            "context": {"segment": segment},
            "policy": {"name": "logging", "version": 1, "propensity": p}}),
        ev(2, EventType.EXECUTION_COMPLETED, {"output": arm}),
        ev(3, EventType.OUTCOME_RECORDED, {"decisionId": "offer", "key": "conv",
                                           "success": won, "recordedBy": "system",
                                           "late": True}),
    ]


def _bandit_evidence(n: int, seed: int) -> list[EventEnvelope]:
    rng = random.Random(seed)
    events: list[EventEnvelope] = []
    for i in range(n):
        segment = "smb" if rng.random() < SEGMENTS["smb"] else "ent"
        arm = "a" if rng.random() < _logging_policy(segment, "a") else "b"
        won = rng.random() < MEAN[(segment, arm)]
        log = _logged_execution(f"e{i}", segment, arm, _logging_policy(segment, arm), won,
                                1_000_000 + i)
        # Each execution as compaction leaves it: [0], the end and the late reward
        # on the log, the decision in the checkpoint's state.
        events += evidence_events(fold_log(log), [log[0], log[2], log[3]])
    return events


def test_simulated_bandit_estimate_lands_within_its_interval_of_the_truth() -> None:
    # One fixed seed keeps the test deterministic. A 95% interval misses the
    # truth for about one seed in twenty (the first seed tried, 20261007, is
    # such a one: 3 standard errors off); checked offline over seeds 0-199,
    # it covered the truth for 95.5% (smart) and 96% (naive) of them.
    paths = trajectories(_bandit_evidence(2000, seed=0))
    assert len(paths) == 2000
    smart_truth, naive_truth = _true_value(_smart), _true_value(_naive)
    assert smart_truth == pytest.approx(0.53)
    assert naive_truth == pytest.approx(0.35)

    smart = evaluate_policy(paths, _smart)
    low, high = smart.confidence_interval
    assert low <= smart_truth <= high, (smart, smart_truth)
    assert smart.logged_value == pytest.approx(0.426, abs=0.03)
    assert 300 < smart.effective_sample_size < 700
    assert promotion_gate(smart, min_lift=0.0, min_ess=200).passed

    naive = evaluate_policy(paths, _naive)
    low, high = naive.confidence_interval
    assert low <= naive_truth <= high, (naive, naive_truth)
    verdict = promotion_gate(naive, min_lift=0.0, min_ess=50)
    assert not verdict.passed
    assert any("below min_lift" in r for r in verdict.reasons)


# ------------------------------------------------------------ non-finite input
def _one(score: float, propensity: float = 0.5, eid: str = "n") -> list[EventEnvelope]:
    def ev(seq: int, type: EventType, payload: dict[str, Any]) -> EventEnvelope:
        return EventEnvelope.make(eid, seq, type, seq, payload)
    return [
        ev(0, EventType.EXECUTION_STARTED, {"flowId": "f", "flowVersion": 1, "flowHash": "h"}),
        ev(1, EventType.DECISION_RECORDED, {"decisionId": "d", "choice": "a", "policy": {
            "name": "logging", "version": 1, "propensity": propensity}}),
        ev(2, EventType.EXECUTION_COMPLETED, {}),
        # A log the score bound did not protect (an old writer, a hand-built file).
        ev(3, EventType.OUTCOME_RECORDED, {"decisionId": "d", "key": "k", "score": score}),
    ]


def test_non_finite_reward_accumulators_raise() -> None:
    huge = trajectories(_one(1.7e308, eid="u") + _one(1.7e308, eid="v"))
    with pytest.raises(EvaluationError, match="non-finite"):
        evaluate_policy(huge, lambda c, ch, a: 1.0)
    # A finite score made infinite by its importance weight.
    with pytest.raises(EvaluationError, match="non-finite"):
        evaluate_policy(trajectories(_one(1.7e308)), lambda c, ch, a: 1.0)
    # A tiny propensity: the squared weight overflows.
    tiny = trajectories(_one(1.0, propensity=1e-300))
    with pytest.raises(EvaluationError, match="non-finite"):
        evaluate_policy(tiny, lambda c, ch, a: 1.0)
    with pytest.raises(EvaluationError, match="non-finite"):
        evaluate_policy(trajectories(_one(1.0)), lambda c, ch, a: 1.0,
                        reward=lambda t, d: math.nan)


def test_evaluation_refuses_unusable_input() -> None:
    paths = trajectories(_one(1.0))
    with pytest.raises(EvaluationError, match="no decision could be evaluated"):
        evaluate_policy(paths, lambda c, ch, a: 1.0, policy="someone-else")
    with pytest.raises(EvaluationError, match="probability 0"):
        evaluate_policy(paths, lambda c, ch, a: 0.0)
    for bad in (1.5, -0.1, math.nan, True):
        def target(c: Any, ch: Any, a: Any, bad: float = bad) -> float:
            return bad
        with pytest.raises(EvaluationError, match="probability in"):
            evaluate_policy(paths, target)
    with pytest.raises(EvaluationError, match="propensity"):
        evaluate_policy(trajectories(_one(1.0, propensity=0.0)), lambda c, ch, a: 1.0)
    with pytest.raises(ConfigurationError):
        evaluate_policy(paths, lambda c, ch, a: 1.0, confidence=1.0)


# ------------------------------------------------------------- promotion gate
def _evaluation(**changes: float) -> PolicyEvaluation:
    base: dict[str, Any] = dict(
        samples=1000, skipped=0, ips=0.5, snips=0.5, effective_sample_size=400.0,
        logged_value=0.4, estimated_value=0.5, lift=0.1, std_error=0.01,
        confidence_interval=(0.48, 0.52), confidence=0.95, max_weight=3.0)
    base.update(changes)
    return PolicyEvaluation(**base)


@pytest.mark.parametrize("field", ["lift", "estimated_value", "logged_value",
                                   "effective_sample_size"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_promotion_gate_fails_on_non_finite(field: str, value: float) -> None:
    verdict = promotion_gate(_evaluation(**{field: value}), min_lift=-1e9, min_ess=0)
    assert not verdict.passed
    assert any(r.startswith(f"{field} is") for r in verdict.reasons)


def test_promotion_gate_thresholds() -> None:
    assert promotion_gate(_evaluation(), min_lift=0.05, min_ess=100) == (
        promotion_gate(_evaluation(), min_lift=0.1, min_ess=400))
    assert promotion_gate(_evaluation(), min_lift=0.05, min_ess=100).passed
    low_lift = promotion_gate(_evaluation(lift=0.01), min_lift=0.05, min_ess=100)
    assert not low_lift.passed
    assert len(low_lift.reasons) == 1
    low_ess = promotion_gate(_evaluation(effective_sample_size=20.0), min_ess=100)
    assert not low_ess.passed
    assert "effective sample size" in low_ess.reasons[0]
    both = promotion_gate(_evaluation(lift=-0.2, effective_sample_size=5.0))
    assert len(both.reasons) == 2
    for bad in (math.nan, math.inf):
        with pytest.raises(ConfigurationError):
            promotion_gate(_evaluation(), min_lift=bad)
        with pytest.raises(ConfigurationError):
            promotion_gate(_evaluation(), min_ess=bad)


# ------------------------------------------------------- late equals in-run
async def _one_run(in_run: bool) -> tuple[list[Trajectory], EventEnvelope]:
    store = MemoryEventStore()
    runtime = Runtime(store, flows=[offer])
    spec = {"choice": "a", "p": 0.4, "in_run": 1.0 if in_run else None}
    handle = await runtime.start("offer", spec, principal=ALICE, execution_id="run-1")
    await handle.result()
    if not in_run:
        await runtime.record_outcome("run-1", decision_id="offer", key="conv", score=1.0,
                                     principal=ALICE)
    log = await store.read("run-1")
    [outcome] = [e for e in log if e.type == EventType.OUTCOME_RECORDED]
    return trajectories(log), outcome


async def test_late_reward_gives_the_same_trajectory_snips_and_logged_value() -> None:
    on_time, in_run_event = await _one_run(in_run=True)
    late, late_event = await _one_run(in_run=False)
    # The two logs really differ: the late reward sits above the terminal event.
    assert late_event.payload.get("late") is True
    assert "late" not in in_run_event.payload
    assert late_event.sequence > in_run_event.sequence
    assert late == on_time
    assert late[0].decisions[0].rewards == (Reward("conv", 1.0, None),)
    assert late[0].status == "completed"
    assert late[0].terminal_reward == 1.0
    # One decision gives no interval (TooFewSamplesError); the run twice over does.
    a, b = evaluate_policy(late * 2, _offer_target), evaluate_policy(on_time * 2, _offer_target)
    assert (a.snips, a.logged_value) == (b.snips, b.logged_value)
    assert a == b


# ----------------------------------------------------- evidence after compaction
def _jsonb_order(state: ExecutionState) -> ExecutionState:
    # Postgres jsonb keeps object keys sorted by length, then bytes.
    d = state.to_dict()
    d["_decisions"] = dict(sorted(d["_decisions"].items(), key=lambda kv: (len(kv[0]), kv[0])))
    return ExecutionState.from_dict(d)


async def test_evidence_events_of_a_compacted_log_give_the_uncompacted_trajectories() -> None:
    store = MemoryEventStore()
    snapshots = MemorySnapshotStore()
    runtime = Runtime(store, flows=[plan], snapshots=snapshots)
    handle = await runtime.start("plan", None, principal=ALICE, execution_id="p1")
    assert await handle.result() == "done"
    for decision_id, score in (("10", 0.5), ("a", -1.0)):
        await runtime.record_outcome("p1", decision_id=decision_id, key="csat:1",
                                     score=score, principal=ALICE)
    log = await store.read("p1")
    state = fold_log(log)
    [end] = [e.sequence for e in log if e.type == EventType.EXECUTION_COMPLETED]
    jsonb = _jsonb_order(state)
    assert list(jsonb.decisions) == ["2", "a", "b", "10"]  # key order lies

    for discount in (1.0, 0.5):
        truth = trajectories(log, discount=discount)
        assert [d.decision_id for d in truth[0].decisions] == ["10", "2", "b", "a"]
        assert trajectories(evidence_events(state, log), discount=discount) == truth
        # Compaction is capped just below the terminal event (ADR 0116 Q3).
        for k in range(1, end):
            compacted = [e for e in log if e.sequence == 0 or e.sequence > k]
            for folded in (state, jsonb):
                rebuilt = evidence_events(folded, compacted)
                assert trajectories(rebuilt, discount=discount) == truth, (k, discount)

    # The same through a checkpoint: Runtime.load_state reads snapshot + tail.
    k = end - 1
    snap = fold_log([e for e in log if e.sequence <= k]).to_dict()
    await snapshots.save(Snapshot("p1", k, snap))
    loaded = await runtime.load_state("p1", principal=ALICE)
    compacted = [e for e in log if e.sequence == 0 or e.sequence > k]
    assert not any(e.type == EventType.DECISION_RECORDED for e in compacted)
    assert trajectories(evidence_events(loaded, compacted), discount=0.5) == (
        trajectories(log, discount=0.5))


async def test_evidence_keeps_logged_events_and_synthesises_a_missing_end() -> None:
    store = MemoryEventStore()
    runtime = Runtime(store, flows=[offer])
    handle = await runtime.start("offer", {"choice": "b", "p": 0.5}, principal=ALICE,
                                 execution_id="old")
    await handle.result()
    log = await store.read("old")
    state = fold_log(log)
    assert evidence_events(state, log) == [e for e in log if e.type in (
        EventType.EXECUTION_STARTED, EventType.DECISION_RECORDED,
        EventType.EXECUTION_COMPLETED)]
    # A pre-0116 compaction: [0] + a checkpoint at the terminal event, gone.
    rebuilt = evidence_events(state, log[:1])
    [end] = [e for e in rebuilt if e.type == EventType.EXECUTION_COMPLETED]
    assert end.metadata.get("synthesised") is True
    assert end.payload == {"output": "b"}
    assert trajectories(rebuilt) == trajectories(log)
    with pytest.raises(ConfigurationError, match="pass one execution"):
        evidence_events(state, _one(1.0))


def test_a_checkpoint_without_seq_falls_back_to_map_order() -> None:
    log = _one(1.0)
    state = fold_log(log)
    d = state.to_dict()
    del d["_decisions"]["d"]["seq"]
    old = ExecutionState.from_dict(d)
    assert trajectories(evidence_events(old, [log[0], log[2], log[3]])) == trajectories(log)


# ------------------------------------------------------------ terminal credit
def test_discounted_terminal_credit_follows_decision_order() -> None:
    def ev(seq: int, type: EventType, payload: dict[str, Any]) -> EventEnvelope:
        return EventEnvelope.make("t", seq, type, seq, payload)
    decisions = [ev(seq, EventType.DECISION_RECORDED, {"decisionId": d, "choice": 1, "policy": {
        "name": "p", "propensity": 0.5}}) for seq, d in ((3, "last"), (1, "first"), (2, "mid"))]
    ok = trajectories([*decisions, ev(4, EventType.EXECUTION_COMPLETED, {})], discount=0.5)
    assert [(d.decision_id, d.terminal_credit) for d in ok[0].decisions] == [
        ("first", 0.25), ("mid", 0.5), ("last", 1.0)]
    failed = trajectories([*decisions, ev(4, EventType.EXECUTION_FAILED, {})], discount=0.5)
    assert [d.terminal_credit for d in failed[0].decisions] == [0.0, 0.0, 0.0]
    running = trajectories(decisions)[0]
    assert running.status is None
    assert running.decisions[0].terminal_credit is None
    report = evaluate_policy(ok, lambda c, ch, a: 0.5, reward=terminal_credit)
    assert report.logged_value == pytest.approx(1.75 / 3)
    for bad in (1.5, -0.1, math.nan):
        with pytest.raises(ConfigurationError):
            trajectories(decisions, discount=bad)
