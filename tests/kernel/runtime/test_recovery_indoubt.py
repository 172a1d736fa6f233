"""Recovery: a run that died after STEP_STARTED, re-driven by another runtime.

The crash is a real write refused by ``FaultyStore`` (the STEP_COMPLETED never
lands), or a log built by hand and appended to the store.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kernel_kit import FaultyStore, ManualClock, dumped, kinds, settle

from fleet import (
    Context,
    EventEnvelope,
    EventType,
    RetryPolicy,
    Runtime,
    ValidationError,
    flow,
)
from fleet.kernel.store.spi import EventStore

INDOUBT = "__fleet_indoubt__"


def _charge_flow(calls: list[int], *, idempotent: bool) -> Any:
    def charge(amount: int) -> dict[str, Any]:
        calls.append(amount)
        return {"charged": amount, "call": len(calls)}

    @flow("payment")
    async def payment(ctx: Context, amount: int) -> Any:
        receipt = await ctx.step("charge", charge, amount, idempotent=idempotent)
        await ctx.step("notify", lambda: "sent")
        return receipt

    return payment


async def _crash_after_step_started(store: EventStore, definition: Any) -> str:
    """Run until the STEP_COMPLETED of 'charge', whose write never lands."""
    faulty = FaultyStore(store, lambda e: str(e.type) == "STEP_COMPLETED"
                         and e.payload.get("stepId") == "charge")
    dying = Runtime(faulty, flows=[definition])  # type: ignore[arg-type]
    handle = await dying.start("payment", 5, execution_id="pay-1")
    await settle(dying)
    assert faulty.refused, "the fault never triggered"
    assert kinds(await store.read(handle.execution_id)) == ["EXECUTION_STARTED",
                                                             "STEP_STARTED"]
    return handle.execution_id


async def test_idempotent_step_in_doubt_is_rerun_as_attempt_two(store: EventStore) -> None:
    calls: list[int] = []
    definition = _charge_flow(calls, idempotent=True)
    eid = await _crash_after_step_started(store, definition)
    assert calls == [5]  # the effect happened once, the log does not know

    survivor = Runtime(store, flows=[definition])
    await survivor.drive(eid, wait=True)
    assert await survivor.result(eid) == {"charged": 5, "call": 2}
    assert calls == [5, 5]  # at least once
    log = await store.read(eid)
    assert kinds(log) == ["EXECUTION_STARTED", "STEP_STARTED", "RECOVERED", "EFFECT_INDOUBT",
                          "STEP_STARTED", "STEP_COMPLETED", "STEP_STARTED", "STEP_COMPLETED",
                          "EXECUTION_COMPLETED"]
    assert log[2].payload["by"] == survivor.holder
    assert log[3].payload == {"stepId": "charge", "attempt": 1, "idempotent": True}
    assert log[4].payload == {"stepId": "charge", "attempt": 2}
    assert survivor.recovered == 1
    state = await survivor.load_state(eid)
    assert state.recoveries == 1
    assert state.frames["charge"].attempts == 2


async def test_non_idempotent_step_in_doubt_parks_for_an_operator(store: EventStore) -> None:
    calls: list[int] = []
    definition = _charge_flow(calls, idempotent=False)
    eid = await _crash_after_step_started(store, definition)

    survivor = Runtime(store, flows=[definition])
    await survivor.drive(eid, wait=True)
    assert calls == [5]  # not run again
    log = await store.read(eid)
    assert kinds(log) == ["EXECUTION_STARTED", "STEP_STARTED", "RECOVERED", "EFFECT_INDOUBT",
                          "EXECUTION_SUSPENDED"]
    assert log[3].payload["idempotent"] is False
    assert log[4].payload["condition"] == {"on": INDOUBT, "kind": "indoubt",
                                           "correlationKey": "charge"}
    summary = await store.get_execution(eid)
    assert summary is not None
    assert summary.waiting_on == INDOUBT

    # A re-drive of the parked run adds nothing.
    await survivor.drive(eid, wait=True)
    assert len(await store.read(eid)) == len(log)


async def test_operator_answers_complete_with_the_output(store: EventStore) -> None:
    calls: list[int] = []
    definition = _charge_flow(calls, idempotent=False)
    eid = await _crash_after_step_started(store, definition)
    survivor = Runtime(store, flows=[definition])
    await survivor.drive(eid, wait=True)

    await survivor.resume(eid, INDOUBT, {"action": "complete",
                                         "output": {"charged": 5, "call": 1}})
    assert await survivor.result(eid) == {"charged": 5, "call": 1}
    assert calls == [5]  # the operator said it happened: never run again
    log = await store.read(eid)
    resumed = next(e for e in log if str(e.type) == "EXECUTION_RESUMED")
    assert resumed.payload["payload"]["stepId"] == "charge"
    completed = [e.payload for e in log if str(e.type) == "STEP_COMPLETED"]
    assert completed[0] == {"stepId": "charge", "attempt": 1,
                            "output": {"charged": 5, "call": 1}}
    await settle(survivor)


async def test_operator_answers_retry(store: EventStore) -> None:
    calls: list[int] = []
    definition = _charge_flow(calls, idempotent=False)
    eid = await _crash_after_step_started(store, definition)
    survivor = Runtime(store, flows=[definition])
    await survivor.drive(eid, wait=True)

    await survivor.resume(eid, INDOUBT, {"action": "retry"})
    assert await survivor.result(eid) == {"charged": 5, "call": 2}
    assert calls == [5, 5]
    started_ = [e.payload["attempt"] for e in await store.read(eid)
                if str(e.type) == "STEP_STARTED" and e.payload["stepId"] == "charge"]
    assert started_ == [1, 2]
    await settle(survivor)


@pytest.mark.parametrize("answer", [None, "retry", {"action": "skip"}, {"output": 1},
                                    {"action": "complete", "output": {1, 2}}])
async def test_a_bad_indoubt_answer_is_refused_and_the_log_unchanged(
        store: EventStore, answer: Any) -> None:
    calls: list[int] = []
    definition = _charge_flow(calls, idempotent=False)
    eid = await _crash_after_step_started(store, definition)
    survivor = Runtime(store, flows=[definition])
    await survivor.drive(eid, wait=True)
    before = dumped(await store.read(eid))
    with pytest.raises(ValidationError):
        await survivor.resume(eid, INDOUBT, answer)
    assert dumped(await store.read(eid)) == before
    # Still parked and answerable.
    await survivor.resume(eid, INDOUBT, {"action": "retry"})
    assert (await survivor.result(eid))["call"] == 2
    await settle(survivor)


async def test_recover_abandoned_picks_up_an_expired_lease(clocked_store: EventStore,
                                                          clock: ManualClock) -> None:
    store = clocked_store
    calls: list[int] = []
    definition = _charge_flow(calls, idempotent=True)
    eid = await _crash_after_step_started(store, definition)

    survivor = Runtime(store, flows=[definition], clock=clock)
    # The dead holder's lease is still live: nothing to recover yet.
    report = await survivor.recover_abandoned()
    assert report.recovered == 0
    assert kinds(await store.read(eid))[-1] == "STEP_STARTED"

    clock.advance(31)  # past the default 30 s lease
    report = await survivor.recover_abandoned()
    assert (report.examined, report.recovered) == (1, 1)
    assert await survivor.result(eid) == {"charged": 5, "call": 2}
    assert kinds(await store.read(eid))[2:4] == ["RECOVERED", "EFFECT_INDOUBT"]
    # Done: a second sweep finds nothing.
    await settle(survivor)
    assert (await survivor.recover_abandoned()).examined == 0


async def test_recovery_of_a_log_built_by_hand(store: EventStore) -> None:
    calls: list[int] = []
    definition = _charge_flow(calls, idempotent=True)
    flow_hash = definition.content_hash()
    events = [
        EventEnvelope.make("hand", 0, EventType.EXECUTION_STARTED, 1_000, {
            "flowId": "payment", "flowVersion": 1, "flowHash": flow_hash, "input": 9,
            "owner": None}),
        EventEnvelope.make("hand", 1, EventType.STEP_STARTED, 1_001,
                           {"stepId": "charge", "attempt": 1}),
    ]
    await store.append_batch(events)
    runtime = Runtime(store, flows=[definition])
    await runtime.drive("hand", wait=True)
    assert await runtime.result("hand") == {"charged": 9, "call": 1}
    assert kinds(await store.read("hand"))[2:5] == ["RECOVERED", "EFFECT_INDOUBT",
                                                     "STEP_STARTED"]


async def test_a_fresh_start_is_not_a_recovery(store: EventStore) -> None:
    # A log that ends on EXECUTION_STARTED (the first drive never ran) is not
    # a crash mid-step: no RECOVERED, no in-doubt.
    calls: list[int] = []
    definition = _charge_flow(calls, idempotent=False)
    await store.append(EventEnvelope.make("fresh", 0, EventType.EXECUTION_STARTED, 1, {
        "flowId": "payment", "flowVersion": 1, "flowHash": definition.content_hash(),
        "input": 1}))
    runtime = Runtime(store, flows=[definition])
    await runtime.drive("fresh", wait=True)
    assert await runtime.result("fresh") == {"charged": 1, "call": 1}
    assert "RECOVERED" not in kinds(await store.read("fresh"))
    assert "EFFECT_INDOUBT" not in kinds(await store.read("fresh"))


async def test_a_crash_between_retries_resumes_at_the_next_attempt(store: EventStore) -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("first try fails")
        return "ok"

    @flow("retry-crash")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.step("flaky", flaky, retry=RetryPolicy(max_attempts=3,
                                                                 initial_interval=0.001))

    # The process dies as it starts attempt 2: STEP_FAILED(retryAt) is the last event.
    faulty = FaultyStore(store, lambda e: str(e.type) == "STEP_STARTED"
                         and e.payload.get("attempt") == 2)
    dying = Runtime(faulty, flows=[body])  # type: ignore[arg-type]
    await dying.start("retry-crash", execution_id="rc")
    await settle(dying)
    assert kinds(await store.read("rc")) == ["EXECUTION_STARTED", "STEP_STARTED", "STEP_FAILED"]

    survivor = Runtime(store, flows=[body])
    await survivor.drive("rc", wait=True)
    assert await survivor.result("rc") == "ok"
    assert len(calls) == 2
    log = await store.read("rc")
    # Not in doubt: the failure was recorded, so the next attempt is simply due.
    assert "EFFECT_INDOUBT" not in kinds(log)
    assert [e.payload["attempt"] for e in log if str(e.type) == "STEP_STARTED"] == [1, 2]


async def test_an_idempotent_start_by_execution_id_starts_once(store: EventStore) -> None:
    calls: list[int] = []
    definition = _charge_flow(calls, idempotent=True)
    runtime = Runtime(store, flows=[definition])
    other = Runtime(store, flows=[definition])
    handles = await asyncio.gather(runtime.start("payment", 3, execution_id="once"),
                                   other.start("payment", 3, execution_id="once"),
                                   runtime.start("payment", 3, execution_id="once"))
    assert {h.execution_id for h in handles} == {"once"}
    assert await runtime.result("once") == {"charged": 3, "call": 1}
    await settle(runtime)
    await settle(other)
    assert calls == [3]
    assert kinds(await store.read("once")).count("EXECUTION_STARTED") == 1
