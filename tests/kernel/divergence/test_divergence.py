"""Replay-divergence detection (ADR 0113 D3, notes 3-5, 9, fix rounds 1-3).

Each test names the ADR item it pins. A "refused" case always asserts that the
effect the edited body was about to run was NOT invoked. Parallel scopes are
in test_divergence_scopes.py; the park itself (the reserved gate,
retry_diverged, the latch) in test_divergence_park.py; D4 (replay-check of
step families) in test_divergence_families.py; the recorded-log corpus in
test_divergence_corpus.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from divergence_kit import Drill, Effects, ab_go_c, define, dropped_a, parked_ab
from kernel_kit import ManualClock, kinds, settle

from fleet import (
    Context,
    Decision,
    FlowReplayDivergenceError,
    MemorySnapshotStore,
    RetryPolicy,
    Runtime,
)
from fleet.kernel import run as run_module
from fleet.kernel import runtime as runtime_module
from fleet.kernel.divergence import DivergenceDetector
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.fold import DIVERGED_GATE, fold_log
from fleet.kernel.replay import replay_check
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore, Snapshot

# -- D3: a body edit that drops a recorded step, in each mode ---------------------


async def test_d3_fail_refuses_before_the_next_live_steps_effect(store: EventStore) -> None:
    drill, fx = Drill(store), Effects()
    eid = await parked_ab(drill, fx)
    runtime = await drill.resume(dropped_a(fx), eid, divergence="fail")
    assert fx.ran("c") == 0  # the negative test: c's effect never ran
    assert runtime.divergence_parked == 1
    assert runtime.divergence_warnings == 0
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["a"]
    assert "STEP_STARTED" not in kinds(await store.read(eid))[-2:]


async def test_d3_warn_reports_once_counts_once_and_proceeds(store: EventStore) -> None:
    drill, fx = Drill(store), Effects()
    eid = await parked_ab(drill, fx)
    runtime = await drill.resume(dropped_a(fx), eid, divergence="warn")
    assert await runtime.result(eid) == "c-done"
    assert fx.ran("c") == 1  # warn proceeds: it only reports a fault already there
    assert runtime.divergence_warnings == 1
    assert runtime.divergence_parked == 0
    [warning] = drill.warnings
    assert "skipped 1 recorded step(s) (a)" in warning
    assert "divergence='warn': proceeding" in warning


async def test_d3_warn_stops_judging_after_its_one_report() -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()

    async def v1(ctx: Context, _: Any) -> None:
        await ctx.step("a", fx("a"))
        await ctx.step("b", fx("b"))
        await ctx.wait("go")

    async def v2(ctx: Context, _: Any) -> None:  # drops both, then three new steps
        await ctx.wait("go")
        for name in ("x", "y", "z"):
            await ctx.step(name, fx(name))
    eid = await drill.park(define(v1))
    runtime = await drill.resume(define(v2), eid, divergence="warn")
    assert fx.calls == {"a": 1, "b": 1, "x": 1, "y": 1, "z": 1}
    assert runtime.divergence_warnings == 1
    assert len(drill.warnings) == 1
    assert "skipped 2 recorded step(s) (a, b)" in drill.warnings[0]


async def test_d3_off_does_not_judge(store: EventStore) -> None:
    drill, fx = Drill(store), Effects()
    eid = await parked_ab(drill, fx)
    runtime = await drill.resume(dropped_a(fx), eid, divergence="off")
    assert await runtime.result(eid) == "c-done"
    assert runtime.divergence_warnings == runtime.divergence_parked == 0
    assert drill.warnings == []


async def test_d3_an_unchanged_body_is_never_refused(store: EventStore) -> None:
    drill, fx = Drill(store), Effects()
    eid = await parked_ab(drill, fx)
    runtime = await drill.resume(ab_go_c(fx), eid, divergence="fail")
    assert await runtime.result(eid) == "c-done"
    assert fx.calls == {"a": 1, "b": 1, "c": 1}
    assert drill.warnings == []


async def test_d3_membership_not_order_a_pure_reorder_passes(store: EventStore) -> None:
    drill, fx = Drill(store), Effects()
    eid = await parked_ab(drill, fx)

    async def reordered(ctx: Context, _: Any) -> str:
        await ctx.step("b", fx("b"))
        await ctx.step("a", fx("a"))
        await ctx.wait("go")
        return str(await ctx.step("c", fx("c")))
    runtime = await drill.resume(define(reordered), eid, divergence="fail")
    assert await runtime.result(eid) == "c-done"
    assert fx.calls == {"a": 1, "b": 1, "c": 1}
    assert drill.warnings == []


async def test_d3_a_new_step_inserted_before_recorded_ones_is_caught(store: EventStore) -> None:
    drill, fx = Drill(store), Effects()
    eid = await parked_ab(drill, fx)

    async def inserted(ctx: Context, _: Any) -> str:
        await ctx.step("new", fx("new"))  # live new work while a and b are unasked
        await ctx.step("a", fx("a"))
        await ctx.step("b", fx("b"))
        await ctx.wait("go")
        return str(await ctx.step("c", fx("c")))
    runtime = await drill.resume(define(inserted), eid, divergence="fail")
    assert fx.ran("new") == 0
    assert fx.ran("c") == 0
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["a", "b"]


# -- D3: the explicit checks at park, continuation and completion -----------------


@pytest.mark.parametrize("ending", ["waits", "continues", "returns"])
async def test_d3_park_continuation_and_completion_are_judged(ending: str) -> None:
    store = MemoryEventStore()
    drill, fx = Drill(store), Effects()
    eid = await parked_ab(drill, fx)

    async def dropped_then_ends(ctx: Context, _: Any) -> str:
        await ctx.step("b", fx("b"))
        await ctx.wait("go")
        if ending == "waits":
            await ctx.wait("another")
        elif ending == "continues":
            await ctx.continue_as_new("next")
        return "done"
    before = await store.read(eid)
    runtime = await drill.resume(define(dropped_then_ends), eid, divergence="fail")
    after = await store.read(eid)
    # Neither the park on "another", nor the successor, nor the end was written.
    assert kinds(after[len(before):]) == ["EXECUTION_RESUMED", "EXECUTION_SUSPENDED"]
    assert after[-1].payload["condition"]["on"] == DIVERGED_GATE
    assert await store.head(f"{eid}~1") is None
    assert runtime.divergence_parked == 1


# -- fix round 1 item 1: what is NOT judged ----------------------------------------


@pytest.mark.parametrize("first_new_work", ["decide", "emit", "timer"])
async def test_fix1_item1_decide_emit_and_timer_are_not_judged_the_next_step_is(
        first_new_work: str) -> None:
    store = MemoryEventStore()
    drill, fx = Drill(store), Effects()
    eid = await parked_ab(drill, fx)
    deciders: list[str] = []

    async def dropped(ctx: Context, _: Any) -> str:
        await ctx.step("b", fx("b"))
        await ctx.wait("go")
        if first_new_work == "decide":
            deciders.append(await ctx.decide("route", lambda: "left"))
        elif first_new_work == "emit":
            await ctx.emit("progress", {"at": "b"})
        else:
            await ctx.sleep(0)
        return str(await ctx.step("c", fx("c")))
    runtime = await drill.resume(define(dropped), eid, divergence="fail")
    tail = kinds(await store.read(eid))
    # No refusal fired at the decide / emit / timer: it was appended ...
    written = {"decide": "DECISION_RECORDED", "emit": "EMITTED", "timer": "TIMER_FIRED"}
    assert written[first_new_work] in tail
    if first_new_work == "decide":
        assert deciders == ["left"]  # a decider is transient work: it may run
    # ... and the next step start refused before c's effect.
    assert fx.ran("c") == 0
    assert tail[-1] == "EXECUTION_SUSPENDED"
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["a"]


# -- note 4 / fix round 1 item 5: a recorded, unfinished step ---------------------


def _gather_body(fx: Effects, *, with_w: bool = True, with_z: bool = True,
                 flaky_x: int = 1) -> Any:
    """``w``, then ``x`` (fails once, untyped, long backoff) beside ``z`` in an unscoped gather."""
    retry = RetryPolicy(max_attempts=5, initial_interval=3600)

    async def body(ctx: Context, _: Any) -> list[Any]:
        if with_w:
            await ctx.step("w", fx("w"))
        steps = [ctx.step("x", fx("x", fail_first=flaky_x, delay=0.02), retry=retry)]
        if with_z:
            steps.append(ctx.step("z", fx("z")))
        return list(await asyncio.gather(*steps))
    return define(body, "gathered")


async def _crashed_in_backoff(store: EventStore, fx: Effects, clock: ManualClock) -> str:
    """Run until x's first attempt failed and the run sleeps in its backoff; then "crash"."""
    runtime = Runtime(store, flows=[_gather_body(fx)], divergence="fail", clock=clock)
    handle = await runtime.start("gathered")
    eid = handle.execution_id
    for _ in range(500):
        if "STEP_FAILED" in kinds(await store.read(eid)):
            break
        await asyncio.sleep(0.002)
    run = runtime._runs[eid]
    assert run.task is not None
    run.task.cancel()
    await settle(runtime)
    clock.advance(3601)  # the backoff is over when the next holder drives it
    log = kinds(await store.read(eid))
    assert log.count("STEP_STARTED") == 3
    assert log[-1] == "STEP_FAILED"
    return eid


