"""The traces test's flow, and its client (``python -c 'import trace_flows; ...'``)."""

from __future__ import annotations

import asyncio

from fleet.kernel.context import Context
from fleet.kernel.flows import flow


async def _inc(n: int) -> int:
    return n + 1


@flow("traced", steps=["a", "b"])
async def traced(ctx: Context, n: int) -> int:
    """Two steps with a durable sleep between: a drive, a timer, a second drive."""
    a = await ctx.step("a", _inc, n)
    await ctx.sleep(1.5)  # past inline_sleep_max: it parks, the timer service fires it
    return int(await ctx.step("b", _inc, a))


ALL = "trace_flows:traced"


def start_one() -> None:
    """Start one ``traced`` through the dispatcher (settings from ``FLEET_*``); print its id."""
    from fleet.config import FleetSettings
    from fleet.dispatcher import Dispatcher

    async def go() -> str:
        async with Dispatcher(FleetSettings()) as dispatcher:
            return await dispatcher.start("traced", 1)

    print(asyncio.run(go()), flush=True)
