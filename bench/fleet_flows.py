"""Flows the fleet benchmark's worker processes run (``FLEET_FLOWS=bench.fleet_flows:...``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fleet.kernel.context import Context
from fleet.kernel.flows import flow

ALL = ("bench.fleet_flows:three,bench.fleet_flows:hold,bench.fleet_flows:sleep,"
       "bench.fleet_flows:child,bench.fleet_flows:parent,bench.fleet_flows:cancellable")


def _inc(n: int) -> int:
    return n + 1


@flow("bench-three", version=1, steps=["a", "b", "c"])
async def three(ctx: Context, n: int) -> int:
    """The 3 trivial steps the plain Celery chain also runs."""
    n = await ctx.step("a", _inc, n)
    n = await ctx.step("b", _inc, n)
    return int(await ctx.step("c", _inc, n))


def _first(marker: str) -> bool:
    path = Path(marker)
    first = not path.exists()
    path.touch()
    return first


async def _hold(marker: str) -> str:
    """Long on the first attempt (the one the benchmark kills), instant on a re-run."""
    if await asyncio.to_thread(_first, marker):
        await asyncio.sleep(60)
    return "done"


@flow("bench-hold", version=1, steps=["hold", "after"])
async def hold(ctx: Context, marker: str) -> str:
    await ctx.step("hold", _hold, marker)
    return str(await ctx.step("after", _inc, 0))


@flow("bench-sleep", version=1, steps=["sleep"])
async def sleep(ctx: Context, seconds: float) -> float:
    """One step that waits: many of them keep a worker's drives busy at once."""
    await ctx.step("sleep", asyncio.sleep, seconds)
    return seconds


@flow("bench-child", version=1, steps=["a"])
async def child(ctx: Context, n: int) -> int:
    """A child flow of one step (``bench.flows_react``)."""
    return int(await ctx.step("a", _inc, n))


@flow("bench-parent", version=1)
async def parent(ctx: Context, children: int) -> int:
    """Starts ``children`` child flows at once, then waits for each (``bench.flows_react``)."""
    handles = [await ctx.start_child(child, i) for i in range(children)]
    total = 0
    for handle in handles:
        total += int(await handle.result())
    return total


@flow("bench-cancellable", version=1, steps=["cleanup"])
async def cancellable(ctx: Context, _: int) -> str:
    """Parks on a gate; a cancellation runs one cleanup step (``bench.flows_react``)."""
    try:
        await ctx.wait("never")
    except asyncio.CancelledError:
        await ctx.step("cleanup", _inc, 0)
        raise
    return "answered"