async def test_note4_an_untyped_failure_rerun_on_an_unchanged_body_is_not_refused(
        store: EventStore) -> None:
    clock, fx = ManualClock(), Effects()
    eid = await _crashed_in_backoff(store, fx, clock)
    # x (recorded, unfinished) starts again before z's recorded frame is served:
    # it is judged only against the frames first started before it (w).
    runtime = Runtime(store, flows=[_gather_body(fx)], divergence="fail", clock=clock)
    await runtime.drive(eid)
    assert await runtime.result(eid) == ["x-done", "z-done"]
    assert fx.calls == {"w": 1, "x": 2, "z": 1}
    assert runtime.divergence_parked == runtime.divergence_warnings == 0


async def test_fix1_item5_a_recorded_unfinished_step_is_judged_against_frames_before_it(
        ) -> None:
    store, clock, fx = MemoryEventStore(), ManualClock(), Effects()
    eid = await _crashed_in_backoff(store, fx, clock)
    # Dropping w (ranked before x): refused at x's start, x does not run again.
    runtime = Runtime(store, flows=[_gather_body(fx, with_w=False)], divergence="fail",
                      clock=clock)
    await runtime.drive(eid)
    await settle(runtime)
    assert fx.calls == {"w": 1, "x": 1, "z": 1}
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["w"]


