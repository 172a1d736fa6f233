"""Durable queues in one runtime (decision 0056): limits, order, wakes, refusals.

Every embedded store. The fleet-wide tests (several processes, real workers) are in
``tests/integration/test_queues_fleet.py``; the store's answers in the conformance kit.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from kernel_kit import ManualClock

from fleet import Context, Principal, Queue, Runtime, flow
from fleet.kernel.errors import (
    ConfigurationError,
    ExecutionCancelledError,
    GateMismatchError,
    PayloadTooLargeError,
    ValidationError,
)
from fleet.kernel.events import EventType
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore
from fleet.kernel.store.spi_queues import HoldsQueues, QueueEntry
from fleet.kernel.values import datetime_from_ms

ALICE = Principal("alice", tenant="acme")


@flow("q-hold")
async def hold(ctx: Context, name: str) -> str:
    """Holds its slot until its gate is answered."""
    await ctx.wait("done")
    return name


@flow("q-nap")
async def nap(ctx: Context, name: str) -> str:
    await ctx.sleep(3600)
    return name


@flow("q-echo")
async def echo(ctx: Context, name: Any) -> Any:
    return name


def runtime(store: EventStore, clock: ManualClock | None = None, *queues: Queue,
            **kw: Any) -> Runtime:
    return Runtime(store, flows=[hold, nap, echo], queues=list(queues), local_timers=False,
                   clock=clock, **kw)


async def status(rt: Runtime, eid: str) -> tuple[str, str | None]:
    state = await rt.load_state(eid)
    return state.status, (state.waiting or {}).get("on")


async def settle(rt: Runtime) -> None:
    """Let the runs and passes launched in the background finish their writes."""
    for _ in range(5):
        tasks = [t for t in rt.engine.background if not t.done()]
        if not tasks:
            return
        await asyncio.wait(tasks, timeout=5)


def plain_store(inner: EventStore) -> Any:
    """A store with the ``EventStore`` calls only (a third party's, say): no queues."""

    class Plain:
        pass

    for name in (n for n in dir(EventStore) if not n.startswith("_")):
        setattr(Plain, name, lambda self, *a, _name=name, **k: getattr(inner, _name)(*a, **k))
    return Plain()


def test_a_queue_declaration_with_a_bad_limit_names_the_queue_and_the_field() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"concurrency": 0}, "'mail': concurrency"),
        ({"concurrency": -3}, "'mail': concurrency"),
        ({"concurrency": True}, "'mail': concurrency"),
        ({"per_key_concurrency": 0}, "'mail': per_key_concurrency"),
        ({"rate": (-1, timedelta(seconds=1))}, "'mail': rate count"),
        ({"rate": (0, timedelta(seconds=1))}, "'mail': rate count"),
        ({"rate": (10, 1.0)}, "'mail': rate period must be a timedelta"),
        ({"rate": (10, timedelta(seconds=-1))}, "'mail': rate period"),
        ({"rate": (10,)}, "'mail': rate must be"),
        ({"priority": "yes"}, "'mail': priority"),
    ]
    for kw, words in cases:
        with pytest.raises(ValidationError, match=words):
            Queue("mail", **kw)
    for name in ("", "bad name", "x" * 101, "a/b", None):
        with pytest.raises(ValidationError, match="queue name"):
            Queue(name, concurrency=1)  # type: ignore[arg-type]


def test_a_runtime_refuses_two_queues_of_one_name_and_a_store_without_queues() -> None:
    with pytest.raises(ConfigurationError, match="declared twice"):
        Runtime(MemoryEventStore(), queues=[Queue("a"), Queue("a", concurrency=2)])
    with pytest.raises(ConfigurationError, match="Queue"):
        Runtime(MemoryEventStore(), queues=["a"])  # type: ignore[list-item]
    plain = plain_store(MemoryEventStore())
    assert isinstance(plain, EventStore)
    assert not isinstance(plain, HoldsQueues)
    with pytest.raises(ConfigurationError, match="keeps no queues"):
        Runtime(plain, queues=[Queue("a")])  # type: ignore[arg-type]
    Runtime(plain)  # type: ignore[arg-type] # without queues it is fine


