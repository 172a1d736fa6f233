"""The conformance kit: what every ``EventStore`` and ``SnapshotStore`` must do.

A backend or decorator is done when it passes this kit. It ships in the
package so a third-party backend runs the same tests (it needs ``pytest``
and ``pytest-asyncio`` with ``asyncio_mode = "auto"``)::

    from fleet.kernel.store.conformance import EventStoreConformance

    class TestMyStore(EventStoreConformance):
        @pytest.fixture
        async def store(self):
            store = MyStore(...)   # an EMPTY store: its own database / schema / prefix
            yield store
            await store.close()

``SnapshotStoreConformance`` does the same with a ``snapshot_store`` fixture.
Lease expiry is waited for with ``pass_time``; a backend whose fixture
injects a manual clock overrides it to advance that clock instead (and back:
``conformance_clock.forge_lease`` moves it back to make a lease set too far
ahead; a fixture whose clock cannot go back overrides ``forge_lease``). A fixture
that builds its store with a ``max_event_bytes`` other than the default sets
the class attribute of that name to match. What every store keeps and refuses
(NUL, lone surrogates, int64, the size limit, argument types) is in
``fleet.kernel.store.conformance_values``, included here, and so is
``conformance_decorators``: a decorator that overrides only ``append`` and
``append_batch`` (``WriteWitness``) sees every write the kernel makes (decision 0050).

Pinned choices the SPI leaves open: ``updated_before`` / ``updated_after``
are strict bounds, a lease expiring exactly at ``lease_expired_at`` counts as
expired, ``due_timers`` ties break by execution id then timer id, ``limit=0``
returns nothing and a negative limit or lease is a ``ValidationError``; an
envelope whose id is not ``f"{executionId}-{sequence}"``, and a conditional
append that carries an event but no ``expect``, are ``ValidationError`` too.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import replace
from typing import Any, ClassVar

import pytest

from fleet.kernel.errors import (
    DuplicateSequenceError,
    FleetError,
    SequenceGapError,
    StaleFenceError,
    ValidationError,
)
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.store.conformance_clock import LeaseClockConformance
from fleet.kernel.store.conformance_decorators import DecoratorConformance, WriteWitness
from fleet.kernel.store.conformance_events import HOSTILE_STRINGS, T0, make_event, started
from fleet.kernel.store.conformance_feed import FeedConformance
from fleet.kernel.store.conformance_leases import LeaseConformance
from fleet.kernel.store.conformance_queues import QueueConformance
from fleet.kernel.store.conformance_timers import TimerClaimConformance
from fleet.kernel.store.conformance_values import SnapshotValueConformance, ValueConformance
from fleet.kernel.store.spi import (
    EventStore,
    Snapshot,
    SnapshotStore,
    TipObservation,
    append_many,
)

__all__ = ["HOSTILE_STRINGS", "T0", "EventStoreConformance", "SnapshotStoreConformance",
           "WriteWitness", "make_event", "started"]

E = EventType


async def _log(store: EventStore, execution_id: str, length: int, **kw: Any) -> list[
        EventEnvelope]:
    events = [started(execution_id, **kw)] + [make_event(execution_id, s)
                                              for s in range(1, length)]
    await store.append_batch(events)
    return events


def _wire(events: list[EventEnvelope]) -> list[str]:
    # Strict on JSON types (1 is not 1.0 is not true), lenient on key order,
    # which a store that keeps documents as jsonb does not preserve.
    return [json.dumps(e.to_dict(), sort_keys=True) for e in events]


class EventStoreConformance(FeedConformance, ValueConformance, LeaseConformance,
                            TimerClaimConformance,
                            DecoratorConformance,
                            LeaseClockConformance,
                            QueueConformance):
    """The ``EventStore`` contract as tests; subclass it and provide ``store``."""

    lease_ms: ClassVar[int] = 250  # a short lease the kit waits out with pass_time

    async def pass_time(self, ms: int) -> None:
        """Let ``ms`` of the store's clock pass (override for a manual clock)."""
        await asyncio.sleep(ms / 1000)

    # -- the log -------------------------------------------------------------

    async def test_round_trip_is_exact(self, store: EventStore) -> None:
        events = [
            started("rt"),
            make_event("rt", 1, E.STEP_COMPLETED, {"stepId": "fetch", "output": {
                "nested": [1, 2.5, -0.0, None, True, {"deep": "ünï 🚀"}], "big": 2**53,
                "empty": {}, "quote": "'\""}}),
            make_event("rt", 2, E.EMITTED, {"type": "user.note", "payload": [1, "two"]},
                       kernel=False),
            EventEnvelope.make("rt", 3, E.DECISION_RECORDED, T0 + 3,
                               {"decisionId": "plan", "choice": "pro",
                                "policy": {"name": "p", "version": 2, "propensity": 0.25}},
                               metadata={"traceId": "abc", "attempt": 2}),
        ]
        for event in events:
            await store.append(event)
        back = await store.read("rt")
        assert back == events
        assert _wire(back) == _wire(events)
        assert [e.kernel for e in back] == [True, True, False, True]
        assert await store.head("rt") == 3

    async def test_first_event_must_be_sequence_zero(self, store: EventStore) -> None:
        with pytest.raises(SequenceGapError):
            await store.append(make_event("z", 1))
        assert await store.read("z") == []
        assert await store.head("z") is None
        assert await store.get_execution("z") is None
        await store.append(started("z"))
        assert await store.head("z") == 0

    async def test_duplicate_slot_refused_and_log_unchanged(self, store: EventStore) -> None:
        events = await _log(store, "dup", 2)
        for sequence in (0, 1):
            with pytest.raises(DuplicateSequenceError):
                await store.append(make_event("dup", sequence, E.STEP_COMPLETED,
                                              {"stepId": "intruder"}))
        assert _wire(await store.read("dup")) == _wire(events)
        summary = await store.get_execution("dup")
        assert summary is not None
        assert summary.head == 1

    async def test_gap_refused_and_log_unchanged(self, store: EventStore) -> None:
        events = await _log(store, "gap", 1)
        with pytest.raises(SequenceGapError):
            await store.append(make_event("gap", 2))
        with pytest.raises(SequenceGapError):
            await store.append_batch([make_event("gap", 2), make_event("gap", 3)])
        assert await store.read("gap") == events
        await store.append(make_event("gap", 1))
        assert await store.head("gap") == 1

    async def test_batch_is_all_or_nothing(self, store: EventStore) -> None:
        events = await _log(store, "b", 1)
        other = await _log(store, "other", 1)
        bad_batches: list[tuple[type[FleetError], list[EventEnvelope]]] = [
            (SequenceGapError, [make_event("b", 1), make_event("b", 2), make_event("b", 2)]),
            (ValidationError, [make_event("b", 1), make_event("b", 2), make_event("other", 3)]),
            (ValidationError, [make_event("b", 1), make_event("b", 2),
                               replace(make_event("b", 3), id="b-9")]),
            (DuplicateSequenceError, [make_event("b", 0), make_event("b", 1),
                                      make_event("b", 2)]),
            (ValidationError, []),
        ]
        for error, batch in bad_batches:
            with pytest.raises(error):
                await store.append_batch(batch)
            assert await store.read("b") == events, batch
        assert await store.read("other") == other
        good = [make_event("b", 1), make_event("b", 2, E.EXECUTION_SUSPENDED)]
        await store.append_batch(good)
        assert await store.read("b") == events + good
        summary = await store.get_execution("b")
        assert summary is not None
        assert (summary.head, summary.status) == (2, "parked")

    async def test_read_after(self, store: EventStore) -> None:
        events = await _log(store, "ra", 5)
        assert await store.read("ra", after=-1) == events
        assert await store.read("ra", after=1) == events[2:]
        assert await store.read("ra", after=3) == events[4:]
        assert await store.read("ra", after=4) == []
        assert await store.read("ra", after=99) == []
        assert await store.read("nobody", after=-1) == []

    async def test_head(self, store: EventStore) -> None:
        assert await store.head("unknown") is None
        await _log(store, "h", 3)
        assert await store.head("h") == 2
        assert await store.head("H") is None  # ids are case-sensitive

    # -- many appends in one call (spi.AppendsMany) -----------------------------

    async def test_append_many_judges_each_request_alone(self, store: EventStore) -> None:
        """One call, many executions: each request is written or refused as its own
        append would be, and a refusal writes nothing of it and nothing else fails."""
        kept = await _log(store, "m-kept", 1)
        await _log(store, "m-fenced", 1)
        grant = await store.acquire_fence("m-fenced", holder="w", lease_ms=60_000)
        requests: list[tuple[list[EventEnvelope], int | None]] = [
            ([started("m-new")], None),
            ([started("m-pair"), make_event("m-pair", 1)], 0),
            ([make_event("m-kept", 1)], None),
            ([make_event("m-kept", 5)], None),                      # a gap
            ([started("m-kept", owner="intruder")], None),          # the slot is taken
            ([make_event("m-fenced", 1)], grant.token - 1),         # a superseded token
            ([make_event("m-fenced", 1)], grant.token),
            ([], None),                                              # no events
            ([make_event("m-bad", 0), make_event("m-other", 1)], None),  # two executions
        ]
        results = await append_many(store, requests)
        assert len(results) == len(requests)
        assert results[0] is None
        assert results[1] is None
        assert results[2] is None
        assert isinstance(results[3], SequenceGapError)
        assert isinstance(results[4], DuplicateSequenceError)
        assert isinstance(results[5], StaleFenceError)
        assert results[6] is None
        assert isinstance(results[7], ValidationError)
        assert isinstance(results[8], (ValidationError, SequenceGapError))
        assert await store.read("m-new") == [started("m-new")]
        assert await store.head("m-pair") == 1
        assert _wire(await store.read("m-kept")) == _wire([*kept, make_event("m-kept", 1)])
        assert await store.head("m-fenced") == 1
        for nobody in ("m-bad", "m-other"):
            assert await store.head(nobody) is None
        summary = await store.get_execution("m-new")
        assert summary is not None
        assert (summary.flow_id, summary.tenant, summary.owner, summary.status) == (
            "flow", "acme", "alice", "running")
        kept_row = await store.get_execution("m-kept")
        assert kept_row is not None
        assert kept_row.owner == "alice"

    async def test_append_many_with_fence_zero_creates_only_the_never_fenced(
            self, store: EventStore) -> None:
        """``fence=0`` is "nobody ever held it": a start that never waits on a lease,
        and never writes over a start in flight or a deleted execution's holder."""
        await store.acquire_fence("z-held", holder="starting", lease_ms=60_000)
        await _log(store, "z-tomb", 1)
        await store.acquire_fence("z-tomb", holder="zombie", lease_ms=60_000)
        assert await store.delete_execution("z-tomb") is True
        results = await append_many(store, [([started("z-fresh")], 0),
                                            ([started("z-held")], 0),
                                            ([started("z-tomb")], 0)])
        assert results[0] is None
        assert isinstance(results[1], StaleFenceError)
        assert isinstance(results[2], StaleFenceError)
        assert await store.head("z-fresh") == 0
        assert await store.head("z-held") is None
        assert await store.head("z-tomb") is None
        # Written with fence 0, the execution is still free to take.
        grant = await store.acquire_fence_if("z-fresh", holder="w", lease_ms=60_000)
        assert grant is not None
        assert grant.token >= 1
        again = await append_many(store, [([started("z-fresh")], 0)])
        assert isinstance(again[0], StaleFenceError)

    async def test_append_many_keeps_one_executions_requests_in_order(
            self, store: EventStore) -> None:
        results = await append_many(store, [([started("o")], 0)] + [
            ([make_event("o", s)], None) for s in range(1, 6)] + [
            ([make_event("o", 6), make_event("o", 7, E.EXECUTION_SUSPENDED)], None)])
        assert results == [None] * 7
        assert [e.sequence for e in await store.read("o")] == list(range(8))
        summary = await store.get_execution("o")
        assert summary is not None
        assert (summary.head, summary.status, summary.waiting_on) == (7, "parked", "approval")
        assert await append_many(store, []) == []

    async def test_append_many_keeps_each_requests_index_whatever_its_neighbours_carry(
            self, store: EventStore) -> None:
        """Each call's requests share one flush, and a field no request of it carries
        (a tenant, a status, a wait, a clear, a timer, a fence) is sent as such
        (Postgres: a NULL column); the index still moves as each append alone moves it."""
        async def index(x: str) -> tuple[Any, ...]:
            s = await store.get_execution(x)
            assert s is not None
            return (s.flow_id, s.tenant, s.owner, s.status, s.waiting_on, s.head)

        # No tenant in the flush; one request fenced (fence 0), the other not.
        assert await append_many(store, [([started("ix-a", tenant=None)], 0),
                                         ([started("ix-b", tenant=None)], None)]) == [None] * 2
        # Plain steps only: no status, wait, born field, clear, timer or fence.
        assert await append_many(store, [([make_event("ix-a", 1)], None),
                                         ([make_event("ix-b", 1)], None)]) == [None] * 2
        assert await index("ix-a") == ("flow", None, "alice", "running", None, 1)
        # A timer beside a suspension: one request's timer, the other's status and wait.
        assert await append_many(store, [
            ([make_event("ix-a", 2, E.TIMER_SCHEDULED, {"timerId": "n", "dueAt": T0 + 5})],
             None),
            ([make_event("ix-b", 2, E.EXECUTION_SUSPENDED)], None)]) == [None] * 2
        assert await index("ix-a") == ("flow", None, "alice", "running", None, 2)
        assert await index("ix-b") == ("flow", None, "alice", "parked", "approval", 2)
        assert [(t.execution_id, t.timer_id) for t in await store.due_timers(T0 + 5)] == [
            ("ix-a", "n")]
        # One clears its timers (it ends) beside a plain step and a start with a tenant.
        assert await append_many(store, [([make_event("ix-a", 3, E.EXECUTION_COMPLETED)], None),
                                         ([make_event("ix-b", 3)], None),
                                         ([started("ix-c", tenant="t9")], None)]) == [None] * 3
        assert await index("ix-a") == ("flow", None, "alice", "completed", None, 3)
        assert await index("ix-b") == ("flow", None, "alice", "parked", "approval", 3)
        assert await index("ix-c") == ("flow", "t9", "alice", "running", None, 0)
        assert await store.due_timers(T0 + 5) == []

    async def test_append_many_of_many_new_executions_with_hostile_ids(
            self, store: EventStore) -> None:
        ids = [f"many-{i}-{text}" for i, text in enumerate(HOSTILE_STRINGS)]
        ids += [f"many-plain-{i}" for i in range(200)]
        results = await append_many(store, [([started(i, tenant=f"t{n % 3}")], 0)
                                            for n, i in enumerate(ids)])
        assert results == [None] * len(ids)
        for n, execution_id in enumerate(ids):
            assert await store.read(execution_id) == [started(execution_id,
                                                              tenant=f"t{n % 3}")]
        listed = await store.list_executions(tenant="t1", limit=1000)
        assert sorted(row.execution_id for row in listed) == sorted(
            i for n, i in enumerate(ids) if n % 3 == 1)
        twice = await append_many(store, [([started(ids[0])], 0), ([started(ids[0])], 0)])
        assert all(isinstance(r, (DuplicateSequenceError, StaleFenceError)) for r in twice)

    # -- fences --------------------------------------------------------------

    async def test_acquire_bumps_token_and_stale_append_is_refused(
            self, store: EventStore) -> None:
        events = await _log(store, "f", 1)
        first = await store.acquire_fence("f", holder="w1", lease_ms=60_000)
        second = await store.acquire_fence("f", holder="w2", lease_ms=60_000)
        assert second.token > first.token >= 1
        assert (second.holder, second.execution_id) == ("w2", "f")
        with pytest.raises(StaleFenceError) as refused:
            await store.append(make_event("f", 1), fence=first.token)
        assert (refused.value.presented, refused.value.current) == (first.token, second.token)
        with pytest.raises(StaleFenceError):
            await store.append_batch([make_event("f", 1), make_event("f", 2)],
                                     fence=first.token)
        with pytest.raises(StaleFenceError):
            await store.append(make_event("f", 1), fence=second.token + 1)  # a future token
        assert await store.read("f") == events
        await store.append(make_event("f", 1), fence=second.token)
        await store.append(make_event("f", 2), fence=None)  # unfenced: the sequence arbitrates
        assert await store.head("f") == 2
        summary = await store.get_execution("f")
        assert summary is not None
        assert (summary.fence, summary.holder) == (second.token, "w2")
        assert summary.lease_expires_at == second.lease_expires_at

    async def test_fence_before_log_exists(self, store: EventStore) -> None:
        grant = await store.acquire_fence("early", holder="w", lease_ms=60_000)
        assert grant.token >= 1
        with pytest.raises(StaleFenceError):
            await store.append(started("early"), fence=grant.token - 1)
        assert await store.head("early") is None
        await store.append(started("early"), fence=grant.token)
        assert await store.head("early") == 0

    async def test_acquire_fence_if_respects_a_live_lease(self, store: EventStore) -> None:
        held = await store.acquire_fence("l", holder="w1", lease_ms=self.lease_ms)
        assert await store.acquire_fence_if("l", holder="w2", lease_ms=self.lease_ms) is None
        await self.pass_time(self.lease_ms * 3)
        taken = await store.acquire_fence_if("l", holder="w2", lease_ms=60_000)
        assert taken is not None
        assert taken.token == held.token + 1
        assert taken.holder == "w2"
        assert await store.acquire_fence_if("l", holder="w3", lease_ms=60_000) is None
        fresh = await store.acquire_fence_if("never-fenced", holder="w", lease_ms=1000)
        assert fresh is not None
        assert fresh.token >= 1

    async def test_renew_and_release_refuse_stale_tokens(self, store: EventStore) -> None:
        old = await store.acquire_fence("r", holder="w1", lease_ms=self.lease_ms)
        new = await store.acquire_fence("r", holder="w2", lease_ms=self.lease_ms)
        assert await store.renew_lease("r", old.token, lease_ms=60_000) is False
        assert await store.release_fence("r", old.token) is False
        assert await store.renew_lease("r", 0, lease_ms=60_000) is False
        assert await store.renew_lease("nobody", 1, lease_ms=60_000) is False
        assert await store.release_fence("nobody", 1) is False
        assert await store.renew_lease("r", new.token, lease_ms=60_000) is True
        await self.pass_time(self.lease_ms * 3)  # outlives the first lease: the renewal holds
        assert await store.acquire_fence_if("r", holder="w3", lease_ms=1000) is None
        assert await store.release_fence("r", new.token) is True
        again = await store.acquire_fence_if("r", holder="w3", lease_ms=1000)
        assert again is not None
        assert again.token == new.token + 1
        assert await store.release_fence("r", new.token) is False

    async def test_negative_lease_is_refused(self, store: EventStore) -> None:
        with pytest.raises(ValidationError):
            await store.acquire_fence("n", holder="w", lease_ms=-1)

    async def test_interleaved_writers_keep_the_log_contiguous(self, store: EventStore) -> None:
        # Seeded so a failure replays: writers take the fence over each other and
        # append at the head they believe in; only the current holder may land.
        rng = random.Random(116)
        await store.append(started("race"))
        tokens: dict[str, int] = {}
        current = 0
        outcomes = {"landed": 0, "stale": 0, "taken": 0}
        for _ in range(80):
            writer = f"w{rng.randrange(4)}"
            if writer not in tokens or rng.random() < 0.2:
                current = (await store.acquire_fence("race", holder=writer,
                                                     lease_ms=60_000)).token
                tokens[writer] = current
            head = await store.head("race")
            assert head is not None
            slot = head + 1 - (rng.random() < 0.2)  # sometimes a stale view of the head
            try:
                await store.append(make_event("race", slot), fence=tokens[writer])
            except StaleFenceError:
                assert tokens[writer] != current
                outcomes["stale"] += 1
            except DuplicateSequenceError:
                assert tokens[writer] == current
                assert slot <= head
                outcomes["taken"] += 1
            else:
                assert tokens[writer] == current
                assert slot == head + 1
                outcomes["landed"] += 1
        log = await store.read("race")
        assert [e.sequence for e in log] == list(range(len(log)))
        assert len(log) == outcomes["landed"] + 1
        assert min(outcomes.values()) > 0, outcomes  # the schedule exercised every path

    # -- the conditional append (ADR 0116 Q1) -----------------------------------

    async def _observe(self, store: EventStore, execution_id: str) -> TipObservation:
        result = await store.append_if_unchanged(execution_id, None)
        assert result.appended is False
        return result.tip

    async def test_conditional_observe_writes_nothing(self, store: EventStore) -> None:
        await _log(store, "o", 2, timestamp=T0 + 7)
        grant = await store.acquire_fence("o", holder="w", lease_ms=60_000)
        result = await store.append_if_unchanged("o", None)
        assert (result.appended, result.reason) == (False, "observed")
        assert (result.tip.head, result.tip.fence) == (1, grant.token)
        assert result.tip.anchor is not None
        assert await store.head("o") == 1
        assert (await self._observe(store, "o")).anchor == result.tip.anchor
        missing = await store.append_if_unchanged("missing", None)
        assert (missing.reason, missing.tip.head, missing.tip.anchor) == ("gone", None, None)

    async def test_conditional_unchanged_appends(self, store: EventStore) -> None:
        await _log(store, "u", 3)
        tip = await self._observe(store, "u")
        event = make_event("u", 3, E.OUTCOME_RECORDED)
        result = await store.append_if_unchanged("u", event, tip)
        assert (result.appended, result.reason) == (True, None)
        assert (result.tip.head, result.tip.fence, result.tip.anchor) == (3, tip.fence,
                                                                            tip.anchor)
        assert (await store.read("u", after=2)) == [event]

    async def test_conditional_moved_when_head_changed(self, store: EventStore) -> None:
        await _log(store, "m", 2)
        tip = await self._observe(store, "m")
        await store.append(make_event("m", 2))
        result = await store.append_if_unchanged("m", make_event("m", 2, E.OUTCOME_RECORDED),
                                                 tip)
        assert (result.appended, result.reason, result.tip.head) == (False, "moved", 2)
        late = await store.append_if_unchanged("m", make_event("m", 3, E.OUTCOME_RECORDED),
                                               tip)  # right slot now, stale observation
        assert (late.appended, late.reason) == (False, "moved")
        assert [e.type for e in await store.read("m", after=1)] == [E.STEP_COMPLETED]

    async def test_conditional_moved_when_fence_acquired_after_observation(
            self, store: EventStore) -> None:
        await _log(store, "mf", 2)
        tip = await self._observe(store, "mf")
        grant = await store.acquire_fence("mf", holder="reopener", lease_ms=60_000)
        result = await store.append_if_unchanged(
            "mf", make_event("mf", 2, E.OUTCOME_RECORDED), tip)
        assert (result.appended, result.reason) == (False, "moved")
        assert (result.tip.head, result.tip.fence) == (1, grant.token)
        await store.append(make_event("mf", 2), fence=grant.token)  # the holder's slot is free

    async def test_conditional_moved_when_log_recreated(self, store: EventStore) -> None:
        await _log(store, "aba", 1, timestamp=T0)
        tip = await self._observe(store, "aba")
        assert await store.delete_execution("aba") is True
        await _log(store, "aba", 1, timestamp=T0 + 1000)  # same id, head and token
        now = await self._observe(store, "aba")
        assert (now.head, now.fence) == (tip.head, tip.fence)
        assert now.anchor != tip.anchor
        result = await store.append_if_unchanged(
            "aba", make_event("aba", 1, E.OUTCOME_RECORDED), tip)
        assert (result.appended, result.reason) == (False, "moved")
        assert await store.head("aba") == 0

    async def test_conditional_gone_leaves_no_orphan(self, store: EventStore) -> None:
        await _log(store, "g", 2)
        tip = await self._observe(store, "g")
        await store.delete_execution("g")
        result = await store.append_if_unchanged("g", make_event("g", 2, E.OUTCOME_RECORDED),
                                                 tip)
        assert (result.appended, result.reason, result.tip.head) == (False, "gone", None)
        never = TipObservation(head=None, fence=0, anchor=None)
        refused = await store.append_if_unchanged("never", started("never"), never)
        assert (refused.appended, refused.reason) == (False, "gone")
        for execution_id in ("g", "never"):
            assert await store.read(execution_id) == []
            assert await store.head(execution_id) is None
            assert await store.get_execution(execution_id) is None
        assert await store.list_executions() == []

    async def test_real_token_survives_delete_as_tombstone(self, store: EventStore) -> None:
        await _log(store, "tomb", 1)
        zombie = await store.acquire_fence("tomb", holder="zombie", lease_ms=60_000)
        assert await store.delete_execution("tomb") is True
        gone = await store.append_if_unchanged("tomb", None)
        assert (gone.reason, gone.tip.head, gone.tip.fence) == ("gone", None, zombie.token)
        await store.append(started("tomb"))  # re-created under the same id
        with pytest.raises(StaleFenceError):
            await store.append(make_event("tomb", 1), fence=zombie.token - 1)
        successor = await store.acquire_fence("tomb", holder="new", lease_ms=60_000)
        assert successor.token > zombie.token
        with pytest.raises(StaleFenceError):
            await store.append(make_event("tomb", 1), fence=zombie.token)
        assert await store.head("tomb") == 0

    async def test_conditional_compares_the_token_never_presents_it(
            self, store: EventStore) -> None:
        await _log(store, "tok", 2)
        holder = await store.acquire_fence("tok", holder="w", lease_ms=60_000)
        tip = await self._observe(store, "tok")
        assert tip.fence == holder.token
        result = await store.append_if_unchanged(
            "tok", make_event("tok", 2, E.OUTCOME_RECORDED), tip)
        assert result.appended
        assert result.tip.fence == holder.token
        assert (await self._observe(store, "tok")).fence == holder.token
        await store.append(make_event("tok", 3), fence=holder.token)  # holder unaffected
        assert await store.renew_lease("tok", holder.token, lease_ms=60_000) is True
        assert (await store.acquire_fence("tok", holder="x", lease_ms=1)).token == (
            holder.token + 1)
        unfenced = await self._observe(store, "tok")
        stale = TipObservation(head=unfenced.head, fence=holder.token, anchor=unfenced.anchor)
        refused = await store.append_if_unchanged(
            "tok", make_event("tok", 4, E.OUTCOME_RECORDED), stale)
        assert (refused.appended, refused.reason) == (False, "moved")

    async def test_conditional_requires_the_next_slot(self, store: EventStore) -> None:
        await _log(store, "slot", 3)
        tip = await self._observe(store, "slot")
        for sequence in (1, 2, 4, 9):
            result = await store.append_if_unchanged(
                "slot", make_event("slot", sequence, E.OUTCOME_RECORDED), tip)
            assert (result.appended, result.reason) == (False, "moved"), sequence
        assert await store.head("slot") == 2
        with pytest.raises(ValidationError):
            await store.append_if_unchanged("slot", make_event("other", 3), tip)
        with pytest.raises(ValidationError):  # a write needs the observation it is judged by
            await store.append_if_unchanged("slot", make_event("slot", 3))
        assert await store.head("slot") == 2

    async def test_concurrent_conditional_appends_exactly_one_wins(
            self, store: EventStore) -> None:
        await _log(store, "cc", 2)
        tip = await self._observe(store, "cc")
        results = await asyncio.gather(*(
            store.append_if_unchanged("cc", make_event(
                "cc", 2, E.OUTCOME_RECORDED, {"key": f"k{i}"}), tip) for i in range(8)))
        assert sum(r.appended for r in results) == 1
        assert sorted(str(r.reason) for r in results) == ["None"] + ["moved"] * 7
        log = await store.read("cc")
        assert len(log) == 3
        winner = next(i for i, r in enumerate(results) if r.appended)
        assert log[2].payload["key"] == f"k{winner}"

    # -- delete and the index ---------------------------------------------------

    async def test_delete_execution(self, store: EventStore) -> None:
        await _log(store, "d", 2)
        kept = await _log(store, "keep", 2)
        await store.append(make_event("d", 2, E.TIMER_SCHEDULED, {"timerId": "t",
                                                                  "dueAt": T0}))
        assert await store.delete_execution("d") is True
        assert await store.delete_execution("d") is False
        assert await store.delete_execution("never") is False
        assert await store.read("d") == []
        assert await store.head("d") is None
        assert await store.get_execution("d") is None
        assert [s.execution_id for s in await store.list_executions()] == ["keep"]
        assert await store.due_timers(T0 + 10**9) == []
        assert await store.read("keep") == kept
        await store.append(started("d"))  # the id is free again
        assert await store.head("d") == 0

    async def test_compact_through_keeps_zero_and_the_tail(self, store: EventStore) -> None:
        events = await _log(store, "c", 6)
        other = await _log(store, "other", 3)
        assert await store.compact_through("c", 3) == 3
        assert _wire(await store.read("c")) == _wire([events[0], *events[4:]])
        assert _wire(await store.read("c", after=1)) == _wire(events[4:])
        # The head is the high-water mark: it does not move back.
        assert await store.head("c") == 5
        assert (await store.append_if_unchanged("c", None)).tip.head == 5
        assert _wire(await store.read("other")) == _wire(other)
        # Compacting again drops only what is left below the mark.
        assert await store.compact_through("c", 4) == 1
        assert await store.compact_through("never", 4) == 0

    async def test_compacted_slots_are_never_written_again(self, store: EventStore) -> None:
        events = await _log(store, "c", 4)
        await store.compact_through("c", 3)  # drops every event but 0
        with pytest.raises(DuplicateSequenceError):
            await store.append(make_event("c", 2))
        with pytest.raises(DuplicateSequenceError):
            await store.append(make_event("c", 3))
        assert _wire(await store.read("c")) == [_wire(events)[0]]
        await store.append(make_event("c", 4))
        assert [e.sequence for e in await store.read("c")] == [0, 4]

    async def test_index_follows_the_events(self, store: EventStore) -> None:
        x = "idx"
        await store.append(started(x, flow_id="onboard", tenant="t1", owner="bob",
                                   timestamp=T0))
        s = await store.get_execution(x)
        assert s is not None
        assert (s.flow_id, s.tenant, s.owner, s.status, s.waiting_on, s.head) == (
            "onboard", "t1", "bob", "running", None, 0)
        assert (s.started_at, s.updated_at, s.fence, s.holder) == (T0, T0, 0, None)
        later = ["later"]
        steps: list[tuple[EventType, dict[str, Any], str, str | None, list[str]]] = [
            (E.TIMER_SCHEDULED, {"timerId": "nap", "dueAt": T0 + 500}, "running", None,
             ["nap"]),
            (E.EXECUTION_SUSPENDED, {"condition": {"on": "nap", "kind": "timer"}},
             "parked", "nap", ["nap"]),
            (E.TIMER_FIRED, {"timerId": "nap"}, "running", None, []),
            (E.TIMER_SCHEDULED, {"timerId": "later", "dueAt": T0 + 900}, "running", None,
             later),
            (E.EXECUTION_SUSPENDED, {"condition": {"on": "approval"}}, "parked", "approval",
             later),
            (E.OUTCOME_RECORDED, {}, "parked", "approval", later),
            # Only sequence 0 starts an execution; a later STARTED moves nothing.
            (E.EXECUTION_STARTED, {"flowId": "other", "flowVersion": 2, "flowHash": "h"},
             "parked", "approval", later),
            (E.EXECUTION_RESUMED, {"gate": "approval"}, "running", None, later),
            (E.EXECUTION_COMPLETED, {"output": 1}, "completed", None, []),
            (E.OUTCOME_RECORDED, {}, "completed", None, []),
        ]
        for sequence, (kind, payload, status, waiting_on, timers) in enumerate(steps, 1):
            await store.append(make_event(x, sequence, kind, payload, timestamp=T0 + sequence))
            s = await store.get_execution(x)
            assert s is not None
            assert (s.status, s.waiting_on, s.head) == (status, waiting_on, sequence), kind
            assert (s.updated_at, s.started_at, s.flow_id) == (T0 + sequence, T0, "onboard")
            due = [t.timer_id for t in await store.due_timers(T0 + 10**6)]
            assert due == timers, (sequence, kind)

    async def test_terminal_statuses(self, store: EventStore) -> None:
        for kind, status in ((E.EXECUTION_FAILED, "failed"),
                             (E.EXECUTION_CANCELLED, "cancelled"),
                             (E.EXECUTION_CONTINUED, "continued")):
            x = f"term-{status}"
            await store.append_batch([
                started(x), make_event(x, 1, E.TIMER_SCHEDULED, {"timerId": "t",
                                                                 "dueAt": T0}),
                make_event(x, 2, E.EXECUTION_SUSPENDED), make_event(x, 3, kind)])
            s = await store.get_execution(x)
            assert s is not None
            assert (s.status, s.waiting_on, s.head) == (status, None, 3)
        assert await store.due_timers(T0 + 10**6) == []

    async def test_list_executions_filters(self, store: EventStore) -> None:
        await store.append_batch([started("a", flow_id="x", tenant="t1", timestamp=T0 + 10)])
        await store.append_batch([started("b", flow_id="y", tenant="t2", timestamp=T0),
                                  make_event("b", 1, E.EXECUTION_SUSPENDED,
                                             timestamp=T0 + 20)])
        await store.append_batch([started("c", flow_id="x", tenant="t2", timestamp=T0),
                                  make_event("c", 1, E.EXECUTION_COMPLETED,
                                             timestamp=T0 + 30)])
        await store.append_batch([started("d", flow_id="x", tenant=None, timestamp=T0 + 40)])

        async def ids(**filters: Any) -> list[str]:
            return [s.execution_id for s in await store.list_executions(**filters)]

        assert await ids() == ["a", "b", "c", "d"]
        assert await ids(status="running") == ["a", "d"]
        assert await ids(status="parked") == ["b"]
        assert await ids(status="completed", flow_id="x") == ["c"]
        assert await ids(flow_id="x") == ["a", "c", "d"]
        assert await ids(flow_id="nope") == []
        assert await ids(tenant="t2") == ["b", "c"]
        assert await ids(waiting_on="approval") == ["b"]
        assert await ids(waiting_on="other") == []
        assert await ids(updated_before=T0 + 20) == ["a"]
        assert await ids(updated_after=T0 + 20) == ["c", "d"]
        assert await ids(updated_after=T0 + 10, updated_before=T0 + 40) == ["b", "c"]
        assert await ids(after_id="b") == ["c", "d"]
        assert await ids(limit=2) == ["a", "b"]
        assert await ids(after_id="b", limit=1) == ["c"]
        assert await ids(limit=0) == []
        with pytest.raises(ValidationError):
            await store.list_executions(limit=-1)

    async def test_list_executions_by_lease(self, store: EventStore) -> None:
        for x in ("held", "free", "released"):
            await store.append(started(x))
        grant = await store.acquire_fence("held", holder="w", lease_ms=60_000)
        released = await store.acquire_fence("released", holder="w", lease_ms=60_000)
        await store.release_fence("released", released.token)
        expires = grant.lease_expires_at

        async def ids(at: int) -> list[str]:
            return [s.execution_id for s in await store.list_executions(lease_expired_at=at)]

        assert await ids(expires - 1) == ["free", "released"]
        assert await ids(expires) == ["free", "held", "released"]
        (held,) = [s for s in await store.list_executions() if s.execution_id == "held"]
        assert (held.fence, held.holder, held.lease_expires_at) == (grant.token, "w", expires)
        rel = await store.get_execution("released")
        assert rel is not None
        assert (rel.fence, rel.lease_expires_at) == (released.token, None)

    async def test_due_timers_order_and_limit(self, store: EventStore) -> None:
        # Ties on due_at break by execution id, then timer id (not timer id first).
        plan = {"p": [("t2", 300), ("t9", 100)], "q": [("t5", 200), ("t1", 100)],
                "r": [("late", 10**7)]}
        for x, timers in plan.items():
            await store.append(started(x))
            for sequence, (timer_id, offset) in enumerate(timers, start=1):
                await store.append(make_event(x, sequence, E.TIMER_SCHEDULED,
                                              {"timerId": timer_id, "dueAt": T0 + offset}))
        due = await store.due_timers(T0 + 300)
        assert [(t.execution_id, t.timer_id, t.due_at - T0) for t in due] == [
            ("p", "t9", 100), ("q", "t1", 100), ("q", "t5", 200), ("p", "t2", 300)]
        first_two = await store.due_timers(T0 + 300, limit=2)
        assert [(t.execution_id, t.timer_id) for t in first_two] == [("p", "t9"), ("q", "t1")]
        assert await store.due_timers(T0 + 99) == []
        assert await store.due_timers(T0 + 300, limit=0) == []
        await store.append(make_event("q", 3, E.TIMER_FIRED, {"timerId": "t1"}))
        assert [t.timer_id for t in await store.due_timers(T0 + 100)] == ["t9"]

    async def test_hostile_strings_round_trip(self, store: EventStore) -> None:
        for i, text in enumerate(HOSTILE_STRINGS):
            x = f"{text}#{i}"
            flow, tenant = f"flow {text}", f"tenant {text}"
            event = started(x, flow_id=flow, tenant=tenant, owner=text)
            await store.append(event)
            assert await store.read(x) == [event]
            s = await store.get_execution(x)
            assert s is not None
            assert (s.execution_id, s.flow_id, s.tenant, s.owner) == (
                x, flow, tenant, text)
            assert [r.execution_id for r in await store.list_executions(flow_id=flow)] == [x]
            assert [r.execution_id for r in await store.list_executions(tenant=tenant)] == [x]
            grant = await store.acquire_fence(x, holder=text, lease_ms=60_000)
            await store.append(make_event(x, 1, E.EXECUTION_SUSPENDED,
                                          {"condition": {"on": text}}), fence=grant.token)
            assert [r.execution_id for r in await store.list_executions(waiting_on=text)] == [x]
            tip = await self._observe(store, x)
            result = await store.append_if_unchanged(x, make_event(x, 2, E.OUTCOME_RECORDED),
                                                     tip)
            assert result.appended
        assert await store.head("x") is None  # nothing leaked into a neighbouring id
        assert len(await store.list_executions(limit=1000)) == len(HOSTILE_STRINGS)