async def test_fix1_item5_frames_ranked_after_a_recorded_step_wait_for_a_later_check() -> None:
    store, clock, fx = MemoryEventStore(), ManualClock(), Effects()
    eid = await _crashed_in_backoff(store, fx, clock)
    # Dropping z (ranked after x): x's restart is not refused (z is after it),
    # x runs, and completion is refused for z.
    runtime = Runtime(store, flows=[_gather_body(fx, with_z=False)], divergence="fail",
                      clock=clock)
    await runtime.drive(eid)
    await settle(runtime)
    assert fx.calls == {"w": 1, "x": 2, "z": 1}
    log = await store.read(eid)
    assert "EXECUTION_COMPLETED" not in kinds(log)
    assert log[-1].payload["condition"]["correlationKey"] == "skipped 1: z"


# -- fix round 2 item 1: firstSeq ranks frames, not key order ----------------------


async def test_fix2_item1_integer_like_ids_rank_by_first_seq_not_by_key() -> None:
    store, clock, fx = MemoryEventStore(), ManualClock(), Effects()
    snapshots = MemorySnapshotStore()
    retry = RetryPolicy(max_attempts=5, initial_interval=3600)

    async def body(ctx: Context, _: Any) -> list[Any]:
        await ctx.step("10", fx("10"))
        return list(await asyncio.gather(ctx.step("2", fx("2", fail_first=1, delay=0.02),
                                                  retry=retry),
                                         ctx.step("1", fx("1"))))
    numbered = define(body, "numbered")
    runtime = Runtime(store, flows=[numbered], divergence="fail", clock=clock)
    handle = await runtime.start("numbered")
    eid = handle.execution_id
    for _ in range(500):
        if "STEP_FAILED" in kinds(await store.read(eid)):
            break
        await asyncio.sleep(0.002)
    task = runtime._runs[eid].task
    assert task is not None
    task.cancel()
    await settle(runtime)
    clock.advance(3601)
    # A snapshot written by a store that sorts keys: the frames dict reads back
    # "1", "10", "2". Ranking by key would put "1" (served after "2") first.
    log = await store.read(eid)
    state = json.loads(json.dumps(fold_log(log).to_dict(), sort_keys=True))
    assert list(state["frames"]) == ["1", "10", "2"]
    await snapshots.save(Snapshot(eid, log[-1].sequence, state))
    detector = DivergenceDetector.for_state(fold_log([], fold_log(log)), "fail")
    assert detector is not None
    assert detector.order == ["10", "1"]
    runtime = Runtime(store, flows=[numbered], snapshots=snapshots, divergence="fail",
                      clock=clock)
    await runtime.drive(eid)
    assert await runtime.result(eid) == ["2-done", "1-done"]
    assert runtime.divergence_parked == 0


