"""Flows for ``tests/cli/test_cli_first_hour.py``: the agent demo's two decisions without its
sleeps and gate (so ``fleet learn eval`` meets what the demo's database holds)."""

from __future__ import annotations

from typing import Any

from fleet.examples.agent import choose_discount, choose_style
from fleet.kernel.context import Context
from fleet.kernel.flows import flow

SEGMENTS = ("startup", "smb", "enterprise")


@flow("cli-two-decisions", version=1)
async def two_decisions(ctx: Context, n: int) -> dict[str, Any]:
    triage = {"segment": SEGMENTS[n % len(SEGMENTS)]}
    style = await ctx.decide("reply_style", choose_style, triage, [ctx.random(), ctx.random()])
    discount = await ctx.decide("discount", choose_discount, triage,
                                [ctx.random(), ctx.random()])
    return {"style": style, "discount": discount}


@flow("cli-nap", version=1)
async def nap(ctx: Context, seconds: float) -> str:
    await ctx.sleep(seconds)
    return "rested"


ALL = ["cli_first_hour_flows:two_decisions", "cli_first_hour_flows:nap"]
