"""Debounced starts: one run per window of a key, with the last input (decision 0057).

``start(flow, input, debounce=timedelta(seconds=5), key="user-7")``. The store
keeps a pointer per scope (``sha256([tenant, flow, key])``) to the window's
execution (``HoldsQueues.debounce_get`` / ``debounce_claim``, a compare-and-set).

- No window open (no pointer, or its execution has begun): a new execution with a
  fresh id, a delayed start due ``now + window`` (``later_writes.write_delayed``), or with
  ``queue=`` a queued start eligible then (``later_writes.write_queued``); the pointer is
  claimed before its log is written.
- A window open (its execution still parked on ``__fleet_start__``, or still waiting
  for its queue's eligibility): ``EXECUTION_DEBOUNCED`` (the new input; the fold makes
  it the run's input) and the later due time (``TIMER_SCHEDULED`` of the same timer,
  or the entry's eligibility moved by ``queue_delay``), under that execution's fence.

A window is joined only by a principal who may read its execution, for the same
flow (``Engine.existing``, decision 0024).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from typing import Any

from fleet.kernel.errors import (
    ConfigurationError,
    DuplicateSequenceError,
    ExecutionBusyError,
)
from fleet.kernel.events import EventType
from fleet.kernel.flows import FlowDefinition
from fleet.kernel.fold import ExecutionState, fold_log
from fleet.kernel.later_writes import (
    LaterRuntime,
    LaterStart,
    new_start,
    write_delayed,
    write_queued,
)
from fleet.kernel.security import Principal
from fleet.kernel.start_plan import START_GATE, StartPlan
from fleet.kernel.store.spi_queues import (
    DEFAULT_GRACE_MS,
    QUEUE_GATE_PREFIX,
    HoldsQueues,
    holds_queues,
)
from fleet.kernel.writes import make_events

__all__ = ["debounce_scope", "start_debounced"]

_TRIES = 50


def debounce_scope(tenant: str | None, flow_id: str, key: str) -> str:
    """The store's pointer key of a debounce window: the tenant, the flow and the key."""
    return hashlib.sha256(json.dumps([tenant, flow_id, key]).encode()).hexdigest()


def _open_window(state: ExecutionState) -> str | None:
    """``"timer"`` or ``"queue"`` when ``state`` is a window still open; None once it began."""
    if not state.parked:
        return None
    on = str((state.waiting or {}).get("on", ""))
    if on == START_GATE and not (state.timers.get(START_GATE) or {}).get("fired"):
        return "timer"
    if on.startswith(QUEUE_GATE_PREFIX) and on not in state.timers:
        return "queue"
    return None


async def _extend(rt: LaterRuntime, store: HoldsQueues, state: ExecutionState, form: str,
                  data: Any, due: int, principal: Principal | None) -> bool:
    """Join an open window; False when it closed meanwhile (the caller looks again)."""
    engine = rt.engine
    execution_id = state.execution_id
    bodies: list[tuple[EventType, dict[str, Any]]] = [
        (EventType.EXECUTION_DEBOUNCED, {"input": data, "dueAt": due,
                                         "by": principal.actor if principal else None})]
    if form == "timer":
        bodies.append((EventType.TIMER_SCHEDULED, {"timerId": START_GATE, "dueAt": due}))
    elif not await store.queue_delay(execution_id, due):
        return False  # admitted meanwhile: its run has begun
    made = make_events(execution_id, state.sequence, engine.clock(), bodies)
    try:
        await engine.writer.write(engine.deferred(execution_id), made, last=True)
    except (ExecutionBusyError, DuplicateSequenceError):
        return False
    if form == "timer":
        rt.timers.arm(fold_log(made, state))
    else:
        queue = rt.queues.by_name.get(str((state.waiting or {}).get("on", ""))[
            len(QUEUE_GATE_PREFIX):])
        if queue is not None:
            rt.queues.arm_pass(queue, due)
    return True


async def start_debounced(rt: LaterRuntime, definition: FlowDefinition, data: Any,
                          plan: StartPlan, *, principal: Principal | None,
                          drive: bool = True) -> LaterStart:
    """Open or join the debounce window of ``plan.key`` (see the module)."""
    engine = rt.engine
    store = engine.store
    if not holds_queues(store) or not isinstance(store, HoldsQueues):
        raise ConfigurationError(f"{type(store).__name__} keeps no debounce pointers "
                                 "(spi_queues.HoldsQueues): debounce needs a store that does")
    assert plan.key is not None
    assert plan.debounce_ms is not None
    scope = debounce_scope(principal.tenant if principal else None, definition.flow_id,
                           plan.key)
    delay = 0.01
    for _ in range(_TRIES):
        now = rt.engine.clock()
        due = now + plan.debounce_ms
        claim = await store.debounce_get(scope)
        if claim is not None:
            state = await engine.fold(claim.execution_id)
            if state.sequence < 0 and now - claim.claimed_at < DEFAULT_GRACE_MS:
                await asyncio.sleep(delay)  # claimed, its log not written yet
                delay = min(delay * 2, 0.25)
                continue
            form = _open_window(state) if state.sequence >= 0 else None
            if form is not None:
                await engine.existing(claim.execution_id, definition.flow_id, principal)
                if await _extend(rt, store, state, form, data, due, principal):
                    return LaterStart(claim.execution_id, existed=True)
                continue  # it closed meanwhile (fired, admitted): look again
        execution_id = uuid.uuid4().hex
        if not await store.debounce_claim(scope, execution_id, now_ms=now,
                                          expect=claim.execution_id if claim else None):
            continue  # another start claimed it first: join that window
        started = new_start(rt, definition, data, principal, execution_id, now)
        if plan.queue is not None:
            return await write_queued(rt, plan.queue, definition, started, plan,
                                      eligible_at=due, drive=drive)
        await write_delayed(rt, started, due)
        return LaterStart(execution_id)
    raise ExecutionBusyError(f"the debounce window of key {plan.key!r} kept changing under this "
                             "start; nothing was written, retry")
