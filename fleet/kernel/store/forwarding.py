"""``ForwardingEventStore``: the base of every store decorator.

It forwards each ``EventStore`` operation to ``inner`` unchanged; a decorator
(fault injection, group commit, a third party's) overrides only what it
changes. ``close`` closes the wrapped store: the decorator owns it.

It does not forward ``append_many_leased`` (``spi.AppendsManyLeased``): a decorator
that overrides ``append_many`` or the leased writes would be bypassed by it.
``spi.append_many`` serves a mixed batch to such a decorator through those calls;
one that can batch leased writes itself (group commit, the fault injector) says so
by implementing the method.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleet.kernel.errors import ConfigurationError
from fleet.kernel.events import EventEnvelope
from fleet.kernel.store.forwarding_queues import ForwardingQueues
from fleet.kernel.store.spi import (
    ORIGIN,
    AppendRequest,
    CommittedEvent,
    ConditionalAppendResult,
    CountsExecutions,
    DueTimer,
    EventStore,
    ExecutionSummary,
    FenceGrant,
    Position,
    TipObservation,
    append_acquiring,
    append_many,
    append_releasing,
)


class ForwardingEventStore(ForwardingQueues):
    """An ``EventStore`` that forwards every call to ``inner`` (queues too:
    ``forwarding_queues``)."""

    def __init__(self, inner: EventStore) -> None:
        self.inner = inner

    async def append(self, event: EventEnvelope, *, fence: int | None = None) -> None:
        await self.inner.append(event, fence=fence)

    async def append_batch(self, events: Sequence[EventEnvelope], *,
                           fence: int | None = None) -> None:
        await self.inner.append_batch(events, fence=fence)

    async def append_many(self, requests: Sequence[AppendRequest],
                          ) -> list[BaseException | None]:
        """The inner store's ``append_many`` (one round trip), or one request at a time."""
        return await append_many(self.inner, requests)

    async def append_acquiring(self, events: Sequence[EventEnvelope], *, holder: str,
                               lease_ms: int, release: bool = False) -> FenceGrant | None:
        """The inner store's leased append (one round trip), or the separate calls."""
        return await append_acquiring(self.inner, events, holder=holder, lease_ms=lease_ms,
                                      release=release)

    async def append_releasing(self, events: Sequence[EventEnvelope], *, fence: int) -> None:
        """The inner store's releasing append (one round trip), or the separate calls."""
        await append_releasing(self.inner, events, fence=fence)

    async def append_if_unchanged(self, execution_id: str, event: EventEnvelope | None,
                                  expect: TipObservation | None = None,
                                  ) -> ConditionalAppendResult:
        return await self.inner.append_if_unchanged(execution_id, event, expect)

    async def read(self, execution_id: str, *, after: int = -1) -> list[EventEnvelope]:
        return await self.inner.read(execution_id, after=after)

    async def head(self, execution_id: str) -> int | None:
        return await self.inner.head(execution_id)

    async def acquire_fence(self, execution_id: str, *, holder: str,
                            lease_ms: int) -> FenceGrant:
        return await self.inner.acquire_fence(execution_id, holder=holder, lease_ms=lease_ms)

    async def acquire_fence_if(self, execution_id: str, *, holder: str,
                               lease_ms: int) -> FenceGrant | None:
        return await self.inner.acquire_fence_if(execution_id, holder=holder,
                                                 lease_ms=lease_ms)

    async def renew_lease(self, execution_id: str, token: int, *, lease_ms: int) -> bool:
        return await self.inner.renew_lease(execution_id, token, lease_ms=lease_ms)

    async def release_fence(self, execution_id: str, token: int) -> bool:
        return await self.inner.release_fence(execution_id, token)

    async def delete_execution(self, execution_id: str) -> bool:
        return await self.inner.delete_execution(execution_id)

    async def compact_through(self, execution_id: str, sequence: int) -> int:
        return await self.inner.compact_through(execution_id, sequence)

    async def list_executions(self, *, status: str | None = None, flow_id: str | None = None,
                              tenant: str | None = None, waiting_on: str | None = None,
                              updated_before: int | None = None,
                              updated_after: int | None = None,
                              lease_expired_at: int | None = None,
                              after_id: str | None = None,
                              limit: int = 100) -> list[ExecutionSummary]:
        return await self.inner.list_executions(
            status=status, flow_id=flow_id, tenant=tenant, waiting_on=waiting_on,
            updated_before=updated_before, updated_after=updated_after,
            lease_expired_at=lease_expired_at, after_id=after_id, limit=limit)

    async def count_executions(self) -> dict[str, int]:
        """The inner store's counts (``CountsExecutions``), if it has them."""
        if not isinstance(self.inner, CountsExecutions):
            raise ConfigurationError(f"{type(self.inner).__name__} does not count executions")
        return await self.inner.count_executions()

    async def get_execution(self, execution_id: str) -> ExecutionSummary | None:
        return await self.inner.get_execution(execution_id)

    async def due_timers(self, now_ms: int, *, limit: int = 100) -> list[DueTimer]:
        return await self.inner.due_timers(now_ms, limit=limit)

    async def read_committed(self, *, after: Position = ORIGIN, limit: int = 500,
                             max_bytes: int | None = None) -> list[CommittedEvent]:
        return await self.inner.read_committed(after=after, limit=limit, max_bytes=max_bytes)

    async def close(self) -> None:
        """Close the wrapped store: the decorator owns it."""
        await self.inner.close()
