"""emit and in-run outcomes: appended once, the forgery guard, the stamp-gated fold."""

from __future__ import annotations

import math
from typing import Any

import pytest
from kernel_kit import failed_with, kinds, settle, started

from fleet import (
    Context,
    Decision,
    EventEnvelope,
    EventType,
    KernelEventForgeryError,
    Policy,
    Runtime,
    ValidationError,
    flow,
    fold_log,
)
from fleet.kernel.store.spi import EventStore


async def test_emit_is_appended_once_and_not_again_on_replay(store: EventStore) -> None:
    @flow("emitter")
    async def body(ctx: Context, _: Any) -> str:
        await ctx.emit("order.placed", {"order": 7})
        answer = await ctx.wait("go")
        await ctx.emit("order.shipped", {"order": 7})
        return str(answer)

    runtime = Runtime(store, flows=[body])
    eid = await started(runtime, "emitter")
    handle = await runtime.resume(eid, "go", "ok")
    assert await handle.result() == "ok"
    log = await store.read(eid)
    emitted = [e for e in log if str(e.type) == "EMITTED"]
    assert [e.payload for e in emitted] == [
        {"type": "order.placed", "payload": {"order": 7}, "name": "emit#0"},
        {"type": "order.shipped", "payload": {"order": 7}, "name": "emit#1"}]
    # Userspace events are not kernel-stamped.
    assert not any(e.kernel for e in emitted)
    assert (await runtime.load_state(eid)).emits == 2


@pytest.mark.parametrize("kind", ["STEP_COMPLETED", "EXECUTION_COMPLETED", "DECISION_RECORDED",
                                  "EXECUTION_RESUMED", "RECOVERED", "EMITTED"])
async def test_emit_of_a_kernel_kind_is_refused(store: EventStore, kind: str) -> None:
    @flow("forger")
    async def body(ctx: Context, _: Any) -> str:
        try:
            await ctx.emit(kind, {"stepId": "charge", "attempt": 1, "output": "paid"})
        except KernelEventForgeryError as exc:
            return exc.message
        return "written"

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("forger")
    message = await handle.result()
    assert kind in message
    assert kinds(await store.read(handle.execution_id)) == ["EXECUTION_STARTED",
                                                             "EXECUTION_COMPLETED"]


@pytest.mark.parametrize(("field", "refusal"), [("recordedBy", KernelEventForgeryError),
                                                ("late", KernelEventForgeryError),
                                                ("innerSteps", ValidationError),
                                                ("scope", ValidationError)])
async def test_an_outcome_carrying_kernel_only_fields_is_refused(
        store: EventStore, field: str, refusal: type[ValidationError]) -> None:
    """ADR 0116 D1 names recordedBy and late: refused on an outcome as forgery; any
    other field an outcome does not have is refused as malformed. An application
    event carrying the same keys forges nothing and is written (issue 13 item 3)."""
    forged = {"recordedBy": "someone-else", "late": True, "innerSteps": ["x"], "scope": "/0"}

    @flow("forged-fields")
    async def body(ctx: Context, _: Any) -> list[str]:
        await ctx.decide("d", lambda: Decision("a", policy=Policy("p", 1, 0.5)))
        await ctx.emit("app.event", {"x": 1, field: forged[field]})
        refused = []
        try:
            await ctx.emit("OUTCOME_RECORDED", {"decisionId": "d", "key": "k", "score": 1.0,
                                                field: forged[field]})
        except ValidationError as exc:
            refused.append(type(exc).__name__)
        return refused

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("forged-fields")
    assert await handle.result() == [refusal.__name__]
    log = await store.read(handle.execution_id)
    assert "OUTCOME_RECORDED" not in kinds(log)
    assert [e.payload["payload"] for e in log if e.type == "EMITTED"] == [
        {"x": 1, field: forged[field]}]


async def test_an_uncaught_forgery_ends_the_run(store: EventStore) -> None:
    """Issue 13 item 3: the guard's refusal is deterministic, so it fails the run
    (it used to leave it running for every recovery pass to re-drive)."""
    @flow("forger-uncaught")
    async def body(ctx: Context, _: Any) -> None:
        await ctx.decide("d", lambda: Decision("a", policy=Policy("p", 1, 0.5)))
        await ctx.outcome("d", "k", score=1.0)
        await ctx.emit("OUTCOME_RECORDED", {"decisionId": "d", "key": "k2", "score": 1.0,
                                            "late": True})

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("forger-uncaught")
    await failed_with(handle, KernelEventForgeryError.code)
    state = await runtime.load_state(handle.execution_id)
    assert [(o["key"], "late" in o) for o in state.outcomes] == [("k", False)]
    assert runtime.refused == 1


@pytest.mark.parametrize(("score", "success"), [(1.7e308, None), (math.nan, None),
                                                (-math.inf, None), ("0.5", None), (None, None),
                                                (None, "yes"), (True, None)])
