"""Fork an execution from a step (issue 29.4, decision 0052): the recorded outputs before
the step are reused, the step and what follows run live, the origin is in the new log."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from kernel_kit import kinds
from refusals import hidden

from fleet import (
    Context,
    Decision,
    ExecutionConflictError,
    ExecutionNotFoundError,
    FlowNotFoundError,
    Policy,
    Principal,
    Runtime,
    ValidationError,
    flow,
)
from fleet.kernel.store.spi import EventStore

ALICE = Principal("alice", tenant="acme")
CALLS: Counter[str] = Counter()


def _effect(name: str) -> Any:
    def run(n: int) -> int:
        CALLS[name] += 1
        return n + 1
    return run


def _choose(n: int) -> Decision:
    CALLS["decide"] += 1
    return Decision(f"plan-{n}", policy=Policy("p", version=1, propensity=0.5))


@flow("forked", version=1, steps=["a", "b", "c"])
async def v1(ctx: Context, n: int) -> dict[str, Any]:
    a = await ctx.step("a", _effect("a"), n)
    plan = await ctx.decide("plan", _choose, a)
    token = str(ctx.uuid())
    b = await ctx.step("b", _effect("b"), a)
    c = await ctx.step("c", _effect("c"), b)
    return {"c": c, "plan": plan, "token": token}


@flow("forked", version=2, steps=["a", "b", "c"])
async def v2(ctx: Context, n: int) -> dict[str, Any]:
    a = await ctx.step("a", _effect("a"), n)
    plan = await ctx.decide("plan", _choose, a)
    token = str(ctx.uuid())
    b = await ctx.step("b", _effect("b2"), a)  # the fixed code: b now adds 100
    c = await ctx.step("c", _effect("c"), b + 99)
    return {"c": c, "plan": plan, "token": token}


async def test_fork_reuses_what_came_before_the_step_and_runs_the_rest_live(
        store: EventStore) -> None:
    CALLS.clear()
    runtime = Runtime(store, flows=[v1])
    source = await runtime.start("forked", 1, principal=ALICE)
    first = await source.result(timeout=10)
    assert CALLS == {"a": 1, "decide": 1, "b": 1, "c": 1}
    before = await store.read(source.execution_id)
    forked = await runtime.fork(source.execution_id, from_step="b", principal=ALICE)
    result = await forked.result(timeout=10)
    # a, the decision and the recorded uuid came from the copy; b and c ran again.
    assert CALLS == {"a": 1, "decide": 1, "b": 2, "c": 2}
    assert result == first  # same inputs, same recorded values: the same answer
    assert forked.execution_id != source.execution_id
    assert await store.read(source.execution_id) == before  # the source is untouched
    log = await store.read(forked.execution_id)
    origin = log[0].payload["forkedFrom"]
    cut = next(e.sequence for e in before if e.type == "STEP_STARTED"
               and e.payload["stepId"] == "b")
    assert origin == {"executionId": source.execution_id, "step": "b", "sequence": cut,
                      "by": "alice"}
    assert log[0].payload["owner"] == {"actor": "alice", "tenant": "acme"}
    assert kinds(log[1:cut]) == kinds(before[1:cut])  # the prefix, as recorded
    assert [e.payload for e in log[1:cut]] == [e.payload for e in before[1:cut]]
    assert (kinds(log)[cut], log[cut].payload["reason"]) == ("RECOVERED", "fork")
    assert kinds(log)[cut + 1:] == ["STEP_STARTED", "STEP_COMPLETED", "STEP_STARTED",
                                    "STEP_COMPLETED", "EXECUTION_COMPLETED"]
    assert runtime.stats.recovered == 0  # a fork is not a recovery of a dead holder


async def test_fork_onto_another_version_runs_the_rest_on_its_code(store: EventStore) -> None:
    CALLS.clear()
    runtime = Runtime(store, flows=[v1])
    source = await runtime.start("forked", 1, principal=ALICE)
    await source.result(timeout=10)
    fixed = Runtime(store, flows=[v1, v2])  # the fix deployed
    forked = await fixed.fork(source.execution_id, from_step="b", version=2, principal=ALICE)
    result = await forked.result(timeout=10)
    assert CALLS["a"] == 1  # reused
    assert CALLS["b2"] == 1  # the new code ran
    assert result["c"] == 1 + 1 + 1 + 99 + 1
    log = await store.read(forked.execution_id)
    assert log[0].payload["flowVersion"] == 2


async def test_fork_refusals_write_nothing(store: EventStore) -> None:
    CALLS.clear()
    runtime = Runtime(store, flows=[v1])
    source = await runtime.start("forked", 1, principal=ALICE)
    await source.result(timeout=10)
    eid = source.execution_id
    with pytest.raises(ExecutionNotFoundError):
        await runtime.fork("nope", from_step="b")
    with pytest.raises(ValidationError, match="never started step 'zz'"):
        await runtime.fork(eid, from_step="zz", principal=ALICE)
    with pytest.raises(ValidationError):
        await runtime.fork(eid, from_step="", principal=ALICE)
    with pytest.raises(FlowNotFoundError, match="version 9"):
        await runtime.fork(eid, from_step="b", version=9, principal=ALICE)
    with hidden():
        await runtime.fork(eid, from_step="b", principal=Principal("eve", tenant="other"))
    with pytest.raises(ExecutionConflictError):
        await runtime.fork(eid, from_step="b", principal=ALICE, new_execution_id=eid)
    listed = await store.list_executions(limit=10)
    assert [row.execution_id for row in listed] == [eid]  # no fork was written
    assert kinds(await store.read(eid)).count("EXECUTION_DENIED") == 1  # eve's, audited
    assert CALLS == {"a": 1, "decide": 1, "b": 1, "c": 1}


async def test_fork_without_drive_leaves_it_for_a_worker(store: EventStore) -> None:
    CALLS.clear()
    runtime = Runtime(store, flows=[v1])
    source = await runtime.start("forked", 1)
    await source.result(timeout=10)
    forked = await runtime.fork(source.execution_id, from_step="c", drive=False,
                                new_execution_id="fork-1")
    assert forked.execution_id == "fork-1"
    summary = await store.get_execution("fork-1")
    assert summary is not None
    assert (summary.status, summary.holder) == ("running", None)  # free for a worker
    assert CALLS["c"] == 1
    ran = await (await runtime.drive("fork-1", if_free=True, wait=True)).outcome()
    assert ran is not None
    assert ran.kind == "completed"
    assert CALLS["c"] == 2
