"""The conformance kit's lease clock (decision 0044): leases are granted and judged on the
store's clock and bounded by the store's ``max_lease_ms`` (``spi``).

A lease whose expiry lies further out than ``now + max_lease_ms`` (a row written by a
clock that ran fast before this rule, or a forged one) is not honoured: every way of
taking a fence takes it over, and ``list_executions(lease_expired_at=)`` lists it, so the
sweeper finds it. A ``lease_ms`` over the bound is refused before anything is written.
Included in ``EventStoreConformance``.

``forge_lease`` makes such a row by moving the store's clock ahead and back with
``pass_time`` (the kit's fixtures inject a manual clock, kept in ``self.clock``; on
Postgres that clock replaces the server's). A fixture whose clock cannot move back
overrides it (an UPDATE of the fence row, say).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from fleet.kernel.errors import StaleFenceError, ValidationError
from fleet.kernel.store.conformance_events import make_event, started
from fleet.kernel.store.spi import (
    AcquiringAppend,
    EventStore,
    FenceGrant,
    append_acquiring,
    append_many,
    max_lease_of,
)

__all__ = ["LeaseClockConformance"]

_LEASE = 60_000


class LeaseClockConformance:
    """What every store does with the expiry of a lease (decision 0044)."""

    async def pass_time(self, ms: int) -> None:
        await asyncio.sleep(max(ms, 0) / 1000)  # a real clock cannot go back: see forge_lease

    async def forge_lease(self, store: EventStore, execution_id: str, *,
                          ahead_ms: int) -> FenceGrant:
        """Give ``execution_id`` a lease of ``_LEASE`` whose expiry lies ``ahead_ms``
        further out than the store would grant now: taken with the store's clock moved
        ahead, which is then moved back (a fixture that keeps its manual clock in
        ``self.clock``; any other overrides this)."""
        if getattr(self, "clock", None) is None:
            pytest.fail("forge_lease moves the store's clock back: keep the fixture's manual "
                        "clock in self.clock, or override forge_lease (e.g. UPDATE the fence "
                        "row)")
        await self.pass_time(ahead_ms)
        try:
            return await store.acquire_fence(execution_id, holder="fast-clock",
                                             lease_ms=_LEASE)
        finally:
            await self.pass_time(-ahead_ms)

    async def test_a_lease_longer_than_the_bound_is_refused_and_writes_nothing(
            self, store: EventStore) -> None:
        bound = max_lease_of(store)
        await store.append(started("lb-held"))
        held = await store.acquire_fence("lb-held", holder="w", lease_ms=1000)
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: store.acquire_fence("lb", holder="w", lease_ms=bound + 1),
            lambda: store.acquire_fence_if("lb", holder="w", lease_ms=bound + 1),
            lambda: append_acquiring(store, [started("lb")], holder="w", lease_ms=bound + 1),
            lambda: store.renew_lease("lb-held", held.token, lease_ms=bound + 1)]
        for call in calls:
            with pytest.raises(ValidationError, match="max_lease_ms"):
                await call()
        (answer,) = await append_many(store, [AcquiringAppend([started("lb")], "w",
                                                              bound + 1)])
        assert isinstance(answer, ValidationError), answer
        assert await store.head("lb") is None
        assert (await store.append_if_unchanged("lb", None)).tip.fence == 0  # never taken
        row = await store.get_execution("lb-held")
        assert row is not None
        assert row.lease_expires_at == held.lease_expires_at  # the renewal changed nothing
        # The bound itself is a lease like any other: granted, and live.
        longest = await store.acquire_fence("lb", holder="w", lease_ms=bound)
        assert await store.acquire_fence_if("lb", holder="w2", lease_ms=1000) is None
        assert await store.renew_lease("lb", longest.token, lease_ms=bound)
        assert await store.acquire_fence_if("lb", holder="w2", lease_ms=1000) is None

    async def test_a_lease_set_past_the_bound_is_taken_over_and_listed(
            self, store: EventStore) -> None:
        """Issue 25 item 8: an expiry far ahead pinned an execution until that time."""
        bound = max_lease_of(store)
        forged: dict[str, FenceGrant] = {}
        for x in ("fa", "fb", "fc", "fd"):
            await store.append(started(x))
            forged[x] = await self.forge_lease(store, x, ahead_ms=bound)
        await store.append(started("fl"))
        legit = await store.acquire_fence("fl", holder="w", lease_ms=_LEASE)
        now = legit.lease_expires_at - _LEASE  # the store's now (a manual clock: exact)
        assert forged["fa"].lease_expires_at > now + bound  # what the kit set out to make

        # The sweeper's listing finds them; not the execution whose lease is live.
        expired = {s.execution_id for s in await store.list_executions(lease_expired_at=now)}
        assert expired == {"fa", "fb", "fc", "fd"}
        # Every way of taking a fence takes them over; the live lease still refuses.
        taken = await store.acquire_fence_if("fa", holder="sweeper", lease_ms=_LEASE)
        assert taken is not None
        assert taken.token == forged["fa"].token + 1
        assert taken.lease_expires_at <= now + bound  # a lease the store itself bounds
        grant = await append_acquiring(store, [make_event("fb", 1)], holder="worker",
                                       lease_ms=_LEASE)
        assert grant is not None
        assert grant.token == forged["fb"].token + 1
        answers = await append_many(store, [
            AcquiringAppend([make_event("fc", 1)], "worker", _LEASE),
            AcquiringAppend([make_event("fl", 1)], "worker", _LEASE)])
        assert isinstance(answers[0], FenceGrant), answers
        assert answers[0].token == forged["fc"].token + 1
        assert answers[1] is None  # fl: a live lease is held, nothing written
        assert await store.head("fl") == 0
        assert await store.acquire_fence_if("fl", holder="w2", lease_ms=1000) is None
        # The forged holder is fenced out of every log it held.
        for x in ("fa", "fb", "fc"):
            with pytest.raises(StaleFenceError):
                await store.append(make_event(x, await _next(store, x)),
                                   fence=forged[x].token)
        # A renewal of a held lease brings it back within the bound (the holder's own).
        assert await store.renew_lease("fd", forged["fd"].token, lease_ms=_LEASE)
        assert await store.acquire_fence_if("fd", holder="sweeper", lease_ms=_LEASE) is None

    async def test_the_grant_says_the_expiry_the_store_set(self, store: EventStore) -> None:
        await store.append(started("gx"))
        grant = await store.acquire_fence("gx", holder="w", lease_ms=_LEASE)
        row = await store.get_execution("gx")
        assert row is not None
        assert row.lease_expires_at == grant.lease_expires_at
        assert (await store.append_if_unchanged("gx", None)).tip.lease_expires_at == (
            grant.lease_expires_at)
        await self.pass_time(100)
        assert await store.renew_lease("gx", grant.token, lease_ms=_LEASE)
        row = await store.get_execution("gx")
        assert row is not None
        assert row.lease_expires_at is not None
        assert row.lease_expires_at >= grant.lease_expires_at + 100  # now + lease, its clock


async def _next(store: EventStore, execution_id: str) -> int:
    head = await store.head(execution_id)
    assert head is not None
    return head + 1
