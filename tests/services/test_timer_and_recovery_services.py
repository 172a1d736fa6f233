"""The timer service and the recovery sweeper, on real stores with a manual clock."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from kernel_kit import drove

from fleet import Context, Runtime, flow
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore
from fleet.kernel.store.sqlite import SqliteEventStore
from fleet.recovery import RecoverySweeper
from fleet.timers import TimerService


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now


@pytest.fixture(params=["memory", "sqlite"])
async def clocked(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    clock = Clock()
    store: EventStore = (MemoryEventStore(clock=clock) if request.param == "memory"
                         else SqliteEventStore(str(tmp_path / "t.db"), clock=clock))
    yield store, clock
    await store.close()


steps: list[str] = []


@flow("nap", steps=["after"])
async def nap(ctx: Context, _: Any) -> str:
    await ctx.sleep(60)
    await ctx.step("after", steps.append, "after")
    return "done"


def runtime(store: EventStore, clock: Clock, **kw: Any) -> Runtime:
    return Runtime(store, flows=[nap], clock=clock, local_timers=False, lease_ms=1_000, **kw)


async def test_two_timer_replicas_never_fire_one_timer_twice(clocked: Any) -> None:
    store, clock = clocked
    steps.clear()
    handle = await runtime(store, clock).start("nap", None)
    await asyncio.sleep(0.05)
    enqueued: list[str] = []

    async def enqueue(eid: str) -> None:
        enqueued.append(eid)

    replicas = [TimerService(runtime(store, clock), enqueue=enqueue, interval_s=0.01)
                for _ in range(2)]
    await asyncio.gather(*(r.tick() for r in replicas))
    assert enqueued == []  # not due yet
    clock.now += 61_000  # due while "every replica was down"
    await asyncio.gather(*(r.tick() for r in replicas))
    assert enqueued == [handle.execution_id]
    assert sum(r.fired for r in replicas) == 1
    assert steps == []  # fired, not driven: a worker drives
    worker = runtime(store, clock)
    assert await drove(worker, handle.execution_id)
    assert await worker.result(handle.execution_id) == "done"
    assert steps == ["after"]


async def test_a_lost_enqueue_is_found_by_the_sweeper_after_its_grace(clocked: Any) -> None:
    store, clock = clocked
    handle = await runtime(store, clock).start("nap", None)
    await asyncio.sleep(0.05)
    errors: list[BaseException] = []

    async def broken(eid: str) -> None:
        raise ConnectionError("broker down")

    timers = TimerService(runtime(store, clock), enqueue=broken, on_error=errors.append)
    clock.now += 61_000
    await timers.tick()
    assert (timers.fired, timers.enqueue_errors) == (1, 1)
    assert isinstance(errors[0], ConnectionError)
    found: list[str] = []

    async def enqueue(eid: str) -> None:
        found.append(eid)

    sweeper = RecoverySweeper(runtime(store, clock), enqueue=enqueue, grace_ms=5_000)
    await sweeper.tick()
    assert found == []  # inside the grace period: maybe still being enqueued
    clock.now += 5_001
    await sweeper.tick()
    assert found == [handle.execution_id]


async def test_the_sweeper_re_drives_a_run_whose_holder_died(clocked: Any) -> None:
    store, clock = clocked
    steps.clear()
    dispatcher = runtime(store, clock)
    handle = await dispatcher.start("nap", None, drive=False)
    # A worker took the fence and died: its lease runs out.
    await store.acquire_fence(handle.execution_id, holder="dead-worker", lease_ms=1_000)
    sweeper = RecoverySweeper(runtime(store, clock), grace_ms=0)  # drives in-process
    await sweeper.tick()
    assert sweeper.redriven == 0  # the lease is still live
    clock.now += 1_001
    await sweeper.tick()
    assert sweeper.redriven == 1
    await sweeper.runtime.close()
    assert (await sweeper.runtime.load_state(handle.execution_id)).parked  # asleep again


async def test_the_sweeper_skips_parked_executions(clocked: Any) -> None:
    store, clock = clocked
    handle = await runtime(store, clock).start("nap", None)
    await asyncio.sleep(0.05)
    seen: list[str] = []

    async def enqueue(eid: str) -> None:
        seen.append(eid)

    clock.now += 10**7
    sweeper = RecoverySweeper(runtime(store, clock), enqueue=enqueue, grace_ms=0)
    await sweeper.tick()
    assert seen == []
    assert (await store.get_execution(handle.execution_id)).status == "parked"  # type: ignore[union-attr]


async def _refused_on_replay(store: EventStore, clock: Clock) -> str:
    """A nap whose log records a step the body never asks for (an earlier deploy's),
    whose worker took the fence and died: its re-drive diverges."""
    handle = await runtime(store, clock).start("nap", None, drive=False)
    eid = handle.execution_id
    await store.append_batch([
        EventEnvelope.make(eid, 1, EventType.STEP_STARTED, clock.now,
                           {"stepId": "ghost", "attempt": 1}),
        EventEnvelope.make(eid, 2, EventType.STEP_COMPLETED, clock.now,
                           {"stepId": "ghost", "attempt": 1, "output": 0})])
    await store.acquire_fence(eid, holder="dead-worker", lease_ms=1_000)
    clock.now += 1_001
    return eid


async def test_the_sweeper_names_a_refused_re_drive_with_its_reason(clocked: Any) -> None:
    """ADR 0113 fix round 1 item 2, driving here: the refused re-drive is failed, not
    re-driven, and stats() names it with its error and reason."""
    store, clock = clocked
    eid = await _refused_on_replay(store, clock)
    sweeper = RecoverySweeper(runtime(store, clock, divergence="fail"), grace_ms=0)
    await sweeper.tick()
    await sweeper.runtime.close()
    assert (sweeper.examined, sweeper.redriven, sweeper.failed) == (1, 0, 1)
    stats = sweeper.stats()
    [failure] = stats["failures"]
    assert (failure["executionId"], failure["error"]) == (eid, "FlowReplayDivergenceError")
    assert "ghost" in failure["reason"]
    # Parked on the divergence gate now: listed as diverged from the log, never re-driven.
    await sweeper.tick()
    assert sweeper.stats()["diverged"] == [{"executionId": eid, "reason": "skipped 1: ghost"}]
    assert (sweeper.examined, sweeper.failed) == (1, 1)


async def test_an_enqueuing_sweeper_surfaces_diverged_parks_from_the_log(clocked: Any) -> None:
    """Enqueuing, a worker drives (and reports divergence_parked); the sweeper learns of
    the refusal from the log, lists it with its reason and logs it once."""
    store, clock = clocked
    eid = await _refused_on_replay(store, clock)
    enqueued: list[str] = []

    async def enqueue(execution_id: str) -> None:
        enqueued.append(execution_id)

    sweeper = RecoverySweeper(runtime(store, clock), enqueue=enqueue, grace_ms=0)
    await sweeper.tick()
    assert enqueued == [eid]
    assert sweeper.stats()["diverged"] == []
    worker = runtime(store, clock, divergence="fail")  # the worker the drive went to
    assert await drove(worker, eid)
    await worker.close()
    # A handler on the logger itself, enabled: a logging configuration an earlier test
    # (or an in-process Celery worker) applied may have disabled or detached it.
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("fleet.recovery")
    saved = logger.disabled, logger.level
    logger.disabled = False
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        await sweeper.tick()
        await sweeper.tick()
    finally:
        logger.removeHandler(handler)
        logger.disabled, logger.level = saved
    assert enqueued == [eid]  # parked: not re-driven
    assert sweeper.stats()["diverged"] == [{"executionId": eid, "reason": "skipped 1: ghost"}]
    assert [r.getMessage() for r in records].count(
        f"execution {eid} is parked on __fleet_diverged__ (skipped 1: ghost): fix, pin or "
        "migrate its code, then retry_diverged") == 1
    # Retried (the answer written, its drive enqueued elsewhere): no longer listed.
    await runtime(store, clock).retry_diverged(eid, drive=False)
    await sweeper.tick()
    assert sweeper.stats()["diverged"] == []