async def test_bad_queued_starts_are_refused_and_nothing_is_written(
        store: EventStore) -> None:
    rt = runtime(store, None, Queue("mail", concurrency=1),
                 Queue("tenants", per_key_concurrency=1), Queue("ranked", priority=True))
    cases: list[tuple[str, dict[str, Any]]] = [
        ("no queue 'nope' is declared", {"queue": "nope"}),
        ("per_key_concurrency", {"queue": "tenants"}),
        ("does not order by priority", {"queue": "mail", "priority": 1}),
        ("priority must be an int", {"queue": "ranked", "priority": -1}),
        ("priority must be an int", {"queue": "ranked", "priority": 2**31}),
        ("give queue= too", {"priority": 1}),
        ("key must be", {"queue": "mail", "key": "k" * 513}),
        ("key must be", {"queue": "mail", "key": ""}),
    ]
    for words, kw in cases:
        with pytest.raises(ValidationError, match=words):
            await rt.start("q-echo", 1, execution_id="refused", **kw)
    assert await store.list_executions() == []
    assert isinstance(store, HoldsQueues)
    assert await store.queue_depths(0) == []
    await rt.close()


async def test_concurrency_holds_and_a_run_ending_here_admits_the_next(
        store: EventStore) -> None:
    rt = runtime(store, None, Queue("mail", concurrency=2))
    handles = [await rt.start("q-hold", f"r{i}", queue="mail") for i in range(5)]
    ids = [h.execution_id for h in handles]
    await settle(rt)
    states = [await status(rt, eid) for eid in ids]
    assert states[:2] == [("parked", "done")] * 2  # admitted: they reached their gate
    assert states[2:] == [("parked", "__fleet_queue__:mail")] * 3
    await rt.resume(ids[0], "done")  # r0 ends: its pass admits r2, here
    assert await rt.result(ids[0]) == "r0"
    await settle(rt)
    assert await status(rt, ids[2]) == ("parked", "done")
    assert await status(rt, ids[3]) == ("parked", "__fleet_queue__:mail")
    for eid in (ids[1], ids[2]):
        await rt.resume(eid, "done")
    await settle(rt)
    for eid in ids[3:]:
        await rt.resume(eid, "done")
    assert [await rt.result(eid) for eid in ids] == [f"r{i}" for i in range(5)]
    await rt.close()


async def test_a_run_that_sleeps_keeps_its_slot(clocked_store: EventStore,
                                               clock: ManualClock) -> None:
    rt = runtime(clocked_store, clock, Queue("naps", concurrency=1))
    first = await rt.start("q-nap", "a", queue="naps")
    second = await rt.start("q-nap", "b", queue="naps")
    await settle(rt)
    assert await status(rt, first.execution_id) == ("parked", "sleep#0")
    assert await status(rt, second.execution_id) == ("parked", "__fleet_queue__:naps")
    assert await rt.fire_due_timers(datetime_from_ms(clock.now + 60_000)) == []
    clock.advance(3600)
    await rt.fire_due_timers()  # a's sleep fires, it ends, b is admitted
    assert await rt.result(first.execution_id) == "a"
    await settle(rt)
    assert await status(rt, second.execution_id) == ("parked", "sleep#0")
    await rt.close()


async def test_per_key_concurrency_serialises_each_key(store: EventStore) -> None:
    rt = runtime(store, None, Queue("users", per_key_concurrency=1))
    starts = [("u1", "a"), ("u1", "b"), ("u2", "c"), ("u1", "d")]
    ids = {name: (await rt.start("q-hold", name, queue="users", key=user)).execution_id
           for user, name in starts}
    await settle(rt)
    running = {n for n, eid in ids.items() if (await status(rt, eid))[1] == "done"}
    assert running == {"a", "c"}
    await rt.resume(ids["a"], "done")
    await rt.result(ids["a"])
    await settle(rt)
    running = {n for n, eid in ids.items() if (await status(rt, eid)) == ("parked", "done")}
    assert running == {"b", "c"}
    await rt.close()


