"""The one write path's cases, run on every store (issue 11 item 1, issue 13 item 1,
ADR 0116 round 3 A, ADR 0147).

``tests/kernel/runtime/test_write_path.py`` runs them on memory and SQLite,
``tests/integration/test_write_path_postgres.py`` on Postgres and on Postgres
behind the group-commit decorator (``CoalescingEventStore``, the fleet's default
store): each module imports these and brings its own ``store`` / ``clocked_store``
fixtures.

Every event the kernel writes outside a run's journal goes through
``fleet.kernel.writes.LogWriter``: stored first, then reported to ``on_event``
and then ``on_durable_event``, each exactly once and in order; a refused write
is reported to neither and warned. One test per kind:
start (one and a batch), resume, send (a plain message and a wake), cancel, a timer fired, a
late outcome, the reopen bootstrap (and its re-slot over a late outcome),
the denial audit, a continue-as-new successor's start.

Every test records one timeline: ``stored`` (the store took the write: a
store decorator stamps it as the append returns), ``live`` (``on_event``) and
``durable`` (``on_durable_event``), and compares it with the log.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
from kernel_kit import FaultyStore, ManualClock, eventually, kinds, settle, started

from fleet import (
    AccessDeniedError,
    Context,
    Decision,
    EventEnvelope,
    EventType,
    Principal,
    RetryPolicy,
    Runtime,
    StoreUnavailableError,
    flow,
)
from fleet.kernel.starts import StartRequest
from fleet.kernel.store.forwarding import ForwardingEventStore
from fleet.kernel.store.spi import AppendRequest, EventStore, append_many

ALICE = Principal("alice", tenant="acme")
MALLORY = Principal("mallory", tenant="acme")
Entry = tuple[str, dict[str, Any]]


class Timeline:
    """What the store took and what each observer reported, in the order it happened."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []

    def note(self, what: str, event: EventEnvelope) -> None:
        self.entries.append((what, event.to_dict()))

    def observers(self) -> dict[str, Any]:
        return {"on_event": lambda e: self.note("live", e),
                "on_durable_event": lambda e: self.note("durable", e)}

    def since(self, mark: int) -> list[Entry]:
        return self.entries[mark:]


class Stamping(ForwardingEventStore):
    """A real store that notes each write the moment the store has taken it."""

    def __init__(self, inner: EventStore, timeline: Timeline) -> None:
        super().__init__(inner)
        self.timeline = timeline

    async def append(self, event: EventEnvelope, *, fence: int | None = None) -> None:
        await self.inner.append(event, fence=fence)
        self.timeline.note("stored", event)

    async def append_batch(self, events: Sequence[EventEnvelope], *,
                           fence: int | None = None) -> None:
        await self.inner.append_batch(events, fence=fence)
        for event in events:
            self.timeline.note("stored", event)

    async def append_acquiring(self, events: Sequence[EventEnvelope], *, holder: str,
                               lease_ms: int, release: bool = False) -> Any:
        grant = await super().append_acquiring(events, holder=holder, lease_ms=lease_ms,
                                               release=release)
        if grant is not None:
            for event in events:
                self.timeline.note("stored", event)
        return grant

    async def append_releasing(self, events: Sequence[EventEnvelope], *, fence: int) -> None:
        await super().append_releasing(events, fence=fence)
        for event in events:
            self.timeline.note("stored", event)

    async def append_if_unchanged(self, execution_id: str, event: EventEnvelope | None,
                                  expect: Any = None) -> Any:
        result = await self.inner.append_if_unchanged(execution_id, event, expect)
        if event is not None and result.appended:
            self.timeline.note("stored", event)
        return result

    async def append_many(self, requests: Sequence[AppendRequest],
                          ) -> list[BaseException | None]:
        answers = await append_many(self.inner, requests)
        for (events, _), answer in zip(requests, answers, strict=True):
            if answer is None:
                for event in events:
                    self.timeline.note("stored", event)
        return answers


