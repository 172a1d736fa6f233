"""Flows for ``tests/cli/test_cli_fleet.py`` (the CLI imports them through FLEET_FLOWS)."""

from __future__ import annotations

from typing import Any

from fleet.kernel.context import Context
from fleet.kernel.flows import flow


def _add(x: int, y: int) -> int:
    return x + y


@flow("cli-gate", version=1, steps=["before"])
async def gate(ctx: Context, n: int) -> dict[str, Any]:
    before = await ctx.step("before", _add, n, 1)
    return {"before": before, "approved": await ctx.wait("approval")}


@flow("cli-receive", version=1, steps=["before"])
async def receive(ctx: Context, n: int) -> dict[str, Any]:
    before = await ctx.step("before", _add, n, 1)
    return {"before": before, "message": await ctx.receive("ping")}


ALL = ["cli_fleet_flows:gate", "cli_fleet_flows:receive"]
