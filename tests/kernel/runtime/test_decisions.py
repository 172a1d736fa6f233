"""Decisions: the policy and its propensity on the log, refusals, inner steps."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from kernel_kit import failed_with, kinds, settle

from fleet import (
    Context,
    Decision,
    InvalidPropensityError,
    Policy,
    Runtime,
    flow,
)
from fleet.kernel.store.spi import EventStore


async def test_decision_with_policy_is_logged(store: EventStore) -> None:
    @flow("decide")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.decide("plan", lambda: Decision(
            "pro", policy=Policy("ranker", 3, 0.25), alternatives=["free", "pro"],
            context={"segment": "smb"}))

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("decide")
    assert await handle.result() == "pro"
    [event] = [e for e in await store.read(handle.execution_id)
               if str(e.type) == "DECISION_RECORDED"]
    assert event.kernel
    assert event.payload["decisionId"] == "plan"
    assert event.payload["choice"] == "pro"
    assert event.payload["policy"] == {"name": "ranker", "version": 3, "propensity": 0.25}
    assert event.payload["alternatives"] == ["free", "pro"]
    assert event.payload["context"] == {"segment": "smb"}
    state = await runtime.load_state(handle.execution_id)
    assert state.decisions["plan"]["policy"]["propensity"] == 0.25
    assert state.decisions["plan"]["seq"] == event.sequence


async def test_bare_value_decision_has_no_policy(store: EventStore) -> None:
    async def decider() -> dict[str, int]:
        return {"tier": 2}

    @flow("bare")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.decide("tier", decider)

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("bare")
    assert await handle.result() == {"tier": 2}
    [event] = [e for e in await store.read(handle.execution_id)
               if str(e.type) == "DECISION_RECORDED"]
    assert event.payload["choice"] == {"tier": 2}
    assert "policy" not in event.payload


@pytest.mark.parametrize("propensity", [0, 0.0, 1.5, -0.1, math.nan, math.inf, True])
async def test_propensity_outside_0_1_is_refused_and_nothing_appended(
        store: EventStore, propensity: Any) -> None:
    @flow("bad-propensity")
    async def body(ctx: Context, _: Any) -> str:
        try:
            await ctx.decide("d", lambda: Decision("x", policy=Policy("p", 1, propensity)))
        except InvalidPropensityError as exc:
            return exc.message
        return "accepted"

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("bad-propensity")
    message = await handle.result()
    assert "propensity" in message
    assert "(0, 1]" in message
    assert "DECISION_RECORDED" not in kinds(await store.read(handle.execution_id))


async def test_propensity_one_is_accepted(store: EventStore) -> None:
    @flow("p-one")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.decide("d", lambda: Decision("x", policy=Policy("greedy", 1, 1)))

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("p-one")
    assert await handle.result() == "x"


async def test_uncaught_invalid_propensity_fails_the_run_with_nothing_else_written(
        store: EventStore) -> None:
    warnings: list[str] = []

    @flow("p-uncaught")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.decide("d", lambda: Decision("x", policy=Policy("p", 1, 0)))

    runtime = Runtime(store, flows=[body], on_warn=warnings.append)
    handle = await runtime.start("p-uncaught")
    await failed_with(handle, InvalidPropensityError.code, timeout=2)
    await settle(runtime)
    # A refusal that can never succeed ends the run (decision 0023): the decision
    # wrote nothing, the execution failed with the typed error.
    assert kinds(await store.read(handle.execution_id)) == ["EXECUTION_STARTED",
                                                             "EXECUTION_FAILED"]
    assert (runtime.aborted, runtime.refused, runtime.failed) == (0, 1, 1)
    assert any("InvalidPropensityError" in w for w in warnings)


async def test_inner_steps_of_a_decider_are_recorded(store: EventStore) -> None:
    calls = []

    def score(name: str) -> float:
        calls.append(name)
        return {"a": 0.2, "b": 0.9}[name]

    @flow("inner")
    async def body(ctx: Context, _: Any) -> Any:
        async def decider() -> Decision:
            sa = await ctx.step("score#a", score, "a")
            sb = await ctx.step("score#b", score, "b")
            return Decision("b" if sb > sa else "a", policy=Policy("argmax", 1, 1.0))
        await ctx.step("before", lambda: 0)
        choice = await ctx.decide("pick", decider)
        gate = await ctx.wait("go")
        return [choice, gate]

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("inner")
    await settle(runtime)
    [event] = [e for e in await store.read(handle.execution_id)
               if str(e.type) == "DECISION_RECORDED"]
    assert event.payload["innerSteps"] == ["score#a", "score#b"]
    state = await runtime.load_state(handle.execution_id)
    assert state.decisions["pick"]["innerSteps"] == ["score#a", "score#b"]

    # Replay serves the decision: the decider's steps are not run again.
    await runtime.resume(handle.execution_id, "go", 1)
    assert await handle.result() == ["b", 1]
    assert calls == ["a", "b"]


async def test_a_sibling_branchs_step_is_not_a_deciders_inner_step(store: EventStore) -> None:
    sibling_ran = asyncio.Event()

    @flow("inner-parallel")
    async def body(ctx: Context, _: Any) -> Any:
        async def deciding(c: Context) -> Any:
            async def decider() -> str:
                # The sibling's step runs while this decider is still open.
                await c.step("own", lambda: asyncio.wait_for(sibling_ran.wait(), 2))
                return "x"
            return await c.decide("d", decider)

        async def sibling(c: Context) -> Any:
            out = await c.step("sibling", lambda: 1)
            sibling_ran.set()
            return out

        return await ctx.parallel([deciding, sibling])

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("inner-parallel")
    assert await handle.result(timeout=5) == ["x", 1]
    [event] = [e for e in await store.read(handle.execution_id)
               if str(e.type) == "DECISION_RECORDED"]
    assert event.payload["innerSteps"] == ["own"]
