"""Steps: the only calls of a flow that act on the world (``ctx.step``).

A step runs its function once, durably: ``STEP_STARTED`` is durable before
the effect starts (decision 0002), the result is recorded in ``STEP_COMPLETED``
and a replay returns the recorded output instead of running it again. A
failing attempt is recorded in ``STEP_FAILED`` with its ``retryAt``; the
``RetryPolicy`` decides whether another attempt follows. A step found started
but unfinished after a crash is in doubt: it runs again (at least once) unless
``idempotent=False``, which parks the execution on the in-doubt gate for an
operator (decision 0005). How an attempt runs (a sync function in a thread,
within its ``timeout`` and ``heartbeat``) is ``step_controls``; the
``RetryPolicy`` is ``retry`` (decisions 0053, 0054).

The output is recorded as the step returned it: the log keeps a snapshot taken
when the step returned, and the flow gets a copy of its own that it may mutate
freely (issue 26 7a: the journal encodes later, so a flow mutating the object
it got would otherwise change what the log records).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from pydantic import TypeAdapter

from fleet.kernel.cancel_delivery import cancel_owed
from fleet.kernel.errors import (
    DuplicateStepError,
    ExecutionParked,
    NotSerializableError,
    RunInterrupt,
    ValidationError,
)
from fleet.kernel.events import EventType, dumps, ensure_json
from fleet.kernel.flow_run import FlowRun, Where, check_op_id
from fleet.kernel.fold import INDOUBT_GATE
from fleet.kernel.retry import DEFAULT_RETRY, NO_RETRY, RetryPolicy
from fleet.kernel.step_controls import (
    StepControls,
    attempt_error,
    call_step,
    step_controls,
    step_failed,
)
from fleet.kernel.typed import from_log, return_adapter, to_log
from fleet.kernel.values import due_after

# JSON values no caller can mutate: handed to the flow as they are recorded.
_IMMUTABLE = frozenset({type(None), bool, int, float, str})


def recorded_and_handed(value: Any, what: str,
                        adapter: TypeAdapter[Any] | None = None) -> tuple[Any, Any]:
    """``value`` as the log records it, and a copy of that for the flow to keep (as the
    type ``adapter`` names, when the step's function annotates one: ``fleet.kernel.typed``).

    The two are equal and share nothing, so a flow that mutates what it got
    never changes what the log records (nor what a replay returns).
    """
    if adapter is not None:
        recorded = to_log(value, what, adapter)
        return recorded, from_log(recorded, adapter, what)
    try:
        recorded = ensure_json(value, what)
    except NotSerializableError:
        recorded = to_log(value, what)  # models and dataclasses in it: their JSON form
    if type(recorded) in _IMMUTABLE:
        return recorded, recorded
    return recorded, json.loads(dumps(recorded))


class _RetrySentinel:
    pass


_RETRY: Any = _RetrySentinel()


async def run_step(where: Where, step_id: str, fn: Callable[..., Any],
                   args: tuple[Any, ...], kwargs: dict[str, Any], *,
                   retry: RetryPolicy | None, idempotent: bool, timeout: Any = None,
                   heartbeat: Any = None, blocking: Any = True) -> Any:
    """``ctx.step``: run ``fn(*args, **kwargs)`` once, durably (see the module).

    A cancellation owed to the flow is delivered here when the log does not hold
    the step's end (decision 0033): a step started and not finished is recorded
    cancelled (``STEP_CANCELLED``: whatever its effect did, its result is not
    waited for) and the flow gets ``asyncio.CancelledError`` instead of a re-run.
    """
    run, scope = where.run, where.scope
    check_op_id(step_id, "step")
    controls = None if timeout is None and heartbeat is None and blocking is True \
        else step_controls(timeout, heartbeat, blocking)
    if step_id in run.asked_steps:
        raise DuplicateStepError(
            f"step id {step_id!r} was asked for twice in execution "
            f"{run.state.execution_id!r}; step ids are unique per execution (mint 'id#n' "
            "for a loop)")
    run.asked_steps.add(step_id)
    run.note_step(step_id, scope)
    frame = run.state.frames.get(step_id)
    owed = cancel_owed(run, where.branch, f"step:{step_id}", answered=frame is not None
                       and frame.status in ("completed", "failed", "cancelled"))
    if owed is not None:
        if frame is not None and frame.status in ("started", "indoubt", "retrying"):
            run.journal.commit(EventType.STEP_CANCELLED, {"stepId": step_id,
                                                          "reason": "cancelled"})
        raise owed
    if frame is not None:
        if frame.status == "completed":
            return from_log(frame.output, return_adapter(fn), f"the output of step {step_id!r}")
        if frame.status in ("failed", "cancelled"):
            raise step_failed(step_id, frame.error or {})
        if frame.status in ("started", "indoubt"):
            answer = await _in_doubt(run, scope, step_id, frame.attempts, idempotent)
            if answer is not _RETRY:
                return answer
        elif frame.status == "retrying" and frame.retry_at is not None:
            delay = (frame.retry_at - run.clock()) / 1000
            if delay > 0:
                await asyncio.sleep(delay)
    return await _run_live(run, scope, step_id, fn, args, kwargs, retry or DEFAULT_RETRY,
                           frame.attempts if frame is not None else 0, controls)


async def _in_doubt(run: FlowRun, scope: str | None, step_id: str, attempts: int,
                    idempotent: bool) -> Any:
    frame = run.state.frames[step_id]
    if frame.status == "started":
        await run.before_new_work(EventType.EFFECT_INDOUBT, step_id, scope)
        run.journal.commit(EventType.EFFECT_INDOUBT,
                           {"stepId": step_id, "attempt": max(attempts, 1),
                            "idempotent": idempotent})
    if idempotent:
        return _RETRY
    for answer in run.state.resume_payloads.get(INDOUBT_GATE, []):
        if isinstance(answer, dict) and answer.get("stepId") == step_id:
            if answer.get("action") == "complete":
                output, handed = recorded_and_handed(answer.get("output"),
                                                     f"in-doubt answer for {step_id!r}")
                run.journal.commit(EventType.STEP_COMPLETED,
                                   {"stepId": step_id, "attempt": max(attempts, 1),
                                    "output": output})
                return handed
            return _RETRY
    raise run.issue(ExecutionParked({"on": INDOUBT_GATE, "kind": "indoubt",
                                     "correlationKey": step_id}))


async def _run_live(run: FlowRun, scope: str | None, step_id: str, fn: Callable[..., Any],
                    args: tuple[Any, ...], kwargs: dict[str, Any], retry: RetryPolicy,
                    attempts: int, controls: StepControls | None) -> Any:
    journal = run.journal
    while True:
        attempt = attempts + 1
        await run.before_new_work(EventType.STEP_STARTED, step_id, scope)
        if journal.on_event is not None:
            # on_event never announces a step while an earlier write is in
            # flight (ADR 0147's first table). Without an on_event consumer
            # nothing can tell, so the previous step's completion and this
            # start share one write (decision 0002).
            await journal.barrier()
        payload: dict[str, Any] = {"stepId": step_id, "attempt": attempt}
        if scope is not None:
            payload["scope"] = scope
        journal.commit(EventType.STEP_STARTED, payload)
        await journal.barrier()
        try:
            # In a thread when blocking, within the step's limits (step_controls).
            result = await call_step(run, step_id, attempt, fn, args, kwargs, controls)
        except (RunInterrupt, asyncio.CancelledError):
            raise
        except Exception as exc:
            retryable = retry.retries(exc)
            final = not retryable or attempt >= retry.max_attempts
            error = attempt_error(exc, retryable)
            fail: dict[str, Any] = {"stepId": step_id, "attempt": attempt, "error": error,
                                    "final": final}
            delay = 0.0
            if not final:
                delay = retry.delay(attempt)
                fail["retryAt"] = due_after(run.clock(), delay, "a retry delay")
            journal.commit(EventType.STEP_FAILED, fail)
            if final:
                raise step_failed(step_id, error) from exc
            await journal.barrier()
            await asyncio.sleep(delay)
            attempts = attempt
            continue
        try:
            output, handed = recorded_and_handed(result, f"the output of step {step_id!r}",
                                                 return_adapter(fn))
        except ValidationError as refused:
            # The effect ran and its result can never be recorded: the run
            # fails (decision 0023) rather than leave the step started for a
            # re-drive to run again. Not a step failure the flow could catch:
            # the flow cannot undo an effect it never saw the result of.
            raise journal.refuse(refused) from refused
        journal.commit(EventType.STEP_COMPLETED,
                       {"stepId": step_id, "attempt": attempt, "output": output})
        return handed


__all__ = ["DEFAULT_RETRY", "NO_RETRY", "RetryPolicy", "recorded_and_handed", "run_step"]
