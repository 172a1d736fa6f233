"""The flow the backlog tests (issue 28 item 1) run in ``fleet worker`` subprocesses.

``backlog-slow`` holds its drive slot for ``seconds`` in one step, so a backlog a
slow worker cannot drain in time persists while the test samples the gauges.
"""

from __future__ import annotations

import asyncio

from fleet.kernel.context import Context
from fleet.kernel.flows import flow


async def _nap(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds


@flow("backlog-slow", version=1, steps=["nap"])
async def slow(ctx: Context, seconds: float) -> float:
    return float(await ctx.step("nap", _nap, seconds))


ALL = "backlog_flows:slow"
