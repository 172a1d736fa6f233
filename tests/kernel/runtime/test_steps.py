"""Steps: sync and async, retries with backoff on the log, typed failures."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kernel_kit import ManualClock, kinds, settle

from fleet import (
    Context,
    ExecutionFailedError,
    RetryPolicy,
    Runtime,
    StepFailedError,
    StepFailure,
    flow,
)
from fleet.kernel.store.spi import EventStore

FAST = RetryPolicy(max_attempts=3, initial_interval=0.001, backoff=2.0)


async def test_sync_and_async_step_functions(store: EventStore) -> None:
    def sync_fn(a: int, b: int = 0) -> int:
        return a + b

    async def async_fn(a: int) -> dict[str, int]:
        await asyncio.sleep(0)
        return {"double": a * 2}

    @flow("sync-async")
    async def body(ctx: Context, x: int) -> list[Any]:
        s = await ctx.step("sync", sync_fn, x, b=5)
        a = await ctx.step("async", async_fn, s)
        return [s, a]

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("sync-async", 1)
    assert await handle.result() == [6, {"double": 12}]
    log = await store.read(handle.execution_id)
    assert kinds(log) == ["EXECUTION_STARTED", "STEP_STARTED", "STEP_COMPLETED",
                          "STEP_STARTED", "STEP_COMPLETED", "EXECUTION_COMPLETED"]
    assert [e.payload.get("output") for e in log if str(e.type) == "STEP_COMPLETED"] == [
        6, {"double": 12}]
    assert all(e.kernel for e in log)


async def test_retryable_failure_is_retried_with_backoff_logged(
        store: EventStore, clock: ManualClock) -> None:
    attempts: list[int] = []

    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionError(f"boom {len(attempts)}")
        return "ok"

    @flow("flaky")
    async def body(ctx: Context, _: Any) -> str:
        return str(await ctx.step("flaky", flaky, retry=RetryPolicy(
            max_attempts=3, initial_interval=0.002, backoff=3.0)))

    runtime = Runtime(store, flows=[body], clock=clock)
    handle = await runtime.start("flaky")
    assert await handle.result() == "ok"
    assert len(attempts) == 3
    log = await store.read(handle.execution_id)
    assert kinds(log) == ["EXECUTION_STARTED",
                          "STEP_STARTED", "STEP_FAILED",
                          "STEP_STARTED", "STEP_FAILED",
                          "STEP_STARTED", "STEP_COMPLETED", "EXECUTION_COMPLETED"]
    failed = [e for e in log if str(e.type) == "STEP_FAILED"]
    started_ = [e for e in log if str(e.type) == "STEP_STARTED"]
    assert [e.payload["attempt"] for e in started_] == [1, 2, 3]
    for n, event in enumerate(failed, start=1):
        assert event.payload["attempt"] == n
        assert event.payload["final"] is False
        assert event.payload["error"]["type"] == "ConnectionError"
        assert event.payload["error"]["message"] == f"boom {n}"
        # Backoff: retryAt is the failure time plus initial * backoff ** (n - 1).
        assert event.payload["retryAt"] == event.timestamp + [2, 6][n - 1]
    state = await runtime.load_state(handle.execution_id)
    assert state.frames["flaky"].attempts == 3
    assert state.frames["flaky"].status == "completed"


async def test_exhausted_retries_raise_step_failed_the_flow_can_catch(
        store: EventStore) -> None:
    calls = []

    def always() -> None:
        calls.append(1)
        raise TimeoutError("still down")

    @flow("exhaust")
    async def body(ctx: Context, _: Any) -> dict[str, Any]:
        try:
            await ctx.step("down", always, retry=RetryPolicy(max_attempts=2,
                                                              initial_interval=0.001))
        except StepFailedError as exc:
            return {"caught": exc.step_id, "type": exc.error["type"]}
        return {"caught": None}

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("exhaust")
    assert await handle.result() == {"caught": "down", "type": "TimeoutError"}
    assert len(calls) == 2
    failed = [e.payload for e in await store.read(handle.execution_id)
              if str(e.type) == "STEP_FAILED"]
    assert [(p["attempt"], p["final"]) for p in failed] == [(1, False), (2, True)]
    assert "retryAt" not in failed[-1]


async def test_typed_step_failure_is_not_retried(store: EventStore) -> None:
    calls = []

    def refuse() -> None:
        calls.append(1)
        raise StepFailure("card declined")

    @flow("typed")
    async def body(ctx: Context, _: Any) -> str:
        try:
            await ctx.step("charge", refuse, retry=FAST)
        except StepFailedError as exc:
            return str(exc.error["message"])
        return "no"

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("typed")
    assert await handle.result() == "card declined"
    assert len(calls) == 1
    failed = [e.payload for e in await store.read(handle.execution_id)
              if str(e.type) == "STEP_FAILED"]
    assert len(failed) == 1
    assert failed[0]["final"] is True
    assert failed[0]["error"]["retryable"] is False


async def test_non_retryable_exception_types_are_not_retried(store: EventStore) -> None:
    calls: list[str] = []

    def bad_value(kind: str) -> None:
        calls.append(kind)
        if kind == "value":
            raise ValueError("bad amount")
        raise KeyError("missing")

    policy = RetryPolicy(max_attempts=3, initial_interval=0.001, non_retryable=(ValueError,))

    @flow("non-retryable")
    async def body(ctx: Context, _: Any) -> list[str]:
        out = []
        for kind in ("value", "key"):
            try:
                await ctx.step(f"s-{kind}", bad_value, kind, retry=policy)
            except StepFailedError as exc:
                out.append(exc.error["type"])
        return out

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("non-retryable")
    assert await handle.result() == ["ValueError", "KeyError"]
    # ValueError is listed: one attempt. KeyError is not: all three.
    assert calls == ["value", "key", "key", "key"]


async def test_uncaught_step_failure_fails_the_execution(store: EventStore) -> None:
    def broken() -> None:
        raise StepFailure("nope")

    @flow("uncaught")
    async def body(ctx: Context, _: Any) -> None:
        await ctx.step("broken", broken)

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("uncaught")
    with pytest.raises(ExecutionFailedError, match="nope") as info:
        await handle.result()
    assert info.value.error["type"] == "StepFailedError"
    log = await store.read(handle.execution_id)
    assert kinds(log)[-2:] == ["STEP_FAILED", "EXECUTION_FAILED"]
    assert log[-1].payload["error"]["code"] == "step_failed"
    state = await runtime.load_state(handle.execution_id)
    assert state.status == "failed"
    await settle(runtime)


async def test_a_flow_exception_fails_the_execution_with_its_type(store: EventStore) -> None:
    @flow("raises")
    async def body(ctx: Context, _: Any) -> None:
        raise LookupError("no such customer")

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("raises")
    with pytest.raises(ExecutionFailedError, match="LookupError: no such customer"):
        await handle.result()
    assert kinds(await store.read(handle.execution_id)) == ["EXECUTION_STARTED",
                                                             "EXECUTION_FAILED"]


async def test_replay_of_a_failed_step_raises_again_without_calling_it(
        store: EventStore) -> None:
    calls = []

    def refuse() -> None:
        calls.append(1)
        raise StepFailure("declined")

    @flow("failed-replay")
    async def body(ctx: Context, _: Any) -> str:
        try:
            await ctx.step("charge", refuse)
        except StepFailedError:
            pass
        return str(await ctx.wait("go"))

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("failed-replay")
    await settle(runtime)
    await runtime.resume(handle.execution_id, "go", "after")
    assert await handle.result() == "after"
    assert len(calls) == 1
