"""ADR 0147: ``on_durable_event`` reports only what the log holds.

Both tables of the record are reproduced with real processes and a real
SQLite file: a process SIGKILLed while its STEP_COMPLETED write is in flight,
then a second process that recovers the execution (table 1); a STEP_COMPLETED
write that rejects (table 2). The rest of the contract (a write that never
resolves, only this runtime's writes, at most once, in order per writer,
isolation, fencing, free when unset, the paths that append outside a journal)
runs in this process over a real SQLite file.

Faults come from ``FaultInjectingEventStore``: a write that rejects or never
resolves, never one that "succeeds" silently, which the journal could not
tell from a real write (the record's point about crashingEventStore).

Every handshake with a child is a line it prints and flushes; no test waits
for a fixed time to see something happen.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import sys
import types
from collections.abc import AsyncIterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from fleet import (
    AccessDeniedError,
    Context,
    EventEnvelope,
    EventType,
    ExecutionCancelledError,
    Principal,
    Runtime,
    flow,
)
from fleet.kernel import journal as journal_module
from fleet.kernel import observers as observers_module
from fleet.kernel.store.faults import FaultInjectingEventStore
from fleet.kernel.store.sqlite import SqliteEventStore
from fleet.kernel.values import datetime_from_ms

pytestmark = pytest.mark.integration

CHILD = Path(__file__).resolve().parents[1] / "kits" / "_observer_child.py"
LINE_TIMEOUT = 30.0  # generous: a line the child owes us, on a loaded 2-core machine

Pair = tuple[int, str]

# The record's two tables, as it prints them (EXECUTION_ is dropped there).
ADR_TABLE_1 = {
    "LIVE": "0 STARTED 1 STEP_STARTED 2 STEP_COMPLETED 2 RECOVERED 3 EFFECT_INDOUBT "
            "4 SUSPENDED",
    "DURABLE": "0 STARTED 1 STEP_STARTED 2 RECOVERED 3 EFFECT_INDOUBT 4 SUSPENDED",
}
ADR_TABLE_2 = {
    "LIVE": "0 STARTED 1 STEP_STARTED 2 STEP_COMPLETED 3 EXECUTION_COMPLETED",
    "DURABLE": "0 STARTED 1 STEP_STARTED",
}
_ADR_NAMES = {"EXECUTION_STARTED": "STARTED", "EXECUTION_SUSPENDED": "SUSPENDED"}

STARTED = "EXECUTION_STARTED"
STEP_STARTED = "STEP_STARTED"
STEP_COMPLETED = "STEP_COMPLETED"
COMPLETED = "EXECUTION_COMPLETED"
SUSPENDED = "EXECUTION_SUSPENDED"


# ----------------------------------------------------------------- helpers


def pairs(events: Sequence[EventEnvelope]) -> list[Pair]:
    return [(e.sequence, e.type.value) for e in events]


def dumped(events: Sequence[EventEnvelope]) -> list[dict[str, Any]]:
    return [e.to_dict() for e in events]


def adr_row(rows: Sequence[Pair]) -> str:
    """A row of pairs written the way the record prints its tables."""
    return " ".join(f"{seq} {_ADR_NAMES.get(kind, kind)}" for seq, kind in rows)


def file_row(db: Path, event: EventEnvelope) -> str | None:
    """The type stored in the SQLite file at this event's slot, read on a connection of
    its own (so it sees only what was committed), or ``None`` when the slot is empty."""
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        row = conn.execute("SELECT type FROM events WHERE execution_id = ? AND sequence = ?",
                           (event.execution_id, event.sequence)).fetchone()
    return None if row is None else str(row[0])


def holds_step_completed(events: Sequence[EventEnvelope]) -> bool:
    return any(e.type is EventType.STEP_COMPLETED for e in events)


async def read_log(db: Path, execution_id: str) -> list[EventEnvelope]:
    store = SqliteEventStore(db)
    try:
        return await store.read(execution_id)
    finally:
        await store.close()


class Recorder:
    """Both observers of one runtime.

    With ``db`` it also checks the file at each call: an ``on_durable_event``
    whose row is not yet committed, or an ``on_event`` whose row already is,
    is recorded (an assert inside an observer would only be warned about).
    """

    def __init__(self, db: Path | None = None) -> None:
        self.db = db
        self.live: list[EventEnvelope] = []
        self.durable: list[EventEnvelope] = []
        self.durable_before_write: list[str] = []
        self.live_after_write: list[str] = []

    def on_event(self, event: EventEnvelope) -> None:
        self.live.append(event)
        if self.db is not None and file_row(self.db, event) is not None:
            self.live_after_write.append(event.id)

    def on_durable_event(self, event: EventEnvelope) -> None:
        self.durable.append(event)
        if self.db is not None and file_row(self.db, event) != event.type.value:
            self.durable_before_write.append(event.id)

    def observers(self) -> dict[str, Any]:
        return {"on_event": self.on_event, "on_durable_event": self.on_durable_event}


class Child:
    """A worker process (``_observer_child.py``) whose stdout is read line by line."""

    def __init__(self, proc: asyncio.subprocess.Process, role: str) -> None:
        self.proc = proc
        self.role = role
        self.lines: list[str] = []
        self.stderr = ""

    @classmethod
    async def spawn(cls, role: str, db: Path, execution_id: str) -> Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(CHILD), role, str(db), execution_id,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        return cls(proc, role)

    async def read_until(self, prefix: str) -> None:
        """Read lines until one starts with ``prefix``."""
        assert self.proc.stdout is not None
        while True:
            raw = await asyncio.wait_for(self.proc.stdout.readline(), LINE_TIMEOUT)
            if not raw:
                await self.finish()
                raise AssertionError(f"{self.role} ended before printing {prefix!r}: "
                                     f"{self.lines}\n{self.stderr}")
            self.lines.append(raw.decode().rstrip("\n"))
            if self.lines[-1].startswith(prefix):
                return

    async def finish(self) -> int:
        """Read what is left of stdout and stderr, reap the process; its return code."""
        out, err = await asyncio.wait_for(self.proc.communicate(), LINE_TIMEOUT * 2)
        self.lines.extend(out.decode().splitlines())
        self.stderr += err.decode()
        assert self.proc.returncode is not None
        return self.proc.returncode

    async def kill(self) -> int:
        """SIGKILL the process unless it was already reaped; its return code."""
        if self.proc.returncode is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGKILL)
        return await self.finish()

    async def run_to_end(self) -> int:
        """Read to DONE and wait for a clean exit (killed if anything fails first)."""
        try:
            await self.read_until("DONE")
            return await self.finish()
        finally:
            await self.kill()

    def observed(self, kind: str) -> list[Pair]:
        rows = []
        for line in self.lines:
            word, _, rest = line.partition(" ")
            if word == kind:
                seq, _, type_ = rest.partition(" ")
                rows.append((int(seq), type_))
        return rows

    def starting(self, prefix: str) -> list[str]:
        return [line for line in self.lines if line.startswith(prefix)]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "fleet.db"


@pytest.fixture
async def sqlite_store(db: Path) -> AsyncIterator[SqliteEventStore]:
    store = SqliteEventStore(db)
    yield store
    await store.close()


# ------------------------------------------------------------------- flows


def add_one(x: int) -> int:
    return x + 1


@flow("one-step", steps=("charge",))
async def one_step(ctx: Context, x: int) -> int:
    return int(await ctx.step("charge", add_one, x))


@flow("three-steps", steps=("a", "b", "c"))
async def three_steps(ctx: Context, x: int) -> list[int]:
    a = await ctx.step("a", add_one, x)
    b = await ctx.step("b", add_one, a)
    await ctx.emit("progress", {"b": b})
    c = await ctx.step("c", add_one, b)
    return [a, b, c]


@flow("long", step_families=("s",))
async def long_flow(ctx: Context, n: int) -> int:
    total = 0
    for i in range(n):
        total += await ctx.step(f"s#{i}", add_one, i)
    return total


@flow("fan", step_families=("p",))
async def fan(ctx: Context, n: int) -> int:
    return sum(await ctx.parallel([(f"p#{i}", add_one, i) for i in range(n)]))


@flow("gated", steps=("before", "after"))
async def gated(ctx: Context, x: int) -> list[int]:
    before = await ctx.step("before", add_one, x)
    answer = await ctx.wait("go")
    after = await ctx.step("after", add_one, answer)
    return [before, after]


@flow("errand", steps=("fetch",))
async def errand(ctx: Context, x: int) -> Any:
    answer = await ctx.wait("go")
    await ctx.sleep(3600)
    note = await ctx.receive("note")
    fetched = await ctx.step("fetch", add_one, answer)
    return [fetched, note, await ctx.wait("last")]


# ------------------------------------------------------- table 1 (processes)


@pytest.mark.parametrize("takeover", ["recover", "drive"])
async def test_table_1_a_process_dies_before_the_step_completed_write_lands(
        db: Path, takeover: str) -> None:
    """A SIGKILLed process reported STEP_COMPLETED live, never durably; B recovers.

    A's flow is ``charge`` (idempotent=False) then ``ship``. The kernel puts a
    durability barrier before a live step's STEP_STARTED (``Context._run_live``),
    so ``ship`` first writes what is pending: the STEP_COMPLETED of ``charge``.
    That write never resolves, so A stops after LIVE 2 and prints HANG.
    """
    eid = f"table-1-{takeover}"
    a = await Child.spawn("crash", db, eid)
    try:
        await a.read_until("HANG ")
        # A grace period before the kill: whatever A might still print would fail the
        # exact transcript below. Passing does not depend on it (the write never resolves).
        await asyncio.sleep(0.2)
    finally:
        killed = await a.kill()
    assert killed == -signal.SIGKILL, a.stderr
    assert a.lines == [
        "LIVE 0 EXECUTION_STARTED", "DURABLE 0 EXECUTION_STARTED",
        "LIVE 1 STEP_STARTED", "DURABLE 1 STEP_STARTED",
        "EFFECT charge",  # the effect happened; the log will never say so
        "LIVE 2 STEP_COMPLETED",
        "HANG 2 STEP_COMPLETED",
    ], a.stderr

    b = await Child.spawn(takeover, db, eid)
    assert await b.run_to_end() == 0, b.stderr

    assert a.observed("LIVE") == [(0, STARTED), (1, STEP_STARTED), (2, STEP_COMPLETED)]
    assert a.observed("DURABLE") == [(0, STARTED), (1, STEP_STARTED)]
    expected_b = [(2, "RECOVERED"), (3, "EFFECT_INDOUBT"), (4, SUSPENDED)]
    assert b.observed("LIVE") == expected_b
    assert b.observed("DURABLE") == expected_b
    for line in b.starting("DURABLE "):  # each durable report follows its live one
        assert b.lines.index("LIVE" + line.removeprefix("DURABLE")) < b.lines.index(line)
    assert b.starting("EFFECT") == []  # charge is in doubt, not charged twice
    assert b.starting("RECOVERED-BY") == [f"RECOVERED-BY {takeover}"]
    assert b.starting("STATE") == ["STATE parked __fleet_indoubt__ charge"]
    assert a.starting("WARN") == b.starting("WARN") == []

    # The record's table, row for row.
    assert adr_row(a.observed("LIVE") + b.observed("LIVE")) == ADR_TABLE_1["LIVE"]
    assert adr_row(a.observed("DURABLE") + b.observed("DURABLE")) == ADR_TABLE_1["DURABLE"]

    log = await read_log(db, eid)
    assert pairs(log) == [(0, STARTED), (1, STEP_STARTED), *expected_b]
    assert log[3].payload["stepId"] == "charge"
    assert log[3].payload["idempotent"] is False
    # The sequence of the lost write was reused: A's "2" and the log's "2" share an id.
    assert log[2].id == f"{eid}-2"


# ------------------------------------------------------- table 2 (a process)


async def test_table_2_the_step_completed_write_rejects(db: Path) -> None:
    """The STEP_COMPLETED write (batched with EXECUTION_COMPLETED) is rejected."""
    eid = "table-2"
    child = await Child.spawn("reject", db, eid)
    assert await child.run_to_end() == 0, child.stderr

    assert child.observed("LIVE") == [(0, STARTED), (1, STEP_STARTED), (2, STEP_COMPLETED),
                                      (3, COMPLETED)]
    assert child.observed("DURABLE") == [(0, STARTED), (1, STEP_STARTED)]
    assert adr_row(child.observed("LIVE")) == ADR_TABLE_2["LIVE"]
    assert adr_row(child.observed("DURABLE")) == ADR_TABLE_2["DURABLE"]
    assert child.starting("EFFECT") == ["EFFECT charge"]
    # handle.result() raises the store's own typed, retryable error.
    assert child.starting("RESULT") == ["RESULT-ERROR StoreUnavailableError "
                                        "store_unavailable True"]
    assert child.starting("WARN") == []
    assert pairs(await read_log(db, eid)) == [(0, STARTED), (1, STEP_STARTED)]


# ------------------------------------------------- a write that never resolves


async def test_a_write_that_never_resolves_is_never_reported(db: Path) -> None:
    hung = asyncio.Event()

    def hang(events: Sequence[EventEnvelope]) -> bool:
        if holds_step_completed(events):
            hung.set()
            return True
        return False

    store = FaultInjectingEventStore(SqliteEventStore(db), hang_when=hang)
    seen = Recorder(db)
    warnings: list[str] = []
    runtime = Runtime(store, flows=[one_step], on_warn=warnings.append, **seen.observers())
    try:
        handle = await runtime.start("one-step", 1, execution_id="hung")
        await asyncio.wait_for(hung.wait(), LINE_TIMEOUT)
        # The run cannot complete: its write neither lands nor fails.
        with pytest.raises(TimeoutError):
            await handle.result(timeout=0.5)
        assert runtime.active == 1
        assert pairs(seen.live) == [(0, STARTED), (1, STEP_STARTED), (2, STEP_COMPLETED),
                                    (3, COMPLETED)]
        assert pairs(seen.durable) == [(0, STARTED), (1, STEP_STARTED)]
        assert pairs(await store.read("hung")) == [(0, STARTED), (1, STEP_STARTED)]
        assert [(f.sequence, f.kind) for f in store.injected] == [(2, "hung")]
        # on_event ran ahead of every write of the run's journal; on_durable_event
        # never did. The start is written outside a run (LogWriter, decision 0015),
        # so on_event reports it once stored, like every such event (ADR 0116 3 A).
        assert seen.live_after_write == ["hung-0"]
        assert seen.durable_before_write == []

        # Cancelling with force ends such a run: its write is abandoned, never delivered,
        # and cancel's own events (delivered after their write) reuse the lost sequences.
        await asyncio.wait_for(runtime.cancel("hung", force=True), LINE_TIMEOUT)
        log = await store.read("hung")
        assert pairs(log) == [(0, STARTED), (1, STEP_STARTED), (2, "STEP_CANCELLED"),
                              (3, "EXECUTION_CANCELLED")]
        assert dumped(seen.durable) == dumped(log)
        assert seen.durable_before_write == []
        assert seen.live[2].id == seen.durable[2].id == "hung-2"  # nothing tells them apart
        assert runtime.active == 0
        with pytest.raises(ExecutionCancelledError):
            await handle.result(timeout=LINE_TIMEOUT)
        assert warnings == []
    finally:
        await runtime.close()
        await store.close()


# ------------------------------------------------------ contract properties


async def test_only_this_runtimes_writes_are_delivered(sqlite_store: SqliteEventStore,
                                                       db: Path) -> None:
    """Two runtimes on one store, even on one execution: each hears its own writes."""
    first, second = Recorder(db), Recorder(db)
    rt1 = Runtime(sqlite_store, flows=[gated], **first.observers())
    rt2 = Runtime(sqlite_store, flows=[gated], **second.observers())

    await rt1.start("gated", 1, execution_id="shared")
    await rt2.start("gated", 5, execution_id="other")
    await rt1.close()
    await rt2.close()
    await rt2.resume("shared", "go", 10)  # rt2 appends RESUMED and drives it to the end
    assert await rt2.result("shared") == [2, 11]
    await rt2.close()

    shared = await sqlite_store.read("shared")
    other = await sqlite_store.read("other")
    assert pairs(shared[:4]) == [(0, STARTED), (1, STEP_STARTED), (2, STEP_COMPLETED),
                                 (3, SUSPENDED)]
    assert dumped(first.durable) == dumped(shared[:4])
    assert dumped(second.durable) == dumped(other) + dumped(shared[4:])
    assert pairs(shared[4:]) == [(4, "EXECUTION_RESUMED"), (5, STEP_STARTED),
                                 (6, STEP_COMPLETED), (7, COMPLETED)]
    assert first.durable_before_write == second.durable_before_write == []


@pytest.mark.parametrize("shape", ["sequential", "parallel"])
async def test_each_write_is_delivered_at_most_once_in_order_per_writer(
        db: Path, shape: str) -> None:
    """50 steps per execution, three executions at once, writes delayed by a seeded draw."""
    store = FaultInjectingEventStore(SqliteEventStore(db), seed=147, delay_ms=(0, 2))
    seen = Recorder(db)
    runtime = Runtime(store, flows=[long_flow, fan], **seen.observers())
    try:
        ids = [f"{shape}-{i}" for i in range(3)]
        handles = [await runtime.start("long" if shape == "sequential" else "fan", 50,
                                       execution_id=eid) for eid in ids]
        for handle in handles:
            assert await handle.result(timeout=LINE_TIMEOUT) == sum(range(1, 51))
        await runtime.close()

        assert any(f.kind == "delayed" for f in store.injected)
        delivered_ids = [e.id for e in seen.durable]
        assert len(delivered_ids) == len(set(delivered_ids))  # at most once
        for eid in ids:
            log = await store.read(eid)
            assert len(log) == (102 if shape == "sequential" else 104)
            mine = [e for e in seen.durable if e.execution_id == eid]
            assert dumped(mine) == dumped(log)  # every write, once, in sequence order
        assert seen.durable_before_write == []
    finally:
        await store.close()


class FakeMonotonic:
    """Stands in for the ``time`` module the warner reads its rate limit from."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def monotonic(self) -> float:
        return self.now


