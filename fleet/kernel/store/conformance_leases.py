"""The conformance kit's leased writes (decision 0029): a write that takes the fence, one
that ends it, and both among the requests of one ``append_many`` (group commit).

Run through ``spi.append_acquiring`` / ``spi.append_releasing`` / ``spi.append_many``,
so a store that implements ``AppendsLeased`` / ``AppendsManyLeased`` is held to them,
and one that does not is held to the same answers through the separate calls.
Included in ``EventStoreConformance``.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import pytest

from fleet.kernel.errors import (
    DuplicateSequenceError,
    SequenceGapError,
    StaleFenceError,
    ValidationError,
)
from fleet.kernel.events import EventType
from fleet.kernel.store.conformance_events import make_event, started
from fleet.kernel.store.spi import (
    APPEND_LEASED,
    AcquiringAppend,
    EventStore,
    ExecutionSummary,
    FenceGrant,
    ManyRequest,
    ReleasingAppend,
    append_acquiring,
    append_many,
    append_releasing,
    capabilities_of,
)


class LeaseConformance:
    """What ``append_acquiring`` and ``append_releasing`` must do on every store."""

    lease_ms: ClassVar[int] = 250

    async def pass_time(self, ms: int) -> None:
        await asyncio.sleep(ms / 1000)

    async def _free(self, store: EventStore, execution_id: str) -> int | None:
        """The token another holder would get now, or None while a live lease is held
        (that holder then releases at once)."""
        grant = await store.acquire_fence_if(execution_id, holder="probe", lease_ms=60_000)
        if grant is None:
            return None
        assert await store.release_fence(execution_id, grant.token)
        return grant.token

    async def test_leased_append_takes_the_fence_with_the_write(self, store: EventStore,
                                                                ) -> None:
        events = [started("la"), make_event("la", 1)]
        grant = await append_acquiring(store, events, holder="w1", lease_ms=60_000)
        assert grant is not None
        assert (grant.execution_id, grant.holder) == ("la", "w1")
        assert grant.token >= 1
        assert await store.read("la") == events
        summary = await store.get_execution("la")
        assert summary is not None
        assert (summary.fence, summary.holder, summary.head) == (grant.token, "w1", 1)
        assert summary.lease_expires_at == grant.lease_expires_at
        # The token is the fence: the next write presents it.
        await store.append(make_event("la", 2), fence=grant.token)
        with pytest.raises(StaleFenceError):
            await store.append(make_event("la", 3), fence=grant.token - 1)

    async def test_leased_append_refused_while_another_holds_a_live_lease(
            self, store: EventStore) -> None:
        held = await store.acquire_fence("lb", holder="w1", lease_ms=60_000)
        assert await append_acquiring(store, [started("lb")], holder="w2",
                                      lease_ms=60_000) is None
        assert await store.head("lb") is None  # nothing written
        assert await store.acquire_fence_if("lb", holder="w3", lease_ms=1000) is None
        assert await store.release_fence("lb", held.token)  # w1 still held it
        # And over a log: a live lease of a leased writer refuses the next one too.
        grant = await append_acquiring(store, [started("lc")], holder="w1", lease_ms=60_000)
        assert grant is not None
        assert await append_acquiring(store, [make_event("lc", 1)], holder="w2",
                                      lease_ms=60_000) is None
        assert await store.head("lc") == 0
        summary = await store.get_execution("lc")
        assert summary is not None
        assert (summary.fence, summary.holder) == (grant.token, "w1")

    @staticmethod
    def _moved(store: EventStore) -> int:
        """How far a refused leased write moves the fence token: not at all on a store that
        declares ``APPEND_LEASED`` (one statement); by one through the separate calls a
        store without it is served by (the fence taken, the append refused, the fence
        released: no holder is left either way)."""
        return 0 if APPEND_LEASED in capabilities_of(store) else 1

    async def test_refused_leased_append_leaves_the_fence_as_it_was(
            self, store: EventStore) -> None:
        moved = self._moved(store)
        first = await append_acquiring(store, [started("ld")], holder="w1", lease_ms=60_000,
                                       release=True)
        assert first is not None
        for n, (events, error) in enumerate((([started("ld")], DuplicateSequenceError),
                                             ([make_event("ld", 5)], SequenceGapError)),
                                            start=1):
            with pytest.raises(error):
                await append_acquiring(store, events, holder="w2", lease_ms=60_000)
            summary = await store.get_execution("ld")
            assert summary is not None
            assert (summary.fence, summary.holder, summary.head) == (first.token + n * moved,
                                                                     None, 0)
        with pytest.raises(ValidationError):
            await append_acquiring(store, [make_event("ld", 1)], holder="w2", lease_ms=-1)
        # Nothing moved: the next holder gets the very next token.
        assert await self._free(store, "ld") == first.token + 1 + 2 * moved
        # A new execution whose first write is refused leaves no fence behind.
        with pytest.raises(SequenceGapError):
            await append_acquiring(store, [make_event("le", 1)], holder="w1", lease_ms=60_000)
        assert await store.head("le") is None
        assert await self._free(store, "le") == 1 + moved

    async def test_leased_append_with_release_writes_and_lets_go(
            self, store: EventStore) -> None:
        grant = await append_acquiring(store, [started("lf")], holder="w1", lease_ms=60_000,
                                       release=True)
        assert grant is not None
        assert await store.head("lf") == 0
        summary = await store.get_execution("lf")
        assert summary is not None
        assert (summary.fence, summary.holder, summary.lease_expires_at) == (grant.token,
                                                                             None, None)
        assert await self._free(store, "lf") == grant.token + 1

    async def test_releasing_append_ends_the_lease_of_its_holder_only(
            self, store: EventStore) -> None:
        grant = await append_acquiring(store, [started("lg")], holder="w1", lease_ms=60_000)
        assert grant is not None
        await append_releasing(store, [make_event("lg", 1), make_event("lg", 2)],
                               fence=grant.token)
        assert await store.head("lg") == 2
        summary = await store.get_execution("lg")
        assert summary is not None
        assert (summary.fence, summary.holder, summary.lease_expires_at) == (grant.token,
                                                                             None, None)
        # Superseded: a releasing append of the old holder writes nothing and ends
        # nothing of the new holder's lease.
        old = await store.acquire_fence("lh", holder="w1", lease_ms=60_000)
        await store.append(started("lh"), fence=old.token)
        new = await store.acquire_fence("lh", holder="w2", lease_ms=60_000)
        with pytest.raises(StaleFenceError):
            await append_releasing(store, [make_event("lh", 1)], fence=old.token)
        assert await store.head("lh") == 0
        assert await self._free(store, "lh") is None  # w2's lease still holds
        summary = await store.get_execution("lh")
        assert summary is not None
        assert (summary.fence, summary.holder) == (new.token, "w2")
        # A refused releasing append (a taken slot) ends nothing either.
        with pytest.raises(DuplicateSequenceError):
            await append_releasing(store, [started("lh")], fence=new.token)
        assert await self._free(store, "lh") is None

    async def test_a_crash_after_the_first_leased_write_leaves_a_lease_that_expires(
            self, store: EventStore) -> None:
        grant = await append_acquiring(store, [started("li"), make_event("li", 1)],
                                       holder="dead", lease_ms=self.lease_ms)
        assert grant is not None
        # The writer dies here. A sweeper finds the lease live, then expired.
        assert await store.acquire_fence_if("li", holder="sweeper", lease_ms=60_000) is None
        await self.pass_time(self.lease_ms * 3)
        taken = await store.acquire_fence_if("li", holder="sweeper", lease_ms=60_000)
        assert taken is not None
        assert taken.token == grant.token + 1
        # The dead holder, back, is fenced out: it writes and releases nothing.
        with pytest.raises(StaleFenceError):
            await append_releasing(store, [make_event("li", 2)], fence=grant.token)
        assert await store.head("li") == 1
        assert await store.release_fence("li", grant.token) is False
        summary = await store.get_execution("li")
        assert summary is not None
        assert (summary.fence, summary.holder) == (taken.token, "sweeper")

    async def test_concurrent_leased_starts_exactly_one_wins(self, store: EventStore) -> None:
        answers = await asyncio.gather(
            *(append_acquiring(store, [started("lj", owner=f"w{i}")], holder=f"w{i}",
                               lease_ms=60_000) for i in range(6)),
            return_exceptions=True)
        grants = [a for a in answers if a is not None and not isinstance(a, BaseException)]
        assert len(grants) == 1, answers
        for answer in answers:
            assert answer is None or answer is grants[0] \
                or isinstance(answer, DuplicateSequenceError), answer
        log = await store.read("lj")
        assert len(log) == 1
        summary = await store.get_execution("lj")
        assert summary is not None
        assert (summary.fence, summary.holder) == (grants[0].token, grants[0].holder)
        assert log[0].payload["owner"]["actor"] == grants[0].holder  # the winner's start

    # -- leased requests in one append_many (group commit) -----------------------

    async def _row(self, store: EventStore, execution_id: str) -> ExecutionSummary:
        summary = await store.get_execution(execution_id)
        assert summary is not None, execution_id
        return summary

    async def test_append_many_mixes_acquiring_plain_and_releasing_requests(
            self, store: EventStore) -> None:
        """One call carries starts that take the fence, writes under a held fence and
        ends that let it go, of several executions: each as its single call."""
        held = await append_acquiring(store, [started("mx-b")], holder="wb", lease_ms=60_000)
        assert held is not None
        requests: list[ManyRequest] = [
            AcquiringAppend([started("mx-a"), make_event("mx-a", 1)], "wa", 60_000),
            ([make_event("mx-b", 1)], held.token),
            AcquiringAppend([started("mx-c")], "wc", 60_000, release=True),
            ReleasingAppend([make_event("mx-b", 2),
                             make_event("mx-b", 3, EventType.EXECUTION_COMPLETED)], held.token),
            ([started("mx-d")], 0),
            # Taken and ended in one call: the release presents the token the acquiring
            # request before it takes (the first of a never-fenced execution).
            AcquiringAppend([started("mx-e")], "we", 60_000),
            ReleasingAppend([make_event("mx-e", 1)], 1),
        ]
        answers = await append_many(store, requests)
        assert len(answers) == len(requests)
        grant_a, grant_c, grant_e = answers[0], answers[2], answers[5]
        for grant, execution_id, holder in ((grant_a, "mx-a", "wa"), (grant_c, "mx-c", "wc"),
                                            (grant_e, "mx-e", "we")):
            assert isinstance(grant, FenceGrant), answers
            assert (grant.execution_id, grant.holder) == (execution_id, holder)
        assert isinstance(grant_a, FenceGrant)
        assert isinstance(grant_e, FenceGrant)
        assert grant_e.token == 1
        assert [answers[i] for i in (1, 3, 4, 6)] == [None] * 4, answers
        assert [e.sequence for e in await store.read("mx-a")] == [0, 1]
        assert [e.sequence for e in await store.read("mx-b")] == [0, 1, 2, 3]
        assert await store.read("mx-d") == [started("mx-d")]
        assert [e.sequence for e in await store.read("mx-e")] == [0, 1]
        # a holds its lease; b's and e's ended with their last write; c's with its start.
        row = await self._row(store, "mx-a")
        assert (row.fence, row.holder, row.head) == (grant_a.token, "wa", 1)
        assert row.lease_expires_at == grant_a.lease_expires_at
        assert await self._free(store, "mx-a") is None
        row = await self._row(store, "mx-b")
        assert (row.fence, row.holder, row.status, row.head) == (held.token, None,
                                                                 "completed", 3)
        for execution_id, token in (("mx-b", held.token), ("mx-e", 1)):
            assert await self._free(store, execution_id) == token + 1
        assert isinstance(grant_c, FenceGrant)
        row = await self._row(store, "mx-c")
        assert (row.fence, row.holder, row.lease_expires_at) == (grant_c.token, None, None)
        assert (await self._row(store, "mx-d")).fence == 0

    async def test_append_many_refuses_each_leased_request_alone(
            self, store: EventStore) -> None:
        """A stale fence, a live lease, a taken slot, a gap, a bad lease: each refuses its
        own request (nothing written, the fence as it was) while its neighbours land."""
        old = await store.acquire_fence("rf-stale", holder="w1", lease_ms=60_000)
        await store.append(started("rf-stale"), fence=old.token)
        new = await store.acquire_fence("rf-stale", holder="w2", lease_ms=60_000)
        live = await store.acquire_fence("rf-live", holder="w1", lease_ms=60_000)
        taken = await append_acquiring(store, [started("rf-taken")], holder="w1",
                                       lease_ms=60_000, release=True)
        assert taken is not None
        requests: list[ManyRequest] = [
            AcquiringAppend([started("rf-ok")], "w", 60_000),
            ReleasingAppend([make_event("rf-stale", 1)], old.token),  # superseded
            AcquiringAppend([started("rf-live")], "w3", 60_000),       # a live lease
            ([started("rf-plain")], 0),
            AcquiringAppend([started("rf-taken")], "w3", 60_000),      # the slot is taken
            AcquiringAppend([make_event("rf-gap", 1)], "w3", 60_000),  # a gap, new log
            AcquiringAppend([started("rf-bad")], "w3", -1),            # a bad lease
            ReleasingAppend([], 1),                                     # no events
            ReleasingAppend([make_event("rf-stale", 1)], new.token),   # after the stale one
        ]
        answers = await append_many(store, requests)
        assert isinstance(answers[0], FenceGrant), answers
        assert isinstance(answers[1], StaleFenceError), answers
        assert answers[2] is None, answers
        assert answers[3] is None, answers
        assert isinstance(answers[4], DuplicateSequenceError), answers
        assert isinstance(answers[5], SequenceGapError), answers
        assert isinstance(answers[6], ValidationError), answers
        assert isinstance(answers[7], ValidationError), answers
        assert answers[8] is None, answers
        # The neighbours landed.
        assert await store.head("rf-ok") == 0
        assert await store.head("rf-plain") == 0
        # The stale release wrote nothing and ended nothing of w2's lease; w2's did.
        assert [e.sequence for e in await store.read("rf-stale")] == [0, 1]
        assert await self._free(store, "rf-stale") == new.token + 1
        # The live lease: nothing written, w1 still holds it with its token.
        assert await store.head("rf-live") is None
        assert await self._free(store, "rf-live") is None
        assert await store.release_fence("rf-live", live.token)
        # The taken slot: the fence exactly as it was (released, same token).
        moved = self._moved(store)
        row = await self._row(store, "rf-taken")
        assert (row.fence, row.holder, row.lease_expires_at, row.head) == (
            taken.token + moved, None, None, 0)
        assert await self._free(store, "rf-taken") == taken.token + 1 + moved
        # The gap and the bad lease: no log, and no fence left behind.
        for execution_id, tokens in (("rf-gap", 1 + moved), ("rf-bad", 1)):
            assert await store.head(execution_id) is None
            assert await self._free(store, execution_id) == tokens

    async def test_append_many_answers_two_executions_in_either_key_order(
            self, store: EventStore) -> None:
        """Whatever order the store takes the rows in, each answer is its own request's."""
        lengths = {"a": 1, "b": 3}
        for order in ("ab", "ba"):
            ids = {name: f"ko-{order}-{name}" for name in "ab"}
            answers = await append_many(store, [AcquiringAppend(
                [started(ids[name])] + [make_event(ids[name], s)
                                        for s in range(1, lengths[name])],
                f"holder-{name}", 60_000) for name in order])
            grants = dict(zip(order, answers, strict=True))
            for name, grant in grants.items():
                assert isinstance(grant, FenceGrant), answers
                assert (grant.execution_id, grant.holder) == (ids[name], f"holder-{name}")
            ends: list[ManyRequest] = []
            for name in order:
                grant = grants[name]
                assert isinstance(grant, FenceGrant)
                ends.append(ReleasingAppend([make_event(ids[name], lengths[name])],
                                            grant.token))
                ends.append(ReleasingAppend([make_event(ids[name], lengths[name] + 1)],
                                            grant.token + 1))  # never held: stale
            answers = await append_many(store, ends)
            for n, name in enumerate(order):
                assert answers[2 * n] is None, answers
                assert isinstance(answers[2 * n + 1], StaleFenceError), answers
                assert await store.head(ids[name]) == lengths[name]
                row = await self._row(store, ids[name])
                assert (row.holder, row.lease_expires_at) == (None, None)

    async def test_concurrent_many_calls_in_opposite_orders_each_start_wins_once(
            self, store: EventStore) -> None:
        """Two calls race for the same executions, listed in opposite orders: each
        execution is taken by exactly one request; the others hear a live lease or a
        taken slot (no deadlock, nothing written twice)."""
        ids = [f"race-{n}" for n in range(6)]

        def starts(holder: str, order: list[str]) -> list[ManyRequest]:
            return [AcquiringAppend([started(i, owner=holder)], holder, 60_000)
                    for i in order]

        first, second = await asyncio.gather(
            append_many(store, starts("w1", ids)),
            append_many(store, starts("w2", ids[::-1])))
        answers = dict(zip(ids, first, strict=True))
        for execution_id, other in zip(ids[::-1], second, strict=True):
            mine = answers[execution_id]
            grants = [a for a in (mine, other) if isinstance(a, FenceGrant)]
            assert len(grants) == 1, (execution_id, mine, other)
            loser = other if grants[0] is mine else mine
            assert loser is None or isinstance(loser, DuplicateSequenceError), loser
            log = await store.read(execution_id)
            assert len(log) == 1
            assert log[0].payload["owner"]["actor"] == grants[0].holder
            row = await self._row(store, execution_id)
            assert (row.fence, row.holder) == (grants[0].token, grants[0].holder)
