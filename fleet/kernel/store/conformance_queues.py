"""The conformance kit's queue part: ``HoldsQueues`` (decision 0056, 0057).

Included in ``EventStoreConformance``. A store that keeps queues must give these
answers; one that does not must say so (``spi_queues.holds_queues`` is False), and a
``Runtime`` with queues then refuses it.
Each test writes the logs the kernel would (a start parked on the queue's gate, its
wake, its end) and asks the store what it admits: times are explicit (``T0 + ...``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fleet.kernel.errors import ValidationError
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.store.conformance_events import T0, make_event, started
from fleet.kernel.store.spi import EventStore
from fleet.kernel.store.spi_queues import (
    HoldsQueues,
    QueueEntry,
    QueueLimits,
    QueuePass,
    holds_queues,
)

__all__ = ["QueueConformance"]

E = EventType
GRACE = 60_000
REWAKE = 5_000


def _store(store: EventStore) -> HoldsQueues:
    assert isinstance(store, HoldsQueues)
    return store


async def _head(store: EventStore, eid: str) -> int:
    head = await store.head(eid)
    assert head is not None
    return head


async def _append(store: EventStore, eid: str, *bodies: tuple[EventType, dict[str, Any]],
                  at: int = T0) -> None:
    head = await _head(store, eid)
    await store.append_batch([EventEnvelope.make(eid, head + 1 + i, kind, at, body)
                              for i, (kind, body) in enumerate(bodies)])


async def enqueue(store: EventStore, limits: QueueLimits, eid: str, now: int, *,
                  key: str | None = None, priority: int = 0, eligible_at: int = 0,
                  ) -> QueuePass:
    """What a queued start does: the pass with its entry, then its log parked on the gate."""
    done = await _store(store).queue_pass(
        limits, now, entry=QueueEntry(eid, limits.name, key, priority, eligible_at),
        grace_ms=GRACE, rewake_ms=REWAKE)
    condition = {"on": limits.gate, "kind": "timer", "queue": limits.name}
    await store.append_batch([started(eid, timestamp=now),
                              make_event(eid, 1, E.EXECUTION_SUSPENDED,
                                         {"condition": condition}, timestamp=now)])
    if done.entry_at is not None:
        await wake(store, limits, eid, done.entry_at, now)
    return done


async def wake(store: EventStore, limits: QueueLimits, eid: str, at: int, now: int) -> None:
    """An admission's wake: its timer, fired at once when its slot is now."""
    bodies: list[tuple[EventType, dict[str, Any]]] = [
        (E.TIMER_SCHEDULED, {"timerId": limits.gate, "dueAt": at})]
    if at <= now:
        bodies.append((E.TIMER_FIRED, {"timerId": limits.gate}))
    await _append(store, eid, *bodies, at=now)


async def run_pass(store: EventStore, limits: QueueLimits, now: int, **kw: Any) -> QueuePass:
    """A pass without an entry (the timer service's); its admissions woken."""
    done = await _store(store).queue_pass(limits, now, grace_ms=GRACE, rewake_ms=REWAKE, **kw)
    for admission in done.admitted:
        await wake(store, limits, admission.execution_id, admission.at, now)
    return done


async def end(store: EventStore, eid: str, kind: EventType = E.EXECUTION_COMPLETED) -> None:
    payload: dict[EventType, dict[str, Any]] = {
        EventType.EXECUTION_CANCELLED: {"reason": "test"},
        EventType.EXECUTION_FAILED: {"error": {"type": "Boom", "message": "x"}}}
    await _append(store, eid, (kind, payload.get(kind, {"output": None})))


def ids(done: QueuePass) -> list[str]:
    return [a.execution_id for a in done.admitted]


