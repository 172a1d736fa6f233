"""One runtime's queues: the passes that admit waiting runs, and their wakes (decision 0056).

The store judges (``HoldsQueues.queue_pass``); this writes what the judgement
means in the logs. An admitted run is woken by its queue's reserved timer
(``__fleet_queue__:<name>``): ``TIMER_SCHEDULED`` and, when its slot is now,
``TIMER_FIRED``, written under the execution's fence only if it still waits on
that gate with no queue timer (so two wakes of one admission write once), then
driven here (``drive=True``) or left to the caller, who enqueues it. A slot
planned for later (a rate) gets only its timer; the timer service fires it.

Passes run on a queued start (``fleet.kernel.later``), when a queued run ends in
this runtime (``Engine.on_ended``: a pass of its queue, in the background), and on
every ``fire_due_timers`` (``Runtime``: one pass per declared queue), which also
catches slots freed elsewhere (a cancel, another process, a crash).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from fleet.kernel.engine import Engine
from fleet.kernel.errors import (
    ConfigurationError,
    DuplicateSequenceError,
    ExecutionBusyError,
    FlowNotFoundError,
    StoreUnavailableError,
    ValidationError,
)
from fleet.kernel.events import EventType
from fleet.kernel.fold import ExecutionState, fold_log
from fleet.kernel.queues import Queue
from fleet.kernel.store.spi_queues import (
    QUEUE_GATE_PREFIX,
    Admission,
    HoldsQueues,
    QueueEntry,
    QueuePass,
    holds_queues,
)
from fleet.kernel.timers import FiredTimer, Timers
from fleet.kernel.writes import make_events

__all__ = ["Admissions", "check_queues"]


def check_queues(queues: Sequence[Any]) -> tuple[Queue, ...]:
    """The queues a runtime is built with: ``Queue`` objects with distinct names."""
    out: list[Queue] = []
    for queue in queues:
        if not isinstance(queue, Queue):
            raise ConfigurationError(f"queues= takes Queue(...) objects, got "
                                     f"{type(queue).__name__} {queue!r}")
        if any(q.name == queue.name for q in out):
            raise ConfigurationError(f"queue {queue.name!r} is declared twice")
        out.append(queue)
    return tuple(out)


class Admissions:
    """The declared queues of one runtime, their passes and wakes (see the module).

    Args:
        engine: The runtime's engine (its store must keep queues when any is declared).
        timers: The runtime's timers (a planned slot arms a loop timer when local).
        queues: The declared queues.
        local: Arm loop timers and loop passes (an embedded runtime's ``local_timers``).
    """

    def __init__(self, engine: Engine, timers: Timers, queues: Sequence[Queue], *,
                 local: bool) -> None:
        self.engine = engine
        self.timers = timers
        self.local = local
        self.by_name = {q.name: q for q in check_queues(queues)}
        self.admitted = 0  # runs this runtime woke from a queue
        self._armed: dict[str, asyncio.TimerHandle] = {}
        if self.by_name:
            if not holds_queues(engine.store):
                raise ConfigurationError(
                    f"{type(engine.store).__name__} keeps no queues (spi_queues.HoldsQueues): "
                    "a Runtime with queues= needs a store that does (memory, SQLite, "
                    "Postgres, and their decorators)")
            # Beside any listener already there (the hook is one callable: chained).
            before = engine.on_ended

            def ended(state: ExecutionState) -> None:
                if before is not None:
                    before(state)
                self.ended(state)

            engine.on_ended = ended

    def declared(self) -> tuple[str, ...]:
        return tuple(sorted(self.by_name))

    def get(self, name: Any) -> Queue:
        """The declared queue ``name``, or ``ValidationError`` naming it."""
        queue = self.by_name.get(name) if isinstance(name, str) else None
        if queue is None:
            raise ValidationError(
                f"no queue {name!r} is declared on this runtime (declared: "
                f"{list(self.declared())}): declare it with Runtime(queues=[Queue({name!r}, "
                "...)]), or in FLEET_QUEUES for a fleet (every process the same)")
        return queue

    @property
    def store(self) -> HoldsQueues:
        store = self.engine.store
        assert isinstance(store, HoldsQueues)
        return store

    # -- passes ------------------------------------------------------------------------
    async def enter(self, queue: Queue, entry: QueueEntry, now: int) -> QueuePass:
        """A queued start's pass: enter ``entry`` and admit what fits (itself, or older).

        A queue without limits admits an eligible start at once, with no store call.
        """
        if not queue.limited and entry.eligible_at <= now:
            return QueuePass(entry_at=now, entered=True)
        done = await self.store.queue_pass(queue.limits(), now, entry=entry)
        self._limits_changed(queue, done)
        return done

    async def run(self, queue: Queue, *, now: int | None = None, limit: int = 100,
                  drive: bool = True, sweep: bool = True) -> list[FiredTimer]:
        """One pass of ``queue``; wake what it admitted (and, sweeping, lost wakes). The
        runs woken now (due at once), which with ``drive=False`` the caller enqueues."""
        now = self.engine.clock() if now is None else now
        done = await self.store.queue_pass(queue.limits(), now, limit=limit, sweep=sweep)
        self._limits_changed(queue, done)
        return await self.wake_all(queue, (*done.admitted, *done.rewake), now, drive=drive)

    async def run_all(self, now: int | None = None, *, limit: int = 100,
                      drive: bool = True) -> list[FiredTimer]:
        """One pass of every declared queue (``fire_due_timers``)."""
        woken: list[FiredTimer] = []
        for name in self.declared():
            if limit - len(woken) <= 0:
                break
            woken += await self.run(self.by_name[name], now=now, limit=limit - len(woken),
                                    drive=drive)
        return woken

    async def wake_all(self, queue: Queue, admissions: Sequence[Admission], now: int, *,
                       drive: bool) -> list[FiredTimer]:
        woken: list[FiredTimer] = []
        for admission in admissions:
            try:
                written = await self.wake(queue, admission, now, drive=drive)
            except (FlowNotFoundError, StoreUnavailableError) as exc:
                # Its code is not deployed here, or the store failed: the others are
                # still woken; this one stays admitted and a later pass wakes it again.
                self.engine.warner.warn(
                    f"queue {queue.name!r}: the wake of {admission.execution_id!r} was not "
                    f"written ({type(exc).__name__}: {exc}); a later pass tries again",
                    key=f"queue-wake:{admission.execution_id}")
                continue
            if written and admission.at <= now:
                woken.append(FiredTimer(admission.execution_id, queue.gate))
        return woken

    async def wake(self, queue: Queue, admission: Admission, now: int, *,
                   drive: bool) -> bool:
        """Write the wake of one admission (see the module); whether this call wrote it."""
        engine = self.engine
        execution_id, gate = admission.execution_id, queue.gate
        state = await engine.fold(execution_id)
        if not state.parked or (state.waiting or {}).get("on") != gate or gate in state.timers:
            return False  # woken already, ended, or not written yet (its start wakes it)
        bodies: list[tuple[EventType, dict[str, Any]]] = [
            (EventType.TIMER_SCHEDULED, {"timerId": gate, "dueAt": admission.at})]
        lease = engine.deferred(execution_id)
        try:
            if admission.at <= now:
                bodies.append((EventType.TIMER_FIRED, {"timerId": gate}))
                await engine.answer(state, lease, bodies, drive=drive)
            else:
                made = make_events(execution_id, state.sequence, engine.clock(), bodies)
                await engine.writer.write(lease, made, last=True)
                self.timers.arm(fold_log(made, state))
        except (ExecutionBusyError, DuplicateSequenceError):
            return False  # someone else wrote first; a later pass re-wakes if need be
        self.admitted += 1
        return True

    def _limits_changed(self, queue: Queue, done: QueuePass) -> None:
        if done.limits_were is not None:
            self.engine.warner.warn(
                f"queue {queue.name!r} was last judged with other limits ({done.limits_were}) "
                f"than this process declares ({queue.limits().to_json()}): declare it the "
                "same in every process (FLEET_QUEUES)", key=f"queue-limits:{queue.name}")

    # -- what wakes a waiting run --------------------------------------------------------
    def ended(self, state: ExecutionState) -> None:
        """A queued run ended here (``Engine.on_ended``): a pass of its queue frees its slot."""
        if self.engine.handing_back:
            return  # shutting down: the timer service's next pass admits the next one
        for timer_id in state.timers:
            if timer_id.startswith(QUEUE_GATE_PREFIX):
                queue = self.by_name.get(timer_id[len(QUEUE_GATE_PREFIX):])
                if queue is not None and queue.limited:
                    self._background(self.run(queue, sweep=False))

    def arm_pass(self, queue: Queue, at: int) -> None:
        """Run a pass of ``queue`` at ``at`` (ms) from the loop (``local`` only): a
        delayed or debounced queued start becomes eligible then."""
        if not self.local:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, (at - self.engine.clock()) / 1000)
        handle = self._armed.pop(queue.name, None)
        if handle is not None and handle.when() <= loop.time() + delay:
            self._armed[queue.name] = handle  # an earlier pass is armed already
            return
        if handle is not None:
            handle.cancel()

        def fire() -> None:
            self._armed.pop(queue.name, None)
            self._background(self.run(queue))

        self._armed[queue.name] = loop.call_later(delay, fire)

    def _background(self, work: Any) -> None:
        engine = self.engine
        task = asyncio.get_running_loop().create_task(work)
        engine.background.add(task)
        task.add_done_callback(engine.background.discard)
        task.add_done_callback(self._report)

    def _report(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.engine.warner.warn(f"a queue pass failed: {type(exc).__name__}: {exc} (the "
                                    "timer service's next pass admits what waits)",
                                    key="queue-pass-failed")

    def close(self) -> None:
        for handle in self._armed.values():
            handle.cancel()
        self._armed.clear()
