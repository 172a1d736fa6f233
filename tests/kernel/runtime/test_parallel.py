"""ctx.parallel: branches overlap, results in order, scopes on the log."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kernel_kit import kinds, settle, started

from fleet import Context, EventEnvelope, Runtime, StepFailedError, StepFailure, flow
from fleet.kernel.store.spi import EventStore


async def test_branches_run_concurrently_and_results_keep_their_order(
        store: EventStore) -> None:
    # Each branch waits at a barrier only all three can pass together: if the
    # branches ran one after another, the first would time out there.
    barrier = asyncio.Barrier(3)
    finished: list[str] = []

    async def meet(name: str, delay: float) -> str:
        await asyncio.wait_for(barrier.wait(), timeout=2)
        await asyncio.sleep(delay)
        finished.append(name)
        return name.upper()

    @flow("fan-out")
    async def body(ctx: Context, _: Any) -> list[Any]:
        return await ctx.parallel([("a", meet, "a", 0.03), ("b", meet, "b", 0.0),
                                   ("c", meet, "c", 0.015)])

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("fan-out")
    assert await handle.result(timeout=5) == ["A", "B", "C"]
    # They finished out of order, the results are still in branch order.
    assert finished == ["b", "c", "a"]


async def test_scope_path_is_on_step_started_and_kernel_stamped(store: EventStore) -> None:
    async def branch(ctx: Context) -> list[Any]:
        inner = await ctx.parallel([("x", lambda: 1), ("y", lambda: 2)])
        return [await ctx.step("after-inner", lambda: 3), *inner]

    @flow("nested")
    async def body(ctx: Context, _: Any) -> list[Any]:
        top = await ctx.step("top", lambda: 0)
        return [top, *await ctx.parallel([branch, ("single", lambda: 9)])]

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("nested")
    assert await handle.result() == [0, [3, 1, 2], 9]
    log = await store.read(handle.execution_id)
    scopes = {e.payload["stepId"]: e.payload.get("scope") for e in log
              if str(e.type) == "STEP_STARTED"}
    assert scopes == {"top": None, "single": "/0", "x": "/0/0", "y": "/0/0",
                      "after-inner": "/0"}
    assert all(e.kernel for e in log if str(e.type) == "STEP_STARTED")
    state = await runtime.load_state(handle.execution_id)
    assert state.frames["x"].scope == "/0/0"
    assert set(state.scopes) == {"/0", "/0/0"}
    assert all(s["completed"] for s in state.scopes.values())


async def test_fold_ignores_a_scope_on_an_unstamped_step_started() -> None:
    from fleet import EventType, fold_log

    log = [EventEnvelope.make("x", 0, EventType.EXECUTION_STARTED, 1, {
               "flowId": "f", "flowVersion": 1, "flowHash": "fnv1a:00000000"}),
           EventEnvelope.make("x", 1, EventType.STEP_STARTED, 2, {
               "stepId": "s", "attempt": 1, "scope": "/9"}, kernel=False)]
    assert fold_log(log).frames["s"].scope is None
    assert fold_log([log[0], EventEnvelope.make("x", 1, EventType.STEP_STARTED, 2, {
        "stepId": "s", "attempt": 1, "scope": "/9"})]).frames["s"].scope == "/9"


async def test_parallel_events_appear_once_even_after_replay(store: EventStore) -> None:
    calls: list[str] = []

    def work(name: str) -> str:
        calls.append(name)
        return name

    @flow("fan-out-then-wait")
    async def body(ctx: Context, _: Any) -> list[Any]:
        results = await ctx.parallel([("p", work, "p"), ("q", work, "q")])
        return [*results, await ctx.wait("go")]

    runtime = Runtime(store, flows=[body])
    eid = await started(runtime, "fan-out-then-wait")
    await runtime.resume(eid, "go", "!")
    assert await runtime.result(eid) == ["p", "q", "!"]
    log_kinds = kinds(await store.read(eid))
    assert log_kinds.count("PARALLEL_STARTED") == 1
    assert log_kinds.count("PARALLEL_COMPLETED") == 1
    assert sorted(calls) == ["p", "q"]  # the replay did not run them again
    await settle(runtime)


async def test_a_failing_branch_raises_after_its_siblings_settle(store: EventStore) -> None:
    finished: list[str] = []

    async def ok(name: str) -> str:
        await asyncio.sleep(0.01)
        finished.append(name)
        return name

    def bad() -> None:
        raise StepFailure("branch broke")

    @flow("branch-fails")
    async def body(ctx: Context, _: Any) -> str:
        try:
            await ctx.parallel([("ok", ok, "ok"), ("bad", bad)])
        except StepFailedError as exc:
            return exc.step_id
        return "no error"

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("branch-fails")
    assert await handle.result() == "bad"
    assert finished == ["ok"]
    assert "PARALLEL_COMPLETED" not in kinds(await store.read(handle.execution_id))


async def test_a_parked_branch_parks_the_execution(store: EventStore) -> None:
    async def waits(ctx: Context) -> Any:
        return await ctx.wait("branch-gate")

    @flow("branch-parks")
    async def body(ctx: Context, _: Any) -> list[Any]:
        return await ctx.parallel([waits, ("s", lambda: "s")])

    runtime = Runtime(store, flows=[body])
    eid = await started(runtime, "branch-parks")
    assert (await runtime.load_state(eid)).waiting == {"on": "branch-gate", "kind": "gate"}
    await runtime.resume(eid, "branch-gate", "g")
    assert await runtime.result(eid) == ["g", "s"]


@pytest.mark.parametrize("branch", [42, "not callable"])
async def test_a_branch_that_is_neither_callable_nor_tuple_is_refused(
        store: EventStore, branch: Any) -> None:
    from fleet import ValidationError

    @flow("bad-branch")
    async def body(ctx: Context, _: Any) -> str:
        try:
            await ctx.parallel([branch])
        except ValidationError as exc:
            return exc.message
        return "ran"

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("bad-branch")
    assert "neither a callable nor a tuple" in await handle.result()
