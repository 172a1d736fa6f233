"""A run returns its outcome (issue 11 item 3): one test per ``RunOutcome`` kind.

``ExecutionHandle.outcome()`` hands the caller the run's own answer: no last
event to inspect, no store wrapper, no id set on the runtime. ``last_sequence``
is the last sequence the run made durable.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kernel_kit import FaultyStore, ManualClock, eventually, kinds, settle, started

from fleet import (
    Context,
    EventType,
    FlowReplayDivergenceError,
    Runtime,
    StaleFenceError,
    StoreUnavailableError,
    flow,
)
from fleet.kernel.errors import (
    ConfigurationError,
    DuplicateStepError,
    ExecutionBusyError,
    ExecutionFailedError,
)
from fleet.kernel.fold import DIVERGED_GATE, MESSAGE_GATE
from fleet.kernel.run_outcome import RunOutcome, Waiting
from fleet.kernel.store.spi import EventStore


async def outcome_of(handle: Any) -> RunOutcome:
    outcome = await handle.outcome()
    assert outcome is not None
    return outcome


async def head(store: EventStore, execution_id: str) -> int:
    value = await store.head(execution_id)
    assert value is not None
    return value


@flow("oc-done")
async def done(ctx: Context, n: int) -> int:
    return int(await ctx.step("double", lambda: 2 * n))


@flow("oc-gate")
async def gate(ctx: Context, _: Any) -> Any:
    return await ctx.wait("approval")


async def test_outcome_completed(store: EventStore) -> None:
    runtime = Runtime(store, flows=[done])
    outcome = await outcome_of(await runtime.start("oc-done", 21, execution_id="c1"))
    assert (outcome.kind, outcome.execution_id, outcome.status) == ("completed", "c1",
                                                                    "completed")
    assert outcome.last_sequence == await head(store, "c1") == 3
    assert outcome.ended
    assert (outcome.cause, outcome.waiting) == (None, None)


async def test_outcome_failed_carries_the_recorded_error(store: EventStore) -> None:
    @flow("oc-fails")
    async def fails(ctx: Context, _: Any) -> None:
        raise LookupError("no such customer")

    runtime = Runtime(store, flows=[fails])
    outcome = await outcome_of(await runtime.start("oc-fails", None, execution_id="f1"))
    assert outcome.kind == "failed"
    assert outcome.error == {"type": "LookupError", "message": "no such customer",
                             "retryable": False}
    assert outcome.last_sequence == await head(store, "f1")
    assert (await store.read("f1"))[-1].payload["error"] == outcome.error


async def test_outcome_parked_on_a_gate(store: EventStore) -> None:
    runtime = Runtime(store, flows=[gate])
    outcome = await outcome_of(await runtime.start("oc-gate", None, execution_id="p1"))
    assert outcome.kind == "parked"
    assert outcome.waiting == Waiting("approval", "gate")
    assert outcome.last_sequence == await head(store, "p1")
    assert not outcome.ended


async def test_outcome_parked_on_a_timer_and_on_a_message(clocked_store: EventStore,
                                                          clock: ManualClock) -> None:
    @flow("oc-nap")
    async def nap(ctx: Context, _: Any) -> None:
        await ctx.sleep(600)

    @flow("oc-inbox")
    async def inbox(ctx: Context, _: Any) -> Any:
        return await ctx.receive("reply")

    runtime = Runtime(clocked_store, flows=[nap, inbox], clock=clock, local_timers=False)
    timer = await outcome_of(await runtime.start("oc-nap", None))
    assert (timer.kind, timer.waiting) == ("parked", Waiting("sleep#0", "timer"))
    message = await outcome_of(await runtime.start("oc-inbox", None))
    assert (message.kind, message.waiting) == ("parked",
                                               Waiting(MESSAGE_GATE, "message", "reply"))


async def test_outcome_diverged_parked(store: EventStore) -> None:
    @flow("oc-div", steps=["a", "b", "c"])
    async def v1(ctx: Context, _: Any) -> str:
        await ctx.step("a", lambda: 1)
        await ctx.step("b", lambda: 2)
        await ctx.wait("go")
        return str(await ctx.step("c", lambda: 3))

    @flow("oc-div", steps=["a", "b", "c"])
    async def v2(ctx: Context, _: Any) -> str:  # a deploy dropped step a
        await ctx.step("b", lambda: 2)
        await ctx.wait("go")
        return str(await ctx.step("c", lambda: 3))

    eid = await started(Runtime(store, flows=[v1]), "oc-div")
    runtime = Runtime(store, flows=[v2], divergence="fail", on_warn=lambda m: None)
    outcome = await outcome_of(await runtime.resume(eid, "go"))
    assert outcome.kind == "diverged_parked"
    assert isinstance(outcome.cause, FlowReplayDivergenceError)
    assert outcome.cause.skipped == ["a"]
    assert outcome.waiting is not None
    assert (outcome.waiting.on, outcome.waiting.kind) == (DIVERGED_GATE, "diverged")
    assert outcome.last_sequence == await head(store, eid)


async def test_outcome_continued_names_the_successor(store: EventStore) -> None:
    @flow("oc-chain")
    async def chain(ctx: Context, n: int) -> int:
        if n < 1:
            await ctx.continue_as_new(n + 1)
        return n

    runtime = Runtime(store, flows=[chain])
    outcome = await outcome_of(await runtime.start("oc-chain", 0, execution_id="k"))
    assert (outcome.kind, outcome.next_execution_id) == ("continued", "k~1")
    assert kinds(await store.read("k"))[-1] == "EXECUTION_CONTINUED"


# -- stopped from outside, or without an end ------------------------------------------

def _holding_flow(name: str, release: asyncio.Event, calls: list[int]) -> Any:
    async def hold() -> str:
        calls.append(1)
        if len(calls) == 1:
            await release.wait()  # only the first attempt is slow
        return "held"

    @flow(name, steps=["hold"])
    async def body(ctx: Context, _: Any) -> str:
        return str(await ctx.step("hold", hold))
    return body


async def _until_step_started(store: EventStore, eid: str) -> None:
    async def holds() -> bool:
        return kinds(await store.read(eid))[-1:] == ["STEP_STARTED"]
    await eventually(holds)


async def test_outcome_cancelled(store: EventStore) -> None:
    release, calls = asyncio.Event(), []
    runtime = Runtime(store, flows=[_holding_flow("oc-cancel", release, calls)])
    handle = await runtime.start("oc-cancel", None)
    await _until_step_started(store, handle.execution_id)
    await runtime.cancel(handle.execution_id, force=True)
    outcome = await outcome_of(handle)
    assert outcome.kind == "cancelled"
    assert outcome.last_sequence == 1  # the run made STARTED and STEP_STARTED durable
    assert kinds(await store.read(handle.execution_id))[-1] == "EXECUTION_CANCELLED"


async def test_outcome_fenced_out_by_a_later_holder(store: EventStore) -> None:
    release, calls = asyncio.Event(), []
    body = _holding_flow("oc-fence", release, calls)
    zombie = Runtime(store, flows=[body], holder="zombie")
    handle = await zombie.start("oc-fence", None)
    await _until_step_started(store, handle.execution_id)
    successor = Runtime(store, flows=[body], holder="successor")
    taken = await successor.drive(handle.execution_id, wait=True)  # supersedes the fence
    assert (await outcome_of(taken)).kind == "completed"
    release.set()  # the zombie's step returns; its write is refused
    outcome = await outcome_of(handle)
    assert outcome.kind == "fenced_out"
    assert isinstance(outcome.cause, StaleFenceError)
    assert outcome.last_sequence == 1


async def test_outcome_fenced_out_when_resume_as_supersedes_the_run(store: EventStore) -> None:
    release, calls = asyncio.Event(), []
    runtime = Runtime(store, flows=[_holding_flow("oc-migrate", release, calls)])
    handle = await runtime.start("oc-migrate", None)
    await _until_step_started(store, handle.execution_id)
    migrated = await runtime.resume_as(handle.execution_id)
    outcome = await outcome_of(handle)
    assert (outcome.kind, outcome.cause) == ("fenced_out", None)
    release.set()
    assert (await outcome_of(migrated)).kind == "completed"


async def test_outcome_handed_back(store: EventStore) -> None:
    release, calls = asyncio.Event(), []
    runtime = Runtime(store, flows=[_holding_flow("oc-hand", release, calls)])
    handle = await runtime.start("oc-hand", None)
    await _until_step_started(store, handle.execution_id)
    runtime.hand_back_now()
    outcome = await outcome_of(handle)
    assert (outcome.kind, outcome.last_sequence) == ("handed_back", 1)
    assert runtime.handed_back == 1


async def test_outcome_aborted_by_a_failed_write(store: EventStore) -> None:
    faulty = FaultyStore(store, lambda e: e.type is EventType.STEP_COMPLETED)
    runtime = Runtime(faulty, flows=[done])  # type: ignore[arg-type]
    outcome = await outcome_of(await runtime.start("oc-done", 1, execution_id="a1"))
    assert outcome.kind == "aborted"
    assert isinstance(outcome.cause, StoreUnavailableError)
    assert outcome.last_sequence == await head(store, "a1") == 1


async def test_outcome_failed_by_a_programming_fault(store: EventStore) -> None:
    @flow("oc-twice")
    async def twice(ctx: Context, _: Any) -> None:
        await ctx.step("same", lambda: 1)
        await ctx.step("same", lambda: 2)

    warnings: list[str] = []
    runtime = Runtime(store, flows=[twice], on_warn=warnings.append)
    outcome = await outcome_of(await runtime.start("oc-twice", None, execution_id="t1"))
    # A refusal that can never succeed fails the run (decision 0023, was 0003's stop).
    assert outcome.kind == "failed"
    assert isinstance(outcome.cause, DuplicateStepError)
    assert outcome.error is not None
    assert outcome.error["code"] == DuplicateStepError.code
    assert outcome.last_sequence == await head(store, "t1") == 3
    assert (await runtime.load_state("t1")).status == "failed"
    with pytest.raises(ExecutionFailedError):
        await runtime.result("t1")
    assert any("'t1' FAILED: DuplicateStepError" in w for w in warnings)


async def test_outcome_nothing_to_do_when_finished_or_parked(store: EventStore) -> None:
    runtime = Runtime(store, flows=[done, gate])
    await (await runtime.start("oc-done", 1, execution_id="n1")).result()
    await started(runtime, "oc-gate", execution_id="n2")
    finished = await outcome_of(await runtime.drive("n1", wait=True))
    assert (finished.kind, finished.status, finished.last_sequence) == (
        "nothing_to_do", "completed", await head(store, "n1"))
    parked = await outcome_of(await runtime.drive("n2", wait=True))
    assert (parked.kind, parked.status, parked.waiting) == (
        "nothing_to_do", "parked", Waiting("approval", "gate"))
    await settle(runtime)
    assert runtime.drives == 2  # nothing-to-do drives started no run


async def test_a_call_that_launched_no_run_has_no_outcome(store: EventStore) -> None:
    runtime = Runtime(store, flows=[done])
    first = await runtime.start("oc-done", 1, execution_id="x1", drive=False)
    assert await first.outcome() is None
    again = await runtime.start("oc-done", 1, execution_id="x1")  # idempotent: exists
    assert await again.outcome() is None
    assert (await outcome_of(await runtime.drive("x1"))).kind == "completed"


async def test_outcome_stepped_aside_when_a_drive_if_free_meets_a_live_lease(
        store: EventStore) -> None:
    """Decision 0032: the first write of ``drive(if_free=True)`` takes the fence only if
    it is free; a live lease elsewhere makes the run step aside having written nothing."""
    runtime = Runtime(store, flows=[done])
    eid = (await runtime.start("oc-done", 1, execution_id="sa1", drive=False)).execution_id
    grant = await store.acquire_fence_if(eid, holder="other", lease_ms=60_000)
    assert grant is not None
    before = await store.read(eid)
    aside = await outcome_of(await runtime.drive(eid, if_free=True, wait=True))
    assert (aside.kind, aside.status, aside.last_sequence) == ("stepped_aside", "running", 0)
    assert isinstance(aside.cause, ExecutionBusyError)
    assert await store.read(eid) == before
    assert (runtime.drives, runtime.aborted) == (0, 0)
    # A grant with if_free is refused before anything is read or written.
    with pytest.raises(ConfigurationError, match="takes no grant"):
        await runtime.drive(eid, grant=grant, if_free=True)
    assert await store.read(eid) == before
    await store.release_fence(eid, grant.token)
    ran = await outcome_of(await runtime.drive(eid, if_free=True, wait=True))
    assert ran.kind == "completed"
    assert await runtime.result(eid) == 2