# -- fix round 3 item 1: a frame with no firstSeq (a pre-upgrade snapshot) ---------


async def test_fix3_item1_an_unranked_frame_sorts_first_and_is_not_falsely_refused() -> None:
    store, clock, fx = MemoryEventStore(), ManualClock(), Effects()
    snapshots = MemorySnapshotStore()
    eid = await _crashed_in_backoff(store, fx, clock)
    log = await store.read(eid)
    legacy = fold_log(log).to_dict()
    for frame in legacy["frames"].values():  # the snapshot predates firstSeq and scope
        frame.pop("firstSeq", None)
        frame.pop("scope", None)
    await snapshots.save(Snapshot(eid, log[-1].sequence, legacy))
    # A re-run from that snapshot restarts x in the tail (x fails again) and dies.
    fx_flaky = Effects()
    fx_flaky.calls.update(fx.calls)
    runtime = Runtime(store, flows=[_gather_body(fx_flaky, flaky_x=2)], snapshots=snapshots,
                      divergence="fail", clock=clock)
    await runtime.drive(eid)
    for _ in range(500):
        if kinds(await store.read(eid)).count("STEP_FAILED") == 2:
            break
        await asyncio.sleep(0.002)
    task = runtime._runs[eid].task
    assert task is not None
    task.cancel()
    await settle(runtime)
    clock.advance(3601)
    tail = await store.read(eid, after=log[-1].sequence)
    restarted = [e for e in tail if e.type is EventType.STEP_STARTED]
    assert [e.payload["stepId"] for e in restarted] == ["x"]
    # The tail's STEP_STARTED did not stamp x with a late firstSeq: x stays
    # unranked (sorts first), so z is not "before" it and nothing is refused.
    state = fold_log(tail, fold_log([], _state_from(legacy)))
    assert state.frames["x"].first_seq is None
    runtime = Runtime(store, flows=[_gather_body(fx_flaky, flaky_x=2)], snapshots=snapshots,
                      divergence="fail", clock=clock)
    await runtime.drive(eid)
    assert await runtime.result(eid) == ["x-done", "z-done"]
    assert runtime.divergence_parked == 0
    assert fx_flaky.calls == {"w": 1, "x": 3, "z": 1}


def _state_from(d: dict[str, Any]) -> Any:
    from fleet.kernel.fold import ExecutionState

    return ExecutionState.from_dict(d)


def test_fix3_item1_an_unstamped_step_started_carrying_scope_leaves_scope_unset() -> None:
    started = EventEnvelope.make("e", 0, EventType.EXECUTION_STARTED, 1, {"flowId": "f"})
    forged = EventEnvelope.make("e", 1, EventType.STEP_STARTED, 1,
                                {"stepId": "s", "attempt": 1, "scope": "/0"}, kernel=False)
    stamped = EventEnvelope.make("e", 2, EventType.STEP_STARTED, 1,
                                 {"stepId": "t", "attempt": 1, "scope": "/0"})
    state = fold_log([started, forged, stamped])
    assert state.frames["s"].scope is None
    assert state.frames["t"].scope == "/0"
    assert (state.frames["s"].first_seq, state.frames["t"].first_seq) == (1, 2)


