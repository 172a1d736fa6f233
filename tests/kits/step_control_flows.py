"""Flows of the step-control tests on real Celery workers (issue 27 item 4).

Imported by the workers through ``FLEET_FLOWS=step_control_flows:...``. A step
tells the test where it runs through files in a directory the test names (a
marker it writes), never through shared memory.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from fleet import RetryPolicy, current_attempt, heartbeat, last_heartbeat
from fleet.kernel.context import Context
from fleet.kernel.flows import flow

WORKER_NAME_ENV = "FLEET_TEST_WORKER_NAME"
HEARTBEAT = timedelta(seconds=2)


def _who() -> str:
    return os.environ.get(WORKER_NAME_ENV, "?")


def _mark(directory: str, name: str) -> None:
    path = Path(directory, name)
    written = path.with_name(f"{name}.{os.getpid()}")
    written.write_text(f"{_who()} {os.getpid()}")
    written.replace(path)  # whole or not there


def _blocks_until_released(directory: str) -> dict[str, Any]:
    """A blocking call (a slow ``requests.get`` to the loop): sleeps until told to stop."""
    _mark(directory, "entered")
    deadline = time.monotonic() + 120
    while not Path(directory, "release").exists():
        if time.monotonic() > deadline:
            raise AssertionError("never released")
        time.sleep(0.05)
    return {"worker": _who(), "pid": os.getpid()}


def _quick(n: int) -> dict[str, Any]:
    return {"worker": _who(), "pid": os.getpid(), "n": n + 1}


def _exports(directory: str) -> dict[str, Any]:
    """The first attempt beats with its progress until its worker is killed; a retry
    says which attempt it is and where the last one got to."""
    attempt = current_attempt()
    if attempt == 1:
        _mark(directory, "first")
        for row in range(1, 600):  # 2 minutes at most: the test kills the worker first
            heartbeat({"row": row})
            time.sleep(0.2)
        raise AssertionError("the first attempt was never killed")
    return {"attempt": attempt, "last": last_heartbeat(), "worker": _who()}


@flow("sc-block", version=1, steps=["block"])
async def block(ctx: Context, directory: str) -> Any:
    return await ctx.step("block", _blocks_until_released, directory)


@flow("sc-quick", version=1, steps=["quick"])
async def quick(ctx: Context, n: int) -> Any:
    return await ctx.step("quick", _quick, n)


@flow("sc-timeout", version=1, steps=["slow"])
async def timeout(ctx: Context, seconds: float) -> Any:
    # time.sleep itself: a sync step, abandoned in its thread at the timeout.
    return await ctx.step("slow", time.sleep, seconds, timeout=timedelta(milliseconds=500),
                          retry=RetryPolicy(max_attempts=2, initial_interval=0.01))


@flow("sc-export", version=1, steps=["export"])
async def export(ctx: Context, directory: str) -> Any:
    return await ctx.step("export", _exports, directory, heartbeat=HEARTBEAT)


ALL = ",".join(f"step_control_flows:{name}" for name in ("block", "quick", "timeout",
                                                         "export"))
