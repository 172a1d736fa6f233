"""A fleet worker's drive takes its fence with the run's first write (decision 0032).

On a real Postgres (behind group commit, as the fleet runs it), through the worker's
own drive (``WorkerProcess.drive_async``) over a real ``Runtime``. Calls are counted by
a ``ForwardingEventStore`` that only counts and forwards; the other holder is a real
store call (``acquire_fence_if``) or a second runtime on the same database.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from fleet import Context, Runtime, flow
from fleet.config import FleetSettings
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.ids import successor_id
from fleet.kernel.store.coalescing import CoalescingEventStore
from fleet.kernel.store.forwarding import ForwardingEventStore
from fleet.kernel.store.postgres import PostgresEventStore
from fleet.kernel.store.spi import EventStore
from fleet.workers.process import WorkerProcess

pytestmark = pytest.mark.integration

# (execution id, what ran): every step body and decider of the flows below.
RAN: collections.Counter[tuple[str, str]] = collections.Counter()
# A step that waits for the test (by execution id), and says it started.
HOLD: dict[str, asyncio.Event] = {}
STARTED: dict[str, asyncio.Event] = {}


def _effect(eid: str, name: str, n: int) -> int:
    RAN[(eid, name)] += 1
    return n + 1


async def _held(eid: str, n: int) -> int:
    RAN[(eid, "held")] += 1
    STARTED[eid].set()
    await HOLD[eid].wait()
    return n + 1


@flow("dd-step", steps=["a", "b", "c"])
async def three_steps(ctx: Context, n: int) -> int:
    for name in "abc":
        n = await ctx.step(name, _effect, ctx.execution_id, name, n)
    return n


@flow("dd-park", steps=["a"])
async def park_first(ctx: Context, n: int) -> int:
    await ctx.wait("go")
    return int(await ctx.step("a", _effect, ctx.execution_id, "a", n))


@flow("dd-decide", steps=["a"])
async def decide_first(ctx: Context, n: int) -> int:
    eid = ctx.execution_id
    choice = await ctx.decide("d", lambda: _effect(eid, "decider", n))
    return int(await ctx.step("a", _effect, eid, "a", choice))


@flow("dd-sleep", steps=["a"])
async def sleep_first(ctx: Context, n: int) -> int:
    await ctx.sleep(0.01)  # inline: TIMER_SCHEDULED is written before the sleep
    return int(await ctx.step("a", _effect, ctx.execution_id, "a", n))


@flow("dd-continue", steps=["a"])
async def continue_first(ctx: Context, n: int) -> int:
    if n == 0:
        await ctx.continue_as_new(1)
    return int(await ctx.step("a", _effect, ctx.execution_id, "a", n))


@flow("dd-long", steps=["held", "b"])
async def long_first(ctx: Context, n: int) -> int:
    n = await ctx.step("held", _held, ctx.execution_id, n)
    return int(await ctx.step("b", _effect, ctx.execution_id, "b", n))


FLOWS = [three_steps, park_first, decide_first, sleep_first, continue_first, long_first]


class Counting(ForwardingEventStore):
    """Counts the calls the runtime makes, forwards each unchanged; ``after_read`` runs
    once, after the next ``read`` returned (a writer between a drive's fold and its
    first write)."""

    NAMES = ("read", "head", "get_execution", "acquire_fence", "acquire_fence_if",
             "release_fence", "renew_lease", "append", "append_batch", "append_many",
             "append_acquiring", "append_releasing", "append_if_unchanged")

    def __init__(self, inner: EventStore) -> None:
        super().__init__(inner)
        self.calls: collections.Counter[str] = collections.Counter()
        self.after_read: Callable[[], Awaitable[Any]] | None = None
        for name in self.NAMES:
            setattr(self, name, self._counted(name, getattr(super(), name)))

    def _counted(self, name: str, call: Callable[..., Awaitable[Any]]) -> Any:
        async def counted(*args: Any, **kw: Any) -> Any:
            self.calls[name] += 1
            answer = await call(*args, **kw)
            if name == "read" and self.after_read is not None:
                hook, self.after_read = self.after_read, None
                await hook()
            return answer
        return counted


@pytest.fixture
async def schema(database_url: str) -> str:
    return f"dd_{secrets.token_hex(5)}"


async def _open(database_url: str, schema: str) -> PostgresEventStore:
    return await PostgresEventStore(database_url, schema=schema, pool_max=4).open()


@pytest.fixture
async def plain(database_url: str, schema: str) -> AsyncIterator[Runtime]:
    """Another runtime on the same database (its own pool): starts, holds, sends."""
    store = await _open(database_url, schema)
    runtime = Runtime(CoalescingEventStore(store), flows=FLOWS, holder="other")
    yield runtime
    await runtime.close()
    await store.close()


class Worker:
    """A worker's drive (``WorkerProcess.drive_async``) over a runtime on a counted store."""

    def __init__(self, runtime: Runtime, counted: Counting, pg: PostgresEventStore) -> None:
        self.runtime, self.counted, self.pg = runtime, counted, pg
        self.process = WorkerProcess(FleetSettings(database_url="memory:",
                                                   broker_url="memory://", flows=[]))
        self.process._runtime = runtime  # the worker's drive, on this runtime

    async def drive(self, eid: str) -> str:
        return str(await self.process.drive_async(eid))


