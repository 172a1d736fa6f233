"""Flows the worker-fleet test of issue 26 runs (``integration/test_fleet_reacting_flows.py``).

Imported by ``fleet worker`` subprocesses through ``FLEET_FLOWS``. Steps tell the
test where they are through files (a marker each writes), never shared memory.
"""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from fleet.kernel.context import Context
from fleet.kernel.flows import flow
from fleet.kernel.waits import Update


def _mark(name: str) -> str:
    # Read at each call: the test process imports this module before it knows the folder.
    path = Path(os.environ["FLEET_TEST_MARKS"]) / name
    with path.open("a") as out:  # one line a call: the test counts effects
        out.write(f"{os.getpid()}\n")
    return name


async def _sleep_marked(name: str, seconds: float) -> str:
    _mark(name)
    await asyncio.sleep(seconds)
    return name


@flow("react-step")
async def react_step(ctx: Context, tag: str) -> str:
    try:
        await ctx.step("long", _sleep_marked, f"{tag}.long", 60.0)
    except asyncio.CancelledError:
        await ctx.step("cleanup", _mark, f"{tag}.cleanup")
        raise
    return "finished"


@flow("react-sleep")
async def react_sleep(ctx: Context, tag: str) -> str:
    try:
        await ctx.sleep(timedelta(hours=1))
    except asyncio.CancelledError:
        await ctx.step("cleanup", _mark, f"{tag}.cleanup")
        raise
    return "slept"


@flow("react-wait")
async def react_wait(ctx: Context, seconds: float) -> Any:
    try:
        return {"answer": await ctx.wait("answer", timeout=seconds)}
    except TimeoutError:
        return {"timed_out": True}


@flow("react-child")
async def react_child(ctx: Context, tag: str) -> str:
    try:
        await ctx.wait("never")
    except asyncio.CancelledError:
        await ctx.step("cleanup", _mark, f"{tag}.child-cleanup")
        raise
    return "child done"


@flow("react-crashy-child")
async def react_crashy_child(ctx: Context, tag: str) -> str:
    # The test SIGKILLs the worker during this step; the recovery re-runs it.
    return await ctx.step("work", _sleep_marked, f"{tag}.work", 3.0)


@flow("react-parent")
async def react_parent(ctx: Context, spec: dict[str, str]) -> Any:
    child = "react-crashy-child" if spec.get("crashy") else "react-child"
    return {"child": await ctx.child(child, spec["tag"])}


@flow("react-inbox")
async def react_inbox(ctx: Context, _: Any) -> Any:
    return await ctx.receive("note")


@flow("react-sender")
async def react_sender(ctx: Context, spec: dict[str, str]) -> str:
    await ctx.send(spec["target"], "note", {"from": ctx.execution_id})
    # Right after sending: a step the test kills the worker in.
    await ctx.step("after", _sleep_marked, f"{spec['tag']}.after", 3.0)
    return "sent"


@flow("react-counter")
async def react_counter(ctx: Context, start: int) -> int:
    total = start
    while True:
        update = await ctx.receive("add")
        assert isinstance(update, Update)
        total += int(update.payload)
        await ctx.reply(update, total)
        if update.payload == 0:
            return total


ALL = ",".join(f"fleet_react_flows:{name}" for name in (
    "react_step", "react_sleep", "react_wait", "react_child", "react_crashy_child",
    "react_parent", "react_inbox", "react_sender", "react_counter"))
