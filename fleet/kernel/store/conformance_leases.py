"""The conformance kit's leased writes (decision 0029): a write that takes the fence, one
that ends it.

Run through ``spi.append_acquiring`` / ``spi.append_releasing``, so a store that
implements ``AppendsLeased`` is held to it, and one that does not is held to the
same answers through the separate calls. Included in ``EventStoreConformance``.
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
from fleet.kernel.store.conformance_events import make_event, started
from fleet.kernel.store.spi import EventStore, append_acquiring, append_releasing


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

    async def test_refused_leased_append_leaves_the_fence_as_it_was(
            self, store: EventStore) -> None:
        first = await append_acquiring(store, [started("ld")], holder="w1", lease_ms=60_000,
                                       release=True)
        assert first is not None
        for events, error in (([started("ld")], DuplicateSequenceError),
                              ([make_event("ld", 5)], SequenceGapError)):
            with pytest.raises(error):
                await append_acquiring(store, events, holder="w2", lease_ms=60_000)
            summary = await store.get_execution("ld")
            assert summary is not None
            assert (summary.fence, summary.holder, summary.head) == (first.token, None, 0)
        with pytest.raises(ValidationError):
            await append_acquiring(store, [make_event("ld", 1)], holder="w2", lease_ms=-1)
        # Nothing moved: the next holder gets the very next token.
        assert await self._free(store, "ld") == first.token + 1
        # A new execution whose first write is refused leaves no fence behind.
        with pytest.raises(SequenceGapError):
            await append_acquiring(store, [make_event("le", 1)], holder="w1", lease_ms=60_000)
        assert await store.head("le") is None
        assert await self._free(store, "le") == 1

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