async def test_a_throwing_consumer_never_reaches_the_run_and_is_warned_once_a_minute(
        sqlite_store: SqliteEventStore, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeMonotonic()
    monkeypatch.setattr(observers_module, "time",
                        types.SimpleNamespace(monotonic=clock.monotonic))
    calls: list[EventEnvelope] = []
    warnings: list[str] = []

    def broken(event: EventEnvelope) -> None:
        calls.append(event)
        raise RuntimeError("projection is down")

    runtime = Runtime(sqlite_store, flows=[three_steps], on_durable_event=broken,
                      on_warn=warnings.append)

    async def run(eid: str) -> None:
        handle = await runtime.start("three-steps", 1, execution_id=eid)
        assert await handle.result(timeout=LINE_TIMEOUT) == [2, 3, 4]
        await runtime.close()

    await run("first")
    log = await sqlite_store.read("first")
    assert pairs(log)[-1] == (len(log) - 1, COMPLETED)
    assert dumped(calls) == dumped(log)  # every event offered, the throws notwithstanding
    assert len(warnings) == 1  # many failures, one warning
    assert "on_durable_event" in warnings[0]
    assert "projection is down" in warnings[0]

    clock.now += 59
    await run("second")
    assert len(warnings) == 1
    clock.now += 2  # a minute after the first warning: heard again
    await run("third")
    assert len(warnings) == 2
    assert len(calls) == 3 * len(log)


async def test_an_async_consumer_is_not_awaited_and_its_failure_never_reaches_the_run(
        sqlite_store: SqliteEventStore) -> None:
    release = asyncio.Event()
    started: list[EventEnvelope] = []
    finished: list[EventEnvelope] = []
    tasks: list[asyncio.Task[Any]] = []
    warnings: list[str] = []

    async def broken(event: EventEnvelope) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.append(task)
        started.append(event)
        await release.wait()
        finished.append(event)
        raise RuntimeError("sink rejected the batch")

    runtime = Runtime(sqlite_store, flows=[three_steps], on_durable_event=broken,
                      on_warn=warnings.append)
    handle = await runtime.start("three-steps", 1, execution_id="async")
    # Completes while every consumer coroutine is still blocked: nothing awaits them.
    assert await handle.result(timeout=LINE_TIMEOUT) == [2, 3, 4]
    await runtime.close()
    log = await sqlite_store.read("async")
    assert finished == []
    assert warnings == []

    release.set()
    for _ in range(10_000):  # let every consumer task take its first step
        if len(tasks) == len(log):
            break
        await asyncio.sleep(0)
    assert dumped(started) == dumped(log)
    await asyncio.gather(*tasks, return_exceptions=True)  # each task's own callbacks ran first
    assert dumped(finished) == dumped(log)
    assert len(warnings) == 1
    assert "on_durable_event failed asynchronously" in warnings[0]
    assert "sink rejected the batch" in warnings[0]


async def test_a_fenced_write_is_not_delivered_nor_anything_after(
        sqlite_store: SqliteEventStore, db: Path) -> None:
    """rt2 supersedes rt1 (``drive``) while rt1's step runs; rt1's next write is stale."""
    entered, release = asyncio.Event(), asyncio.Event()
    attempts: list[str] = []

    async def slow_once(x: int) -> int:
        attempts.append("attempt")
        if len(attempts) == 1:  # rt1's attempt: held until rt2 has taken over and finished
            entered.set()
            await release.wait()
        return x + 1

    @flow("fenced", steps=("a", "b"))
    async def fenced(ctx: Context, x: int) -> list[int]:
        a = await ctx.step("a", slow_once, x)
        b = await ctx.step("b", add_one, a)
        return [a, b]

    zombie, successor = Recorder(db), Recorder(db)
    warnings: list[str] = []
    rt1 = Runtime(sqlite_store, flows=[fenced], on_warn=warnings.append, **zombie.observers())
    rt2 = Runtime(sqlite_store, flows=[fenced], on_warn=warnings.append,
                  **successor.observers())
    await rt1.start("fenced", 1, execution_id="fenced")
    await asyncio.wait_for(entered.wait(), LINE_TIMEOUT)
    await rt2.drive("fenced", wait=True)
    assert await rt2.result("fenced") == [2, 3]
    log = await sqlite_store.read("fenced")

    release.set()  # rt1 commits STEP_COMPLETED; its write under the old fence is refused
    await rt1.close()
    assert rt1.aborted == 1
    assert await sqlite_store.read("fenced") == log  # the zombie wrote nothing
    assert pairs(zombie.live) == [(0, STARTED), (1, STEP_STARTED), (2, STEP_COMPLETED)]
    assert pairs(zombie.durable) == [(0, STARTED), (1, STEP_STARTED)]
    assert pairs(log) == [(0, STARTED), (1, STEP_STARTED), (2, "RECOVERED"),
                          (3, "EFFECT_INDOUBT"), (4, STEP_STARTED), (5, STEP_COMPLETED),
                          (6, STEP_STARTED), (7, STEP_COMPLETED), (8, COMPLETED)]
    assert dumped(successor.durable) == dumped(log[2:])
    assert zombie.durable_before_write == successor.durable_before_write == []
    assert warnings == []


async def test_free_when_unset(sqlite_store: SqliteEventStore,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, the journal does no delivery work; set and synchronous, it adds no task."""
    delivered: list[str] = []
    real_deliver = journal_module.deliver

    def counting_deliver(observer: Any, event: EventEnvelope, warner: Any, name: str) -> None:
        delivered.append(name)
        real_deliver(observer, event, warner, name)

    # The journal delivers a run's events; the write path (observers.Observers)
    # the start's, written outside the run.
    monkeypatch.setattr(journal_module, "deliver", counting_deliver)
    monkeypatch.setattr(observers_module, "deliver", counting_deliver)
    created: list[str] = []
    loop = asyncio.get_running_loop()

    def counting_factory(loop: asyncio.AbstractEventLoop, coro: Any,
                         **kwargs: Any) -> asyncio.Task[Any]:
        created.append(getattr(coro, "__qualname__", type(coro).__name__))
        return asyncio.Task(coro, loop=loop, **kwargs)

    async def consume(event: EventEnvelope) -> None:
        return None

    async def run(eid: str, **observers: Any) -> tuple[list[str], list[str]]:
        created.clear()
        delivered.clear()
        runtime = Runtime(sqlite_store, flows=[three_steps], **observers)
        handle = await runtime.start("three-steps", 1, execution_id=eid)
        assert await handle.result() == [2, 3, 4]
        await runtime.close()
        return sorted(created), list(delivered)

    previous = loop.get_task_factory()
    loop.set_task_factory(counting_factory)
    try:
        bare_tasks, bare_calls = await run("bare")
        sync_tasks, sync_calls = await run("sync", on_durable_event=lambda e: None)
        async_tasks, async_calls = await run("async", on_durable_event=consume)
    finally:
        loop.set_task_factory(previous)
    events = len(await sqlite_store.read("bare"))

    assert "Engine._drive" in bare_tasks  # the counting factory saw the run start
    assert bare_calls == []  # no observer: the journal never even calls deliver
    assert sync_calls == async_calls == ["on_durable_event"] * events
    assert sync_tasks == bare_tasks  # a synchronous consumer costs no task
    extra = list(async_tasks)
    for name in bare_tasks:
        extra.remove(name)
    assert extra == [consume.__qualname__] * events  # an async one: one task per event


async def test_paths_outside_the_journal_deliver_after_their_write(
        sqlite_store: SqliteEventStore, db: Path) -> None:
    """resume, a timer firing, send, a denial's audit and cancel append directly."""
    alice, mallory = Principal("alice", "acme"), Principal("mallory", "acme")
    seen = Recorder(db)
    denials: list[dict[str, Any]] = []
    runtime = Runtime(sqlite_store, flows=[errand], local_timers=False,
                      on_execution_denied=denials.append, **seen.observers())
    handle = await runtime.start("errand", 0, principal=alice, execution_id="errand")
    await runtime.close()  # close waits for the runs this runtime drives

    def delivered_since(mark: int) -> list[Pair]:
        return pairs(seen.durable[mark:])

    mark = len(seen.durable)
    await runtime.resume("errand", "go", 41, principal=alice)
    await runtime.close()
    assert delivered_since(mark)[0] == (mark, "EXECUTION_RESUMED")

    scheduled = [e for e in await sqlite_store.read("errand")
                 if e.type is EventType.TIMER_SCHEDULED]
    mark = len(seen.durable)
    assert len(await runtime.fire_due_timers(
        datetime_from_ms(scheduled[0].payload["dueAt"]))) == 1
    await runtime.close()
    assert delivered_since(mark)[0] == (mark, "TIMER_FIRED")

    mark = len(seen.durable)
    await runtime.send("errand", "note", "hi", principal=alice)
    await runtime.close()
    assert delivered_since(mark)[:2] == [(mark, "MESSAGE_RECEIVED"),
                                         (mark + 1, "EXECUTION_RESUMED")]

    mark = len(seen.durable)
    with pytest.raises(AccessDeniedError):
        await runtime.resume("errand", "last", "nope", principal=mallory)
    assert delivered_since(mark) == [(mark, "EXECUTION_DENIED")]
    assert len(denials) == 1

    mark = len(seen.durable)
    await runtime.cancel("errand", principal=alice, reason="done testing", force=True)
    assert delivered_since(mark) == [(mark, "EXECUTION_CANCELLED")]
    with pytest.raises(ExecutionCancelledError):
        await handle.result(timeout=LINE_TIMEOUT)

    log = await sqlite_store.read("errand")
    assert dumped(seen.durable) == dumped(log)  # every event of the log, once, in order
    assert seen.durable_before_write == []  # each delivered only once its row was committed
