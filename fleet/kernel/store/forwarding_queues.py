"""``HoldsQueues`` forwarded by every store decorator (``ForwardingEventStore``'s mixin).

A decorator over a store without queues answers every call with
``ConfigurationError`` (``spi_queues.holds_queues`` says so before: ``Runtime``
refuses ``queues=`` on such a store).
"""

from __future__ import annotations

from fleet.kernel.errors import ConfigurationError
from fleet.kernel.store.spi import EventStore
from fleet.kernel.store.spi_queues import (
    DEFAULT_GRACE_MS,
    DEFAULT_REWAKE_MS,
    DebounceClaim,
    HoldsQueues,
    QueueDepth,
    QueueEntry,
    QueueLimits,
    QueuePass,
)

__all__ = ["ForwardingQueues"]


class ForwardingQueues:
    """Forwards ``HoldsQueues`` to ``inner``."""

    inner: EventStore

    def _queues_inner(self) -> HoldsQueues:
        if not isinstance(self.inner, HoldsQueues):
            raise ConfigurationError(f"{type(self.inner).__name__} keeps no queues "
                                     "(spi_queues.HoldsQueues)")
        return self.inner

    async def queue_pass(self, limits: QueueLimits, now_ms: int, *,
                         entry: QueueEntry | None = None, limit: int = 100,
                         grace_ms: int = DEFAULT_GRACE_MS,
                         rewake_ms: int = DEFAULT_REWAKE_MS,
                         sweep: bool = True) -> QueuePass:
        return await self._queues_inner().queue_pass(limits, now_ms, entry=entry, limit=limit,
                                                     grace_ms=grace_ms, rewake_ms=rewake_ms,
                                                     sweep=sweep)

    async def queue_delay(self, execution_id: str, eligible_at: int) -> bool:
        return await self._queues_inner().queue_delay(execution_id, eligible_at)

    async def queue_forget(self, execution_id: str) -> bool:
        return await self._queues_inner().queue_forget(execution_id)

    async def queue_depths(self, now_ms: int) -> list[QueueDepth]:
        return await self._queues_inner().queue_depths(now_ms)

    async def debounce_get(self, scope: str) -> DebounceClaim | None:
        return await self._queues_inner().debounce_get(scope)

    async def debounce_claim(self, scope: str, execution_id: str, *, expect: str | None,
                             now_ms: int) -> bool:
        return await self._queues_inner().debounce_claim(scope, execution_id, expect=expect,
                                                         now_ms=now_ms)