async def _worker(database_url: str, schema: str, holder: str,
                  lease_ms: int = 60_000) -> Worker:
    pg = await _open(database_url, schema)
    counted = Counting(CoalescingEventStore(pg))
    runtime = Runtime(counted, flows=FLOWS, holder=holder, lease_ms=lease_ms)
    return Worker(runtime, counted, pg)


async def _close(worker: Worker) -> None:
    await worker.runtime.close()
    await worker.pg.close()


@pytest.fixture
async def worker(database_url: str, schema: str) -> AsyncIterator[Worker]:
    made = await _worker(database_url, schema, "w1")
    yield made
    await _close(made)


def _types(events: list[EventEnvelope]) -> list[str]:
    return [str(e.type) for e in events]


def _ran(eid: str) -> dict[str, int]:
    return {name: n for (e, name), n in RAN.items() if e == eid}


# -- the round trips -------------------------------------------------------------

async def test_a_worker_drive_of_three_steps_is_one_read_and_four_writes(
        worker: Worker, plain: Runtime) -> None:
    eid = (await plain.start("dd-step", 0, drive=False)).execution_id
    assert await worker.drive(eid) == "completed"
    calls = dict(worker.counted.calls)
    # No round trip for the fence: 1 read (the fold), then the journal's 4 writes:
    # take the fence + STEP_STARTED(a); COMPLETED(a) + STARTED(b); COMPLETED(b) +
    # STARTED(c); COMPLETED(c) + EXECUTION_COMPLETED + end the lease.
    assert calls == {"read": 1, "append_acquiring": 1, "append_batch": 2,
                     "append_releasing": 1}, calls
    assert _types(await worker.pg.read(eid)) == [
        "EXECUTION_STARTED", "STEP_STARTED", "STEP_COMPLETED", "STEP_STARTED",
        "STEP_COMPLETED", "STEP_STARTED", "STEP_COMPLETED", "EXECUTION_COMPLETED"]
    summary = await worker.pg.get_execution(eid)
    assert summary is not None
    assert (summary.holder, summary.lease_expires_at) == (None, None)
    assert _ran(eid) == {"a": 1, "b": 1, "c": 1}
    # A drive of it again: 1 read, nothing written, no fence taken.
    worker.counted.calls.clear()
    assert await worker.drive(eid) == "idle"
    assert dict(worker.counted.calls) == {"read": 1}
    assert worker.runtime.drives == 1


# -- a live lease held elsewhere ---------------------------------------------------

async def _with_live_lease(plain: Runtime, flow_id: str) -> tuple[str, int]:
    """Start ``flow_id`` (not driven) and hold its fence as another holder would; for
    ``recover``, that holder also wrote a step's STEP_STARTED (a drive then recovers)."""
    eid = (await plain.start(flow_id, 0, drive=False)).execution_id
    grant = await plain.store.acquire_fence_if(eid, holder="other", lease_ms=60_000)
    assert grant is not None
    return eid, grant.token


# flow, what the drive writes first, its outcome once the lease is free.
FIRST_WRITES = {
    "step": ("dd-step", "completed"),            # STEP_STARTED(a)
    "park": ("dd-park", "parked"),               # EXECUTION_SUSPENDED (and ends the lease)
    "decide": ("dd-decide", "completed"),        # the fence alone, before the decider runs
    "sleep": ("dd-sleep", "completed"),          # TIMER_SCHEDULED, before the inline sleep
    "continue": ("dd-continue", "continued"),    # the fence alone, before the successor
    "recover": ("dd-step", "completed"),         # RECOVERED + EFFECT_INDOUBT + STEP_STARTED
}


