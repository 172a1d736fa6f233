"""Answers to executions: a gate's resume and a message (``Runtime.resume``/``send``).

Both are authorised against the recorded owner, written under the execution's
fence (taken only when no live lease is held: a run holds it while it runs) and,
when they wake a parked execution, followed by its drive. A message to a run in
flight in this runtime joins that run's journal.

An execution that continued as new is answered in the newest run of its chain
(issue 26 7d): a message or resume to ``order-7`` reaches ``order-7~3``.

A flow's own ``ctx.send``/``ctx.resume`` and ``runtime.update`` come through here
too, carrying an id: ``sendId`` (the sender and its call) makes a repeat after a
crash a no-op, ``updateId`` marks an update the flow replies to. Decision 0033.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleet.kernel.engine import Engine, RunFuture
from fleet.kernel.errors import (
    ExecutionBusyError,
    ExecutionFinishedError,
    ExecutionNotFoundError,
    ReservedNameError,
    ValidationError,
)
from fleet.kernel.events import EventType
from fleet.kernel.flow_run import RESERVED_PREFIX
from fleet.kernel.fold import DIVERGED_GATE, INDOUBT_GATE, MESSAGE_GATE, ExecutionState, waits_on
from fleet.kernel.gates import check_resumable, indoubt_answer
from fleet.kernel.security import Principal
from fleet.kernel.typed import to_log
from fleet.kernel.values import check_text
from fleet.kernel.writes import make_events

# How many continue_as_new links a message follows before it gives up (a cycle).
MAX_CHAIN = 10_000


async def newest(engine: Engine, execution_id: str) -> ExecutionState:
    """The state of the newest run of ``execution_id``'s continue_as_new chain."""
    state = await engine.fold(execution_id)
    if state.sequence < 0:
        raise ExecutionNotFoundError(f"no execution {execution_id!r}")
    for _ in range(MAX_CHAIN):
        if state.status != "continued" or not state.next_execution_id:
            return state
        nxt = await engine.fold(state.next_execution_id)
        if nxt.sequence < 0:
            return state  # the successor is being started: the chain ends here for now
        state = nxt
    raise ExecutionBusyError(f"the continue_as_new chain of {execution_id!r} is longer than "
                             f"{MAX_CHAIN} runs")


def check_key(key: Any) -> str:
    """A message key ``ctx.receive`` could take (refused before anything is written)."""
    if not isinstance(key, str) or not key:
        raise ValidationError("a message key must be a non-empty string")
    check_text(key, "message key")
    if key.startswith(RESERVED_PREFIX):
        raise ReservedNameError(f"message key {key!r} uses the reserved prefix "
                                f"{RESERVED_PREFIX}")
    return key


async def resume_gate(engine: Engine, execution_id: str, gate: str, payload: Any, *,
                      principal: Principal | None, drive: bool, send_id: str | None = None,
                      system: bool = False) -> tuple[str, RunFuture | None]:
    """Answer the gate a parked execution waits on, then drive it; the execution answered
    (the newest of its chain) and its drive. A repeat of ``send_id`` answers nothing."""
    state = await newest(engine, execution_id)
    execution_id = state.execution_id
    await engine.access.check(state, "resume", principal, audit=True, system=system)
    data = to_log(payload, f"the payload for gate {gate!r}")
    if send_id is not None and send_id in state.send_ids:
        return execution_id, None
    check_resumable(state, gate, running=await engine.why_running(state))
    lease = await engine.take_if_free(execution_id)
    if lease is None:
        raise ExecutionBusyError(
            f"execution {execution_id!r} is held by a live lease; retry shortly")
    async with lease:
        state = await engine.fold(execution_id)  # re-judge under the fence
        if send_id is not None and send_id in state.send_ids:
            return execution_id, None
        check_resumable(state, gate)
        if gate == INDOUBT_GATE:
            data = indoubt_answer(state, data)
        elif gate == DIVERGED_GATE:
            data = None  # status-only: the answer never reaches the flow
        body: dict[str, Any] = {"gate": gate, "payload": data}
        if principal is not None:
            body["by"] = principal.actor
        if send_id is not None:
            body["sendId"] = send_id
        run = await engine.answer(state, lease, [(EventType.EXECUTION_RESUMED, body)],
                                  drive=drive)
    return execution_id, run


async def send_message(engine: Engine, execution_id: str, key: str, payload: Any, *,
                       principal: Principal | None, drive: bool, send_id: str | None = None,
                       update_id: str | None = None,
                       system: bool = False) -> tuple[str, bool]:
    """Deliver a message to ``ctx.receive(key)``; the execution it reached (the newest of
    its chain) and whether it woke a parked execution (with ``drive=False`` the caller
    then enqueues its drive). A repeat of ``send_id`` or ``update_id`` delivers nothing."""
    check_key(key)  # what ctx.receive would refuse is refused here too
    state = await newest(engine, execution_id)
    execution_id = state.execution_id
    await engine.access.check(state, "send", principal, audit=False, system=system)
    data = to_log(payload, f"the message {key!r}")
    body: dict[str, Any] = {"key": key, "payload": data}
    if send_id is not None:
        body["sendId"] = send_id
    if update_id is not None:
        body["updateId"] = update_id
    message = (EventType.MESSAGE_RECEIVED, body)
    for _ in range(50):
        if _delivered(state, send_id, update_id):
            return execution_id, False
        run = engine.runs.get(execution_id)
        if run is not None and run.journal.failed is None and not run.state.parked \
                and not run.state.terminal and not run.continuing:
            # Held by a run here: the message joins that run's journal.
            if _delivered(run.state, send_id, update_id):
                return execution_id, False
            run.journal.commit(*message)
            await run.journal.barrier()
            return execution_id, False
        if run is not None and run.task is not None and not run.task.done():
            await asyncio.wait({run.task})
            state = await newest(engine, execution_id)
            execution_id = state.execution_id
            continue
        lease = await engine.take_if_free(execution_id)
        if lease is None:
            raise ExecutionBusyError(
                f"execution {execution_id!r} is held by a live lease elsewhere; retry")
        async with lease:
            state = await engine.fold(execution_id)
            if state.terminal:
                raise ExecutionFinishedError(
                    f"execution {execution_id!r} already ended ({state.status})")
            if _delivered(state, send_id, update_id):
                return execution_id, False
            if state.parked and waits_on(state.waiting, "message", MESSAGE_GATE, key):
                await engine.answer(state, lease, [
                    message, (EventType.EXECUTION_RESUMED, {"gate": MESSAGE_GATE})],
                    drive=drive)
                return execution_id, True
            await engine.writer.write(lease, make_events(execution_id, state.sequence,
                                                         engine.clock(), [message]))
            return execution_id, False
    raise ExecutionBusyError(f"execution {execution_id!r} stayed busy; retry")


def _delivered(state: ExecutionState, send_id: str | None, update_id: str | None) -> bool:
    """Whether the log holds this message already (a repeat after a crash or a retry)."""
    if send_id is not None and send_id in state.send_ids:
        return True
    return update_id is not None and any(update_id in ids for ids in state.message_ids.values())


__all__ = ["MAX_CHAIN", "check_key", "newest", "resume_gate", "send_message"]