def written_outside_a_run(events: Sequence[EventEnvelope]) -> list[Entry]:
    """The timeline of one write through the write path: stored, then each observer."""
    rows = [e.to_dict() for e in events]
    return ([("stored", r) for r in rows] + [("live", r) for r in rows]
            + [("durable", r) for r in rows])


def reported_exactly(timeline: list[Entry], events: Sequence[EventEnvelope]) -> None:
    """Each of ``events`` reached each observer exactly once, in sequence order, and
    ``on_event`` before ``on_durable_event`` (a run's journal reports ``on_event`` at
    commit, before the write; the write path once stored)."""
    rows = [e.to_dict() for e in events]
    for what in ("live", "durable"):
        assert [r for w, r in timeline if w == what] == rows, what
    for row in rows:
        assert timeline.index(("live", row)) < timeline.index(("durable", row))


def _runtime(store: EventStore, timeline: Timeline, *flows: Any, **kw: Any) -> Runtime:
    return Runtime(Stamping(store, timeline), flows=list(flows), **timeline.observers(), **kw)


@flow("wp-gate")
async def gate(ctx: Context, _: Any) -> Any:
    return await ctx.wait("g")


async def test_write_path_start_reports_execution_started(store: EventStore) -> None:
    timeline = Timeline()
    runtime = _runtime(store, timeline, gate)
    handle = await runtime.start("wp-gate", None, execution_id="s1", drive=False)
    log = await store.read(handle.execution_id)
    assert kinds(log) == ["EXECUTION_STARTED"]
    assert timeline.since(0) == written_outside_a_run(log)


async def test_write_path_start_many_reports_each_execution_started_it_wrote(
        store: EventStore) -> None:
    """``Runtime.start_many`` (one ``append_many``): each start it wrote is reported once
    stored; one that already existed (answered by ``start``) writes and reports nothing."""
    timeline = Timeline()
    runtime = _runtime(store, timeline, gate)
    await runtime.start("wp-gate", None, execution_id="m-old", drive=False)
    mark = len(timeline.entries)
    handles = await runtime.start_many([StartRequest("wp-gate", 1, execution_id="m-new"),
                                        StartRequest("wp-gate", 2, execution_id="m-old")])
    assert [h.execution_id for h in handles] == ["m-new", "m-old"]
    new, old = await store.read("m-new"), await store.read("m-old")
    assert kinds(new) == kinds(old) == ["EXECUTION_STARTED"]
    assert old[0].payload["input"] is None  # the existing one, untouched
    assert timeline.since(mark) == written_outside_a_run(new)


async def test_write_path_resume_reports_execution_resumed(store: EventStore) -> None:
    timeline = Timeline()
    runtime = _runtime(store, timeline, gate)
    eid = await started(runtime, "wp-gate", principal=ALICE)
    before, mark = len(await store.read(eid)), len(timeline.entries)
    await runtime.resume(eid, "g", 41, principal=ALICE, drive=False)
    tail = (await store.read(eid))[before:]
    assert kinds(tail) == ["EXECUTION_RESUMED"]
    assert timeline.since(mark) == written_outside_a_run(tail)


async def test_write_path_send_reports_message_received(store: EventStore) -> None:
    timeline = Timeline()
    runtime = _runtime(store, timeline, gate)
    eid = await started(runtime, "wp-gate", principal=ALICE)
    before, mark = len(await store.read(eid)), len(timeline.entries)
    # Parked on a gate, not on this key: the message is logged, nothing wakes.
    assert await runtime.send(eid, "note", {"n": 1}, principal=ALICE) is False
    tail = (await store.read(eid))[before:]
    assert kinds(tail) == ["MESSAGE_RECEIVED"]
    assert timeline.since(mark) == written_outside_a_run(tail)


