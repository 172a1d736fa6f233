"""A flow that parks on a timer due at an instant its input names (the timer tests').

Imported by ``fleet timers`` subprocesses through ``FLEET_FLOWS=timer_flows:timer_nap``.
"""

from __future__ import annotations

from fleet.kernel.context import Context
from fleet.kernel.flows import flow


@flow("timer-nap")
async def timer_nap(ctx: Context, due_at: float) -> str:
    """Sleep until ``due_at`` (epoch seconds): every execution started with one
    ``due_at`` has its timer due at that instant."""
    await ctx.sleep(max(0.0, due_at - ctx.now()))
    return "awake"


ALL = "timer_flows:timer_nap"