async def test_outcome_with_a_bad_score_is_refused(store: EventStore, score: Any,
                                                   success: Any) -> None:
    @flow("bad-score")
    async def body(ctx: Context, _: Any) -> str:
        await ctx.decide("d", lambda: "a")
        try:
            await ctx.outcome("d", "csat:1", score=score, success=success)
        except ValidationError as exc:
            return type(exc).__name__
        return "written"

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("bad-score")
    assert await handle.result() == "ValidationError"
    assert "OUTCOME_RECORDED" not in kinds(await store.read(handle.execution_id))


async def test_outcome_for_an_unknown_decision_is_refused(store: EventStore) -> None:
    @flow("unknown-decision")
    async def body(ctx: Context, _: Any) -> str:
        await ctx.decide("known", lambda: "a")
        try:
            await ctx.outcome("unknown", "csat:1", score=1.0)
        except ValidationError as exc:
            return exc.message
        return "written"

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("unknown-decision")
    assert "unknown" in await handle.result()
    assert "OUTCOME_RECORDED" not in kinds(await store.read(handle.execution_id))


async def test_in_run_outcome_is_unstamped_and_idempotent(store: EventStore) -> None:
    @flow("in-run-outcome")
    async def body(ctx: Context, _: Any) -> str:
        await ctx.decide("d", lambda: Decision("a", policy=Policy("p", 1, 0.5)))
        await ctx.outcome("d", "csat:1", score=0.75, success=True)
        await ctx.outcome("d", "csat:1", score=0.75, success=True)  # same: a no-op
        try:
            await ctx.outcome("d", "csat:1", score=0.1)  # conflicting: refused
        except ValidationError:
            pass
        gate = await ctx.wait("go")
        return str(gate)

    runtime = Runtime(store, flows=[body])
    eid = await started(runtime, "in-run-outcome")
    handle = await runtime.resume(eid, "go", "done")
    assert await handle.result() == "done"
    log = await store.read(eid)
    outcomes = [e for e in log if str(e.type) == "OUTCOME_RECORDED"]
    assert len(outcomes) == 1  # not re-appended on replay either
    [outcome] = outcomes
    assert not outcome.kernel
    assert outcome.payload == {"decisionId": "d", "key": "csat:1", "score": 0.75,
                               "success": True}
    state = await runtime.load_state(eid)
    assert [(o["key"], o["score"], o["success"]) for o in state.outcomes] == [
        ("csat:1", 0.75, True)]
    assert "recordedBy" not in state.outcomes[0]
    await settle(runtime)


def _outcome_log(kernel: bool) -> list[EventEnvelope]:
    start = EventEnvelope.make("x", 0, EventType.EXECUTION_STARTED, 1, {
        "flowId": "f", "flowVersion": 1, "flowHash": "fnv1a:00000000"})
    decision = EventEnvelope.make("x", 1, EventType.DECISION_RECORDED, 2, {
        "decisionId": "d", "choice": "a", "innerSteps": ["s"]}, kernel=kernel)
    outcome = EventEnvelope.make("x", 2, EventType.OUTCOME_RECORDED, 3, {
        "decisionId": "d", "key": "k", "score": 1.0, "recordedBy": "mallory",
        "late": True}, kernel=kernel)
    return [start, decision, outcome]


def test_fold_copies_kernel_only_fields_only_from_a_stamped_envelope() -> None:
    forged = fold_log(_outcome_log(kernel=False))
    assert "recordedBy" not in forged.outcomes[0]
    assert "late" not in forged.outcomes[0]
    assert "innerSteps" not in forged.decisions["d"]
    assert forged.outcomes[0]["score"] == 1.0  # the reward itself still counts

    stamped = fold_log(_outcome_log(kernel=True))
    assert stamped.outcomes[0]["recordedBy"] == "mallory"
    assert stamped.outcomes[0]["late"] is True
    assert stamped.decisions["d"]["innerSteps"] == ["s"]


async def test_an_unstamped_forged_outcome_in_a_store_folds_without_the_fields(
        store: EventStore) -> None:
    # A log the guard did not protect (an old writer, a direct append).
    await store.append_batch(_outcome_log(kernel=False))
    runtime = Runtime(store)
    state = await runtime.load_state("x")
    assert "recordedBy" not in state.outcomes[0]
    assert "late" not in state.outcomes[0]


async def test_parallel_emits_are_matched_per_branch_on_replay(store: EventStore) -> None:
    # Branch b parks before it emits; on the replay after the resume, b runs
    # first, so a single run-wide emit counter would re-append a's emit and
    # drop b's. Names per branch keep exactly one of each.
    async def a(ctx: Context) -> str:
        await ctx.emit("a.done", {})
        return "a"

    async def b(ctx: Context) -> str:
        await ctx.wait("go")
        await ctx.emit("b.done", {})
        return "b"

    @flow("branches")
    async def body(ctx: Context, _: Any) -> list[Any]:
        return await ctx.parallel([b, a])

    runtime = Runtime(store, flows=[body])
    eid = await started(runtime, "branches")
    handle = await runtime.resume(eid, "go", True)
    assert await handle.result() == ["b", "a"]
    emitted = [e.payload["type"] for e in await store.read(eid) if str(e.type) == "EMITTED"]
    assert sorted(emitted) == ["a.done", "b.done"]
