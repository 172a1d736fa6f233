"""Replay divergence in parallel scopes (ADR 0113 D3, fix round 1 item 4, fix round 2 item 3).

A scope's own frames compare as a set when it closes; a step that starts inside
an open scope is judged against the frames outside it recorded before the
scope; an explicit tuple-branch scope also forces the recorded frames it no
longer asks for; a log without scope stamps falls back to the first cut's
floor. Each refusal asserts that the effect it stopped did not run.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from divergence_kit import Drill, Effects, define, parked_ab

from fleet import Context, FlowReplayDivergenceError
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.fold import fold_log
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore


def _scoped(fx: Effects, branches: Any, *, with_a: bool = True) -> Any:
    async def body(ctx: Context, _: Any) -> str:
        if with_a:
            await ctx.step("a", fx("a"))
        await ctx.parallel(branches(ctx))
        await ctx.wait("go")
        return str(await ctx.step("c", fx("c")))
    return define(body, "scoped")


def _tuples(fx: Effects, *names: str) -> Any:
    return lambda ctx: [(n, fx(n)) for n in names]


def _functions(fx: Effects, *groups: tuple[str, ...]) -> Any:
    def branch(names: tuple[str, ...]) -> Any:
        async def run(ctx: Context) -> list[Any]:
            return [await ctx.step(n, fx(n)) for n in names]
        return run
    return lambda ctx: [branch(g) for g in groups]


async def test_d3_scope_steps_compare_as_a_set_so_reordered_branches_pass(
        store: EventStore) -> None:
    drill, fx = Drill(store), Effects()
    eid = await drill.park(_scoped(fx, _tuples(fx, "p", "q", "r")))
    frames = fold_log(await store.read(eid)).frames
    assert {frames[s].scope for s in "pqr"} == {"/0"}
    runtime = await drill.resume(_scoped(fx, _tuples(fx, "r", "p", "q")), eid)
    assert await runtime.result(eid) == "c-done"
    assert fx.calls == {"a": 1, "p": 1, "q": 1, "r": 1, "c": 1}


async def test_fix1_item4_a_function_branch_scope_that_dropped_a_step_is_caught_at_close(
        ) -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()
    deciders: list[str] = []

    def decider() -> str:
        deciders.append("ran")
        return "x"

    def scoped_then_decides(*groups: tuple[str, ...]) -> Any:
        async def body(ctx: Context, _: Any) -> str:
            await ctx.step("a", fx("a"))
            await ctx.parallel(_functions(fx, *groups)(ctx))
            await ctx.wait("go")
            # A live decide is not judged: only the set check at the scope's
            # close keeps its decider from running under the edited body.
            await ctx.decide("next", decider)
            return str(await ctx.step("c", fx("c")))
        return define(body, "scoped")
    eid = await drill.park(scoped_then_decides(("p", "q"), ("r",)))
    runtime = await drill.resume(scoped_then_decides(("p",), ("r",)), eid)
    assert deciders == []
    assert fx.ran("c") == 0
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["q"]


async def test_fix2_item3_a_step_inside_a_scope_is_judged_against_frames_outside_before_it(
        ) -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()
    eid = await drill.park(_scoped(fx, _functions(fx, ("p",), ("r",))))
    # The edit drops a (recorded before the scope) and adds s inside the scope.
    runtime = await drill.resume(
        _scoped(fx, _functions(fx, ("p",), ("r", "s")), with_a=False), eid)
    assert fx.ran("s") == 0
    assert fx.ran("c") == 0
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["a"]


async def test_fix2_item3_a_new_step_inside_a_scope_may_run_when_nothing_outside_was_dropped(
        ) -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()
    eid = await drill.park(_scoped(fx, _functions(fx, ("p",), ("r",))))
    # a was asked for; the frames recorded after the scope (none here) are not
    # judged at s's start. A new step in a recorded scope runs, and the set at
    # close holds every recorded scope frame.
    runtime = await drill.resume(_scoped(fx, _functions(fx, ("p",), ("r", "s"))), eid)
    assert await runtime.result(eid) == "c-done"
    assert fx.calls == {"a": 1, "p": 1, "r": 1, "s": 1, "c": 1}


async def test_fix2_item3_explicit_tuple_branches_that_dropped_a_recorded_step_are_caught(
        ) -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()
    eid = await drill.park(_scoped(fx, _tuples(fx, "p", "q")))
    # q is replaced by s: the explicit branch set no longer holds q, so s's
    # start is refused before its effect (not only at close).
    runtime = await drill.resume(_scoped(fx, _tuples(fx, "p", "s")), eid)
    assert fx.ran("s") == 0
    assert fx.ran("c") == 0
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["q"]


async def test_fix2_item3_a_new_scope_judges_every_frame_outside_open_scopes() -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()
    eid = await drill.park(_scoped(fx, _tuples(fx, "p")))

    async def inserted_scope(ctx: Context, _: Any) -> str:
        await ctx.parallel([("p", fx("p"))])
        await ctx.parallel([("n", fx("n"))])  # a new scope, a skipped recorded a
        await ctx.wait("go")
        return str(await ctx.step("c", fx("c")))
    runtime = await drill.resume(define(inserted_scope, "scoped"), eid)
    assert fx.ran("n") == 0
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["a"]


async def test_fix2_item3_a_log_without_scope_stamps_falls_back_to_the_floor() -> None:
    fx = Effects()
    source = Drill(MemoryEventStore())
    eid = await source.park(_scoped(fx, _functions(fx, ("p",), ("r",))), execution_id="old")
    events = []
    for event in await source.store.read(eid):
        if event.type is EventType.STEP_STARTED:
            payload = {k: v for k, v in event.payload.items() if k != "scope"}
            event = EventEnvelope(event.id, event.execution_id, event.sequence, event.type,
                                  event.timestamp, payload, event.metadata)
        events.append(event)
    state = fold_log(events)
    assert state.scopes
    assert all(f.scope is None for f in state.frames.values())
    store = MemoryEventStore()
    await store.append_batch(events)
    drill = Drill(store)
    # Unchanged body: clean. a dropped and s added: the floor (frames ranked
    # below the lowest frame the scope asked for) still catches a at s's start.
    runtime = await drill.resume(_scoped(fx, _functions(fx, ("p",), ("r", "s")),
                                         with_a=False), "old")
    assert fx.ran("s") == 0
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result("old")
    assert refused.value.skipped == ["a"]


def _nested(fx: Effects, *, drop: str | None = None) -> Any:
    """Two branches that each open a nested parallel: both nested scopes get the path
    "/0/0" (paths are positional per context). Branch 1 first awaits something
    outside the kernel, so branch 0's nested scope closes before branch 1's opens."""
    def branch(i: int) -> Any:
        async def run(ctx: Context) -> list[Any]:
            if i == 1:
                await asyncio.sleep(0.01)
            names = [n for n in (f"n{i}a", f"n{i}b") if n != drop]
            return await ctx.parallel([(n, fx(n)) for n in names])
        return run

    async def body(ctx: Context, _: Any) -> str:
        await ctx.parallel([branch(0), branch(1)])
        await ctx.wait("go")
        return str(await ctx.step("c", fx("c")))
    return define(body, "nested")


async def test_fix2_item3_sibling_nested_scopes_sharing_a_path_are_not_falsely_refused(
        ) -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()
    eid = await drill.park(_nested(fx))
    frames = fold_log(await drill.store.read(eid)).frames
    assert {frames[n].scope for n in ("n0a", "n0b", "n1a", "n1b")} == {"/0/0"}
    # Unchanged body under fail: branch 0's nested close must not judge the
    # frames branch 1 has not reached yet (a false refusal before the fix).
    runtime = await drill.resume(_nested(fx), eid)
    assert await runtime.result(eid) == "c-done"
    assert runtime.divergence_parked == 0


async def test_fix2_item3_a_dropped_nested_step_is_caught_when_the_outer_scope_closes() -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()
    eid = await drill.park(_nested(fx))
    runtime = await drill.resume(_nested(fx, drop="n1b"), eid)
    assert fx.ran("c") == 0
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["n1b"]


async def test_fix2_item3_a_new_scope_over_a_log_that_never_had_one_judges_everything(
        ) -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()
    eid = await parked_ab(drill, fx)  # no parallel: no frame carries a scope

    async def dropped_then_scope(ctx: Context, _: Any) -> str:
        await ctx.step("b", fx("b"))
        await ctx.wait("go")
        await ctx.parallel([("n", fx("n"))])
        return "done"
    # Before the fix this fell to the legacy floor (scopes recorded, frames
    # unstamped), found no floor, and let n's effect run before the refusal.
    runtime = await drill.resume(define(dropped_then_scope), eid)
    assert fx.ran("n") == 0
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["a"]


async def test_d3_a_step_outside_an_open_scope_leaves_the_scopes_frames_to_its_close() -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()

    def concurrent(top: str, *, pause: float) -> Any:
        async def slow_branch(ctx: Context) -> None:
            await ctx.step("p", fx("p"))
            await asyncio.sleep(pause)  # the scope stays open a while
            await ctx.step("q", fx("q"))

        async def beside(ctx: Context) -> None:
            await asyncio.sleep(0.005)
            await ctx.step(top, fx(top))

        async def body(ctx: Context, _: Any) -> str:
            await ctx.step("a", fx("a"))
            await asyncio.gather(ctx.parallel([slow_branch]), beside(ctx))
            await ctx.wait("go")
            return str(await ctx.step("c", fx("c")))
        return define(body, "beside")
    eid = await drill.park(concurrent("t", pause=0.0))
    # The edit renames t to n. n starts while the scope is open and q (in it)
    # is not asked yet: q is compared at the scope's close, so n is judged
    # against a only; t, outside the scope, is what the edit dropped.
    runtime = await drill.resume(concurrent("n", pause=0.03), eid)
    assert fx.ran("n") == 0
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["t"]


async def test_fix2_item3_a_new_step_in_a_shared_nested_path_is_judged_as_in_its_scope() -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()

    def nested(extra: bool) -> Any:
        def branch(i: int) -> Any:
            async def run(ctx: Context) -> None:
                async def inner(c: Context) -> None:
                    await c.step(f"n{i}", fx(f"n{i}"))
                    if i == 1 and extra:
                        await asyncio.sleep(0.01)  # branch 0's nested scope closes first
                        await c.step("n1-new", fx("n1-new"))
                await ctx.parallel([inner])
            return run

        async def body(ctx: Context, _: Any) -> str:
            await ctx.parallel([branch(0), branch(1)])
            await ctx.step("after", fx("after"))
            await ctx.wait("go")
            return str(await ctx.step("c", fx("c")))
        return define(body, "shared")
    eid = await drill.park(nested(False))
    # Both nested scopes are "/0/0". n1-new starts after branch 0 closed its
    # copy: the path is still open (branch 1's), so n1-new is judged as a step
    # inside it (frames before the scope), not against "after", recorded later.
    runtime = await drill.resume(nested(True), eid)
    assert await runtime.result(eid) == "c-done"
    assert fx.ran("n1-new") == 1
    assert runtime.divergence_parked == 0


async def test_fix3_item5_receive_inside_a_parallel_branch_completes_clean_under_fail(
        store: EventStore) -> None:
    """Fix round 3 item 5: a branch parks on ``ctx.receive``; a ``send`` wakes it; the
    unchanged body re-runs under ``fail``: nothing is refused, nothing re-runs."""
    drill, fx = Drill(store), Effects()

    def body_of() -> Any:
        async def inbox(ctx: Context) -> Any:
            message = await ctx.receive("k")
            return [message, await ctx.step("b", fx("b"))]

        async def body(ctx: Context, _: Any) -> Any:
            await ctx.step("a", fx("a"))
            return await ctx.parallel([("p", fx("p")), inbox])
        return define(body, "inbox")

    eid = await drill.park(body_of())
    state = fold_log(await store.read(eid))
    assert state.parked
    assert state.waiting is not None
    assert state.waiting["correlationKey"] == "k"
    assert fx.calls == {"a": 1, "p": 1}
    runtime = drill.runtime(body_of())  # divergence="fail"
    assert await runtime.send(eid, "k", "hello") is True
    assert await runtime.result(eid) == ["p-done", ["hello", "b-done"]]
    assert fx.calls == {"a": 1, "p": 1, "b": 1}
    assert runtime.divergence_parked == 0
    assert drill.divergence_warnings() == []
    assert not any(e.payload.get("condition", {}).get("on") == "__fleet_diverged__"
                   for e in await store.read(eid))
