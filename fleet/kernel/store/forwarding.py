"""``ForwardingEventStore``: the base of every store decorator.

It forwards each ``EventStore`` operation to ``inner`` unchanged; a decorator
(fault injection, group commit, a third party's) overrides only what it
changes. ``close`` closes the wrapped store: the decorator owns it.

Its ``capabilities`` (decision 0050) are worked out from what the subclass
overrides, so a decorator is never gone around:

- one that overrides no write method (a read-side decorator) declares what the
  inner store declares, and its optional writes go straight to the inner store's
  one round trip;
- one that overrides any write method (``append``, ``append_batch``,
  ``append_many``, ``append_acquiring``, ``append_releasing``,
  ``append_many_leased``) declares only the write capabilities whose methods it
  implements itself. An encrypting or auditing decorator that overrides
  ``append`` and ``append_batch`` therefore sees every write of a run: the
  kernel takes and ends leases through ``acquire_fence_if`` and
  ``release_fence`` around its ``append_batch`` (two more round trips per run),
  until it also implements ``append_acquiring`` / ``append_releasing`` to keep
  them in one.

A subclass may set ``capabilities`` itself (a class attribute) to declare exactly
what it offers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from fleet.kernel.errors import ConfigurationError
from fleet.kernel.events import EventEnvelope
from fleet.kernel.store.backlog import Backlog, ReportsBacklog
from fleet.kernel.store.claims import ClaimedTimer, claim_due_timers
from fleet.kernel.store.forwarding_queues import ForwardingQueues
from fleet.kernel.store.spi import (
    COMMIT_SIGNAL,
    COUNT_EXECUTIONS,
    ORIGIN,
    WRITE_CAPABILITIES,
    AppendRequest,
    CommittedEvent,
    ConditionalAppendResult,
    CountsExecutions,
    DueTimer,
    EventStore,
    ExecutionSummary,
    FenceGrant,
    ManyAnswer,
    ManyRequest,
    Position,
    TipObservation,
    append_acquiring,
    append_many,
    append_releasing,
    capabilities_of,
    max_lease_of,
)

#: The methods that write events: overriding any of them makes a decorator declare
#: only the write capabilities it implements itself.
WRITE_METHODS = frozenset({"append", "append_batch",
                           *(m for ms in WRITE_CAPABILITIES.values() for m in ms)})


@functools.cache
def _overridden_writes(cls: type) -> frozenset[str]:
    """The write methods ``cls`` defines below ``ForwardingEventStore``."""
    below = cls.__mro__[:cls.__mro__.index(ForwardingEventStore)]
    return frozenset(name for name in WRITE_METHODS
                     if any(name in vars(klass) for klass in below))


def forwarded_capabilities(cls: type, inner: EventStore) -> frozenset[str]:
    """What a ``ForwardingEventStore`` subclass ``cls`` over ``inner`` declares (see the
    module's docstring): the inner store's, less the writes ``cls`` changes but does not
    implement."""
    declared = capabilities_of(inner)
    own = _overridden_writes(cls)
    if not own:
        return declared
    reads = declared - WRITE_CAPABILITIES.keys()
    return reads | {capability for capability, methods in WRITE_CAPABILITIES.items()
                    if all(method in own for method in methods)}


class ForwardingEventStore(ForwardingQueues):
    """An ``EventStore`` that forwards every call to ``inner`` (queues too:
    ``forwarding_queues``)."""

    #: Set per instance from the subclass and the inner store (``forwarded_capabilities``)
    #: unless a subclass declares it as a class attribute.
    capabilities: frozenset[str]

    def __init__(self, inner: EventStore) -> None:
        self.inner = inner
        if not any("capabilities" in vars(klass) for klass in type(self).__mro__):
            # commit_signal is not forwarded: a reader asks the store it opened.
            self.capabilities = forwarded_capabilities(type(self), inner) - {COMMIT_SIGNAL}

    @property
    def max_lease_ms(self) -> int:
        """The wrapped store's lease bound (spi; decision 0044)."""
        return max_lease_of(self.inner)

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

    async def append_many_leased(self, requests: Sequence[ManyRequest],
                                 ) -> list[ManyAnswer]:
        """The inner store's ``append_many_leased`` (declared only when the inner store
        declares it and this decorator changes no write)."""
        return list(await append_many(self.inner, requests))

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
        if COUNT_EXECUTIONS not in capabilities_of(self.inner) \
                or not isinstance(self.inner, CountsExecutions):
            raise ConfigurationError(f"{type(self.inner).__name__} does not count executions")
        return await self.inner.count_executions()

    async def backlog(self, now_ms: int, *, gates: Sequence[str] = ()) -> Backlog:
        """The inner store's backlog (``ReportsBacklog``), if it has one."""
        if not isinstance(self.inner, ReportsBacklog):
            raise ConfigurationError(f"{type(self.inner).__name__} does not report its backlog")
        return await self.inner.backlog(now_ms, gates=gates)

    async def get_execution(self, execution_id: str) -> ExecutionSummary | None:
        return await self.inner.get_execution(execution_id)

    async def due_timers(self, now_ms: int, *, limit: int = 100) -> list[DueTimer]:
        return await self.inner.due_timers(now_ms, limit=limit)

    async def claim_due_timers(self, now_ms: int, *, holder: str, lease_ms: int,
                               limit: int = 100) -> list[ClaimedTimer]:
        """The inner store's claim (one round trip on Postgres), or one timer at a time."""
        return await claim_due_timers(self.inner, now_ms, holder=holder, lease_ms=lease_ms,
                                      limit=limit)

    async def read_committed(self, *, after: Position = ORIGIN, limit: int = 500,
                             max_bytes: int | None = None) -> list[CommittedEvent]:
        return await self.inner.read_committed(after=after, limit=limit, max_bytes=max_bytes)

    async def close(self) -> None:
        """Close the wrapped store: the decorator owns it."""
        await self.inner.close()
