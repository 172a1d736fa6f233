"""Starts that run later: delayed, queued, debounced (decisions 0055, 0056, 0057).

``Runtime.start`` (and the dispatcher) hand a start here once ``plan_start`` found
it asks for more than an ordinary start: ``later_writes`` writes a delayed or a
queued one, ``debounce`` opens or joins a debounce window. A start whose id
exists is an idempotent start (decision 0024): the existing execution, to a
reader of the same flow, unchanged.
"""

from __future__ import annotations

import uuid
from typing import Any

from fleet.kernel.debounce import start_debounced
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
from fleet.kernel.start_plan import StartPlan

__all__ = ["LaterStart", "start_later"]


def _execution_id(definition: FlowDefinition, principal: Principal | None,
                  execution_id: str | None, idempotency_key: str | None) -> tuple[str, bool]:
    """The id a start writes, and whether it is fresh (random: it cannot exist yet)."""
    if idempotency_key is not None:
        return idempotent_execution_id(definition.flow_id, idempotency_key,
                                       principal.tenant if principal else None), False
    if execution_id is not None:
        return check_explicit_id(execution_id), False
    return uuid.uuid4().hex, True


async def start_later(rt: LaterRuntime, definition: FlowDefinition, data: Any,
                      plan: StartPlan, *, principal: Principal | None,
                      execution_id: str | None = None, idempotency_key: str | None = None,
                      drive: bool = True) -> LaterStart:
    """Write a delayed, queued or debounced start; what it did.

    Raises what ``Runtime.start`` raises; ``ExecutionConflictError`` for an id taken
    by an execution the principal may not have (decision 0024).
    """
    if plan.debounce_ms is not None:
        return await start_debounced(rt, definition, data, plan, principal=principal,
                                     drive=drive)
    engine = rt.engine
    eid, fresh = _execution_id(definition, principal, execution_id, idempotency_key)
    if not fresh and await engine.store.head(eid) is not None:
        await engine.existing(eid, definition.flow_id, principal)
        return LaterStart(eid, existed=True)
    started = new_start(rt, definition, data, principal, eid, rt.clock())
    if plan.queue is not None:
        result = await write_queued(rt, plan.queue, started, plan,
                                    eligible_at=plan.due or 0, drive=drive)
    else:
        assert plan.due is not None  # plan_start makes no plan for an ordinary start
        result = LaterStart(eid, existed=not await write_delayed(rt, started, plan.due))
    if result.existed:
        await engine.existing(eid, definition.flow_id, principal)
    return result
