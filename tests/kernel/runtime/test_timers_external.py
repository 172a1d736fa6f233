"""Timers fired by an external service (drive=False): fired once, driven by someone else."""

from __future__ import annotations

from typing import Any

from kernel_kit import drove

from fleet import Context, Runtime, flow
from fleet.kernel.store.spi import EventStore


@flow("napper")
async def napper(ctx: Context, _: Any) -> str:
    await ctx.sleep(3600)
    return "awake"


async def test_fire_without_driving_then_a_worker_drives(store: EventStore) -> None:
    clock = {"now": 1_000_000}
    runtime = Runtime(store, flows=[napper], local_timers=False, clock=lambda: clock["now"])
    handle = await runtime.start("napper", None)
    await runtime.close()
    assert (await runtime.load_state(handle.execution_id)).parked
    clock["now"] += 3_600_000
    replica = Runtime(store, flows=[napper], local_timers=False, clock=lambda: clock["now"])
    fired = await replica.fire_due_timers(drive=False)
    assert [f.execution_id for f in fired] == [handle.execution_id]
    assert await replica.fire_due_timers(drive=False) == []  # never twice
    state = await replica.load_state(handle.execution_id)
    assert state.status == "running"  # fired, not yet driven
    assert (await store.get_execution(handle.execution_id)).holder is None  # type: ignore[union-attr]
    worker = Runtime(store, flows=[napper], local_timers=False, clock=lambda: clock["now"])
    assert await drove(worker, handle.execution_id)
    assert await worker.result(handle.execution_id) == "awake"
