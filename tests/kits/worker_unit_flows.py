"""Flows for the in-process worker unit tests; the tests hold and release them."""

from __future__ import annotations

import asyncio
import threading

from fleet.kernel.context import Context
from fleet.kernel.flows import flow

STARTED: dict[str, threading.Event] = {}
RELEASE: dict[str, threading.Event] = {}


async def _hold(key: str) -> str:
    STARTED.setdefault(key, threading.Event()).set()
    release = RELEASE.setdefault(key, threading.Event())
    # Set by the test's thread: an asyncio.Event cannot be set from there.
    while not release.is_set():  # noqa: ASYNC110
        await asyncio.sleep(0.005)
    return key


def _double(n: int) -> int:
    return 2 * n


@flow("unit-hold", version=1, steps=["hold", "after"])
async def hold(ctx: Context, key: str) -> str:
    await ctx.step("hold", _hold, key)
    return str(await ctx.step("after", _hold, key))


@flow("unit-double", version=1, steps=["double"])
async def double(ctx: Context, n: int) -> int:
    return int(await ctx.step("double", _double, n))


@flow("unit-gate", version=1)
async def gate(ctx: Context, n: int) -> object:
    return await ctx.wait("go")
