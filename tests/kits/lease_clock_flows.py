"""The flow the lease-clock tests run on worker processes (``FLEET_FLOWS=lease_clock_flows:ALL``).

``clock-effect`` runs one step whose effect appends a line (the worker's name) to a
file per execution in ``spec["dir"]``, then holds ``spec["hold"]`` seconds on its
first run only (a re-run after a crash finds the file and returns at once): the
file is the effect's own record of how many times it ran, whoever ran it.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from fleet import Context, flow


async def _effect(directory: str, execution_id: str, hold: float) -> int:
    path = Path(directory) / execution_id
    first = not path.exists()
    with path.open("a") as record:
        record.write(os.environ.get("FLEET_TEST_WORKER_NAME", "?") + "\n")
    if first:
        await asyncio.sleep(hold)
    return os.getpid()


@flow("clock-effect", version=1, steps=["effect"])
async def clock_effect(ctx: Context, spec: dict[str, Any]) -> str:
    await ctx.step("effect", _effect, spec["dir"], ctx.execution_id, spec["hold"])
    return "done"


ALL = "lease_clock_flows:clock_effect"