async def test_write_path_send_that_wakes_reports_message_and_resume(store: EventStore) -> None:
    @flow("wp-inbox")
    async def inbox(ctx: Context, _: Any) -> Any:
        return await ctx.receive("k")

    timeline = Timeline()
    runtime = _runtime(store, timeline, inbox)
    eid = await started(runtime, "wp-inbox", principal=ALICE)
    before, mark = len(await store.read(eid)), len(timeline.entries)
    assert await runtime.send(eid, "k", "hello", principal=ALICE, drive=False) is True
    tail = (await store.read(eid))[before:]
    assert kinds(tail) == ["MESSAGE_RECEIVED", "EXECUTION_RESUMED"]
    assert timeline.since(mark) == written_outside_a_run(tail)


async def test_write_path_cancel_reports_step_cancelled_and_execution_cancelled(
        store: EventStore) -> None:
    @flow("wp-retrying")
    async def retrying(ctx: Context, _: Any) -> Any:
        def flaky() -> None:
            raise OSError("down")
        # The first attempt fails; the run waits out a minute's backoff (a live run).
        return await ctx.step("call", flaky, retry=RetryPolicy(initial_interval=60))

    timeline = Timeline()
    runtime = _runtime(store, timeline, retrying)
    eid = (await runtime.start("wp-retrying", None, principal=ALICE)).execution_id
    await eventually(lambda: len(timeline.entries) > 0 and timeline.entries[-1][0] == "durable"
                     and timeline.entries[-1][1]["type"] == "STEP_FAILED")
    before, mark = len(await store.read(eid)), len(timeline.entries)
    await runtime.cancel(eid, principal=ALICE, reason="no longer needed", force=True)
    await settle(runtime)
    tail = (await store.read(eid))[before:]
    assert kinds(tail) == ["STEP_CANCELLED", "EXECUTION_CANCELLED"]
    assert timeline.since(mark) == written_outside_a_run(tail)


async def test_write_path_timer_fire_reports_timer_fired(clocked_store: EventStore,
                                                         clock: ManualClock) -> None:
    @flow("wp-nap")
    async def nap(ctx: Context, _: Any) -> str:
        await ctx.sleep(3600)
        return "awake"

    timeline = Timeline()
    runtime = _runtime(clocked_store, timeline, nap, clock=clock, local_timers=False)
    eid = await started(runtime, "wp-nap")
    before, mark = len(await clocked_store.read(eid)), len(timeline.entries)
    clock.advance(3601)
    fired = await runtime.fire_due_timers(drive=False)
    assert [(f.execution_id, f.timer_id) for f in fired] == [(eid, "sleep#0")]
    tail = (await clocked_store.read(eid))[before:]
    assert kinds(tail) == ["TIMER_FIRED"]
    assert timeline.since(mark) == written_outside_a_run(tail)


async def test_write_path_late_outcome_reports_outcome_recorded(store: EventStore) -> None:
    @flow("wp-priced")
    async def priced(ctx: Context, _: Any) -> Any:
        return await ctx.decide("price", lambda: Decision(9))

    timeline = Timeline()
    runtime = _runtime(store, timeline, priced)
    handle = await runtime.start("wp-priced", None, principal=ALICE)
    assert await handle.result() == 9
    await settle(runtime)
    eid = handle.execution_id
    before, mark = len(await store.read(eid)), len(timeline.entries)
    result = await runtime.record_outcome(eid, decision_id="price", key="csat:1", score=0.8,
                                          principal=ALICE)
    tail = (await store.read(eid))[before:]
    assert kinds(tail) == ["OUTCOME_RECORDED"]
    assert (result.appended, result.sequence) == (True, tail[0].sequence)
    assert timeline.since(mark) == written_outside_a_run(tail)
    # The same outcome again is a duplicate: nothing written, nothing reported.
    mark = len(timeline.entries)
    again = await runtime.record_outcome(eid, decision_id="price", key="csat:1", score=0.8,
                                         principal=ALICE)
    assert again.appended is False
    assert timeline.since(mark) == []