@pytest.mark.parametrize("first", list(FIRST_WRITES))
async def test_a_drive_while_another_holder_has_a_live_lease_steps_aside_having_done_nothing(
        worker: Worker, plain: Runtime, first: str) -> None:
    flow_id, then = FIRST_WRITES[first]
    eid, token = await _with_live_lease(plain, flow_id)
    if first == "recover":
        await plain.store.append(EventEnvelope.make(eid, 1, EventType.STEP_STARTED, 1,
                                                    {"stepId": "a", "attempt": 1}),
                                 fence=token)
    before = await worker.pg.read(eid)
    assert await worker.drive(eid) == "stepped_aside"
    assert await worker.pg.read(eid) == before  # nothing written
    assert _ran(eid) == {}  # no step body, no decider
    assert await worker.pg.head(successor_id(eid)) is None  # no successor started
    runtime = worker.runtime
    assert (runtime.drives, runtime.aborted, runtime.recovered) == (0, 0, 0)
    assert worker.process.counters.stepped_aside == 1
    assert worker.counted.calls["acquire_fence_if"] == (first in ("decide", "continue"))
    summary = await worker.pg.get_execution(eid)
    assert summary is not None
    assert summary.holder == "other"  # its lease untouched

    await plain.store.release_fence(eid, token)  # the holder lets go: now it is ours
    assert await worker.drive(eid) == then
    ran = {"park": {}, "decide": {"decider": 1, "a": 1}, "continue": {},
           "step": {"a": 1, "b": 1, "c": 1}, "recover": {"a": 1, "b": 1, "c": 1}}
    assert _ran(eid) == ran.get(first, {"a": 1})  # each once
    assert runtime.recovered == (first == "recover")
    assert runtime.drives == 1 + (first == "continue")  # its successor is driven here too


async def test_a_stepped_aside_drive_fails_no_waiter_who_later_gets_the_result(
        worker: Worker, plain: Runtime) -> None:
    eid, token = await _with_live_lease(plain, "dd-step")
    runtime = worker.runtime
    waiter = asyncio.create_task(runtime.result(eid))
    await asyncio.sleep(0)  # it waits on this runtime's results
    assert eid in runtime.engine.results.waiters
    assert await worker.drive(eid) == "stepped_aside"
    for _ in range(3):
        await asyncio.sleep(0)
    assert not waiter.done()  # not failed: a stepped-aside drive is no failure
    assert eid not in runtime.engine.results.aborts
    await plain.store.release_fence(eid, token)
    assert await worker.drive(eid) == "completed"
    assert await asyncio.wait_for(waiter, 30) == 3


# -- two drives at once ---------------------------------------------------------

async def test_two_drives_of_one_execution_at_once_run_each_step_once(
        database_url: str, schema: str, plain: Runtime) -> None:
    one = await _worker(database_url, schema, "w1")
    two = await _worker(database_url, schema, "w2")
    try:
        eids = [(await plain.start("dd-step", n, drive=False)).execution_id
                for n in range(12)]
        answers = await asyncio.gather(*(w.drive(eid) for eid in eids for w in (one, two)))
        for i, eid in enumerate(eids):
            pair = sorted(answers[2 * i:2 * i + 2])
            # The other one found the lease live, or (the first ran to its end before
            # the second wrote) its slot taken, then the end: idle.
            assert pair in (["completed", "stepped_aside"], ["completed", "idle"]), pair
            assert _ran(eid) == {"a": 1, "b": 1, "c": 1}
            types = _types(await one.pg.read(eid))
            assert types.count("EXECUTION_COMPLETED") == 1
            assert types.count("STEP_STARTED") == 3
            assert "RECOVERED" not in types
        assert one.runtime.completed + two.runtime.completed == len(eids)
        assert one.runtime.aborted + two.runtime.aborted == 0
    finally:
        await _close(one)
        await _close(two)


# -- a write between the fold and the first write -----------------------------------

