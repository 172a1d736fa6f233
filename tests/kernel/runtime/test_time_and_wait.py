"""Time in Python's units, errors that tell the truth, and waiting for a state (issue 15
items 2 and 3).

``fire_due_timers(now=...)`` took epoch milliseconds: seconds silently fired
nothing, a datetime fired every timer at once on SQLite (an int compared with
text) and raised TypeError on memory. It now takes an aware ``datetime`` and
refuses anything else with a typed error, on every store (Postgres a real server).
Resuming a timer said "resume that gate"; it now says it is a timer and how to fire
it. A resume that races the run said "running" while ``fleet list`` later said
"parked": both were true at their moment, so the error now says who is driving the
run, and ``handle.wait(until="parked")`` waits for the moment the gate is reached.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest
from kernel_kit import ManualClock, settle

from fleet import (
    Context,
    ExecutionNotFoundError,
    ExecutionNotParkedError,
    GateMismatchError,
    Runtime,
    ValidationError,
    flow,
)
from fleet.kernel.store.spi import EventStore, SnapshotStore
from fleet.kernel.values import datetime_from_ms

UTC = dt.UTC


@flow("onboard")
async def onboard(ctx: Context, user: str) -> dict[str, Any]:
    profile = await ctx.step("profile", lambda: {"user": user})
    await ctx.sleep(3600)
    approved = await ctx.wait("approval")
    return {"profile": profile, "approved": approved}


async def test_fire_due_timers_takes_an_aware_datetime(
        stores: tuple[EventStore, SnapshotStore]) -> None:
    clock = ManualClock()
    runtime = Runtime(stores[0], flows=[onboard], clock=clock, local_timers=False)
    handle = await runtime.start("onboard", "u-1")
    parked = await handle.wait(until="parked", timeout=10)
    assert (parked.waiting or {}).get("on") == "sleep#0"
    now = datetime_from_ms(clock.now)
    assert await runtime.fire_due_timers(now) == []
    assert await runtime.fire_due_timers(now + dt.timedelta(minutes=59)) == []
    fired = await runtime.fire_due_timers(now=now + dt.timedelta(hours=1))
    assert [f.timer_id for f in fired] == ["sleep#0"]
    at_gate = await handle.wait(until="parked", timeout=10)
    assert (at_gate.waiting or {}).get("on") == "approval"
    await runtime.resume(handle.execution_id, "approval", True)
    done = await handle.wait(timeout=10)
    assert (done.status, done.output["approved"]) == ("completed", True)


@pytest.mark.parametrize("now", [
    1_700_000_000,                        # seconds? milliseconds?
    1_700_000_000_000,
    1.7e9,
    dt.datetime(2030, 1, 1),              # naive: which zone?
    "2030-01-01T00:00:00Z",
    dt.date(2030, 1, 1),
])
async def test_anything_but_an_aware_datetime_is_refused_on_every_store(
        stores: tuple[EventStore, SnapshotStore], now: Any) -> None:
    runtime = Runtime(stores[0], flows=[onboard], local_timers=False)
    handle = await runtime.start("onboard", "u-1")
    await handle.wait(until="parked", timeout=10)
    with pytest.raises(ValidationError, match=r"aware datetime|naive datetime") as refused:
        await runtime.fire_due_timers(now)
    assert "timezone.utc" in str(refused.value)  # says how to build a good one
    with pytest.raises(ValidationError):
        await runtime.recover_abandoned(now=now)
    state = await runtime.load_state(handle.execution_id)
    assert (state.waiting or {}).get("on") == "sleep#0"  # nothing fired, nothing compared
    # The store's own API takes milliseconds and refuses a datetime just the same.
    with pytest.raises(ValidationError):
        await stores[0].due_timers(dt.datetime.now(UTC))  # type: ignore[arg-type]
    assert await stores[0].due_timers(2**62) != []


async def test_resuming_a_timer_says_it_is_a_timer_and_how_to_fire_it(
        stores: tuple[EventStore, SnapshotStore]) -> None:
    runtime = Runtime(stores[0], flows=[onboard], local_timers=False)
    handle = await runtime.start("onboard", "u-1")
    await handle.wait(until="parked", timeout=10)
    with pytest.raises(GateMismatchError) as refused:
        await runtime.resume(handle.execution_id, "approval", True)
    message = str(refused.value)
    assert "waits on a timer ('sleep#0', due 2" in message
    assert "not on gate 'approval'" in message
    assert "fire_due_timers" in message
    assert "resume that gate" not in message


async def test_a_resume_racing_the_run_says_who_drives_it_and_the_index_agrees(
        stores: tuple[EventStore, SnapshotStore]) -> None:
    store = stores[0]
    release = asyncio.Event()

    @flow("slow-gate")
    async def slow_gate(ctx: Context, _: Any) -> Any:
        await ctx.step("slow", release.wait)
        return await ctx.wait("approval")

    runtime = Runtime(store, flows=[slow_gate])
    handle = await runtime.start("slow-gate")
    with pytest.raises(ExecutionNotParkedError,
                       match="in flight in this runtime and has not parked yet"):
        await runtime.resume(handle.execution_id, "approval", "yes")
    summary = await store.get_execution(handle.execution_id)
    assert summary is not None
    assert summary.status == "running"  # what `fleet list` shows at that moment, too

    elsewhere = Runtime(store, flows=[slow_gate])
    with pytest.raises(ExecutionNotParkedError, match=r"held by '.*' until 2"):
        await elsewhere.resume(handle.execution_id, "approval", "yes")

    release.set()
    parked = await elsewhere.wait(handle.execution_id, until="parked", timeout=10)
    assert (parked.status, (parked.waiting or {}).get("on")) == ("parked", "approval")
    summary = await store.get_execution(handle.execution_id)
    assert summary is not None
    assert (summary.status, summary.waiting_on) == ("parked", "approval")
    await elsewhere.resume(handle.execution_id, "approval", "yes")
    assert await handle.result(timeout=10) == "yes"
    await settle(runtime)


async def test_wait_returns_at_the_end_if_the_run_never_parks_and_refuses_bad_calls(
        stores: tuple[EventStore, SnapshotStore]) -> None:
    @flow("quick")
    async def quick(ctx: Context, n: int) -> int:
        return int(await ctx.step("double", lambda: n * 2))

    runtime = Runtime(stores[0], flows=[quick, onboard], local_timers=False)
    handle = await runtime.start("quick", 21)
    state = await handle.wait(until="parked", timeout=10)
    assert (state.status, state.output) == ("completed", 42)
    with pytest.raises(ValidationError, match="'parked' or 'terminal'"):
        await handle.wait(until="done")  # type: ignore[arg-type]
    with pytest.raises(ExecutionNotFoundError):
        await runtime.wait("ghost", until="parked")
    sleeper = await runtime.start("onboard", "u-2")
    with pytest.raises(TimeoutError):
        await sleeper.wait(until="terminal", timeout=0.3)
