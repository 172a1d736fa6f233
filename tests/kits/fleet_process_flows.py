"""Flows the fleet process tests run in ``fleet worker`` subprocesses.

Imported by the workers through ``FLEET_FLOWS=fleet_process_flows:...`` with
this directory on ``PYTHONPATH``. A step tells the test where it runs through
files (a marker it writes when it starts), never through shared memory.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from fleet.kernel.context import Context, Decision, Policy
from fleet.kernel.flows import flow
from fleet.workers.process import local_process

WORKER_NAME_ENV = "FLEET_TEST_WORKER_NAME"
UNTIL_HANDED_BACK = "until handed back"  # proc-nap's ``first``: see ``_nap``


def _who() -> str:
    return os.environ.get(WORKER_NAME_ENV, "?")


def _mark(path: Path) -> int:
    attempt = 1 if not path.exists() else 2
    written = path.with_name(f"{path.name}.{os.getpid()}")
    written.write_text(f"{_who()} {os.getpid()} {time.time()}\n")
    written.replace(path)  # whole or not there: the test reads it once it exists
    return attempt


def _handing_back() -> bool:
    process = local_process()
    return process is not None and process.runtime.handing_back


async def _nap(marker: str, first: float | str, again: float) -> dict[str, Any]:
    """The first attempt writes ``marker``, then naps ``first`` seconds, or, when
    ``first`` is ``UNTIL_HANDED_BACK``, until its worker begins to hand its runs back
    (SIGTERM): the step then ends, whatever delay load put between the signal and
    its handling. Any later attempt naps ``again`` seconds."""
    attempt = await asyncio.to_thread(_mark, Path(marker))
    if attempt == 1 and first == UNTIL_HANDED_BACK:
        while True:  # nothing to await: the runtime's flag, polled
            if _handing_back():
                break
            await asyncio.sleep(0.02)
    else:
        await asyncio.sleep(float(first) if attempt == 1 else again)
    return {"worker": _who(), "attempt": attempt}


async def _block(seconds: float) -> str:
    # Blocks the worker's event loop on purpose: what a stuck loop looks like. (An
    # async step that forgot to await: a sync step would run in a thread.)
    time.sleep(seconds)  # noqa: ASYNC251
    return _who()


def _add(x: int, y: int) -> int:
    return x + y


def _choose(n: int) -> Decision:
    return Decision("big" if n > 5 else "small", policy=Policy("threshold", version=1,
                                                                 propensity=0.8),
                    alternatives=["small", "big"], context={"n": n})


@flow("proc-nap", version=1, steps=["nap", "after"])
async def nap(ctx: Context, spec: dict[str, Any]) -> dict[str, Any]:
    first = spec["first"]
    slept = await ctx.step("nap", _nap, spec["marker"],
                           first if first == UNTIL_HANDED_BACK else float(first),
                           float(spec.get("again", 0.0)))
    after = await ctx.step("after", _who)
    return {"nap": slept, "after": after}


@flow("proc-block", version=1, steps=["block"])
async def block(ctx: Context, seconds: float) -> str:
    return str(await ctx.step("block", _block, seconds))


@flow("proc-gate", version=1, steps=["before"])
async def gate(ctx: Context, n: int) -> dict[str, Any]:
    before = await ctx.step("before", _add, n, 1)
    return {"before": before, "approved": await ctx.wait("approval")}


@flow("proc-receive", version=1, steps=["before"])
async def receive(ctx: Context, n: int) -> dict[str, Any]:
    before = await ctx.step("before", _add, n, 1)
    return {"before": before, "message": await ctx.receive("ping")}


@flow("proc-timer", version=1, steps=["after"])
async def timer(ctx: Context, seconds: float) -> str:
    await ctx.sleep(seconds)  # over the inline limit: parks, the timer service fires it
    return str(await ctx.step("after", _who))


@flow("proc-decide", version=1, steps=[])
async def decide(ctx: Context, n: int) -> str:
    return str(await ctx.decide("size", _choose, n))


ALL = ",".join(f"fleet_process_flows:{name}" for name in
               ("nap", "block", "gate", "receive", "timer", "decide"))