async def test_a_message_between_the_fold_and_the_first_write_drives_once_more(
        worker: Worker, plain: Runtime) -> None:
    """``send`` to a running execution nobody holds writes MESSAGE_RECEIVED and drives
    nothing: the drive whose slot it took reads again (once) and completes it."""
    eid = (await plain.start("dd-step", 0, drive=False)).execution_id

    async def send() -> None:
        assert await plain.send(eid, "note", 1) is False  # written; nobody woken

    worker.counted.after_read = send
    assert await worker.drive(eid) == "completed"
    assert worker.counted.calls["read"] == 2
    assert worker.counted.calls["append_acquiring"] == 2  # refused (slot taken), then taken
    types = _types(await worker.pg.read(eid))
    assert types[:2] == ["EXECUTION_STARTED", "MESSAGE_RECEIVED"]
    assert types.count("EXECUTION_COMPLETED") == 1
    assert _ran(eid) == {"a": 1, "b": 1, "c": 1}
    assert worker.process.counters.stepped_aside == 0
    assert worker.runtime.drives == 1


async def test_a_drive_elsewhere_between_the_fold_and_the_first_write_is_stepped_around(
        worker: Worker, plain: Runtime) -> None:
    """Another holder drove it to its end in between: the slot is taken, the second read
    finds the end; nothing written here, each step ran once."""
    eid = (await plain.start("dd-step", 0, drive=False)).execution_id

    async def drive_elsewhere() -> None:
        handle = await plain.drive(eid, if_free=True, wait=True)
        outcome = await handle.outcome()
        assert outcome is not None
        assert outcome.kind == "completed"

    worker.counted.after_read = drive_elsewhere
    assert await worker.drive(eid) == "idle"
    assert worker.counted.calls["read"] == 2
    assert worker.counted.calls["append_acquiring"] == 1  # refused: the slot was taken
    assert _types(await worker.pg.read(eid)).count("EXECUTION_COMPLETED") == 1
    assert _ran(eid) == {"a": 1, "b": 1, "c": 1}
    assert (worker.runtime.drives, worker.runtime.aborted) == (0, 0)


async def test_a_holder_that_takes_it_between_the_fold_and_the_first_write_is_stepped_aside(
        worker: Worker, plain: Runtime) -> None:
    """Another holder's run took the fence and is in its first step: the first write
    here finds its lease live and steps aside; that run completes the execution."""
    eid = (await plain.start("dd-long", 0, drive=False)).execution_id
    HOLD[eid], STARTED[eid] = asyncio.Event(), asyncio.Event()
    elsewhere: list[asyncio.Future[Any]] = []

    async def start_elsewhere() -> None:
        handle = await plain.drive(eid, if_free=True)
        run = handle._run
        assert run is not None
        elsewhere.append(run)
        await STARTED[eid].wait()  # its STEP_STARTED is durable, its lease live

    worker.counted.after_read = start_elsewhere
    assert await worker.drive(eid) == "stepped_aside"
    assert worker.counted.calls["read"] == 1  # a live lease: no second read
    HOLD[eid].set()
    outcome = await asyncio.wait_for(elsewhere[0], 30)
    assert outcome.kind == "completed"
    assert _ran(eid) == {"held": 1, "b": 1}
    assert _types(await worker.pg.read(eid)).count("STEP_STARTED") == 2


# -- renewal -----------------------------------------------------------------------

async def test_a_long_first_step_is_renewed_once_its_write_took_the_fence(
        database_url: str, schema: str, plain: Runtime) -> None:
    worker = await _worker(database_url, schema, "w-renew", lease_ms=600)
    try:
        eid = (await plain.start("dd-long", 0, drive=False)).execution_id
        HOLD[eid], STARTED[eid] = asyncio.Event(), asyncio.Event()
        drive = asyncio.create_task(worker.drive(eid))
        await asyncio.wait_for(STARTED[eid].wait(), 30)
        first = await worker.pg.get_execution(eid)
        assert first is not None
        assert first.holder == "w-renew"
        assert first.lease_expires_at is not None
        later = first
        for _ in range(100):  # renewed every 200 ms; the step holds until told
            later = await worker.pg.get_execution(eid)
            assert later is not None
            if (later.lease_expires_at or 0) > first.lease_expires_at:
                break
            await asyncio.sleep(0.05)
        assert later.lease_expires_at is not None
        assert later.lease_expires_at > first.lease_expires_at
        assert worker.counted.calls["renew_lease"] >= 1
        HOLD[eid].set()
        assert await drive == "completed"
    finally:
        await _close(worker)
