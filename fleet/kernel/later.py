"""Starts that run later: delayed, queued, debounced (decisions 0055, 0056, 0057).

``Runtime.start`` (and the dispatcher) hand a start here once ``plan_start`` found
it asks for more than an ordinary start: ``later_writes`` writes a delayed or a
queued one, ``debounce`` opens or joins a debounce window. A start whose id
exists is an idempotent start (decision 0024): the existing execution, to a
reader of the same flow, unchanged.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

from fleet.kernel.debounce import start_debounced
from fleet.kernel.errors import FlowNotFoundError, ValidationError
from fleet.kernel.events import ensure_json
from fleet.kernel.flows import FlowDefinition
from fleet.kernel.ids import check_explicit_id, idempotent_execution_id
from fleet.kernel.later_writes import (
    LaterRuntime,
    LaterStart,
    new_start,
    write_delayed,
    write_queued,
)
from fleet.kernel.security import Principal
from fleet.kernel.start_plan import plan_start

__all__ = ["LaterStart", "asks_later", "start_later"]


def _execution_id(definition: FlowDefinition, principal: Principal | None,
                  execution_id: str | None, idempotency_key: str | None) -> tuple[str, bool]:
    """The id a start writes, and whether it is fresh (random: it cannot exist yet)."""
    if idempotency_key is not None:
        return idempotent_execution_id(definition.flow_id, idempotency_key,
                                       principal.tenant if principal else None), False
    if execution_id is not None:
        return check_explicit_id(execution_id), False
    return uuid.uuid4().hex, True


def asks_later(start_at: datetime | None, start_in: timedelta | None, queue: str | None,
               key: str | None, priority: int | None, debounce: timedelta | None) -> bool:
    """Whether a start's arguments ask for more than an ordinary start."""
    return not (start_at is None and start_in is None and queue is None and key is None
                and priority is None and debounce is None)


async def start_later(rt: LaterRuntime, flow_id: str | FlowDefinition, input: Any = None, *,
                      principal: Principal | None = None, execution_id: str | None = None,
                      idempotency_key: str | None = None, drive: bool = True,
                      start_at: datetime | None = None, start_in: timedelta | None = None,
                      queue: str | None = None, key: str | None = None,
                      priority: int | None = None,
                      debounce: timedelta | None = None) -> LaterStart | None:
    """Write a delayed, queued or debounced start; what it did. None when the arguments
    ask for an ordinary start after all (a start time already here): the caller starts it.

    Checks what ``Runtime.start`` checks (the flow, the ``start`` permission, the input,
    the id), then ``plan_start``, before anything is written. Raises what
    ``Runtime.start`` raises; ``ExecutionConflictError`` for an id taken by an execution
    the principal may not have (decision 0024).
    """
    engine = rt.engine
    if isinstance(flow_id, FlowDefinition):
        flow_id = flow_id.flow_id
    definition = rt.flows.latest(flow_id)
    if definition is None:
        known = sorted({d.flow_id for d in rt.flows})
        raise FlowNotFoundError(f"no flow {flow_id!r} is registered; known flows: {known}")
    await engine.access.check(None, "start", principal, audit=False)
    data = ensure_json(input, f"the input of flow {flow_id!r}")
    if execution_id is not None and idempotency_key is not None:
        raise ValidationError("give execution_id or idempotency_key, not both")
    plan = plan_start(rt.engine.clock(), rt.queues, start_at=start_at, start_in=start_in,
                      queue=queue, key=key, priority=priority, debounce=debounce,
                      execution_id=execution_id, idempotency_key=idempotency_key)
    if plan is None:
        return None
    if plan.debounce_ms is not None:
        return await start_debounced(rt, definition, data, plan, principal=principal,
                                     drive=drive)
    eid, fresh = _execution_id(definition, principal, execution_id, idempotency_key)
    if not fresh and await engine.store.head(eid) is not None:
        await engine.existing(eid, definition.flow_id, principal)
        return LaterStart(eid, existed=True)
    started = new_start(rt, definition, data, principal, eid, rt.engine.clock())
    if plan.queue is not None:
        result = await write_queued(rt, plan.queue, definition, started, plan,
                                    eligible_at=plan.due or 0, drive=drive)
    else:
        assert plan.due is not None  # plan_start makes no plan for an ordinary start
        result = LaterStart(eid, existed=not await write_delayed(rt, started, plan.due))
    if result.existed:
        await engine.existing(eid, definition.flow_id, principal)
    return result
