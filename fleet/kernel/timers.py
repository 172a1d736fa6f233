"""Durable timers: firing what is due, and the in-process timers of an embedded runtime.

A long ``ctx.sleep`` parks the execution on its timer (``TIMER_SCHEDULED`` holds
the due time; the store's timer index lists it). ``fire_due`` fires every due
timer: it takes the execution's fence only if no live lease is held, checks
that the timer is still unfired and waited on, writes ``TIMER_FIRED`` through
the one write path and drives the execution (or leaves the drive to the caller:
the fleet's timer service enqueues it). Each claim is conditional, so several
replicas never fire one timer twice, and each call returns exactly the timers
it fired, whatever other calls overlap with it.

With ``local_timers`` a runtime also arms a loop timer when one of its runs
parks on a sleep, so an embedded runtime needs no timer service.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fleet.kernel.engine import Engine
from fleet.kernel.events import EventType
from fleet.kernel.fold import ExecutionState
from fleet.kernel.writes import make_events


@dataclass(frozen=True, slots=True)
class FiredTimer:
    """A timer this runtime fired: its ``TIMER_FIRED`` is durable."""

    execution_id: str
    timer_id: str


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
        """Fire every due timer (at most ``limit``); the ones this call fired."""
        engine = self.engine
        now = engine.clock() if now is None else now
        fired: list[FiredTimer] = []
        for due in await engine.store.due_timers(now, limit=limit):
            if await self.fire(due.execution_id, due.timer_id, drive=drive, now=now):
                fired.append(FiredTimer(due.execution_id, due.timer_id))
        return fired

    async def fire(self, execution_id: str, timer_id: str, *, drive: bool = True,
                   now: int | None = None) -> bool:
        """Fire one timer if it is still waited on (and, given ``now``, still due then);
        True when this call fired it. Judged under the fence: a due time moved on since
        ``fire_due`` listed it (a debounced start, decision 0057) is not fired early."""
        engine = self.engine
        lease = await engine.take_if_free(execution_id)
        if lease is None:
            return False
        async with lease:
            state = await engine.fold(execution_id)
            timer = state.timers.get(timer_id)
            waiting = state.waiting or {}
            if (timer is None or timer.get("fired") or not state.parked
                    or waiting.get("on") != timer_id):
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
