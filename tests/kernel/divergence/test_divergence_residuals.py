"""The divergence residuals the seed left (issue 25 item 14; ADR 0113 fix rounds 2 and 3).

- A new step inside a scope whose own recorded frames the re-run did not ask for (a
  function-branch scope that dropped one of them, or a parallel inserted before a
  recorded one, which takes its path: scope-path aliasing) ran its effect before the
  refusal at the scope's close. Now its siblings replay first, and the frames still
  not asked for refuse it before its effect; a healthy re-run is not refused.
- "A decider must await its steps": a step the decider detaches and that finishes
  after it returned is not on its record, so a re-run that serves the decision does
  not ask for it and refuses an unchanged body (pinned, documented on ``ctx.decide``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from divergence_kit import Drill, Effects, define

from fleet import Context, Decision, FlowReplayDivergenceError
from fleet.kernel.store.spi import EventStore


def _function_branches(fx: Effects, *branches: tuple[str, ...], inserted: tuple[str, ...] = (),
                       ) -> Any:
    def branch(names: tuple[str, ...]) -> Any:
        async def run(ctx: Context) -> list[Any]:
            return [await ctx.step(n, fx(n)) for n in names]
        return run

    async def body(ctx: Context, _: Any) -> str:
        if inserted:  # a parallel put in front: it takes the recorded one's path "/0"
            await ctx.parallel([branch(inserted)])
        await ctx.parallel([branch(b) for b in branches])
        await ctx.wait("go")
        return str(await ctx.step("c", fx("c")))
    return define(body, "branches")


async def test_an_inserted_parallel_on_a_recorded_path_is_refused_before_its_new_step(
        store: EventStore) -> None:
    drill, fx = Drill(store), Effects()
    eid = await drill.park(_function_branches(fx, ("p1", "p2")))
    # The edit puts a parallel of one new step first: it opens "/0", whose recorded
    # frames p1 and p2 are the old parallel's (now "/1", not started yet).
    runtime = await drill.resume(_function_branches(fx, ("p1", "p2"), inserted=("x1",)), eid)
    assert fx.ran("x1") == 0  # before the fix: x1 ran, then the close refused
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["p1", "p2"]
    assert runtime.divergence_parked == 1


async def test_a_scope_that_dropped_its_own_step_is_refused_before_a_new_one(
        store: EventStore) -> None:
    drill, fx = Drill(store), Effects()
    eid = await drill.park(_function_branches(fx, ("a1", "a2"), ("b1",)))
    runtime = await drill.resume(_function_branches(fx, ("a1",), ("b1", "b2")), eid)
    assert fx.ran("b2") == 0  # its effect never ran: a2 was dropped from its scope
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["a2"]


def _parked_in_a_branch(fx: Effects) -> Any:
    """A branch parks inside the scope after a1; the other replays its recorded step only
    after a turn of the loop. The resumed re-run's new a2 starts while b1 is not yet
    asked for: a healthy re-run its siblings' replay must not refuse."""
    async def first(ctx: Context) -> None:
        await ctx.step("a1", fx("a1"))
        await ctx.wait("go")
        await ctx.step("a2", fx("a2"))

    async def second(ctx: Context) -> None:
        await asyncio.sleep(0)
        await ctx.step("b1", fx("b1"))

    async def body(ctx: Context, _: Any) -> str:
        await ctx.parallel([first, second])
        return str(await ctx.step("c", fx("c")))
    return define(body, "in-branch")


async def test_a_healthy_re_run_inside_a_scope_is_not_refused(store: EventStore) -> None:
    drill, fx = Drill(store), Effects()
    eid = await drill.park(_parked_in_a_branch(fx))
    assert fx.calls == {"a1": 1, "b1": 1}
    runtime = await drill.resume(_parked_in_a_branch(fx), eid)
    assert await runtime.result(eid) == "c-done"
    assert runtime.divergence_parked == 0
    assert fx.calls == {"a1": 1, "b1": 1, "a2": 1, "c": 1}


def _decides(fx: Effects, *, detach: bool) -> Any:
    detached: list[asyncio.Future[Any]] = []

    async def body(ctx: Context, _: Any) -> str:
        async def decider() -> Decision:
            if detach:  # started, never awaited: it finishes after the decider returned
                detached.append(asyncio.ensure_future(
                    ctx.step("lookup", fx("lookup", delay=0.01))))
            else:
                await ctx.step("lookup", fx("lookup"))
            return Decision("a")

        await ctx.decide("pick", decider)
        await asyncio.sleep(0.05)  # the detached step finishes meanwhile
        await ctx.wait("go")
        return str(await ctx.step("c", fx("c")))
    return define(body, "decides")


async def test_a_decider_must_await_its_steps(store: EventStore) -> None:
    drill, fx = Drill(store), Effects()
    awaited = await drill.park(_decides(fx, detach=False))
    runtime = await drill.resume(_decides(fx, detach=False), awaited)
    assert await runtime.result(awaited) == "c-done"  # the decider's own step: exempt

    detached = await drill.park(_decides(fx, detach=True))
    assert fx.ran("lookup") == 2
    runtime = await drill.resume(_decides(fx, detach=True), detached)
    # The unchanged body is refused: the served decision exempts only the steps its
    # record names, and the detached one finished after the record was written.
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(detached)
    assert refused.value.skipped == ["lookup"]
    assert fx.ran("c") == 1  # only the awaited run's
