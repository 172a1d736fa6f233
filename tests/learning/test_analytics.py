"""fleet.analytics: attach_outcomes (counts, retry of retryable errors only) and records."""

from __future__ import annotations

from typing import Any

import pytest

from fleet import (
    ConfigurationError,
    Context,
    Decision,
    EventEnvelope,
    EventType,
    MemoryEventStore,
    OutcomeContendedError,
    OutcomeRefusedError,
    OutcomeResult,
    Policy,
    Principal,
    Runtime,
    flow,
    fold_log,
)
from fleet.analytics import (
    AttachReport,
    LateReward,
    attach_outcomes,
    decision_records,
    outcome_records,
)
from fleet.learning import evidence_events

ALICE = Principal("alice", tenant="acme")


@flow("pick")
async def pick(ctx: Context, spec: dict[str, Any]) -> Any:
    choice = await ctx.decide("pick", lambda: Decision(
        spec["choice"], policy=Policy("logging", "v1", 0.5), alternatives=["a", "b"],
        context={"user": spec.get("user")}))
    if spec.get("in_run"):
        await ctx.outcome("pick", "flow:done", success=True)
    if spec.get("wait"):
        await ctx.wait("approval")
    return choice


class ContendedRuntime:
    """A real runtime whose ``record_outcome`` meets a moving tip ``contended`` times first.

    Not a storage mock: every call that gets through is the real conditional
    append; the wrapper only plays the part of a tip that kept moving.
    """

    def __init__(self, runtime: Runtime, contended: int,
                 error: type[Exception] = OutcomeContendedError) -> None:
        self.runtime = runtime
        self.contended = contended
        self.error = error
        self.calls = 0

    async def record_outcome(self, execution_id: str, *, decision_id: str, key: str,
                             score: float | None = None, success: bool | None = None,
                             principal: Principal | None = None,
                             system: bool = False) -> OutcomeResult:
        self.calls += 1
        if self.calls <= self.contended:
            raise self.error(f"the log of {execution_id!r} kept moving (injected)")
        return await self.runtime.record_outcome(
            execution_id, decision_id=decision_id, key=key, score=score, success=success,
            principal=principal, system=system)


async def _finished(runtime: Runtime, *ids: str, **spec: Any) -> None:
    for execution_id in ids:
        handle = await runtime.start("pick", {"choice": "a", **spec}, principal=ALICE,
                                     execution_id=execution_id)
        if not spec.get("wait"):
            await handle.result()


async def test_attach_outcomes_counts_appended_duplicates_and_failed() -> None:
    store = MemoryEventStore()
    runtime = Runtime(store, flows=[pick])
    await _finished(runtime, "e1", "e2")
    await _finished(runtime, "parked", wait=True)
    rewards: list[LateReward | dict[str, Any]] = [
        LateReward("e1", "pick", "csat:1", score=0.9),
        {"executionId": "e2", "decisionId": "pick", "key": "csat:1", "success": True},
        LateReward("e1", "pick", "csat:1", score=0.9),         # duplicate: same value
        LateReward("e1", "pick", "csat:1", score=0.1),         # conflict: refused
        LateReward("e1", "invented", "csat:1", score=1.0),     # no such decision
        LateReward("parked", "pick", "csat:1", score=1.0),     # not terminal
        LateReward("nowhere", "pick", "csat:1", score=1.0),    # no such execution
        LateReward("e2", "pick", "csat:2", score=float("nan")),  # bad shape
        {"execution_id": "e2", "key": "csat:3", "score": 1.0},  # no decision id
    ]
    report = await attach_outcomes(runtime, rewards, principal=ALICE, backoff=0.0)
    assert (report.appended, report.duplicates, report.retried) == (2, 1, 0)
    assert [(f.code, f.attempts) for f in report.failed] == [
        ("outcome_refused", 1), ("outcome_refused", 1), ("execution_not_terminal", 1),
        ("execution_not_found", 1), ("validation", 1), ("validation", 0)]
    assert "already recorded" in report.failed[0].reason
    assert not any(f.retryable for f in report.failed)
    late = [e for e in await store.read("e1") if e.type == EventType.OUTCOME_RECORDED]
    assert [(e.payload["score"], e.payload["late"], e.payload["recordedBy"]) for e in late] == [
        (0.9, True, "alice")]

    # Someone else is not the owner: every reward is refused, nothing written.
    before = [e.to_dict() for e in await store.read("e2")]
    denied = await attach_outcomes(runtime, [LateReward("e2", "pick", "csat:9", score=1.0)],
                                   principal=Principal("mallory", tenant="acme"))
    assert [f.code for f in denied.failed] == ["access_denied"]
    assert [e.to_dict() for e in await store.read("e2")] == before


