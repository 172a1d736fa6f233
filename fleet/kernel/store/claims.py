"""Claiming due timers in batches: ``ClaimsTimers`` and ``claim_due_timers`` (decision 0048).

The timer service fires a timer by taking its execution's fence, appending
``TIMER_FIRED`` under it and ending the lease. One timer at a time that is three
round trips, and two replicas walking the same ``due_timers`` list contend for
the same fences (issue 28: 3,000 due timers took 7-8 s with one replica, 9-15 s
with two). A claim takes the fences of many due timers at once, skipping those
another claimer holds, so replicas divide the work; the appends then go as one
``append_many`` (``fleet.kernel.timers``).

A timer is named by ``(execution_id, timer_id)``. A claim fires it only when the
execution's index row says it is parked (``timer_waited_on``), and never a flow's
deadline timer. The append under the claim's grant at
``head + 1`` is the guarantee: a store write in between moves the head or the
fence and the append is refused, so a timer fires once however many claimers run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast, runtime_checkable

from fleet.kernel.state import DEADLINE_TIMER
from fleet.kernel.store.spi import (
    CLAIM_TIMERS,
    DueTimer,
    EventStore,
    ExecutionSummary,
    FenceGrant,
    capabilities_of,
    check_limit,
)
from fleet.kernel.values import check_ms

__all__ = ["ClaimedTimer", "ClaimsTimers", "claim_due_timers", "timer_waited_on"]


@dataclass(frozen=True, slots=True)
class ClaimedTimer:
    """A due timer a claim took: its execution's fence is now held under ``grant``.

    ``head`` is the execution's head when the claim took the fence (its
    ``TIMER_FIRED`` goes at ``head + 1``); ``flow_id`` and ``tenant`` route the
    drive that follows, with no second read.
    """

    execution_id: str
    timer_id: str
    due_at: int
    grant: FenceGrant
    head: int
    flow_id: str
    tenant: str | None


@runtime_checkable
class ClaimsTimers(Protocol):
    """Optional: claim many due timers in one round trip.

    ``claim_due_timers(now_ms, holder=, lease_ms=, limit=)`` takes the fence of up
    to ``limit`` executions (earliest due first) that have a timer due at
    ``now_ms``, wait on it (``timer_waited_on``) and hold no live lease, each as
    ``acquire_fence_if`` would, and returns each with the head it had. An
    execution whose fence row another claim or write holds at that moment is
    skipped, not waited for, so concurrent claimers divide the due timers.

    Postgres does it in one statement (``fleet_claim_timers``, ``FOR UPDATE SKIP
    LOCKED``); ``claim_due_timers`` below serves a store without it through
    ``due_timers``, ``get_execution`` and ``acquire_fence_if`` (the same answers,
    a few calls per timer).
    """

    async def claim_due_timers(self, now_ms: int, *, holder: str, lease_ms: int,
                               limit: int = 100) -> list[ClaimedTimer]: ...


def timer_waited_on(summary: ExecutionSummary | None, timer_id: str) -> bool:
    """Whether a claim may fire ``timer_id``: the execution is parked, and it is not the
    flow's deadline (which fails the execution instead: ``fleet.kernel.deadlines``).

    A pending timer of a parked execution is one its park waits on, alone or among the
    waits of a ``first`` park (which the index's ``waiting_on``, the race's name, does not
    list: decision 0033); one it does not wait on is marked fired, which wakes nothing.
    The one rule a claim fires by (``fleet_claim_timers`` says the same in SQL).
    """
    return (summary is not None and summary.status == "parked"
            and timer_id != DEADLINE_TIMER)


async def claim_due_timers(store: EventStore, now_ms: int, *, holder: str, lease_ms: int,
                           limit: int = 100) -> list[ClaimedTimer]:
    """``store.claim_due_timers``, or the same claims one timer at a time."""
    if CLAIM_TIMERS in capabilities_of(store):
        # Declared, never guessed from a method (decision 0050): a decorator that
        # changes writes is never gone around.
        own = cast(ClaimsTimers, store)
        return await own.claim_due_timers(now_ms, holder=holder, lease_ms=lease_ms,
                                          limit=limit)
    check_ms(now_ms, "now_ms")
    check_limit(limit)
    claimed: list[ClaimedTimer] = []
    seen: set[str] = set()
    read = 0
    while len(claimed) < limit:
        # Timers nobody waits on (or held) are passed over: read a page further each time.
        page = await store.due_timers(now_ms, limit=read + limit)
        for due in page[read:]:
            if len(claimed) >= limit:
                break
            claim = await _claim_one(store, due, seen, holder=holder, lease_ms=lease_ms)
            if claim is not None:
                claimed.append(claim)
        if len(page) < read + limit:
            break
        read = len(page)
    return claimed


async def _claim_one(store: EventStore, due: DueTimer, seen: set[str], *, holder: str,
                     lease_ms: int) -> ClaimedTimer | None:
    if due.execution_id in seen:
        return None
    if not timer_waited_on(await store.get_execution(due.execution_id), due.timer_id):
        return None
    grant = await store.acquire_fence_if(due.execution_id, holder=holder, lease_ms=lease_ms)
    if grant is None:
        return None
    # Read again under the fence: a write between the look and the take moved it.
    summary = await store.get_execution(due.execution_id)
    if summary is None or not timer_waited_on(summary, due.timer_id):
        await store.release_fence(due.execution_id, grant.token)
        return None
    seen.add(due.execution_id)
    return ClaimedTimer(due.execution_id, due.timer_id, due.due_at, grant, summary.head,
                        summary.flow_id, summary.tenant)