class SnapshotStoreConformance(SnapshotValueConformance):
    """The ``SnapshotStore`` contract; subclass it and provide ``snapshot_store``."""

    async def test_save_load_overwrite_delete(self, snapshot_store: SnapshotStore) -> None:
        state: dict[str, Any] = {"status": "running", "steps": {"a": [1, 2.5, None]},
                                 "note": "ünï 🚀 '\";", "big": 2**53}
        assert await snapshot_store.load("s1") is None
        await snapshot_store.save(Snapshot("s1", 4, state))
        await snapshot_store.save(Snapshot("s2", 1, {"other": True}))
        loaded = await snapshot_store.load("s1")
        assert loaded == Snapshot("s1", 4, state)
        state["status"] = "mutated after save"
        again = await snapshot_store.load("s1")
        assert again is not None
        assert again.state["status"] == "running"
        await snapshot_store.save(Snapshot("s1", 9, {"status": "completed"}))
        assert await snapshot_store.load("s1") == Snapshot("s1", 9, {"status": "completed"})
        await snapshot_store.delete("s1")
        assert await snapshot_store.load("s1") is None
        await snapshot_store.delete("s1")  # deleting nothing is not an error
        assert await snapshot_store.load("s2") == Snapshot("s2", 1, {"other": True})

    async def test_hostile_ids(self, snapshot_store: SnapshotStore) -> None:
        for i, text in enumerate(HOSTILE_STRINGS):
            await snapshot_store.save(Snapshot(text, i, {"id": text}))
        for i, text in enumerate(HOSTILE_STRINGS):
            assert await snapshot_store.load(text) == Snapshot(text, i, {"id": text})

    async def test_non_json_state_is_refused(self, snapshot_store: SnapshotStore) -> None:
        with pytest.raises(ValidationError):
            await snapshot_store.save(Snapshot("bad", 1, {"when": {1, 2}}))
        assert await snapshot_store.load("bad") is None