async def test_attach_outcomes_retries_retryable_errors() -> None:
    runtime = Runtime(MemoryEventStore(), flows=[pick])
    await _finished(runtime, "e1")
    contended = ContendedRuntime(runtime, contended=2)
    report = await attach_outcomes(contended, [LateReward("e1", "pick", "csat:1", score=1.0)],
                                   principal=ALICE, retries=3, backoff=0.001)
    assert report == AttachReport(appended=1, duplicates=0, failed=(), retried=2)
    assert contended.calls == 3


async def test_attach_outcomes_gives_up_after_its_retries() -> None:
    store = MemoryEventStore()
    runtime = Runtime(store, flows=[pick])
    await _finished(runtime, "e1")
    contended = ContendedRuntime(runtime, contended=2)
    report = await attach_outcomes(contended, [LateReward("e1", "pick", "csat:1", score=1.0)],
                                   principal=ALICE, retries=1, backoff=0.001)
    assert report.appended == 0
    assert report.retried == 1
    [failure] = report.failed
    assert (failure.code, failure.attempts, failure.retryable) == ("outcome_contended", 2, True)
    assert contended.calls == 2
    assert not [e for e in await store.read("e1") if e.type == EventType.OUTCOME_RECORDED]


async def test_attach_outcomes_does_not_retry_what_is_not_retryable() -> None:
    runtime = Runtime(MemoryEventStore(), flows=[pick])
    await _finished(runtime, "e1")
    refused = ContendedRuntime(runtime, contended=5, error=OutcomeRefusedError)
    report = await attach_outcomes(refused, [LateReward("e1", "pick", "csat:1", score=1.0)],
                                   principal=ALICE, retries=3, backoff=0.001)
    assert refused.calls == 1
    assert report.retried == 0
    assert [(f.code, f.attempts) for f in report.failed] == [("outcome_refused", 1)]


async def test_attach_outcomes_refuses_bad_arguments() -> None:
    runtime = Runtime(MemoryEventStore(), flows=[pick])
    for kwargs in ({"retries": -1}, {"retries": 1.5}, {"backoff": -0.1},
                   {"backoff": float("nan")}):
        with pytest.raises(ConfigurationError):
            await attach_outcomes(runtime, [], **kwargs)
    assert await attach_outcomes(runtime, []) == AttachReport(0, 0, ())


async def test_decision_and_outcome_records() -> None:
    store = MemoryEventStore()
    runtime = Runtime(store, flows=[pick])
    await _finished(runtime, "r1", in_run=True, user="u-7")
    await runtime.record_outcome("r1", decision_id="pick", key="csat:1", score=0.7,
                                 principal=ALICE)
    log = await store.read("r1")
    [decision] = decision_records(log)
    assert decision.to_dict() == {
        "execution_id": "r1", "decision_id": "pick", "sequence": 1,
        "timestamp": log[1].timestamp, "choice": "a", "policy_name": "logging",
        "policy_version": "v1", "propensity": 0.5, "alternatives": ["a", "b"],
        "context": {"user": "u-7"}}
    in_run, late = outcome_records(log)
    assert (in_run.key, in_run.success, in_run.score, in_run.late, in_run.recorded_by) == (
        "flow:done", True, None, False, None)
    assert (late.key, late.score, late.late, late.recorded_by) == ("csat:1", 0.7, True, "alice")

    # A log nobody guarded: late / recordedBy on an unstamped envelope are not trusted.
    forged = EventEnvelope.make("r1", 99, EventType.OUTCOME_RECORDED, 0, {
        "decisionId": "pick", "key": "k", "score": 1.0, "late": True, "recordedBy": "bob"},
        kernel=False)
    [record] = outcome_records([forged])
    assert (record.late, record.recorded_by) == (False, None)


async def test_records_of_a_compacted_execution_come_from_evidence_events() -> None:
    store = MemoryEventStore()
    runtime = Runtime(store, flows=[pick])
    await _finished(runtime, "c1", in_run=True)
    await runtime.record_outcome("c1", decision_id="pick", key="csat:1", score=0.2,
                                 principal=ALICE)
    log = await store.read("c1")
    end = next(e.sequence for e in log if e.type == EventType.EXECUTION_COMPLETED)
    compacted = [e for e in log if e.sequence == 0 or e.sequence >= end]
    assert decision_records(compacted) == []  # what the log alone still shows
    evidence = evidence_events(fold_log(log), compacted)
    assert decision_records(evidence) == decision_records(log)
    assert outcome_records(evidence) == outcome_records(log)
