"""Flows the Fleet page tests (issue 14) run in ``fleet worker`` subprocesses.

``page-shape`` changes shape when a marker file exists: started without it, it
records step ``a``; re-run with it, the body skips ``a`` -- the replay diverges
and (``FLEET_DIVERGENCE=fail``) the run parks on ``__fleet_diverged__``. Removing
the file is "fixing the code": a retry then completes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fleet.kernel.context import Context
from fleet.kernel.flows import flow


def _add(x: int, y: int) -> int:
    return x + y


@flow("page-shape", version=3, steps=["a", "b"])
async def shape(ctx: Context, marker: str) -> dict[str, Any]:
    if not Path(marker).exists():  # noqa: ASYNC240 - a stat, the test's switch
        await ctx.step("a", _add, 1, 2)
    b = await ctx.step("b", _add, 2, 3)
    return {"b": b, "go": await ctx.wait("go")}


@flow("page-gate", version=1, steps=["before"])
async def gate(ctx: Context, n: int) -> dict[str, Any]:
    before = await ctx.step("before", _add, n, 1)
    return {"before": before, "approved": await ctx.wait("approval")}


@flow("page-timer", version=1, steps=["after"])
async def timer(ctx: Context, seconds: float) -> int:
    await ctx.sleep(seconds)  # over the inline limit: parks, the timer service fires it
    return int(await ctx.step("after", _add, 1, 1))


@flow("page-decide", version=1, steps=[])
async def decide(ctx: Context, n: int) -> str:
    from fleet.kernel.context import Decision, Policy

    def choose(k: int) -> Decision:
        return Decision("big" if k > 5 else "small", policy=Policy("threshold", version=1,
                                                                     propensity=0.8),
                        alternatives=["small", "big"], context={"n": k})

    return str(await ctx.decide("size", choose, n))


ALL = ",".join(f"fleet_page_flows:{name}" for name in ("shape", "gate", "timer", "decide"))