def test_divergence_default_reads_the_module_default(shipped_divergence_default: str) -> None:
    store = MemoryEventStore()
    assert shipped_divergence_default == "warn"  # what the package ships (ADR: warn first)
    assert Runtime(store).divergence == runtime_module.DEFAULT_DIVERGENCE
    assert Runtime(store, strict=True).divergence == "fail"
    assert Runtime(store, strict=True, divergence="warn").divergence == "warn"
    assert Runtime(store, strict=True, divergence="off").divergence == "off"
    assert Runtime(store, divergence="fail").divergence == "fail"


# -- fix round 1 item 3 / fix round 2 item 2: served decisions -----------------------


def _planner(fx: Effects, *, inner: tuple[str, ...] = ("lookup", "rank"),
             with_a: bool = True, with_decide: bool = True) -> Any:
    async def decider(ctx: Context) -> Decision:
        for name in inner:
            await ctx.step(name, fx(name))
        return Decision("plan-1")

    async def body(ctx: Context, _: Any) -> str:
        if with_a:
            await ctx.step("a", fx("a"))
        if with_decide:
            await ctx.decide("plan", decider, ctx)
        await ctx.wait("go")
        return str(await ctx.step("c", fx("c")))
    return define(body, "planner")


async def test_fix1_item3_a_served_decision_exempts_exactly_its_inner_steps(
        store: EventStore) -> None:
    drill, fx = Drill(store), Effects()
    eid = await drill.park(_planner(fx))
    [record] = [e for e in await store.read(eid) if e.type is EventType.DECISION_RECORDED]
    assert record.payload["innerSteps"] == ["lookup", "rank"]
    assert record.kernel
    # The decision is served, so its decider (and its steps) are not asked for again.
    runtime = await drill.resume(_planner(fx), eid, divergence="fail")
    assert await runtime.result(eid) == "c-done"
    assert fx.calls == {"a": 1, "lookup": 1, "rank": 1, "c": 1}


async def test_fix1_item3_dropping_a_body_step_beside_a_served_decision_is_caught() -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()
    eid = await drill.park(_planner(fx))
    runtime = await drill.resume(_planner(fx, with_a=False), eid, divergence="fail")
    assert fx.ran("c") == 0
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["a"]  # lookup and rank stay exempt


async def test_fix1_item3_a_decision_the_body_no_longer_asks_for_exempts_nothing() -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()
    eid = await drill.park(_planner(fx))
    runtime = await drill.resume(_planner(fx, with_decide=False), eid, divergence="fail")
    assert fx.ran("c") == 0
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["lookup", "rank"]


async def test_fix2_item2_inner_steps_is_always_written_even_empty() -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()
    eid = await drill.park(_planner(fx, inner=()))
    [record] = [e for e in await drill.store.read(eid)
                if e.type is EventType.DECISION_RECORDED]
    assert record.payload["innerSteps"] == []
    assert "innerStepsOverflow" not in record.payload


async def _legacy_decision_log(fx: Effects, inner: tuple[str, ...]) -> MemoryEventStore:
    """A pre-R7 log: the decision record carries no innerSteps (hand-edited from a run)."""
    source = Drill(MemoryEventStore())
    eid = await source.park(_planner(fx, inner=inner), execution_id="legacy")
    events = []
    for event in await source.store.read(eid):
        if event.type is EventType.DECISION_RECORDED:
            payload = {k: v for k, v in event.payload.items() if k != "innerSteps"}
            event = EventEnvelope(event.id, event.execution_id, event.sequence, event.type,
                                  event.timestamp, payload, event.metadata)
        events.append(event)
    store = MemoryEventStore()
    await store.append_batch(events)
    assert "innerSteps" not in fold_log(events).decisions["plan"]
    return store