async def test_write_path_reopen_bootstrap_reports_execution_migrated(
        store: EventStore) -> None:
    @flow("wp-deal", version=1, steps=["quote"])
    async def deal_v1(ctx: Context, _: Any) -> str:
        await ctx.step("quote", lambda: 1)
        return "v1"

    @flow("wp-deal", version=2, steps=["quote"])
    async def deal_v2(ctx: Context, _: Any) -> Any:
        await ctx.step("quote", lambda: 1)
        return await ctx.wait("more")  # the reopened run parks here

    timeline = Timeline()
    first = _runtime(store, timeline, deal_v1)
    handle = await first.start("wp-deal", None, principal=ALICE)
    eid = handle.execution_id
    assert await handle.result() == "v1"
    await settle(first)
    runtime = _runtime(store, timeline, deal_v1, deal_v2)  # v2 deployed
    before, mark = len(await store.read(eid)), len(timeline.entries)
    reopened = await runtime.resume_as(eid, version=2, principal=ALICE)
    outcome = await reopened.outcome()
    assert outcome is not None
    assert outcome.kind == "parked"
    tail = (await store.read(eid))[before:]
    assert kinds(tail)[0] == "EXECUTION_MIGRATED"
    assert tail[0].payload["reopen"] is True
    events = timeline.since(mark)
    # The bootstrap: stored, then on_event, then on_durable_event (round 3 A: on_event
    # "once they are stored"), before anything the reopened run commits.
    assert events[:3] == written_outside_a_run(tail[:1])
    # And every event since, the run's own included, reached each observer once, in order.
    reported_exactly(events, tail)


class SlotTaker(Stamping):
    """Runs ``take`` (another write) once, just before the reopen's bootstrap lands."""

    def __init__(self, inner: EventStore, timeline: Timeline) -> None:
        super().__init__(inner, timeline)
        self.take: Callable[[], Awaitable[Any]] | None = None

    async def append_batch(self, events: Sequence[EventEnvelope], *,
                           fence: int | None = None) -> None:
        take, self.take = self.take, None
        if take is not None and any(e.type is EventType.EXECUTION_MIGRATED for e in events):
            await take()
        await super().append_batch(events, fence=fence)


async def test_write_path_reopen_re_slotted_over_a_late_outcome_reports_each_once(
        store: EventStore) -> None:
    """Round 3 A's adopt path: a late outcome takes the reopener's slot; the refused
    first bootstrap is reported to nobody (and not warned: a taken slot is a race its
    caller settles), the late outcome and the re-slotted bootstrap once each."""
    @flow("wp-offer", version=1, steps=["quote"])
    async def offer_v1(ctx: Context, _: Any) -> Any:
        await ctx.step("quote", lambda: 1)
        return await ctx.decide("price", lambda: Decision(9))

    @flow("wp-offer", version=2, steps=["quote"])
    async def offer_v2(ctx: Context, _: Any) -> Any:
        await ctx.step("quote", lambda: 1)
        await ctx.decide("price", lambda: Decision(9))
        return await ctx.wait("more")

    timeline = Timeline()
    warnings: list[str] = []
    first = _runtime(store, timeline, offer_v1)
    handle = await first.start("wp-offer", None, principal=ALICE)
    eid = handle.execution_id
    assert await handle.result() == 9
    await settle(first)
    taker = SlotTaker(store, timeline)
    runtime = Runtime(taker, flows=[offer_v1, offer_v2], on_warn=warnings.append,
                      **timeline.observers())
    taker.take = lambda: runtime.record_outcome(eid, decision_id="price", key="slot",
                                                score=1.0, system=True)
    before, mark = len(await store.read(eid)), len(timeline.entries)
    reopened = await runtime.resume_as(eid, version=2, principal=ALICE)
    outcome = await reopened.outcome()
    assert outcome is not None
    assert outcome.kind == "parked"
    tail = (await store.read(eid))[before:]
    assert kinds(tail)[:2] == ["OUTCOME_RECORDED", "EXECUTION_MIGRATED"]
    assert tail[1].sequence == tail[0].sequence + 1  # re-slotted above the outcome
    events = timeline.since(mark)
    assert events[:6] == written_outside_a_run(tail[:1]) + written_outside_a_run(tail[1:2])
    reported_exactly(events, tail)
    assert warnings == []


