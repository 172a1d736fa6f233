"""Operator actions in bulk (issue 29.5, decision 0052): filter, dry run, rate, limit,
resume after an interruption, each action audited as its single call."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from divergence_kit import Drill, Effects, ab_go_c, dropped_a
from kernel_kit import kinds, settle

from fleet import Context, Principal, Runtime, ValidationError, flow
from fleet.kernel.bulk import BulkReport, ExecutionFilter, Match, bulk_action
from fleet.kernel.fold import DIVERGED_GATE
from fleet.kernel.security import OPERATOR
from fleet.kernel.store.spi import EventStore

ALICE = Principal("alice", tenant="acme")
OPS = Principal("oncall", scope=frozenset({"*"}), roles=frozenset({OPERATOR}))


@flow("gated")
async def gated(ctx: Context, n: int) -> int:
    return int(await ctx.wait("approve")) + n


async def _diverged(store: EventStore, count: int) -> tuple[list[str], Runtime]:
    drill, fx = Drill(store), Effects()
    ids = [await drill.park(ab_go_c(fx), principal=ALICE, execution_id=f"div-{i}")
           for i in range(count)]
    runtime = drill.runtime(dropped_a(fx), gated)
    for eid in ids:
        await runtime.resume(eid, "go", "ok", principal=ALICE)
    await settle(runtime)
    for eid in ids:
        summary = await store.get_execution(eid)
        assert summary is not None
        assert summary.waiting_on == DIVERGED_GATE
    return ids, runtime


async def test_retry_every_diverged_run_of_a_flow_audited(store: EventStore) -> None:
    ids, runtime = await _diverged(store, 3)
    other = await runtime.start("gated", 1, principal=ALICE, execution_id="gate-1")
    await settle(runtime)
    seen: list[tuple[str, str]] = []
    report = await bulk_action(runtime, "retry", ExecutionFilter(flow="shape"),
                               principal=OPS, drive=False,
                               on_item=lambda m, said: seen.append((m.execution_id, said)))
    assert (report.matched, report.acted, report.skipped, report.failed) == (3, 3, 0, 0)
    assert seen == [(eid, "done") for eid in ids]
    for eid in ids:
        last = (await store.read(eid))[-1]
        assert (last.type, last.payload["gate"], last.payload["by"]) == (
            "EXECUTION_RESUMED", DIVERGED_GATE, "oncall")
    assert kinds(await store.read(other.execution_id))[-1] == "EXECUTION_SUSPENDED"
    again = await bulk_action(runtime, "retry", ExecutionFilter(flow="shape"), principal=OPS)
    assert (again.matched, again.acted) == (0, 0)  # no longer parked there: nothing matches


async def test_dry_run_lists_and_writes_nothing(store: EventStore) -> None:
    ids, runtime = await _diverged(store, 2)
    before = {eid: await store.read(eid) for eid in ids}
    seen: list[Match] = []
    report = await bulk_action(runtime, "retry", ExecutionFilter(reason="skipped 1: a"),
                               principal=OPS, dry_run=True,
                               on_item=lambda m, said: seen.append(m))
    assert (report.matched, report.acted, report.dry_run) == (2, 0, True)
    assert [(m.execution_id, m.version, m.reason) for m in seen] == [
        (eid, 1, "skipped 1: a") for eid in ids]
    assert {eid: await store.read(eid) for eid in ids} == before
    none = await bulk_action(runtime, "retry", ExecutionFilter(version=7), principal=OPS,
                             dry_run=True)
    assert none.matched == 0


async def test_a_limit_stops_with_a_cursor_and_the_rest_goes_on_after_it(
        store: EventStore) -> None:
    ids, runtime = await _diverged(store, 5)
    first = await bulk_action(runtime, "retry", ExecutionFilter(), principal=OPS,
                              drive=False, limit=2)
    assert (first.acted, first.cursor) == (2, ids[1])
    assert first.stopped is not None
    assert "limit" in first.stopped
    rest = await bulk_action(runtime, "retry", ExecutionFilter(), principal=OPS,
                             drive=False, after_id=first.cursor)
    assert (rest.acted, rest.cursor) == (3, ids[-1])
    resumed = [eid for eid in ids
               if (await store.read(eid))[-1].payload.get("gate") == DIVERGED_GATE
               and (await store.read(eid))[-1].type == "EXECUTION_RESUMED"]
    assert resumed == ids  # each once: none twice, none missed


async def test_actions_are_paced_at_the_rate(store: EventStore) -> None:
    _, runtime = await _diverged(store, 4)
    began = time.monotonic()
    report = await bulk_action(runtime, "retry", ExecutionFilter(), principal=OPS,
                               drive=False, rate=10.0)
    assert report.acted == 4
    assert time.monotonic() - began >= 0.3 * 0.9  # 4 actions at 10/s: 3 gaps of 0.1 s


async def test_bulk_cancel_needs_a_filter_and_refusals_are_each_matchs(
        store: EventStore) -> None:
    ids, runtime = await _diverged(store, 2)
    with pytest.raises(ValidationError, match="needs a filter"):
        await bulk_action(runtime, "cancel", ExecutionFilter(), principal=OPS)
    with pytest.raises(ValidationError):
        await bulk_action(runtime, "cancel", ExecutionFilter(status="completed"),
                          principal=OPS)
    with pytest.raises(ValidationError):
        await bulk_action(runtime, "resume", ExecutionFilter(flow="shape"), principal=OPS)
    mallory = Principal("mallory", tenant="acme")
    refused = await bulk_action(runtime, "cancel", ExecutionFilter(flow="shape"),
                                principal=mallory)
    assert (refused.failed, refused.acted) == (2, 0)
    assert "AccessDeniedError" in refused.failures[0][1]
    for eid in ids:
        assert kinds(await store.read(eid)).count("EXECUTION_DENIED") == 1  # audited
    young = await bulk_action(runtime, "cancel",
                              ExecutionFilter(flow="shape", older_than=timedelta(days=1)),
                              principal=OPS)
    assert young.matched == 0  # nothing is a day old
    done = await bulk_action(runtime, "cancel", ExecutionFilter(flow="shape"), principal=OPS)
    assert done.acted == 2
    for eid in ids:
        last = (await store.read(eid))[-1]
        assert last.type == "EXECUTION_CANCELLED"
        assert last.payload["reason"].startswith("bulk cancel by oncall (flow=shape")


async def test_bulk_resume_answers_the_gate(store: EventStore) -> None:
    runtime = Runtime(store, flows=[gated])
    handles = [await runtime.start("gated", i, principal=ALICE) for i in range(3)]
    await settle(runtime)
    report: BulkReport = await bulk_action(runtime, "resume", ExecutionFilter(flow="gated"),
                                           principal=OPS, gate="approve", payload=10)
    assert report.acted == 3
    results: list[Any] = [await h.result(timeout=10) for h in handles]
    assert results == [10, 11, 12]