async def test_fix1_item3_a_record_without_inner_steps_falls_back_to_the_naming_convention(
        ) -> None:
    fx = Effects()
    store = await _legacy_decision_log(fx, ("plan:lookup", "plan#1"))
    drill = Drill(store)
    runtime = await drill.resume(_planner(fx, inner=("plan:lookup", "plan#1")), "legacy",
                                 divergence="fail")
    assert await runtime.result("legacy") == "c-done"
    assert fx.calls == {"a": 1, "plan:lookup": 1, "plan#1": 1, "c": 1}


async def test_fix1_item3_a_legacy_record_whose_decider_used_other_ids_reports_them() -> None:
    fx = Effects()
    store = await _legacy_decision_log(fx, ("plan:lookup", "fetch"))
    drill = Drill(store)
    runtime = await drill.resume(_planner(fx, inner=("plan:lookup", "fetch")), "legacy",
                                 divergence="warn")
    # The documented legacy behaviour: "fetch" does not follow the convention.
    assert await runtime.result("legacy") == "c-done"
    [warning] = drill.divergence_warnings()
    assert "(fetch)" in warning


async def test_fix2_item2_an_overflowed_record_exempts_the_window_from_inner_from() -> None:
    # 200 ids of 400 bytes pass the 64 KiB cap long before the 4,096-id cap.
    long_ids = tuple(f"plan:{i:03d}:" + "x" * 392 for i in range(200))
    drill, fx = Drill(MemoryEventStore()), Effects()
    eid = await drill.park(_planner(fx, inner=long_ids))
    [record] = [e for e in await drill.store.read(eid)
                if e.type is EventType.DECISION_RECORDED]
    assert record.payload["innerStepsOverflow"] is True
    kept = record.payload["innerSteps"]
    assert 0 < len(kept) < len(long_ids)
    assert sum(len(s.encode()) + 3 for s in kept) <= 64 * 1024
    a_seq = fold_log(await drill.store.read(eid)).frames["a"].first_seq
    assert a_seq is not None
    assert record.payload["innerFrom"] == a_seq + 2
    # Served: the ids past the cap are exempt through the window, a (before
    # innerFrom) is not.
    runtime = await drill.resume(_planner(fx, inner=long_ids), eid, divergence="fail")
    assert await runtime.result(eid) == "c-done"
    drill2, fx2 = Drill(MemoryEventStore()), Effects()
    eid2 = await drill2.park(_planner(fx2, inner=long_ids))
    runtime = await drill2.resume(_planner(fx2, inner=long_ids, with_a=False), eid2,
                                  divergence="fail")
    assert fx2.ran("c") == 0
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid2)
    assert refused.value.skipped == ["a"]


async def test_fix2_item2_the_id_cap_overflows_at_4096() -> None:
    inner = run_module._InnerSteps(7)
    for i in range(4097):
        inner.add(f"s{i}")
    record = inner.record()
    assert len(record["innerSteps"]) == 4096
    assert record["innerStepsOverflow"] is True
    assert record["innerFrom"] == 7


# -- D3 / note 3: the baseline resets at EXECUTION_MIGRATED -------------------------


async def test_d3_frames_before_a_migration_are_exempt_frames_after_it_are_judged(
        store: EventStore) -> None:
    drill, fx = Drill(store), Effects()

    async def v1_body(ctx: Context, _: Any) -> str:
        await ctx.step("a", fx("a"))
        await ctx.wait("go")
        return "v1"
    v1 = define(v1_body, "migrating", version=1)
    eid = await drill.park(v1)

    async def v2_body(ctx: Context, _: Any) -> str:  # a is gone (transformState-style)
        await ctx.wait("go")
        await ctx.step("b", fx("b"))
        await ctx.wait("go2")
        await ctx.step("c", fx("c"))
        return "done"
    v2 = define(v2_body, "migrating", version=2)
    runtime = drill.runtime(v1, v2)
    await runtime.resume_as(eid, version=2, strategy="force")
    await settle(runtime)
    state = fold_log(await store.read(eid))
    assert state.migrated_at_seq is not None
    assert state.parked
    runtime = await drill.resume(v2, eid, "go")
    assert fx.calls == {"a": 1, "b": 1}  # a is exempt: recorded before the migration
    assert runtime.divergence_parked == 0

    async def v2_edited(ctx: Context, _: Any) -> str:  # drops b, recorded after it
        await ctx.wait("go")
        await ctx.wait("go2")
        await ctx.step("c", fx("c"))
        return "done"
    runtime = await drill.resume(define(v2_edited, "migrating", version=2), eid, "go2")
    assert fx.ran("c") == 0
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["b"]


