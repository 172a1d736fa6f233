"""Flows schedules run in the tests (``FLEET_FLOWS=schedule_flows:...`` for the processes).

``sched-job`` returns its tick (``ctx.scheduled_at``) through a step, so its log shows
how often its body ran; ``sched-slow`` takes longer than its schedule's interval
(``SLOW_S``), so a ``skip`` schedule of it has ticks to skip.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleet.kernel.context import Context
from fleet.kernel.flows import flow

SLOW_S = 2.5


def _stamp(tick: str | None, payload: Any) -> dict[str, Any]:
    return {"tick": tick, "input": payload}


async def _work(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds


@flow("sched-job", version=1, steps=["stamp"])
async def job(ctx: Context, payload: Any) -> dict[str, Any]:
    tick = ctx.scheduled_at.isoformat() if ctx.scheduled_at is not None else None
    return dict(await ctx.step("stamp", _stamp, tick, payload))


@flow("sched-slow", version=1, steps=["work"])
async def slow(ctx: Context, payload: Any) -> float:
    return float(await ctx.step("work", _work, SLOW_S))


ALL = ["schedule_flows:job", "schedule_flows:slow"]
