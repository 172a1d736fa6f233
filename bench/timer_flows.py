"""The timer bench's flow and its parking step, imported as a top-level module.

``bench.timers`` runs ``fleet timers`` processes of a checkout (this one, or
``--peer DIR``) with this folder on ``PYTHONPATH`` and
``FLEET_FLOWS=timer_flows:timer_nap`` (``bench.sweeper``: ``timer_flows:slow``); the
parking runs in a child of the same checkout (``python -c "import timer_flows;
timer_flows.park(...)"``), so each checkout writes its own schema version.
"""

from __future__ import annotations

import asyncio
import sys
import time

from fleet.kernel.context import Context
from fleet.kernel.flows import flow


@flow("bench-timer-nap")
async def timer_nap(ctx: Context, due_at: float) -> str:
    """Sleep until ``due_at`` (epoch seconds): every execution started with one
    ``due_at`` has its timer due at that instant."""
    await ctx.sleep(max(0.0, due_at - ctx.now()))
    return "awake"


async def _park(url: str, count: int, due_at: float) -> None:
    from fleet.kernel.runtime import Runtime
    from fleet.kernel.store.postgres import PostgresEventStore

    store = PostgresEventStore(url, pool_max=16)
    runtime = Runtime(store, flows=[timer_nap], local_timers=False, inline_sleep_max=0)
    try:
        for first in range(0, count, 100):
            await asyncio.gather(*(runtime.start("bench-timer-nap", due_at)
                                   for _ in range(first, min(count, first + 100))))
    finally:
        await runtime.close()
        await store.close()


def park(url: str, count: int, due_at: float) -> None:
    """Start ``count`` executions parked on timers due at ``due_at``; print the seconds."""
    began = time.monotonic()
    asyncio.run(_park(url, count, due_at))
    print(f"{time.monotonic() - began:.3f}", file=sys.stdout, flush=True)


@flow("bench-slow", steps=["nap"])
async def slow(ctx: Context, n: int) -> int:
    """One step that waits ``SLOW_STEP_S``: a backlog that takes a while to drain."""
    return int(await ctx.step("nap", _nap, n))


SLOW_STEP_S = 0.5


async def _nap(n: int) -> int:
    await asyncio.sleep(SLOW_STEP_S)
    return n


async def _dispatch(count: int) -> None:
    from fleet.config import FleetSettings
    from fleet.dispatcher import Dispatcher, Start

    async with Dispatcher(FleetSettings()) as dispatcher:
        for first in range(0, count, 500):
            await dispatcher.start_many([Start("bench-slow", n)
                                         for n in range(first, min(count, first + 500))])


def dispatch(count: int) -> None:
    """Start ``count`` executions of ``bench-slow`` through the dispatcher (the settings
    from ``FLEET_*``): one backlog, all at once; print the seconds it took."""
    began = time.monotonic()
    asyncio.run(_dispatch(count))
    print(f"{time.monotonic() - began:.3f}", flush=True)