async def test_write_path_denial_audit_reports_execution_denied(store: EventStore) -> None:
    timeline = Timeline()
    denials: list[dict[str, Any]] = []
    runtime = _runtime(store, timeline, gate, on_execution_denied=denials.append)
    eid = await started(runtime, "wp-gate", principal=ALICE)
    before, mark = len(await store.read(eid)), len(timeline.entries)
    with pytest.raises(AccessDeniedError):
        await runtime.resume(eid, "g", 1, principal=MALLORY)
    tail = (await store.read(eid))[before:]
    assert kinds(tail) == ["EXECUTION_DENIED"]
    assert tail[0].payload["actor"] == "mallory"
    assert timeline.since(mark) == written_outside_a_run(tail)
    assert [d["op"] for d in denials] == ["resume"]


async def test_write_path_continue_as_new_reports_the_successors_start(
        store: EventStore) -> None:
    @flow("wp-chain")
    async def chain(ctx: Context, n: int) -> int:
        if n < 1:
            await ctx.continue_as_new(n + 1)
        return n

    timeline = Timeline()
    runtime = _runtime(store, timeline, chain)
    handle = await runtime.start("wp-chain", 0, execution_id="wp-c")
    assert await handle.result() == 1
    await settle(runtime)
    successor = await store.read("wp-c~1")
    assert kinds(successor) == ["EXECUTION_STARTED", "EXECUTION_COMPLETED"]
    reported_exactly([e for e in timeline.entries if e[1]["executionId"] == "wp-c~1"],
                     successor)
    started_at = timeline.entries.index(("stored", successor[0].to_dict()))
    assert timeline.entries[started_at:started_at + 3] == written_outside_a_run(successor[:1])


# -- refusals: nothing reported, warned --------------------------------------------------

async def test_write_path_refused_write_is_reported_to_neither_observer_and_warned(
        store: EventStore) -> None:
    timeline = Timeline()
    warnings: list[str] = []
    faulty = FaultyStore(Stamping(store, timeline),
                         lambda e: e.type is EventType.MESSAGE_RECEIVED)
    runtime = Runtime(faulty, flows=[gate], on_warn=warnings.append,  # type: ignore[arg-type]
                      **timeline.observers())
    eid = await started(runtime, "wp-gate", principal=ALICE)
    before, mark = await store.read(eid), len(timeline.entries)
    with pytest.raises(StoreUnavailableError):
        await runtime.send(eid, "note", 1, principal=ALICE)
    assert await store.read(eid) == before
    assert timeline.since(mark) == []
    [warning] = warnings
    assert "MESSAGE_RECEIVED" in warning
    assert "refused" in warning
    assert eid in warning


async def test_write_path_a_denial_while_a_holder_owns_the_slot_appends_and_reports_nothing(
        clocked_store: EventStore, clock: ManualClock) -> None:
    timeline = Timeline()
    runtime = _runtime(clocked_store, timeline, gate, clock=clock)
    eid = await started(runtime, "wp-gate", principal=ALICE)
    other = await clocked_store.acquire_fence_if(eid, holder="someone", lease_ms=60_000)
    assert other is not None  # a live holder owns the next slot
    before, mark = await clocked_store.read(eid), len(timeline.entries)
    with pytest.raises(AccessDeniedError):
        await runtime.resume(eid, "g", 1, principal=MALLORY)
    assert await clocked_store.read(eid) == before
    assert timeline.since(mark) == []


async def test_observers_set_after_construction_hear_the_write_path(store: EventStore) -> None:
    runtime = Runtime(store, flows=[gate])
    heard: list[str] = []
    runtime.on_durable_event = lambda e: heard.append(str(e.type))
    eid = await started(runtime, "wp-gate")
    await runtime.resume(eid, "g", 1, drive=False)
    await asyncio.sleep(0)
    assert heard == ["EXECUTION_STARTED", "EXECUTION_SUSPENDED", "EXECUTION_RESUMED"]
