"""A refusal parks (ADR 0113 note 2, fix round 1 item 2, fix round 2 items 4-5).

The reserved gate, the exact log a refusal leaves, the message when the park
cannot land, recovery and timers leaving a diverged park alone,
``retry_diverged`` (authorisation, one re-park per call, completion once the
code is fixed), the status-only answer, the reserved name, the latch, and the
strict default.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from divergence_kit import Drill, Effects, define
from kernel_kit import FaultyStore, ManualClock, dumped, failed_with, kinds, settle

from fleet import (
    AccessDeniedError,
    Context,
    ExecutionNotFoundError,
    FlowReplayDivergenceError,
    Principal,
    ReservedNameError,
    Runtime,
    StepFailedError,
)
from fleet.kernel.divergence import skipped_key
from fleet.kernel.events import EventType
from fleet.kernel.fold import DIVERGED_GATE, fold_log
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore


def _v1(fx: Effects, *names: str) -> Any:
    async def body(ctx: Context, _: Any) -> str:
        for name in names:
            await ctx.step(name, fx(name))
        await ctx.wait("go")
        return str(await ctx.step("c", fx("c")))
    return define(body, "parked")


def _dropped(fx: Effects, *names: str) -> Any:
    """v1 without the steps in ``names``, i.e. the edit under test."""
    async def body(ctx: Context, _: Any) -> str:
        for name in ("a", "b"):
            if name not in names:
                await ctx.step(name, fx(name))
        await ctx.wait("go")
        return str(await ctx.step("c", fx("c")))
    return define(body, "parked")


async def test_note2_a_refusal_parks_on_the_reserved_gate_and_appends_nothing_else(
        store: EventStore) -> None:
    drill, fx = Drill(store), Effects()
    eid = await drill.park(_v1(fx, "a", "b"), principal=Principal("ops", "t1"))
    before = dumped(await store.read(eid))
    runtime = drill.runtime(_dropped(fx, "a", "b"))
    await runtime.resume(eid, "go", "approved", principal=Principal("ops", "t1"))
    await settle(runtime)
    after = await store.read(eid)
    assert fx.ran("c") == 0
    # The resume's own bootstrap, then the park: nothing else (no STEP_STARTED,
    # no EXECUTION_FAILED).
    assert dumped(after[:len(before)]) == before
    assert kinds(after[len(before):]) == ["EXECUTION_RESUMED", "EXECUTION_SUSPENDED"]
    park = after[-1]
    assert park.kernel
    assert park.payload["condition"] == {"on": DIVERGED_GATE, "kind": "diverged",
                                         "correlationKey": "skipped 2: a, b"}
    state = fold_log(after)
    assert state.parked
    assert state.waiting == park.payload["condition"]
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.parked is True
    assert refused.value.skipped == ["a", "b"]
    assert refused.value.code == "flow_replay_divergence"
    [warning] = drill.warnings
    assert f"execution {eid!r} PARKED on {DIVERGED_GATE}" in warning
    assert "skipped 2 recorded step(s) (a, b)" in warning
    assert runtime.divergence_parked == 1
    summary = await store.get_execution(eid)
    assert summary is not None
    assert summary.status == "parked"
    assert summary.waiting_on == DIVERGED_GATE


def test_note2_the_correlation_key_names_at_most_twenty_ids() -> None:
    ids = [f"s{i}" for i in range(25)]
    assert skipped_key(ids[:2]) == "skipped 2: s0, s1"
    key = skipped_key(ids)
    assert key.startswith("skipped 25: s0, s1,")
    assert key.endswith("s19, ...")


async def test_fix2_item4_a_park_that_cannot_land_says_refused_and_not_parked() -> None:
    inner = MemoryEventStore()
    drill, fx = Drill(inner), Effects()
    eid = await drill.park(_v1(fx, "a", "b"))
    before = dumped(await inner.read(eid))

    def diverged_park(event: Any) -> bool:
        cond = event.payload.get("condition") or {}
        return bool(event.type is EventType.EXECUTION_SUSPENDED
                    and cond.get("on") == DIVERGED_GATE)
    faulty = FaultyStore(inner, diverged_park)
    runtime = Runtime(faulty, flows=[_dropped(fx, "a")], divergence="fail",
                      on_warn=drill.warnings.append)
    await runtime.resume(eid, "go")
    await settle(runtime)
    assert fx.ran("c") == 0
    assert faulty.refused
    assert faulty.refused[0].type is EventType.EXECUTION_SUSPENDED
    after = await inner.read(eid)
    assert dumped(after[:len(before)]) == before
    assert kinds(after[len(before):]) == ["EXECUTION_RESUMED"]
    with pytest.raises(FlowReplayDivergenceError) as refused:
        await runtime.result(eid)
    assert refused.value.parked is False
    [warning] = drill.warnings
    assert f"execution {eid!r} REFUSED and NOT parked (StoreUnavailableError" in warning
    assert "PARKED" not in warning


async def test_fix1_item2_recovery_and_timers_skip_a_diverged_park_and_warn_on_their_path(
        ) -> None:
    clock = ManualClock()
    store = MemoryEventStore(clock=clock)
    drill, fx = Drill(store), Effects()

    async def v1(ctx: Context, _: Any) -> str:
        await ctx.step("a", fx("a"))
        await ctx.sleep(3600)  # parks on a timer
        return str(await ctx.step("c", fx("c")))

    async def v2(ctx: Context, _: Any) -> str:  # drops a; the timer fires into it
        await ctx.sleep(3600)
        await ctx.sleep(7200)  # a new timer is registered (not judged), then parks
        return str(await ctx.step("c", fx("c")))
    runtime = Runtime(store, flows=[define(v1, "timed")], divergence="fail", clock=clock,
                      local_timers=False)
    eid = (await runtime.start("timed")).execution_id
    await settle(runtime)
    runtime = Runtime(store, flows=[define(v2, "timed")], divergence="fail", clock=clock,
                      local_timers=False, on_warn=drill.warnings.append)
    clock.advance(3601)
    assert len(await runtime.fire_due_timers()) == 1  # the timer path reaches the refusal
    await settle(runtime)
    log = await store.read(eid)
    assert log[-1].payload["condition"]["on"] == DIVERGED_GATE
    assert kinds(log)[-2] == "TIMER_SCHEDULED"  # sleep#1: registered, never fired
    assert [w for w in drill.warnings if "PARKED" in w]
    # Its new timer comes due: the timer service leaves the diverged park alone.
    clock.advance(7201)
    assert await runtime.fire_due_timers() == []
    await settle(runtime)
    # Recovery examines running executions with an expired lease: not this one.
    report = await runtime.recover_abandoned()
    assert report.recovered == 0
    assert await store.read(eid) == log
    assert fx.calls == {"a": 1}


async def test_fix2_item4_the_recovery_path_reaches_the_same_refusal_and_warns() -> None:
    clock = ManualClock()
    store = MemoryEventStore(clock=clock)
    drill, fx = Drill(store), Effects()
    eid = await drill.park(_v1(fx, "a", "b"))
    runtime = drill.runtime(_v1(fx, "a", "b"), lease_ms=1000, clock=clock)
    # A holder answers the gate and dies before its run starts (the task is
    # cancelled before its first step: the lease stays, nothing more is written).
    await runtime.resume(eid, "go", "ok")
    task = runtime._runs[eid].task
    assert task is not None
    task.cancel()
    await settle(runtime)
    assert kinds(await store.read(eid))[-1] == "EXECUTION_RESUMED"
    clock.advance(5)
    recovering = Runtime(store, flows=[_dropped(fx, "a")], divergence="fail", clock=clock,
                         on_warn=drill.warnings.append)
    report = await recovering.recover_abandoned()
    # Fix round 1 item 2: a refused re-drive is failed, not recovered, and named.
    assert (report.examined, report.recovered, report.failed) == (1, 0, 1)
    [failure] = report.failures
    assert (failure.execution_id, failure.error) == (eid, "FlowReplayDivergenceError")
    assert "(a)" in failure.reason
    await settle(recovering)
    assert fx.ran("c") == 0
    log = await store.read(eid)
    assert log[-1].payload["condition"]["on"] == DIVERGED_GATE
    assert [w for w in drill.warnings if "PARKED" in w]


async def _abandoned(store: EventStore, clock: ManualClock, definition: Any) -> str:
    """``definition`` parked on "go", answered by a holder that died before its run
    started: running, its lease left to expire, the log ending EXECUTION_RESUMED."""
    eid = await Drill(store).park(definition)
    runtime = Runtime(store, flows=[definition], lease_ms=1000, clock=clock)
    await runtime.resume(eid, "go", "ok")
    task = runtime._runs[eid].task
    assert task is not None
    task.cancel()
    await settle(runtime)
    assert kinds(await store.read(eid))[-1] == "EXECUTION_RESUMED"
    return eid


def _gated(flow_id: str, fx: Effects, last: Any, **kw: Any) -> Any:
    async def body(ctx: Context, _: Any) -> str:
        await ctx.step("a", fx("a"))
        await ctx.wait("go")
        return str(await ctx.step("c", last))
    return define(body, flow_id, **kw)


async def test_fix1_item2_recovery_names_each_refused_re_drive_and_does_not_wait_for_live_work(
        clocked_store: EventStore, clock: ManualClock) -> None:
    """A divergence refusal and a code mismatch are counted and reported alike (the
    record's onError: ids and reasons); a healthy re-drive is recovered, and the pass
    returns while its live step still runs (it waits only for the replay)."""
    store, fx = clocked_store, Effects()
    release = asyncio.Event()

    async def slow() -> str:
        await release.wait()
        return "c"

    diverged = await _abandoned(store, clock, _gated("div", fx, fx("c")))
    mismatched = await _abandoned(store, clock,
                                  _gated("code", fx, fx("c"), code_fingerprint="build-1"))
    healthy = await _abandoned(store, clock, _gated("ok", fx, fx("c")))

    async def dropped(ctx: Context, _: Any) -> str:  # "div" without step a
        await ctx.wait("go")
        return str(await ctx.step("c", fx("c")))
    warnings: list[str] = []
    clock.advance(5)
    recovering = Runtime(store, divergence="fail", clock=clock, on_warn=warnings.append,
                         flows=[define(dropped, "div"),
                                _gated("code", fx, fx("c"), code_fingerprint="build-2"),
                                _gated("ok", fx, slow)])
    report = await asyncio.wait_for(recovering.recover_abandoned(), 10)
    assert (report.examined, report.recovered, report.skipped, report.failed) == (3, 1, 0, 2)
    by_id = {f.execution_id: f for f in report.failures}
    assert set(by_id) == {diverged, mismatched}
    assert by_id[diverged].error == "FlowReplayDivergenceError"
    assert by_id[mismatched].error == "FlowCodeMismatchError"
    assert "build-1" in by_id[mismatched].reason
    assert not release.is_set()  # the healthy run's live step is still running
    assert (await recovering.load_state(healthy)).status == "running"
    release.set()
    assert await recovering.result(healthy) == "c"
    await settle(recovering)
    assert fx.ran("c") == 0  # neither refused re-drive ran its next step
    assert (await recovering.load_state(diverged)).waiting["on"] == DIVERGED_GATE


async def test_fix1_item2_retry_diverged_needs_resume_authorisation(store: EventStore) -> None:
    drill, fx = Drill(store), Effects()
    owner = Principal("ops", "t1")
    eid = await drill.park(_v1(fx, "a", "b"), principal=owner)
    runtime = drill.runtime(_dropped(fx, "a"))
    await runtime.resume(eid, "go", principal=owner)
    await settle(runtime)
    before = dumped(await store.read(eid))
    with pytest.raises(ExecutionNotFoundError) as hidden:  # t2 may not read it either
        await runtime.retry_diverged(eid, principal=Principal("mallory", "t2"))
    assert isinstance(hidden.value.__cause__, AccessDeniedError)
    after = await store.read(eid)
    # The denial is audited; the park is untouched and nothing was re-driven.
    assert dumped(after[:len(before)]) == before
    assert kinds(after[len(before):]) in ([], ["EXECUTION_DENIED"])
    assert fold_log(after).waiting == fold_log(await store.read(eid)).waiting
    assert fold_log(after).parked
    assert fx.ran("c") == 0


async def test_fix1_item2_retry_diverged_reparks_once_per_call_then_completes_when_fixed(
        store: EventStore) -> None:
    drill, fx = Drill(store), Effects()
    owner = Principal("ops", "t1")
    eid = await drill.park(_v1(fx, "a", "b"), principal=owner)
    broken = drill.runtime(_dropped(fx, "a"))
    await broken.resume(eid, "go", "ok", principal=owner)
    await settle(broken)
    for attempt in (1, 2):
        before = len(await store.read(eid))
        await broken.retry_diverged(eid, principal=owner)
        await settle(broken)
        log = await store.read(eid)
        assert kinds(log[before:]) == ["EXECUTION_RESUMED", "EXECUTION_SUSPENDED"]
        assert log[before].payload["gate"] == DIVERGED_GATE
        assert log[before].payload["payload"] is None
        assert broken.divergence_parked == 1 + attempt
    assert fx.ran("c") == 0
    fixed = drill.runtime(_v1(fx, "a", "b"))
    await fixed.retry_diverged(eid, principal=owner)
    assert await fixed.result(eid) == "c-done"
    assert fx.calls == {"a": 1, "b": 1, "c": 1}
    state = fold_log(await store.read(eid))
    # The status-only answer never reached the flow's resume payloads.
    assert DIVERGED_GATE not in state.resume_payloads
    assert state.resume_payloads == {"go": ["ok"]}


async def test_fix1_item2_an_ordinary_resume_of_the_gate_is_coerced_to_no_answer() -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()
    eid = await drill.park(_v1(fx, "a", "b"))
    runtime = await drill.resume(_dropped(fx, "a"), eid)
    await runtime.resume(eid, DIVERGED_GATE, {"approve": True})
    await settle(runtime)
    resumed = [e for e in await drill.store.read(eid)
               if e.type is EventType.EXECUTION_RESUMED]
    assert resumed[-1].payload == {"gate": DIVERGED_GATE, "payload": None}
    assert DIVERGED_GATE not in fold_log(await drill.store.read(eid)).resume_payloads


async def test_fix1_item2_ctx_wait_refuses_the_reserved_gate() -> None:
    store = MemoryEventStore()

    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.wait(DIVERGED_GATE)
    runtime = Runtime(store, flows=[define(body, "sneaky")])
    handle = await runtime.start("sneaky")
    await failed_with(handle, ReservedNameError.code)  # decision 0023: it ends the run
    assert kinds(await store.read(handle.execution_id)) == ["EXECUTION_STARTED",
                                                             "EXECUTION_FAILED"]


# -- note 2: the failure latches ---------------------------------------------------

def _swallowing(fx: Effects, then: str) -> Any:
    async def body(ctx: Context, _: Any) -> str:
        await ctx.step("b", fx("b"))
        await ctx.wait("go")
        try:
            await ctx.step("c", fx("c"))
        except FlowReplayDivergenceError:
            await ctx.step("a", fx("a"))  # now asks for every recorded step ...
            if then == "step":
                await ctx.step("d", fx("d"))  # ... and goes on to new work
            elif then == "raise":
                raise LookupError("the body turned the refusal into its own failure") from None
        return "done"
    return define(body, "parked")


@pytest.mark.parametrize("then", ["step", "return", "raise"])
async def test_note2_the_failure_latches_even_after_every_recorded_step_is_asked(
        then: str) -> None:
    drill, fx = Drill(MemoryEventStore()), Effects()
    eid = await drill.park(_v1(fx, "a", "b"))
    before = len(await drill.store.read(eid))
    runtime = await drill.resume(_swallowing(fx, then), eid)
    assert fx.ran("c") == 0
    assert fx.ran("d") == 0
    log = await drill.store.read(eid)
    assert kinds(log[before:]) == ["EXECUTION_RESUMED", "EXECUTION_SUSPENDED"]
    assert log[-1].payload["condition"]["on"] == DIVERGED_GATE
    with pytest.raises(FlowReplayDivergenceError):
        await runtime.result(eid)


async def test_note2_a_refusal_is_not_a_step_failure_the_body_could_mistake() -> None:
    assert not issubclass(FlowReplayDivergenceError, StepFailedError)


# -- D3 modes: strict defaults to fail; an explicit value wins ------------------------

async def test_d3_strict_defaults_to_fail_and_an_explicit_mode_wins() -> None:
    owner = Principal("ops", "t1")
    for divergence, parks in ((None, True), ("warn", False)):
        store = MemoryEventStore()
        fx = Effects()
        drill = Drill(store)
        eid = await drill.park(_v1(fx, "a", "b"), principal=owner)
        runtime = Runtime(store, flows=[_dropped(fx, "a")], strict=True,
                          divergence=divergence, on_warn=drill.warnings.append)
        await runtime.resume(eid, "go", principal=owner)
        await settle(runtime)
        assert runtime.divergence == ("fail" if parks else "warn")
        assert fx.ran("c") == (0 if parks else 1)
        assert runtime.divergence_parked == (1 if parks else 0)
        assert runtime.divergence_warnings == (0 if parks else 1)
