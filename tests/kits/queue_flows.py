"""Flows the queue tests run in ``fleet worker`` subprocesses (``FLEET_FLOWS=queue_flows:...``).

A step tells the test where it runs through files (a marker it writes when it
starts), never through shared memory; everything else the test reads from the log.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from fleet.kernel.context import Context
from fleet.kernel.flows import flow

ALL = "queue_flows:work,queue_flows:quick,queue_flows:stall"


async def _work(data: dict[str, Any]) -> dict[str, Any]:
    await asyncio.sleep(float(data.get("ms", 0)) / 1000)
    return {"n": data.get("n"), "pid": os.getpid()}


@flow("qf-work")
async def work(ctx: Context, data: dict[str, Any]) -> Any:
    """One step that takes ``data["ms"]`` milliseconds."""
    return await ctx.step("work", _work, data)


@flow("qf-quick")
async def quick(ctx: Context, data: Any) -> Any:
    """Ends at once: what a rate limit paces."""
    return data


def _mark(path: Path) -> bool:
    """Write ``path`` (whole or not at all) unless it exists; whether this call wrote it."""
    if path.exists():
        return False
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text(f"{os.environ.get('FLEET_TEST_WORKER_NAME', '?')} {os.getpid()} "
                   f"{time.time()}\n")
    tmp.replace(path)
    return True


async def _stall(marker: str) -> dict[str, Any]:
    """The first attempt writes ``marker`` and stalls (its worker is killed meanwhile);
    any later attempt (on another worker, after the lease) returns at once."""
    if await asyncio.to_thread(_mark, Path(marker)):
        await asyncio.sleep(120)
    return {"pid": os.getpid()}


@flow("qf-stall")
async def stall(ctx: Context, marker: str) -> Any:
    return await ctx.step("stall", _stall, marker)