class QueueConformance:
    """``HoldsQueues``: mixed into ``EventStoreConformance``."""

    async def test_a_store_says_whether_it_keeps_queues(self, store: EventStore) -> None:
        # One that does not is refused by a Runtime with queues (tests/kernel/runtime).
        if holds_queues(store):
            assert isinstance(store, HoldsQueues)
            assert await store.queue_depths(T0) == []

    async def test_queue_concurrency_admits_in_enqueue_order_up_to_the_limit(
            self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        q = QueueLimits("emails", concurrency=2)
        first = [await enqueue(store, q, eid, T0 + i) for i, eid in enumerate("abcd")]
        assert [p.entry_at for p in first] == [T0, T0 + 1, None, None]
        assert [p.entered for p in first] == [True] * 4
        assert ids(await run_pass(store, q, T0 + 10)) == []  # both slots taken
        await end(store, "a")
        assert ids(await run_pass(store, q, T0 + 20)) == ["c"]
        await end(store, "b", E.EXECUTION_FAILED)
        done = await run_pass(store, q, T0 + 30)
        assert [(a.execution_id, a.at) for a in done.admitted] == [("d", T0 + 30)]
        assert ids(await run_pass(store, q, T0 + 40)) == []

    async def test_an_entry_passed_again_is_the_same_entry(self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        q = QueueLimits("again", concurrency=1)
        first = await enqueue(store, q, "x", T0)
        again = await _store(store).queue_pass(q, T0 + 1, entry=QueueEntry("x", "again"))
        assert (first.entered, again.entered) == (True, False)
        assert first.entry_at == again.entry_at == T0
        assert ids(again) == []

    async def test_per_key_concurrency_serialises_each_key(self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        q = QueueLimits("tenants", per_key=1)
        got = [await enqueue(store, q, eid, T0, key=key)
               for eid, key in (("a1", "acme"), ("a2", "acme"), ("g1", "globex"),
                                ("a3", "acme"), ("g2", "globex"))]
        assert [p.entry_at is not None for p in got] == [True, False, True, False, False]
        assert ids(await run_pass(store, q, T0 + 1)) == []
        await end(store, "a1")
        assert ids(await run_pass(store, q, T0 + 2)) == ["a2"]
        await end(store, "g1")
        await end(store, "a2")
        assert sorted(ids(await run_pass(store, q, T0 + 3))) == ["a3", "g2"]

    async def test_a_priority_queue_admits_the_lowest_priority_first_then_in_order(
            self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        q = QueueLimits("ranked", concurrency=1, priority=True)
        assert (await enqueue(store, q, "first", T0, priority=9)).entry_at == T0
        for eid, priority in (("p5a", 5), ("p9", 9), ("p1", 1), ("p5b", 5), ("p0", 0)):
            assert (await enqueue(store, q, eid, T0, priority=priority)).entry_at is None
        order = []
        running = "first"
        for step in range(5):
            await end(store, running)
            (running,) = ids(await run_pass(store, q, T0 + 10 + step))
            order.append(running)
        assert order == ["p0", "p1", "p5a", "p5b", "p9"]

    async def test_a_rate_is_planned_so_no_window_holds_more_than_n(
            self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        q = QueueLimits("paced", rate_n=2, rate_ms=1_000)
        got = [await enqueue(store, q, f"r{i}", T0) for i in range(6)]
        # Two now, two planned a period on; the rest wait past the one-period horizon.
        assert [p.entry_at for p in got] == [T0, T0, T0 + 1_000, T0 + 1_000, None, None]
        later = await run_pass(store, q, T0 + 1_000)
        assert [(a.execution_id, a.at) for a in later.admitted] == [
            ("r4", T0 + 2_000), ("r5", T0 + 2_000)]
        times = sorted([T0, T0, T0 + 1_000, T0 + 1_000, T0 + 2_000, T0 + 2_000])
        for i, t in enumerate(times):
            assert sum(1 for u in times[i:] if u < t + 1_000) <= 2

    async def test_concurrency_and_rate_together(self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        q = QueueLimits("both", concurrency=1, rate_n=10, rate_ms=1_000)
        assert (await enqueue(store, q, "one", T0)).entry_at == T0
        assert (await enqueue(store, q, "two", T0)).entry_at is None
        await end(store, "one")
        assert [(a.execution_id, a.at) for a in (await run_pass(store, q, T0 + 5)).admitted] \
            == [("two", T0 + 5)]

    async def test_an_entry_is_admitted_only_once_eligible_and_delay_moves_it(
            self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        q = QueueLimits("later", concurrency=5)
        got = await enqueue(store, q, "d", T0, eligible_at=T0 + 500)
        assert got.entry_at is None
        assert await _store(store).queue_delay("d", T0 + 900)
        assert ids(await run_pass(store, q, T0 + 600)) == []
        depth = {d.queue: d for d in await _store(store).queue_depths(T0 + 600)}["later"]
        assert (depth.waiting, depth.delayed, depth.running) == (0, 1, 0)
        assert ids(await run_pass(store, q, T0 + 900)) == ["d"]
        assert not await _store(store).queue_delay("d", T0 + 5_000)  # admitted: too late
        assert not await _store(store).queue_delay("nobody", T0)

    async def test_an_admission_whose_wake_was_lost_is_handed_back_after_rewake_ms(
            self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        q = QueueLimits("lost", concurrency=2)
        hq = _store(store)
        # The pass admits both, then the process dies before writing either wake.
        for eid in ("w1", "w2"):
            done = await hq.queue_pass(q, T0, entry=QueueEntry(eid, "lost"))
            assert done.entry_at == T0
            cond = {"on": q.gate, "kind": "timer"}
            await store.append_batch([started(eid), make_event(eid, 1, E.EXECUTION_SUSPENDED,
                                                               {"condition": cond})])
        soon = await hq.queue_pass(q, T0 + REWAKE - 1, rewake_ms=REWAKE)
        assert soon.rewake == ()
        quiet = await hq.queue_pass(q, T0 + REWAKE, rewake_ms=REWAKE, sweep=False)
        assert quiet.rewake == ()  # a run's end's pass leaves it to the timer service's
        late = await hq.queue_pass(q, T0 + REWAKE, rewake_ms=REWAKE)
        assert sorted(a.execution_id for a in late.rewake) == ["w1", "w2"]
        # A planned wake (its timer) is not lost; a fired one is not either.
        await wake(store, q, "w1", T0 + 99_000, T0 + REWAKE)
        await wake(store, q, "w2", T0, T0 + REWAKE)
        assert (await hq.queue_pass(q, T0 + 2 * REWAKE, rewake_ms=REWAKE)).rewake == ()

    async def test_an_entry_without_a_log_holds_its_slot_only_for_the_grace(
            self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        q = QueueLimits("ghost", concurrency=1)
        hq = _store(store)
        ghost = await hq.queue_pass(q, T0, entry=QueueEntry("ghost", "ghost"), grace_ms=GRACE)
        assert ghost.entry_at == T0  # its start died before writing its log
        assert (await enqueue(store, q, "real", T0 + 1)).entry_at is None
        assert ids(await run_pass(store, q, T0 + GRACE - 1)) == []
        assert ids(await run_pass(store, q, T0 + GRACE + 1)) == ["real"]

    async def test_a_waiting_run_that_ended_is_never_admitted_and_frees_nothing(
            self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        q = QueueLimits("cancels", concurrency=1)
        await enqueue(store, q, "holder", T0)
        await enqueue(store, q, "gone", T0)
        await enqueue(store, q, "next", T0)
        await end(store, "gone", E.EXECUTION_CANCELLED)
        assert ids(await run_pass(store, q, T0 + 1)) == []
        await end(store, "holder", E.EXECUTION_CANCELLED)
        assert ids(await run_pass(store, q, T0 + 2)) == ["next"]
        depth = {d.queue: d for d in await _store(store).queue_depths(T0 + 3)}["cancels"]
        assert (depth.waiting, depth.running) == (0, 1)

    async def test_concurrent_passes_never_admit_past_the_limit(
            self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        q = QueueLimits("crowd", concurrency=3)
        hq = _store(store)
        passes = await asyncio.gather(*(
            hq.queue_pass(q, T0, entry=QueueEntry(f"c{i}", "crowd")) for i in range(20)))
        assert sum(p.entry_at is not None for p in passes) == 3
        assert sum(len(p.admitted) for p in passes) == 3

    async def test_queues_are_independent_and_limits_changes_are_reported(
            self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        a, b = QueueLimits("qa", concurrency=1), QueueLimits("qb", concurrency=1)
        assert (await enqueue(store, a, "a1", T0)).entry_at == T0
        assert (await enqueue(store, b, "b1", T0)).entry_at == T0
        wider = QueueLimits("qa", concurrency=2)
        changed = await _store(store).queue_pass(wider, T0 + 1)
        assert changed.limits_were == a.to_json()
        assert (await _store(store).queue_pass(wider, T0 + 2)).limits_were is None

    async def test_queue_depths_count_waiting_running_delayed_and_the_oldest_wait(
            self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        q = QueueLimits("depth", concurrency=1)
        await enqueue(store, q, "run", T0)
        await enqueue(store, q, "w1", T0 + 100)
        await enqueue(store, q, "w2", T0 + 300)
        await enqueue(store, q, "later", T0 + 300, eligible_at=T0 + 10_000)
        (depth,) = [d for d in await _store(store).queue_depths(T0 + 1_000)
                    if d.queue == "depth"]
        assert (depth.waiting, depth.running, depth.delayed) == (2, 1, 1)
        assert depth.oldest_wait_ms == 900
        assert depth.limits == q.to_json()

    async def test_forget_removes_an_entry(self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        q = QueueLimits("forget", concurrency=1)
        hq = _store(store)
        assert (await hq.queue_pass(q, T0, entry=QueueEntry("f", "forget"))).entry_at == T0
        assert await hq.queue_forget("f")
        assert not await hq.queue_forget("f")
        await enqueue(store, q, "g", T0 + 1)  # the slot was freed by the forget
        assert [d.running for d in await hq.queue_depths(T0 + 2) if d.queue == "forget"] == [1]

    async def test_debounce_pointer_is_a_compare_and_set(self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        hq = _store(store)
        assert await hq.debounce_get("scope-1") is None
        assert await hq.debounce_claim("scope-1", "e1", expect=None, now_ms=T0)
        assert not await hq.debounce_claim("scope-1", "e2", expect=None, now_ms=T0)
        assert not await hq.debounce_claim("scope-1", "e2", expect="nope", now_ms=T0)
        claim = await hq.debounce_get("scope-1")
        assert claim is not None
        assert (claim.execution_id, claim.claimed_at) == ("e1", T0)
        assert await hq.debounce_claim("scope-1", "e2", expect="e1", now_ms=T0 + 5)
        claim = await hq.debounce_get("scope-1")
        assert claim is not None
        assert (claim.execution_id, claim.claimed_at) == ("e2", T0 + 5)
        results = await asyncio.gather(*(hq.debounce_claim("scope-2", f"x{i}", expect=None,
                                                           now_ms=T0) for i in range(10)))
        assert sum(results) == 1

    async def test_bad_queue_arguments_are_refused_and_nothing_is_kept(
            self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        hq = _store(store)
        good = QueueLimits("good", concurrency=1)
        bad: list[tuple[QueueLimits, QueueEntry | None, dict[str, Any]]] = [
            (QueueLimits("bad name!"), None, {}),
            (QueueLimits("zero", concurrency=0), None, {}),
            (QueueLimits("neg", per_key=-1), None, {}),
            (QueueLimits("half", rate_n=3), None, {}),
            (QueueLimits("rate0", rate_n=3, rate_ms=0), None, {}),
            (good, QueueEntry("e", "other"), {}),
            (good, QueueEntry("e", "good", priority=-1), {}),
            (good, QueueEntry("e", "good", priority=2**31), {}),
            (good, QueueEntry("e", "good", key="k" * 513), {}),
            (good, QueueEntry("e\x00", "good"), {}),
            (good, None, {"limit": -1}),
        ]
        for limits, entry, kw in bad:
            with pytest.raises(ValidationError):
                await hq.queue_pass(limits, T0, entry=entry, **kw)
        with pytest.raises(ValidationError):
            await hq.debounce_claim("", "e", expect=None, now_ms=T0)
        assert await hq.queue_depths(T0) == []
        assert await hq.debounce_get("s") is None

    async def test_queue_keys_and_ids_are_kept_exactly(self, store: EventStore) -> None:
        if not holds_queues(store):
            return
        q = QueueLimits("exact", per_key=1)
        key = "it's \"quoted\"; DROP TABLE x; -- ünï 🚀"
        assert (await enqueue(store, q, "x'; --", T0, key=key)).entry_at == T0
        assert (await enqueue(store, q, "y 🚀", T0, key=key)).entry_at is None
        await end(store, "x'; --")
        assert ids(await run_pass(store, q, T0 + 1)) == ["y 🚀"]
