"""``Runtime.cancel``: a cancellation the flow sees, or (``force=True``) an immediate end.

A graceful cancel records ``CANCEL_REQUESTED`` (with the reason and who asked)
and drives the execution: a parked or sleeping run is woken, a run in flight
here is stopped and driven again, a holder elsewhere is fenced out (its lease
taken: a write it tries after that is refused, and its renewal fails, which
stops it). The new drive replays the body and delivers ``asyncio.CancelledError``
at the await the run was parked or running on (``fleet.kernel.cancel_delivery``);
the flow's cleanup then runs as journaled steps, and the execution ends
``cancelled`` if the flow lets the error out. The first request stands:
cancelling again changes nothing (``False``), as in Temporal.

``force=True`` is Temporal's terminate: the steps in flight are recorded
cancelled and ``EXECUTION_CANCELLED`` is written at once, with no cleanup. A run
whose body never ran (a delayed start, a run waiting for its queue's admission:
decisions 0055, 0056) ends so too: there is no cleanup to run, and delivering the
error would run the body's code up to its first call.
Cancelling a finished execution raises ``ExecutionFinishedError`` either way.
Decision 0033.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator
from typing import Any

from fleet.kernel.engine import Engine, RunFuture
from fleet.kernel.errors import (
    ExecutionFinishedError,
    ExecutionNotFoundError,
    ValidationError,
)
from fleet.kernel.events import EventType
from fleet.kernel.fold import ExecutionState, fold_log
from fleet.kernel.security import Principal
from fleet.kernel.start_plan import START_GATE
from fleet.kernel.store.spi_queues import QUEUE_GATE_PREFIX
from fleet.kernel.values import check_text
from fleet.kernel.writes import make_events

MAX_REASON = 4000


def check_reason(reason: Any) -> str:
    """A cancel reason the log keeps: text of at most 4,000 characters."""
    if not isinstance(reason, str):
        raise ValidationError(f"a cancel reason must be a string, got {type(reason).__name__}")
    if len(reason) > MAX_REASON:
        raise ValidationError(f"a cancel reason is at most {MAX_REASON} characters, got "
                              f"{len(reason)}")
    return check_text(reason, "cancel reason")


# Cancels of one execution in one process, one at a time: a second (a parent's cancel and
# then its end both close a child) then sees the first's request and changes nothing,
# rather than taking the fence from the drive that delivers it, mid-step (its step would
# run again, in doubt). Per engine (held weakly): execution id -> [lock, its users].
_LOCKS: weakref.WeakKeyDictionary[Engine, dict[str, list[Any]]] = weakref.WeakKeyDictionary()


@contextlib.asynccontextmanager
async def _one_at_a_time(engine: Engine, execution_id: str) -> AsyncIterator[None]:
    locks = _LOCKS.setdefault(engine, {})
    entry = locks.setdefault(execution_id, [asyncio.Lock(), 0])
    entry[1] += 1
    try:
        async with entry[0]:
            yield
    finally:
        entry[1] -= 1
        if entry[1] == 0:
            locks.pop(execution_id, None)


def _finished(state: ExecutionState) -> ExecutionFinishedError:
    return ExecutionFinishedError(
        f"execution {state.execution_id!r} already ended ({state.status})")


async def cancel_execution(engine: Engine, execution_id: str, *, reason: str,
                           principal: Principal | None, force: bool, drive: bool,
                           system: bool = False) -> tuple[bool, RunFuture | None]:
    """Cancel ``execution_id`` (see the module): whether this call recorded the request
    (or, forced, ended it), and the drive it launched here (None with ``drive=False``:
    the caller enqueues it; or when nothing was recorded). ``system``: the kernel's own
    (a parent's children), not judged by the access policy."""
    reason = check_reason(reason)
    async with _one_at_a_time(engine, execution_id):
        return await _cancel(engine, execution_id, reason=reason, principal=principal,
                             force=force, drive=drive, system=system)


async def _cancel(engine: Engine, execution_id: str, *, reason: str,
                  principal: Principal | None, force: bool, drive: bool,
                  system: bool) -> tuple[bool, RunFuture | None]:
    state = await engine.fold(execution_id)
    if state.sequence < 0:
        raise ExecutionNotFoundError(f"no execution {execution_id!r}")
    await engine.access.check(state, "cancel", principal, audit=True, system=system)
    if state.terminal:
        raise _finished(state)
    if not force and state.cancel is not None:
        return False, None  # requested already: the first request stands
    lease = await engine.take(execution_id)
    async with lease:
        # A run of it here stops at once and is driven again (or, forced, not at all).
        await engine.stop_local(execution_id, "cancelled" if force else "superseded")
        state = await engine.fold(execution_id)
        if state.terminal:
            raise _finished(state)
        if force or _never_ran(state):
            bodies: list[tuple[EventType, dict[str, Any]]] = [
                (EventType.STEP_CANCELLED, {"stepId": step_id, "reason": "cancelled"})
                for step_id, frame in state.frames.items()
                if frame.status in ("started", "retrying", "indoubt")]
            bodies.append((EventType.EXECUTION_CANCELLED, {"reason": reason}))
            made = make_events(execution_id, state.sequence, engine.clock(), bodies)
            await engine.writer.write(lease, made)
            engine.ended(fold_log(made, state))
            return True, None
        if state.cancel is not None:
            # Another canceller got there first; this one took the fence (and stopped a
            # run of it here): drive it, or its delivery would wait for the sweeper.
            return False, (await engine.drive(execution_id, lease) if drive else None)
        body: dict[str, Any] = {"reason": reason}
        if principal is not None:
            body["by"] = principal.actor
        requested = make_events(execution_id, state.sequence, engine.clock(),
                                [(EventType.CANCEL_REQUESTED, body)])
        await engine.writer.write(lease, requested, last=not drive)
        if engine.on_cancel_requested is not None:
            engine.on_cancel_requested(fold_log(requested, state))
        if not drive:
            return True, None
        return True, await engine.drive(execution_id, lease)


def _never_ran(state: ExecutionState) -> bool:
    """Parked on the gate a delayed or queued start waits on before its body first runs."""
    on = str((state.waiting or {}).get("on") or "") if state.parked else ""
    return on == START_GATE or on.startswith(QUEUE_GATE_PREFIX)


__all__ = ["MAX_REASON", "cancel_execution", "check_reason"]
