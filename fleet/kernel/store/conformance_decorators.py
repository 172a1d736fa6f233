"""The conformance kit's decorator check (decision 0050): a store decorator that
overrides only ``append`` and ``append_batch`` sees every event the kernel writes.

``WriteWitness`` is such a decorator (what an encrypting, tenant-scoping or
auditing decorator looks like): it records each event that passes through its
``append`` / ``append_batch``. Every write the kernel makes goes through the
``spi`` helpers (``append_acquiring`` for a start or a worker's first write,
``append`` / ``append_batch`` within a run, ``append_releasing`` for a run's last
write, ``append_many`` for a batch of starts and for group commit); each test
below makes those calls on a witness over the store under test and checks that
the witness saw exactly the events the log holds. Included in
``EventStoreConformance``, so every backend and every decorator is held to it.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.store.conformance_events import make_event, started
from fleet.kernel.store.forwarding import ForwardingEventStore
from fleet.kernel.store.spi import (
    APPEND_LEASED,
    APPEND_MANY,
    APPEND_MANY_LEASED,
    WRITE_CAPABILITIES,
    AcquiringAppend,
    EventStore,
    FenceGrant,
    ReleasingAppend,
    append_acquiring,
    append_many,
    append_releasing,
    capabilities_of,
)

__all__ = ["DecoratorConformance", "WriteWitness"]


class WriteWitness(ForwardingEventStore):
    """A decorator that overrides only the two plain writes and records what they carry."""

    def __init__(self, inner: EventStore) -> None:
        super().__init__(inner)
        self.seen: list[str] = []  # event ids, in the order they reached this decorator

    async def append(self, event: EventEnvelope, *, fence: int | None = None) -> None:
        self.seen.append(event.id)
        await self.inner.append(event, fence=fence)

    async def append_batch(self, events: Sequence[EventEnvelope], *,
                           fence: int | None = None) -> None:
        self.seen.extend(event.id for event in events)
        await self.inner.append_batch(events, fence=fence)


async def _ids(store: EventStore, execution_id: str) -> list[str]:
    return [event.id for event in await store.read(execution_id)]


class DecoratorConformance:
    """What a decorator over every store must see: each write of a run."""

    async def test_a_decorator_that_changes_writes_declares_no_write_it_does_not_implement(
            self, store: EventStore) -> None:
        witness = WriteWitness(store)
        declared = capabilities_of(witness)
        assert not declared & WRITE_CAPABILITIES.keys()
        # A decorator that changes nothing forwards what the store declares.
        assert capabilities_of(ForwardingEventStore(store)) \
            == capabilities_of(store) - {"commit_signal"}

    async def test_a_decorator_sees_every_write_of_a_run(self, store: EventStore) -> None:
        witness = WriteWitness(store)
        # The start (the fence taken with the first write), the steps, the last write
        # ending the lease: as the kernel writes a 3-step run.
        grant = await append_acquiring(witness, [started("dw")], holder="w1",
                                       lease_ms=60_000)
        assert grant is not None
        await witness.append(make_event("dw", 1), fence=grant.token)
        await witness.append_batch([make_event("dw", 2), make_event("dw", 3)],
                                   fence=grant.token)
        await append_releasing(witness, [make_event("dw", 4, EventType.EXECUTION_COMPLETED)],
                               fence=grant.token)
        assert witness.seen == await _ids(store, "dw")
        assert len(witness.seen) == 5
        # The lease ended with the last write: another holder takes the fence now.
        other = await store.acquire_fence_if("dw", holder="w2", lease_ms=1000)
        assert other is not None
        assert other.token > grant.token

    async def test_a_decorator_sees_every_write_of_a_batch(self, store: EventStore) -> None:
        witness = WriteWitness(store)
        plain = await append_many(witness, [([started("db1")], 0), ([started("db2")], 0)])
        assert plain == [None, None]
        grant = await append_acquiring(witness, [started("db3")], holder="w", lease_ms=60_000)
        assert grant is not None
        mixed = await append_many(witness, [
            AcquiringAppend([make_event("db1", 1)], holder="w", lease_ms=60_000),
            ([make_event("db2", 1)], None),
            ReleasingAppend([make_event("db3", 1)], fence=grant.token)])
        assert mixed[1:] == [None, None]
        assert mixed[0] is not None
        stored = [i for e in ("db1", "db2", "db3") for i in await _ids(store, e)]
        assert sorted(witness.seen) == sorted(stored)
        assert len(stored) == 6

    async def test_a_decorator_that_implements_the_leased_writes_keeps_them(
            self, store: EventStore) -> None:
        class Leased(WriteWitness):
            async def append_acquiring(self, events: Sequence[EventEnvelope], *, holder: str,
                                       lease_ms: int, release: bool = False,
                                       ) -> FenceGrant | None:
                self.seen.extend(event.id for event in events)
                return await append_acquiring(self.inner, events, holder=holder,
                                              lease_ms=lease_ms, release=release)

            async def append_releasing(self, events: Sequence[EventEnvelope], *,
                                       fence: int) -> None:
                self.seen.extend(event.id for event in events)
                await append_releasing(self.inner, events, fence=fence)

        witness = Leased(store)
        assert APPEND_LEASED in capabilities_of(witness)
        assert not {APPEND_MANY, APPEND_MANY_LEASED} & capabilities_of(witness)
        grant = await append_acquiring(witness, [started("dl")], holder="w", lease_ms=60_000)
        assert grant is not None
        await append_releasing(witness, [make_event("dl", 1)], fence=grant.token)
        assert witness.seen == await _ids(store, "dl")
