"""The writes of a start that runs later (decisions 0055, 0056, 0057).

Each kind is a new execution written in one write that leaves it parked, so its
id is taken, it is listed and it can be cancelled at once:

- **delayed**: ``EXECUTION_STARTED``, ``TIMER_SCHEDULED`` and ``EXECUTION_SUSPENDED`` of
  the reserved timer ``__fleet_start__``; the timer service fires it
  (``fire_due_timers``), an embedded runtime's loop timer too;
- **queued**: its entry enters the queue first (the store's pass, which also admits
  what fits), then ``EXECUTION_STARTED`` and ``EXECUTION_SUSPENDED`` on the queue's
  gate, with its wake in the same write when that pass admitted it;
- **debounced**: ``fleet.kernel.debounce``, over the two above.

``fleet.kernel.later.start_later`` is the entry ``Runtime.start`` hands on to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from fleet.kernel.admissions import Admissions
from fleet.kernel.engine import Engine, RunFuture
from fleet.kernel.errors import DuplicateSequenceError, ExecutionBusyError, FleetError
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.flows import Features, FlowDefinition, FlowRegistry
from fleet.kernel.fold import fold_log
from fleet.kernel.lease import Lease
from fleet.kernel.queues import Queue
from fleet.kernel.run import Run
from fleet.kernel.security import Principal
from fleet.kernel.start_plan import START_GATE, StartPlan
from fleet.kernel.starts import start_payload
from fleet.kernel.store.spi_queues import QueueEntry
from fleet.kernel.timers import FiredTimer, Timers
from fleet.kernel.writes import make_events

__all__ = ["LaterRuntime", "LaterStart", "new_start", "write_delayed", "write_queued"]


class LaterRuntime(Protocol):
    """What these starts use of ``fleet.kernel.runtime.Runtime`` (which imports this)."""

    engine: Engine
    flows: FlowRegistry
    features: Features
    timers: Timers
    queues: Admissions


@dataclass(slots=True)
class LaterStart:
    """What a later start did.

    Attributes:
        execution_id: The execution it wrote (or found: an idempotent start, or the
            window a debounced start joined).
        run: The run it launched here (a queued start admitted at once, ``drive=True``).
        woken: Runs this start woke (its queue's pass admitted them, or itself) that
            no one drives yet: with ``drive=False`` the caller enqueues their drives.
        existed: The execution was there already (nothing written).
    """

    execution_id: str
    run: RunFuture | None = None
    woken: list[FiredTimer] = field(default_factory=list)
    existed: bool = False


def new_start(rt: LaterRuntime, definition: FlowDefinition, data: Any,
              principal: Principal | None, execution_id: str, now: int) -> EventEnvelope:
    """The ``EXECUTION_STARTED`` a start writes (``starts.start_payload``)."""
    return EventEnvelope.make(execution_id, 0, EventType.EXECUTION_STARTED, now,
                              start_payload(definition, data, principal, now, rt.features))


async def _write_new(engine: Engine, events: list[EventEnvelope], *,
                     keep: bool) -> Lease | None:
    """Write a new execution's first events under its fence (taken by the write). The
    lease, still held when ``keep``; None when the execution exists already."""
    execution_id = events[0].execution_id
    lease = engine.deferred(execution_id)
    try:
        await engine.writer.write(lease, events, last=not keep)
    except DuplicateSequenceError:
        return None
    except ExecutionBusyError:
        # A live lease over an id with no log: another start of it in flight.
        waited = await engine.lease_for_start(execution_id)
        if waited is None:
            return None
        lease = waited
        try:
            await engine.writer.write(lease, events, last=not keep)
        except DuplicateSequenceError:
            await lease.release()
            return None
    return lease


async def write_delayed(rt: LaterRuntime, started: EventEnvelope, due: int) -> bool:
    """A delayed start: parked on ``__fleet_start__`` until ``due``. False: it existed."""
    execution_id = started.execution_id
    events = [started, *make_events(execution_id, 0, started.timestamp, [
        (EventType.TIMER_SCHEDULED, {"timerId": START_GATE, "dueAt": due}),
        (EventType.EXECUTION_SUSPENDED, {"condition": {"on": START_GATE, "kind": "timer"}})])]
    if await _write_new(rt.engine, events, keep=False) is None:
        return False
    rt.timers.arm(fold_log(events))
    return True


async def write_queued(rt: LaterRuntime, queue: Queue, definition: FlowDefinition,
                       started: EventEnvelope, plan: StartPlan, *, eligible_at: int = 0,
                       drive: bool) -> LaterStart:
    """A queued start (see the module); ``existed`` when its id was taken."""
    engine, admissions = rt.engine, rt.queues
    execution_id, now, gate = started.execution_id, started.timestamp, queue.gate
    done = await admissions.enter(queue, QueueEntry(execution_id, queue.name, plan.key,
                                                    plan.priority, eligible_at), now)
    condition: dict[str, Any] = {"on": gate, "kind": "timer", "queue": queue.name}
    if plan.key is not None:
        condition["key"] = plan.key
    if queue.priority:
        condition["priority"] = plan.priority
    bodies: list[tuple[EventType, dict[str, Any]]] = [
        (EventType.EXECUTION_SUSPENDED, {"condition": condition})]
    at = done.entry_at
    if at is not None:
        bodies.append((EventType.TIMER_SCHEDULED, {"timerId": gate, "dueAt": at}))
        if at <= now:
            bodies.append((EventType.TIMER_FIRED, {"timerId": gate}))
    events = [started, *make_events(execution_id, 0, now, bodies)]
    fired = at is not None and at <= now
    result = LaterStart(execution_id)
    try:
        lease = await _write_new(engine, events, keep=fired and drive)
    except FleetError as exc:
        if not exc.retryable and done.entered:
            await admissions.store.queue_forget(execution_id)  # refused: nothing was written
        raise
    if lease is None:
        result.existed = True
    elif fired and drive:
        # Launched from what it wrote, as Engine.begin launches a start: no read.
        run_lease = lease.pass_on()
        result.run = engine.launch(Run(engine, definition, engine.journal(
            fold_log(events), run_lease), run_lease))
        admissions.admitted += 1
    elif fired:
        result.woken.append(FiredTimer(execution_id, gate))
        admissions.admitted += 1
    elif at is not None:
        rt.timers.arm(fold_log(events))  # a slot planned for later (a rate)
    if eligible_at > now:
        admissions.arm_pass(queue, eligible_at)
    others = [a for a in (*done.admitted, *done.rewake) if a.execution_id != execution_id]
    result.woken += await admissions.wake_all(queue, others, now, drive=drive)
    return result
