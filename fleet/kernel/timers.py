"""Durable timers: firing what is due, and the in-process timers of an embedded runtime.

A long ``ctx.sleep`` parks the execution on its timer (``TIMER_SCHEDULED`` holds
the due time; the store's timer index lists it). ``fire_due`` fires due timers
in a batch (decision 0048): one claim (``claims.claim_due_timers``) takes the
fences of the executions parked on a due timer that no live lease holds,
skipping those another claimer holds, so replicas divide the work; then every
``TIMER_FIRED`` is written at ``head + 1`` under its grant in one
``append_many`` that ends each lease, and the caller enqueues the drives (the
fleet's timer service). With ``drive`` (one process) each claimed execution is
folded, checked and driven here instead. The append's checks (fence, head) make
each firing conditional, so several replicas never fire one timer twice, and
each call returns exactly the timers it fired, whatever other calls overlap.

A timer is ``(execution_id, timer_id)``; a claim fires a due timer of an execution
that is parked (``claims.timer_waited_on``): a pending timer of a parked execution
is one its park waits on (a sleep, or a race's, a timeout's or a child's backstop
among the waits of a ``first`` park: decision 0033), and a due timer it does not wait
on is harmlessly marked fired (its time has come) without waking it. A flow's
deadline timer is never claimed: it fails the execution (``fleet.kernel.deadlines``).

With ``local_timers`` a runtime also arms a loop timer when one of its runs
parks on a sleep, so an embedded runtime needs no timer service.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fleet.kernel.deadlines import expire
from fleet.kernel.engine import Engine
from fleet.kernel.events import EventType
from fleet.kernel.fold import ExecutionState, condition_waits, waits_on
from fleet.kernel.lease import Lease
from fleet.kernel.state import DEADLINE_TIMER
from fleet.kernel.store.claims import ClaimedTimer, claim_due_timers
from fleet.kernel.writes import make_events


@dataclass(frozen=True, slots=True)
class FiredTimer:
    """A timer this runtime fired: its ``TIMER_FIRED`` is durable.

    ``flow_id`` and ``tenant`` (when the claim read them) route the drive that
    follows without another read of the index; a timer is its execution and
    timer ids (equality and hash ignore the route).
    """

    execution_id: str
    timer_id: str
    flow_id: str | None = field(default=None, compare=False)
    tenant: str | None = field(default=None, compare=False)


def waits_for_timer(state: ExecutionState, timer_id: str) -> bool:
    """Whether a parked execution waits on ``timer_id`` (alone, or among the waits of a
    ``first``): only then does firing it wake the run."""
    return (state.waiting or {}).get("on") == timer_id or waits_on(state.waiting, "timer",
                                                                     timer_id)


class Timers:
    """Fires one runtime's due timers and, with ``local``, arms loop timers for its parks."""

    def __init__(self, engine: Engine, *, local: bool) -> None:
        self.engine = engine
        self.local = local
        self._armed: dict[str, asyncio.TimerHandle] = {}
        if local:
            engine.on_parked = self.arm

    async def fire_due(self, now: int | None = None, *, limit: int = 100,
                       drive: bool = True) -> list[FiredTimer]:
        """Fire due timers (at most ``limit``); the ones this call fired.

        One claim takes the fences of the due timers nobody else holds (decision
        0048); without ``drive`` every ``TIMER_FIRED`` then goes in one
        ``append_many`` that also ends each lease, and the caller enqueues the drives.
        """
        engine = self.engine
        now = engine.clock() if now is None else now
        claims = await claim_due_timers(engine.store, now, holder=engine.holder,
                                        lease_ms=engine.lease_ms, limit=limit)
        expired = await self._expire_due(now, limit)
        if not claims:
            return expired
        if not drive:
            return expired + await self._write_fired(claims)
        fired: list[FiredTimer] = list(expired)
        for claim in claims:
            if await self._fire_under(engine.lease(claim.grant), claim.execution_id,
                                      claim.timer_id, drive=True, now=now):
                fired.append(FiredTimer(claim.execution_id, claim.timer_id, claim.flow_id,
                                        claim.tenant))
        return fired

    async def _expire_due(self, now: int, limit: int) -> list[FiredTimer]:
        """Flows whose deadline timer is due: failed (``fleet.kernel.deadlines``), not fired.

        A claim never takes a deadline timer (it must not merely mark it fired); it is
        judged here, under the execution's own fence, parked or not."""
        expired: list[FiredTimer] = []
        for due in await self.engine.store.due_timers(now, limit=limit):
            if due.timer_id == DEADLINE_TIMER and await expire(self.engine, due.execution_id):
                expired.append(FiredTimer(due.execution_id, DEADLINE_TIMER))
        return expired

    async def _write_fired(self, claims: list[ClaimedTimer]) -> list[FiredTimer]:
        """Each claimed timer's ``TIMER_FIRED`` at ``head + 1`` under its grant, one call."""
        engine = self.engine
        at = engine.clock()
        writes = [(engine.lease(claim.grant),
                   make_events(claim.execution_id, claim.head, at,
                               [(EventType.TIMER_FIRED, {"timerId": claim.timer_id})]))
                  for claim in claims]
        # A fault of the whole call raises: its fate unknown, the leases expire.
        answers = await engine.writer.write_releasing_many(writes)
        fired: list[FiredTimer] = []
        for claim, (lease, _), answer in zip(claims, writes, answers, strict=True):
            if answer is None:
                fired.append(FiredTimer(claim.execution_id, claim.timer_id, claim.flow_id,
                                        claim.tenant))
            else:
                # Moved since the claim (a write between the index read and the lock):
                # not fired here; the next claim judges it again.
                await lease.release()
        engine.stats.timers_fired += len(fired)
        return fired

    async def fire(self, execution_id: str, timer_id: str, *, drive: bool = True,
                   now: int | None = None) -> bool:
        """Fire one timer if it is still waited on (and, given ``now``, still due then);
        True when this call fired it. Judged under the fence: a due time moved on since
        it was listed (a debounced start, decision 0057) is not fired early.

        A flow's deadline timer fails the execution instead (``fleet.kernel.deadlines``).
        """
        if timer_id == DEADLINE_TIMER:
            return await expire(self.engine, execution_id)
        lease = await self.engine.take_if_free(execution_id)
        if lease is None:
            return False
        return await self._fire_under(lease, execution_id, timer_id, drive=drive, now=now)

    async def _fire_under(self, lease: Lease, execution_id: str, timer_id: str, *,
                          drive: bool, now: int | None = None) -> bool:
        """Fire under a taken ``lease`` if the log still waits on the timer (folded) and,
        given ``now``, it is still due then."""
        engine = self.engine
        async with lease:
            state = await engine.fold(execution_id)
            timer = state.timers.get(timer_id)
            if (timer is None or timer.get("fired") or timer.get("cancelled")
                    or not state.parked or not waits_for_timer(state, timer_id)):
                return False
            due = timer.get("dueAt")
            if now is not None and isinstance(due, int) and due > now:
                return False
            fired = [(EventType.TIMER_FIRED, {"timerId": timer_id})]
            if drive:
                await engine.answer(state, lease, fired)
            else:
                # The caller enqueues the drive; a worker judges the code then.
                await engine.writer.write(lease, make_events(execution_id, state.sequence,
                                                             engine.clock(), fired))
        engine.stats.timers_fired += 1
        return True

    def arm(self, state: ExecutionState) -> None:
        """Arm a loop timer for an execution that parked on a sleep, or on a race with
        timers among its waits (the earliest: ``local`` only)."""
        if not self.local:
            return
        due = [(int(timer.get("dueAt") or 0), str(wait.get("on")))
               for wait in condition_waits(state.waiting) if wait.get("kind") == "timer"
               and (timer := state.timers.get(str(wait.get("on")))) is not None]
        if not due:
            return
        engine = self.engine
        due_at, timer_id = min(due)
        execution_id = state.execution_id
        delay = max(0.0, (due_at - engine.clock()) / 1000)
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._armed.pop(execution_id, None)
            task = loop.create_task(self.fire(execution_id, timer_id))
            engine.background.add(task)
            task.add_done_callback(engine.background.discard)
            task.add_done_callback(report)

        def report(task: asyncio.Task[bool]) -> None:
            if not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                engine.warner.warn(f"local timer {timer_id!r} of {execution_id!r} could not "
                                   f"fire: {type(exc).__name__}: {exc}")

        self.disarm(execution_id)
        self._armed[execution_id] = loop.call_later(delay, fire)

    def disarm(self, execution_id: str) -> None:
        """Forget the loop timer of ``execution_id`` (it was cancelled)."""
        handle = self._armed.pop(execution_id, None)
        if handle is not None:
            handle.cancel()

    def close(self) -> None:
        for handle in self._armed.values():
            handle.cancel()
        self._armed.clear()