async def test_a_priority_queue_admits_lower_priorities_first(store: EventStore) -> None:
    rt = runtime(store, None, Queue("ranked", concurrency=1, priority=True))
    holder = await rt.start("q-hold", "holder", queue="ranked")
    names = {}
    for name, priority in (("low", 9), ("mid", 5), ("top", 1), ("default", None)):
        kw = {} if priority is None else {"priority": priority}
        names[name] = (await rt.start("q-hold", name, queue="ranked", **kw)).execution_id
    order = []
    current = holder.execution_id
    for _ in range(4):
        await rt.resume(current, "done")
        await rt.result(current)
        await settle(rt)
        (current,) = [eid for eid in names.values()
                      if await status(rt, eid) == ("parked", "done")]
        order.append(next(n for n, eid in names.items() if eid == current))
    assert order == ["default", "top", "mid", "low"]  # 0 (not given), then 1, 5, 9
    await rt.close()


async def test_a_rate_plans_the_next_admissions_on_the_timer_service(
        clocked_store: EventStore, clock: ManualClock) -> None:
    rt = runtime(clocked_store, clock, Queue("paced", rate=(2, timedelta(seconds=1))))
    t0 = clock.now
    ids = [(await rt.start("q-echo", i, queue="paced")).execution_id for i in range(5)]
    await settle(rt)
    assert [await rt.result(eid) for eid in ids[:2]] == [0, 1]
    planned = [await rt.load_state(eid) for eid in ids[2:]]
    assert [s.timers.get("__fleet_queue__:paced", {}).get("dueAt") for s in planned] == [
        t0 + 1000, t0 + 1000, None]
    clock.advance(1)
    fired = await rt.fire_due_timers()  # the planned two fire; the pass plans the last
    assert sorted(f.execution_id for f in fired) == sorted(ids[2:4])
    assert [await rt.result(eid) for eid in ids[2:4]] == [2, 3]
    last = await rt.load_state(ids[4])
    assert last.timers["__fleet_queue__:paced"]["dueAt"] == t0 + 2000
    clock.advance(1)
    assert [f.execution_id for f in await rt.fire_due_timers()] == [ids[4]]
    assert await rt.result(ids[4]) == 4
    await rt.close()


async def test_a_cancelled_waiting_run_never_runs_and_a_freed_slot_is_found_by_a_pass(
        store: EventStore) -> None:
    rt = runtime(store, None, Queue("mail", concurrency=1))
    holder, gone, nxt = [(await rt.start("q-hold", n, queue="mail")).execution_id
                         for n in ("holder", "gone", "next")]
    await settle(rt)
    await rt.cancel(gone)  # it never ran: it ends at once, its body never runs
    assert await status(rt, gone) == ("cancelled", None)
    # A slot freed by a cancel in another process (one that declares no queue), not by a
    # run ending here: only a pass finds it.
    elsewhere = runtime(store)
    await elsewhere.cancel(holder, force=True)
    await elsewhere.close()
    assert await status(rt, nxt) == ("parked", "__fleet_queue__:mail")
    fired = await rt.fire_due_timers()
    assert [(f.execution_id, f.timer_id) for f in fired] == [(nxt, "__fleet_queue__:mail")]
    await settle(rt)
    assert await status(rt, nxt) == ("parked", "done")
    with pytest.raises(ExecutionCancelledError):
        await rt.result(gone)
    events = await store.read(gone)
    assert EventType.TIMER_FIRED not in {e.type for e in events}
    await rt.close()


async def test_a_waiting_runs_gate_cannot_be_resumed(store: EventStore) -> None:
    rt = runtime(store, None, Queue("mail", concurrency=1))
    await rt.start("q-hold", "holder", queue="mail")
    waiting = (await rt.start("q-hold", "waiting", queue="mail")).execution_id
    for gate in ("__fleet_queue__:mail", "done"):
        with pytest.raises(GateMismatchError):
            await rt.resume(waiting, gate, "skip the line")
    assert await status(rt, waiting) == ("parked", "__fleet_queue__:mail")
    await rt.close()


async def test_a_start_the_store_refuses_leaves_no_entry_behind(tmp_path: Any) -> None:
    store = MemoryEventStore(max_event_bytes=2_000)
    rt = runtime(store, None, Queue("mail", concurrency=1))
    with pytest.raises(PayloadTooLargeError):
        await rt.start("q-echo", "x" * 5_000, queue="mail")
    assert await store.list_executions() == []
    (depth,) = await store.queue_depths(0)
    assert (depth.running, depth.waiting) == (0, 0)
    ok = await rt.start("q-echo", "small", queue="mail")  # the slot was not kept
    assert await ok.result() == "small"
    await rt.close()