async def test_note3_a_migrated_frame_without_first_seq_is_exempt() -> None:
    started = EventEnvelope.make("m", 0, EventType.EXECUTION_STARTED, 1, {"flowId": "f"})
    migrated = EventEnvelope.make("m", 1, EventType.EXECUTION_MIGRATED, 1,
                                  {"fromFlowHash": "", "toFlowHash": "", "toVersion": 2})
    after = [EventEnvelope.make("m", 2, EventType.STEP_STARTED, 1, {"stepId": "b"}),
             EventEnvelope.make("m", 3, EventType.STEP_COMPLETED, 1, {"stepId": "b"})]
    state = fold_log([started, migrated, *after]).to_dict()
    state["frames"]["legacy"] = {"status": "completed", "attempts": 1}  # no firstSeq
    detector = DivergenceDetector.for_state(_state_from(state), "fail")
    assert detector is not None
    assert detector.order == ["b"]


# -- the dry replay (replay_check) never waits and never swallows a cancel ------------


async def test_replay_check_stops_at_a_restart_instead_of_sleeping_out_its_backoff() -> None:
    store, fx = MemoryEventStore(), Effects()
    # Wall clock: the recorded retryAt is an hour ahead of the replay.
    eid = await _crashed_in_backoff(store, fx, ManualClock())
    log = await store.read(eid)
    verdict = await asyncio.wait_for(replay_check(log, [_gather_body(fx)]), 5)
    assert (verdict.status, verdict.frontier) == ("ok", "STEP_STARTED x")
    assert fx.calls == {"w": 1, "x": 1, "z": 1}


async def test_replay_check_lets_a_cancel_through() -> None:
    fx = Effects()
    block = asyncio.Event()

    async def body(ctx: Context, _: Any) -> str:
        await block.wait()  # the body awaits something outside the kernel
        return str(await ctx.step("a", fx("a")))
    definition = define(body, "slow")
    drill = Drill(MemoryEventStore())
    runtime = drill.runtime(definition)
    eid = (await runtime.start("slow")).execution_id
    await asyncio.sleep(0.01)
    log = await drill.store.read(eid)
    check = asyncio.ensure_future(replay_check(log, [definition]))
    await asyncio.sleep(0.01)
    check.cancel()
    with pytest.raises(asyncio.CancelledError):
        await check
    assert fx.calls == {}
    block.set()
    await settle(runtime)


def _decided_then(fx: Effects, *, before: tuple[str, ...] = (), after: tuple[str, ...] = ("b",)
                  ) -> Any:
    async def decider(ctx: Context) -> str:
        await ctx.step("lookup", fx("lookup"))
        return "plan-1"

    async def body(ctx: Context, _: Any) -> str:
        for name in before:
            await ctx.step(name, fx(name))
        await ctx.decide("plan", decider, ctx)
        for name in after:
            await ctx.step(name, fx(name))
        await ctx.wait("go")
        return str(await ctx.step("c", fx("c")))
    return define(body, "decided")


async def test_fix1_item3_dropping_a_step_recorded_after_a_served_decision_is_caught() -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()
    eid = await drill.park(_decided_then(fx))
    # The first cut's "uncertain window" after a served decision hid this edit.
    runtime = await drill.resume(_decided_then(fx, after=()), eid)
    assert fx.ran("c") == 0
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["b"]


async def test_fix1_item3_a_new_step_before_a_served_decision_is_caught() -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()
    eid = await drill.park(_decided_then(fx))
    runtime = await drill.resume(_decided_then(fx, before=("new",)), eid)
    assert fx.ran("new") == 0
    assert fx.ran("c") == 0
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.skipped == ["lookup", "b"]
