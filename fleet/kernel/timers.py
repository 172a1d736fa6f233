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

A timer is ``(execution_id, timer_id)``; it fires when the execution's index
row says the execution waits on it (``claims.timer_waited_on``: parked, its
``waiting_on`` the timer id, which ``EXECUTION_SUSPENDED``'s ``condition.on``
sets). A new kind of timer plugs in by parking on its timer id that way.

With ``local_timers`` a runtime also arms a loop timer when one of its runs
parks on a sleep, so an embedded runtime needs no timer service.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fleet.kernel.engine import Engine
from fleet.kernel.events import EventType
from fleet.kernel.fold import ExecutionState
from fleet.kernel.lease import Lease
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
        if not claims:
            return []
        if not drive:
            return await self._write_fired(claims)
        fired: list[FiredTimer] = []
        for claim in claims:
            if await self._fire_under(engine.lease(claim.grant), claim.execution_id,
                                      claim.timer_id, drive=True):
                fired.append(FiredTimer(claim.execution_id, claim.timer_id, claim.flow_id,
                                        claim.tenant))
        return fired

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

    async def fire(self, execution_id: str, timer_id: str, *, drive: bool = True) -> bool:
        """Fire one timer if it is still due and waited on; True when this call fired it."""
        lease = await self.engine.take_if_free(execution_id)
        if lease is None:
            return False
        return await self._fire_under(lease, execution_id, timer_id, drive=drive)

    async def _fire_under(self, lease: Lease, execution_id: str, timer_id: str, *,
                          drive: bool) -> bool:
        """Fire under a taken ``lease`` if the log still waits on the timer (folded)."""
        engine = self.engine
        async with lease:
            state = await engine.fold(execution_id)
            timer = state.timers.get(timer_id)
            waiting = state.waiting or {}
            if (timer is None or timer.get("fired") or not state.parked
                    or waiting.get("on") != timer_id):
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
        """Arm a loop timer for an execution that parked on a sleep (``local`` only)."""
        waiting = state.waiting or {}
        if not self.local or waiting.get("kind") != "timer":
            return
        timer = state.timers.get(waiting.get("on", ""))
        if timer is None:
            return
        engine = self.engine
        execution_id, timer_id = state.execution_id, waiting["on"]
        delay = max(0.0, (int(timer.get("dueAt") or 0) - engine.clock()) / 1000)
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