async def test_the_dispatchers_start_wakes_without_driving_and_a_worker_drives(
        store: EventStore) -> None:
    dispatcher = runtime(store, None, Queue("mail", concurrency=1))
    handle = await dispatcher.start("q-echo", "later", queue="mail", drive=False)
    state = await dispatcher.load_state(handle.execution_id)
    assert state.status == "running"
    assert state.timers["__fleet_queue__:mail"]["fired"]
    summary = await store.get_execution(handle.execution_id)
    assert summary is not None
    assert summary.holder is None
    worker = runtime(store, None, Queue("mail", concurrency=1))
    await worker.drive(handle.execution_id, if_free=True, wait=True)
    assert await worker.result(handle.execution_id) == "later"
    await dispatcher.close()
    await worker.close()


async def test_an_admission_whose_wake_was_lost_is_woken_by_a_later_pass(
        clocked_store: EventStore, clock: ManualClock) -> None:
    queue = Queue("mail", concurrency=1)
    rt = runtime(clocked_store, clock, queue)
    waiting = (await rt.start("q-echo", "w", queue="mail", execution_id="w1",
                              start_in=timedelta(seconds=1))).execution_id
    assert isinstance(clocked_store, HoldsQueues)
    # A pass admits it, then its process dies before writing the wake.
    clock.advance(1)
    done = await clocked_store.queue_pass(queue.limits(), clock.now)
    assert [a.execution_id for a in done.admitted] == [waiting]
    assert await status(rt, waiting) == ("parked", "__fleet_queue__:mail")
    assert await rt.fire_due_timers() == []  # within rewake_ms: maybe a wake in flight
    clock.advance(5)
    assert [f.execution_id for f in await rt.fire_due_timers()] == [waiting]
    assert await rt.result(waiting) == "w"
    await rt.close()


async def test_a_queued_start_is_idempotent_and_enters_once(store: EventStore) -> None:
    rt = runtime(store, None, Queue("mail", concurrency=1))
    await rt.start("q-hold", "holder", queue="mail", principal=ALICE)
    first = await rt.start("q-hold", "x", queue="mail", idempotency_key="k", principal=ALICE)
    again = await rt.start("q-hold", "x", queue="mail", idempotency_key="k", principal=ALICE)
    assert first.execution_id == again.execution_id
    assert isinstance(store, HoldsQueues)
    (depth,) = await store.queue_depths(10**13)
    assert (depth.running, depth.waiting) == (1, 1)
    assert await store.head(first.execution_id) == 1
    again_pass = await store.queue_pass(Queue("mail", concurrency=1).limits(), 10**13,
                                        entry=QueueEntry(first.execution_id, "mail"))
    assert not again_pass.entered
    await rt.close()


async def test_a_wake_that_cannot_be_written_here_is_warned_and_the_others_are_woken(
        store: EventStore) -> None:
    starter = runtime(store, None, Queue("mail", concurrency=2))
    holders = [(await starter.start("q-hold", n, queue="mail")).execution_id for n in "ab"]
    stranger = (await starter.start("q-nap", "needs q-nap", queue="mail")).execution_id
    known = (await starter.start("q-echo", "runs here", queue="mail")).execution_id
    await settle(starter)
    elsewhere = runtime(store)  # two slots freed where no queue is declared: no pass yet
    for eid in holders:
        await elsewhere.cancel(eid, force=True)
    await elsewhere.close()
    warnings: list[str] = []
    # A process that registers q-echo alone (q-nap's code is not deployed on it).
    only_echo = Runtime(store, flows=[echo], queues=[Queue("mail", concurrency=2)],
                        local_timers=False, on_warn=warnings.append)
    fired = await only_echo.fire_due_timers()
    assert [f.execution_id for f in fired] == [known]
    assert await only_echo.result(known) == "runs here"
    assert any(stranger in w and "FlowNotFoundError" in w for w in warnings), warnings
    assert await status(starter, stranger) == ("parked", "__fleet_queue__:mail")
    await starter.close()
    await only_echo.close()
