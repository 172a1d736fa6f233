"""Replay: a re-drive serves what the log holds and runs live only what it lacks."""

from __future__ import annotations

from typing import Any

from kernel_kit import kinds, settle, started

from fleet import Context, Decision, Policy, Runtime, flow
from fleet.kernel.store.spi import EventStore


async def test_resume_replays_steps_decisions_and_values_then_runs_the_rest_live(
        store: EventStore) -> None:
    calls: dict[str, int] = {"a": 0, "b": 0, "decider": 0}
    seen: list[dict[str, Any]] = []

    def step_a(x: int) -> int:
        calls["a"] += 1
        return x * 10

    async def step_b(x: int) -> int:
        calls["b"] += 1
        return x + 1

    def decider(x: int) -> Decision:
        calls["decider"] += 1
        return Decision("blue", policy=Policy("p", 1, 0.5))

    @flow("replay", steps=["a", "b"])
    async def body(ctx: Context, x: int) -> dict[str, Any]:
        a = await ctx.step("a", step_a, x)
        choice = await ctx.decide("colour", decider, a)
        values = {"now": ctx.now(), "random": ctx.random(), "uuid": ctx.uuid()}
        seen.append(values)
        go = await ctx.wait("go")
        b = await ctx.step("b", step_b, a)
        return {"a": a, "b": b, "choice": choice, "go": go, **values}

    runtime = Runtime(store, flows=[body])
    eid = await started(runtime, "replay", 4)
    before = await store.read(eid)
    assert kinds(before)[-1] == "EXECUTION_SUSPENDED"
    assert calls == {"a": 1, "b": 0, "decider": 1}

    handle = await runtime.resume(eid, "go", "yes")
    result = await handle.result()

    # The replay did not call the recorded step or decider again ...
    assert calls == {"a": 1, "b": 1, "decider": 1}
    # ... and the recorded values came back exactly.
    assert len(seen) == 2
    assert seen[0] == seen[1]
    assert result == {"a": 40, "b": 41, "choice": "blue", "go": "yes", **seen[0]}
    log = await store.read(eid)
    # What was on the log stays as it was; the replay appended only the new tail.
    assert [e.to_dict() for e in log[:len(before)]] == [e.to_dict() for e in before]
    assert kinds(log[len(before):]) == ["EXECUTION_RESUMED", "STEP_STARTED", "STEP_COMPLETED",
                                        "EXECUTION_COMPLETED"]
    assert kinds(log).count("VALUE_RECORDED") == 3
    assert kinds(log).count("DECISION_RECORDED") == 1


async def test_recorded_values_are_what_the_live_run_returned(store: EventStore) -> None:
    @flow("values")
    async def body(ctx: Context, _: Any) -> list[Any]:
        return [ctx.now(), ctx.random(), ctx.uuid(), ctx.random()]

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("values")
    out = await handle.result()
    recorded = [e.payload["value"] for e in await store.read(handle.execution_id)
                if str(e.type) == "VALUE_RECORDED"]
    assert recorded == out
    assert out[1] != out[3]  # two random() calls are two draws, under two names
    assert 0 <= out[1] < 1
    assert isinstance(out[2], str)
    assert len(out[2]) == 36


async def test_a_second_runtime_replays_from_the_store_alone(store: EventStore) -> None:
    calls = []

    def effect() -> str:
        calls.append(1)
        return "done"

    @flow("two-runtimes")
    async def body(ctx: Context, _: Any) -> list[Any]:
        first = await ctx.step("effect", effect)
        token = ctx.uuid()
        answer = await ctx.wait("answer")
        return [first, token, answer]

    first_rt = Runtime(store, flows=[body])
    eid = await started(first_rt, "two-runtimes")
    token = (await store.read(eid))[3].payload["value"]

    # A fresh runtime (another process, after a deploy) resumes it.
    second_rt = Runtime(store, flows=[body])
    handle = await second_rt.resume(eid, "answer", 42)
    assert await handle.result() == ["done", token, 42]
    assert len(calls) == 1
    await settle(second_rt)
