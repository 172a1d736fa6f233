"""A refusal that can never succeed ends the run; it never loops (issue 10 item 1, issue 13
items 3 and 7, decision 0023).

Each trigger below was found re-running its step's effect on every recovery pass,
forever: the store (or the kernel) refused a write after the effect, the execution
stayed ``running`` and the sweeper drove it into the same refusal again. Now the run
fails (``EXECUTION_FAILED`` with the typed error), releases its lease, warns and counts
the refusal, and a real ``RecoverySweeper`` plus ``recover_abandoned`` loop finds
nothing to re-drive: the effect ran exactly once. On every backend, Postgres a real
server.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from kernel_kit import settle

from fleet import Context, ExecutionFailedError, Runtime, flow
from fleet.kernel.errors import ContinueAsNew, ExecutionParked, HandedBack, RunAborted
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore
from fleet.kernel.store.sqlite import SqliteEventStore
from fleet.recovery import RecoverySweeper

pytestmark = pytest.mark.integration

LIMIT = 64 * 1024  # max_event_bytes of every store here


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[EventStore]:
    if request.param == "memory":
        s: EventStore = MemoryEventStore(max_event_bytes=LIMIT)
    elif request.param == "sqlite":
        s = SqliteEventStore(str(tmp_path / "fleet.db"),
                             max_event_bytes=LIMIT)
    else:
        from fleet.kernel.store.postgres import PostgresEventStore

        url = request.getfixturevalue("pg_database_url")
        s = PostgresEventStore(url, schema=f"t_{secrets.token_hex(5)}", pool_max=4,
                               max_event_bytes=LIMIT)
    try:
        yield s
    finally:
        await s.close()


effects: list[str] = []


class Opaque:
    """A step result that is not JSON."""


def effect(result: Any) -> Callable[[], Any]:
    def run() -> Any:
        effects.append("ran")
        return result
    return run


def body_for(trigger: str) -> Callable[[Context, Any], Any]:
    async def body(ctx: Context, _: Any) -> Any:
        if trigger == "oversized result":
            await ctx.step("effect", effect("x" * (LIMIT + 10)))
        elif trigger == "lone surrogate in a result":
            await ctx.step("effect", effect({"file": "report-\udcff.txt"}))
        elif trigger == "set result":
            await ctx.step("effect", effect({1, 2}))
        elif trigger == "object result":
            await ctx.step("effect", effect(Opaque()))
        else:
            await ctx.step("effect", effect("fine"))
        if trigger == "NUL in a gate":
            await ctx.wait("appro\x00val")
        elif trigger == "NUL in a receive key":
            await ctx.receive("ord\x00er")
        elif trigger == "sleep past int64":
            await ctx.sleep(1e16)
        elif trigger == "forged outcome field":
            await ctx.emit("OUTCOME_RECORDED", {"decisionId": "d", "key": "k", "score": 1,
                                                "recordedBy": "someone-else"})
        elif trigger == "forged park on the divergence gate":
            raise ExecutionParked({"on": "__fleet_diverged__", "kind": "diverged",
                                   "correlationKey": "x"})
        elif trigger == "forged park on a user gate":
            raise ExecutionParked({"on": "approval", "kind": "gate"})
        elif trigger == "forged continue-as-new":
            raise ContinueAsNew("someone-elses-execution", None)
        elif trigger == "forged hand-back":
            raise HandedBack("me")
        elif trigger == "forged abort":
            raise RunAborted(RuntimeError("not from the journal"))
        return "end"
    return body


# trigger -> the error code the execution fails with
TRIGGERS = {
    "oversized result": "payload_too_large",
    "lone surrogate in a result": "unstorable_value",
    "set result": "not_serializable",
    "object result": "not_serializable",
    "NUL in a gate": "unstorable_value",
    "NUL in a receive key": "unstorable_value",
    "sleep past int64": "unstorable_value",
    "forged outcome field": "kernel_event_forgery",
    "forged park on the divergence gate": "kernel_event_forgery",
    "forged park on a user gate": "kernel_event_forgery",
    "forged continue-as-new": "kernel_event_forgery",
    "forged hand-back": "kernel_event_forgery",
    "forged abort": "kernel_event_forgery",
}


@pytest.mark.parametrize("trigger", list(TRIGGERS))
async def test_a_refusal_after_an_effect_fails_the_run_once_and_recovery_never_reruns_it(
        store: EventStore, trigger: str) -> None:
    effects.clear()
    warnings: list[str] = []
    name = "refused-" + trigger.replace(" ", "-")
    runtime = Runtime(store, flows=[flow(name)(body_for(trigger))], lease_ms=200,
                      on_warn=warnings.append, local_timers=False)
    handle = await runtime.start(name, execution_id=name)
    with pytest.raises(ExecutionFailedError) as failed:
        await handle.result(timeout=10)
    await settle(runtime)
    assert failed.value.error["code"] == TRIGGERS[trigger], failed.value.error
    assert effects == ["ran"]
    outcome = await handle.outcome()
    assert outcome is not None
    assert outcome.kind == "failed"

    # The sweeper (driving here) and recover_abandoned, pass after pass, past
    # every lease: nothing is left to re-drive, the effect never runs again.
    sweeper = RecoverySweeper(runtime, enqueue=None, grace_ms=0)
    for _ in range(4):
        await sweeper.tick()
        report = await runtime.recover_abandoned()
        assert report.recovered == 0
        await settle(runtime)
    assert sweeper.redriven == 0
    assert effects == ["ran"]

    state = await runtime.load_state(name)
    assert state.status == "failed"
    assert state.error is not None
    assert state.error["code"] == TRIGGERS[trigger]
    summary = await store.get_execution(name)
    assert summary is not None
    assert (summary.status, summary.lease_expires_at) == ("failed", None)  # lease released
    assert runtime.stats.refused == 1
    assert any(name in w and "FAILED" in w for w in warnings), warnings
    log = await store.read(name)
    assert [str(e.type) for e in log][-1] == "EXECUTION_FAILED"
    assert sum(1 for e in log if e.type == "STEP_STARTED") == 1


async def test_an_application_event_may_carry_fields_an_outcome_may_not(
        store: EventStore) -> None:
    """Issue 13 item 3: ``scope`` (or ``recordedBy`` ...) nested in an application
    event's payload forges nothing; the guard lets it through."""
    @flow("shipped")
    async def shipped(ctx: Context, _: Any) -> str:
        await ctx.emit("order.shipped", {"scope": "EU", "recordedBy": "warehouse",
                                         "late": True, "innerSteps": ["pack"]})
        return "ok"

    runtime = Runtime(store, flows=[shipped])
    handle = await runtime.start("shipped", execution_id="shipped")
    assert await handle.result(timeout=5) == "ok"
    emitted = [e for e in await store.read("shipped") if e.type == "EMITTED"]
    assert [e.payload["payload"] for e in emitted] == [
        {"scope": "EU", "recordedBy": "warehouse", "late": True, "innerSteps": ["pack"]}]
