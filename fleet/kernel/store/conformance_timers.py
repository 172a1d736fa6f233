"""The conformance kit's timer claims (decision 0048): ``claims.claim_due_timers``.

Run through ``claims.claim_due_timers``, so a store that implements
``ClaimsTimers`` (Postgres: one statement) is held to the same answers as the
fallback every other store gets. Included in ``EventStoreConformance``.
"""

from __future__ import annotations

import asyncio

import pytest

from fleet.kernel.errors import DuplicateSequenceError, ValidationError
from fleet.kernel.events import EventType
from fleet.kernel.store.claims import ClaimedTimer, claim_due_timers
from fleet.kernel.store.conformance_events import T0, make_event, started
from fleet.kernel.store.spi import EventStore, ReleasingAppend, append_many

E = EventType


async def _sleeping(store: EventStore, execution_id: str, due: int, *, on: str = "t",
                    kind: str = "timer", tenant: str | None = "acme",
                    timer: str = "t") -> None:
    """A log parked on its timer ``t`` due at ``T0 + due`` (or on ``on``, ``kind``)."""
    condition: dict[str, object] = {"on": on, "kind": kind}
    if kind == "first":
        condition["waits"] = [{"on": "approval", "kind": "gate"}, {"on": timer, "kind": "timer"}]
    await store.append_batch([
        started(execution_id, flow_id="napper", tenant=tenant),
        make_event(execution_id, 1, E.TIMER_SCHEDULED, {"timerId": timer, "dueAt": T0 + due}),
        make_event(execution_id, 2, E.EXECUTION_SUSPENDED, {"condition": condition})])


def _fired(claim: ClaimedTimer) -> ReleasingAppend:
    return ReleasingAppend([make_event(claim.execution_id, claim.head + 1, E.TIMER_FIRED,
                                       {"timerId": claim.timer_id})], fence=claim.grant.token)


class TimerClaimConformance:
    """What ``claim_due_timers`` must do on every store."""

    async def test_a_claim_takes_the_due_timers_waited_on_and_free(self, store: EventStore,
                                                                   ) -> None:
        await _sleeping(store, "tc-due", 10)
        await _sleeping(store, "tc-early", 5, tenant=None)
        await _sleeping(store, "tc-later", 1_000)                  # not due yet
        # A race's timer: the index names the race (first#0), not the timer (decision 0033).
        await _sleeping(store, "tc-race", 20, on="first#0", kind="first", timer="timeout#0")
        await _sleeping(store, "tc-held", 10)
        # A flow's deadline is never claimed: it fails the execution instead.
        await _sleeping(store, "tc-deadline", 3, on="approval", kind="gate",
                        timer="__fleet_deadline__")
        held = await store.acquire_fence("tc-held", holder="worker", lease_ms=60_000)
        claims = await claim_due_timers(store, T0 + 100, holder="timers-1", lease_ms=60_000)
        assert [(c.execution_id, c.timer_id, c.due_at - T0, c.head, c.flow_id, c.tenant)
                for c in claims] == [("tc-early", "t", 5, 2, "napper", None),
                                     ("tc-due", "t", 10, 2, "napper", "acme"),
                                     ("tc-race", "timeout#0", 20, 2, "napper", "acme")]
        for claim in claims:
            assert (claim.grant.execution_id, claim.grant.holder) == (claim.execution_id,
                                                                      "timers-1")
            summary = await store.get_execution(claim.execution_id)
            assert summary is not None
            assert (summary.fence, summary.holder) == (claim.grant.token, "timers-1")
        # Held now: a second claimer gets nothing, and the worker's lease was not touched.
        assert await claim_due_timers(store, T0 + 100, holder="timers-2",
                                      lease_ms=60_000) == []
        assert await store.release_fence("tc-held", held.token)
        # Fired under the grants (and released): the timers are gone from the index.
        assert await append_many(store, [_fired(c) for c in claims]) == [None, None, None]
        for claim in claims:
            assert [e.type for e in await store.read(claim.execution_id, after=2)] == [
                E.TIMER_FIRED]
            summary = await store.get_execution(claim.execution_id)
            assert summary is not None
            assert (summary.status, summary.lease_expires_at) == ("running", None)
        again = await claim_due_timers(store, T0 + 100, holder="timers-2", lease_ms=60_000)
        assert [c.execution_id for c in again] == ["tc-held"]  # free now, still parked on t

    async def test_concurrent_claims_divide_the_due_timers(self, store: EventStore) -> None:
        ids = [f"tc-many-{i:02d}" for i in range(12)]
        for i, execution_id in enumerate(ids):
            await _sleeping(store, execution_id, i)
        answers = await asyncio.gather(*(
            claim_due_timers(store, T0 + 100, holder=f"timers-{n}", lease_ms=60_000, limit=8)
            for n in range(3)))
        claimed = [c.execution_id for answer in answers for c in answer]
        assert sorted(claimed) == ids  # every one once, none twice
        assert all(len(answer) <= 8 for answer in answers)

    async def test_the_limit_takes_the_earliest(self, store: EventStore) -> None:
        for i in range(5):
            await _sleeping(store, f"tc-lim-{i}", 50 - i)
        claims = await claim_due_timers(store, T0 + 100, holder="timers", lease_ms=60_000,
                                        limit=2)
        assert [c.execution_id for c in claims] == ["tc-lim-4", "tc-lim-3"]
        assert await claim_due_timers(store, T0 + 100, holder="timers", lease_ms=60_000,
                                      limit=0) == []
        with pytest.raises(ValidationError):
            await claim_due_timers(store, T0 + 100, holder="timers", lease_ms=60_000,
                                   limit=-1)
        with pytest.raises(ValidationError):
            await claim_due_timers(store, T0 + 100, holder="timers", lease_ms=-5)

    async def test_a_claim_whose_execution_moved_fires_nothing(self, store: EventStore,
                                                               ) -> None:
        await _sleeping(store, "tc-moved", 10)
        [claim] = await claim_due_timers(store, T0 + 100, holder="timers", lease_ms=60_000)
        # An unfenced audit lands at head + 1 after the claim read the head.
        await store.append(make_event("tc-moved", 3, E.EMITTED,
                                      {"type": "audit", "payload": None}))
        [answer] = await append_many(store, [_fired(claim)])
        assert isinstance(answer, DuplicateSequenceError)
        assert [e.type for e in await store.read("tc-moved", after=2)] == [E.EMITTED]
