"""Flows the Redis ACL test runs in ``fleet worker`` subprocesses.

Imported by the workers through ``FLEET_FLOWS=acl_flows:...`` with this folder
on ``PYTHONPATH``. A step tells the test where it runs through a file (a
marker it writes when it starts), never through shared memory.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from fleet.kernel.context import Context, Decision, Policy
from fleet.kernel.flows import flow


def _who() -> str:
    return os.environ.get("FLEET_TEST_WORKER_NAME", "?")


def _add(x: int, y: int) -> int:
    return x + y


def _mark(marker: str) -> bool:
    """Writes ``marker`` (who runs the step); True the first time."""
    path = Path(marker)
    first = not path.exists()
    path.write_text(_who())
    return first


async def _nap(marker: str, seconds: float) -> str:
    """Naps ``seconds`` the first time it runs, not after (a re-run after a hand-back)."""
    if await asyncio.to_thread(_mark, marker):
        await asyncio.sleep(seconds)
    return _who()


def _choose(n: int) -> Decision:
    return Decision("big" if n > 5 else "small",
                    policy=Policy("threshold", version=1, propensity=0.8),
                    alternatives=["small", "big"], context={"n": n})


@flow("acl-steps", version=1, steps=["one", "two", "who"])
async def steps(ctx: Context, n: int) -> dict[str, Any]:
    one = await ctx.step("one", _add, n, 1)
    two = await ctx.step("two", _add, one, 1)
    return {"two": two, "worker": await ctx.step("who", _who)}


@flow("acl-gate", version=1, steps=["before"])
async def gate(ctx: Context, n: int) -> dict[str, Any]:
    before = await ctx.step("before", _add, n, 1)
    return {"before": before, "approved": await ctx.wait("approval")}


@flow("acl-sleep", version=1, steps=["after"])
async def sleep(ctx: Context, seconds: float) -> str:
    await ctx.sleep(seconds)  # over the inline limit (1 s): parks; the timer service fires it
    return str(await ctx.step("after", _who))


@flow("acl-nap", version=1, steps=["nap"])
async def nap(ctx: Context, spec: dict[str, Any]) -> str:
    return str(await ctx.step("nap", _nap, spec["marker"], float(spec["seconds"])))


@flow("acl-decide", version=1, steps=[])
async def decide(ctx: Context, n: int) -> str:
    return str(await ctx.decide("size", _choose, n))


ALL = ",".join(f"acl_flows:{name}" for name in ("steps", "gate", "sleep", "nap", "decide"))
