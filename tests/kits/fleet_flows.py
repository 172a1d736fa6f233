"""Flows the worker tests run in real Celery worker processes.

The worker subprocesses import this module (``FLEET_FLOWS=fleet_flows:...``,
with this directory on ``PYTHONPATH``). Steps that must be observed or held
by a test talk through files (a marker the step writes when it is running, a
release file the test writes to let it finish), so no process shares memory
with another.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from fleet.kernel.context import Context
from fleet.kernel.flows import flow

WORKER_NAME_ENV = "FLEET_TEST_WORKER_NAME"


def _add(x: int, y: int) -> int:
    return x + y


def _whoami(tag: str) -> dict[str, Any]:
    return {"worker": os.environ.get(WORKER_NAME_ENV, "?"), "pid": os.getpid(), "tag": tag}


async def _hold(marker: str, release: str, limit: float) -> str:
    """The first attempt writes ``marker`` and waits for ``release``; later ones do not wait."""
    first = await asyncio.to_thread(_mark, Path(marker))
    if first:
        deadline = time.monotonic() + limit
        # Polls a file another process writes (nothing to await across processes).
        while (not await asyncio.to_thread(Path(release).exists)  # noqa: ASYNC110
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
    return os.environ.get(WORKER_NAME_ENV, "?")


def _mark(path: Path) -> bool:
    first = not path.exists()
    path.write_text(f"{os.getpid()} {os.environ.get(WORKER_NAME_ENV, '?')}\n")
    return first


async def _pause(seconds: float, i: int) -> int:
    await asyncio.sleep(seconds)
    return i


@flow("fleet-three", version=1, steps=["a", "b", "c"])
async def three(ctx: Context, n: int) -> int:
    x = await ctx.step("a", _add, n, 1)
    y = await ctx.step("b", _add, x, 1)
    return int(await ctx.step("c", _add, y, 1))


@flow("fleet-whoami", version=1, steps=["who"])
async def whoami(ctx: Context, tag: str) -> dict[str, Any]:
    return dict(await ctx.step("who", _whoami, tag))


@flow("fleet-heavy", version=1, steps=["who"])
async def heavy(ctx: Context, tag: str) -> dict[str, Any]:
    return dict(await ctx.step("who", _whoami, tag))


@flow("fleet-hold", version=1, steps=["hold", "after"])
async def hold(ctx: Context, spec: dict[str, Any]) -> dict[str, Any]:
    who = await ctx.step("hold", _hold, spec["marker"], spec["release"],
                         float(spec.get("limit", 60)))
    after = await ctx.step("after", _whoami, "after")
    return {"hold": who, "after": after["worker"]}


@flow("fleet-five", version=1, steps=["s1", "s2", "s3", "s4", "s5"])
async def five(ctx: Context, spec: dict[str, Any]) -> list[int]:
    out = []
    for i in range(1, 6):
        out.append(await ctx.step(f"s{i}", _pause, float(spec.get("pause", 0.2)), i))
    return out


@flow("fleet-gate", version=1, steps=["before"])
async def gate(ctx: Context, n: int) -> dict[str, Any]:
    before = await ctx.step("before", _add, n, 1)
    approved = await ctx.wait("approval")
    return {"before": before, "approved": approved}


@flow("fleet-receive", version=1, steps=["before"])
async def receive(ctx: Context, n: int) -> dict[str, Any]:
    before = await ctx.step("before", _add, n, 1)
    message = await ctx.receive("ping")
    return {"before": before, "message": message}


ALL = ",".join(f"fleet_flows:{name}" for name in
               ("three", "whoami", "heavy", "hold", "five", "gate", "receive"))
