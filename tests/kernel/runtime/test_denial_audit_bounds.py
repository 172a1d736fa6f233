"""Denied callers cannot grow a log (issue 10 item 5, decision 0007).

Every denied resume or cancel appended ``EXECUTION_DENIED`` with the caller's actor:
2,000 denials made 2,005 events and 20 denials with a 1 MB actor added 40 MB. The
audit is now coalesced per (execution, op, actor, tenant) and window with a
``count``, capped per log, and every caller-supplied field is cut; the full detail
still reaches ``on_execution_denied``. On memory, SQLite and a real Postgres. (The
callers here may not read the execution, so they are told it does not exist: issue 25
item 11.)
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kernel_kit import ManualClock, started

from fleet import Context, ExecutionNotFoundError, Principal, Runtime, flow
from fleet.kernel.access import AUDIT_MAX_PER_EXECUTION, AUDIT_WINDOW_MS
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore
from fleet.kernel.store.sqlite import SqliteEventStore

ALICE = Principal("alice", tenant="acme")


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path,
                clock: ManualClock) -> AsyncIterator[EventStore]:
    if request.param == "memory":
        s: EventStore = MemoryEventStore(clock=clock)
    elif request.param == "sqlite":
        s = SqliteEventStore(str(tmp_path / "fleet.db"), clock=clock)
    else:
        from fleet.kernel.store.postgres import PostgresEventStore

        url = request.getfixturevalue("pg_database_url")
        s = PostgresEventStore(url, schema=f"t_{secrets.token_hex(5)}", pool_max=4, clock=clock)
    try:
        yield s
    finally:
        await s.close()


@flow("guarded")
async def guarded(ctx: Context, _: Any) -> Any:
    return await ctx.wait("approval")


async def parked(store: EventStore, clock: ManualClock,
                 denied: list[dict[str, Any]]) -> tuple[Runtime, str]:
    runtime = Runtime(store, flows=[guarded], clock=clock, on_execution_denied=denied.append)
    return runtime, await started(runtime, "guarded", principal=ALICE)


async def log_size(store: EventStore, execution_id: str) -> tuple[int, int]:
    events = await store.read(execution_id)
    return len(events), sum(len(e.to_json().encode()) for e in events)


async def test_two_thousand_denials_by_one_caller_add_one_record(
        store: EventStore, clock: ManualClock) -> None:
    denied: list[dict[str, Any]] = []
    runtime, eid = await parked(store, clock, denied)
    before, _ = await log_size(store, eid)
    mallory = Principal("mallory", tenant="evil")
    for _ in range(1000):
        with pytest.raises(ExecutionNotFoundError):
            await runtime.cancel(eid, principal=mallory)
        with pytest.raises(ExecutionNotFoundError):
            await runtime.resume(eid, "approval", True, principal=mallory)
    after, _ = await log_size(store, eid)
    assert after - before == 2  # one record per op (resume, cancel) in the window
    records = [e.payload for e in await store.read(eid) if e.type == "EXECUTION_DENIED"]
    assert [(r["op"], r["count"]) for r in records] == [("cancel", 1), ("resume", 1)]
    assert runtime.denied == len(denied) == 2000  # the application still hears every one

    # A window later the next denial is recorded with every one coalesced since.
    clock.advance(AUDIT_WINDOW_MS / 1000)
    with pytest.raises(ExecutionNotFoundError):
        await runtime.cancel(eid, principal=mallory)
    records = [e.payload for e in await store.read(eid) if e.type == "EXECUTION_DENIED"]
    assert [(r["op"], r["count"]) for r in records] == [("cancel", 1), ("resume", 1),
                                                        ("cancel", 1000)]
    # The owner is never disturbed by any of it.
    await runtime.resume(eid, "approval", "yes", principal=ALICE)
    assert await runtime.result(eid) == "yes"


async def test_a_megabyte_actor_adds_about_a_kilobyte(
        store: EventStore, clock: ManualClock) -> None:
    denied: list[dict[str, Any]] = []
    runtime, eid = await parked(store, clock, denied)
    _, bytes_before = await log_size(store, eid)
    huge = [Principal("m" * 1_000_000 + str(i), tenant="t" * 100_000) for i in range(20)]
    for who in huge:
        with pytest.raises(ExecutionNotFoundError) as refused:
            await runtime.resume(eid, "approval", True, principal=who)
        assert len(str(refused.value)) < 1_000
    _, bytes_after = await log_size(store, eid)
    assert bytes_after - bytes_before < 20 * 1_500  # 20 records; was 40 MB
    record = next(e.payload for e in await store.read(eid) if e.type == "EXECUTION_DENIED")
    assert record["actor"].startswith("m" * 200)
    assert record["actor"].endswith("(1000001 characters)")
    assert [d["actor"] for d in denied] == [who.actor for who in huge]  # full detail


async def test_the_records_on_one_log_are_capped(store: EventStore, clock: ManualClock) -> None:
    denied: list[dict[str, Any]] = []
    runtime, eid = await parked(store, clock, denied)
    for i in range(AUDIT_MAX_PER_EXECUTION + 30):
        with pytest.raises(ExecutionNotFoundError):
            await runtime.cancel(eid, principal=Principal(f"bot-{i}", tenant="evil"))
    records = [e for e in await store.read(eid) if e.type == "EXECUTION_DENIED"]
    assert len(records) == AUDIT_MAX_PER_EXECUTION
    assert (await runtime.load_state(eid)).denials == AUDIT_MAX_PER_EXECUTION
    assert runtime.denied == len(denied) == AUDIT_MAX_PER_EXECUTION + 30


async def test_an_unstorable_actor_is_still_a_plain_denial(
        store: EventStore, clock: ManualClock) -> None:
    denied: list[dict[str, Any]] = []
    runtime, eid = await parked(store, clock, denied)
    for actor in ("bad-\udcff", "nul\x00actor"):
        with pytest.raises(ExecutionNotFoundError):
            await runtime.resume(eid, "approval", True,
                                 principal=Principal(actor, tenant="evil"))
    records = [e.payload for e in await store.read(eid) if e.type == "EXECUTION_DENIED"]
    assert [r["actor"] for r in records] == ["bad-\\udcff", "nul\\x00actor"]
    assert [d["actor"] for d in denied] == ["bad-\udcff", "nul\x00actor"]
