"""Asking a running flow: its values (``get_value``) and updates (``update``).

``runtime.get_value(execution_id, key, timeout=)`` reads what the flow published
with ``ctx.set_value`` (the latest write; along a continue_as_new chain, the
newest run that set it). It writes nothing and takes no fence; with ``timeout`` it
waits that long for the key to appear (``WaitTimeoutError`` after), and it still
answers after the execution ended.

``runtime.update(execution_id, key, payload, timeout=, update_id=)`` delivers a
message the flow takes with ``ctx.receive(key)`` (an ``Update``) and waits for its
``ctx.reply``: the value, or ``UpdateFailedError`` with the flow's error. The flow's
validator for ``key`` (``@flow.validator(key)``) may refuse it first, with nothing
written. Exactly once: a retry with the same ``update_id`` delivers nothing new and
gets the first answer. An execution that ends without replying answers the caller
with its own error (failed) or says it ended, rather than leaving it to time out.
Decision 0033.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fleet.kernel.delivery import MAX_CHAIN, check_key, send_message
from fleet.kernel.engine import Engine
from fleet.kernel.errors import (
    ExecutionFinishedError,
    ExecutionNotFoundError,
    UpdateFailedError,
    ValidationError,
    WaitTimeoutError,
)
from fleet.kernel.fold import ExecutionState
from fleet.kernel.security import Principal
from fleet.kernel.typed import from_log, reader, to_log
from fleet.kernel.values import check_text, printable, seconds_of


async def _chain(engine: Engine, execution_id: str) -> list[ExecutionState]:
    """``execution_id`` and the runs it continued as, in order."""
    state = await engine.fold(execution_id)
    if state.sequence < 0:
        raise ExecutionNotFoundError(f"no execution {execution_id!r}")
    chain = [state]
    while state.status == "continued" and state.next_execution_id and len(chain) < MAX_CHAIN:
        state = await engine.fold(state.next_execution_id)
        if state.sequence < 0:
            break
        chain.append(state)
    return chain


async def _poll(read: Callable[[], Awaitable[Any]], timeout: float | None,
                what: Callable[[], str]) -> Any:
    """Call ``read`` until it returns something other than None, for up to ``timeout`` s."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.01
    while True:
        found = await read()
        if found is not None:
            return found
        if deadline is None or time.monotonic() >= deadline:
            raise WaitTimeoutError(what())
        await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.25)


async def get_value(engine: Engine, execution_id: str, key: str, *, timeout: Any,
                    principal: Principal | None, system: bool = False,
                    type: Any = None) -> Any:
    """``Runtime.get_value`` (see the module)."""
    check_text(key, "value key")
    adapter = reader(type)
    wait = None if timeout is None else seconds_of(timeout, "get_value timeout")
    chain = await _chain(engine, execution_id)
    await engine.access.check(chain[0], "read", principal, audit=False, system=system)

    async def read() -> tuple[Any] | None:
        runs = await _chain(engine, execution_id)
        for state in reversed(runs):
            if key in state.published:
                return (state.published[key],)
        last = runs[-1]
        if last.terminal:
            raise ExecutionFinishedError(
                f"execution {last.execution_id!r} ended ({last.status}) without setting "
                f"value {key!r}")
        return None

    found = await _poll(read, wait, lambda: (
        f"execution {execution_id!r} has set no value {key!r} "
        f"{'yet' if wait is None else f'within {wait:g} s'}"))
    return from_log(found[0], adapter, f"value {key!r}")


async def update(engine: Engine, execution_id: str, key: str, payload: Any, *,
                 timeout: Any, update_id: str | None, principal: Principal | None,
                 drive: bool = True, type: Any = None,
                 after_delivery: Callable[[str, bool], Awaitable[None]] | None = None) -> Any:
    """``Runtime.update`` (see the module). ``after_delivery(target, woke)`` runs once the
    message is durable (the fleet's dispatcher enqueues the drive there)."""
    check_key(key)
    adapter = reader(type)
    wait = None if timeout is None else seconds_of(timeout, "update timeout")
    if update_id is None:
        update_id = uuid.uuid4().hex
    elif not isinstance(update_id, str) or not update_id or len(update_id) > 200:
        raise ValidationError("update_id must be a string of 1-200 characters")
    check_text(update_id, "update_id")
    data = to_log(payload, f"the update {key!r}")
    chain = await _chain(engine, execution_id)
    answered = _reply(chain, update_id)
    if answered is None:
        await _validate(engine, chain[-1], key, data)
        target, woke = await send_message(engine, execution_id, key, data,
                                          principal=principal, drive=drive,
                                          update_id=update_id)
        if after_delivery is not None:
            await after_delivery(target, woke)

    async def read() -> tuple[Any] | None:
        runs = await _chain(engine, execution_id)
        reply = _reply(runs, update_id)
        if reply is not None:
            return reply
        last = runs[-1]
        if last.terminal:
            error = last.error or {"type": "Ended", "message": last.status}
            raise UpdateFailedError(
                f"execution {last.execution_id!r} ended ({last.status}) without replying to "
                f"update {update_id!r}: {error.get('type', '')}: {error.get('message', '')}",
                error=error)
        return None

    found = await _poll(read, wait, lambda: (
        f"execution {execution_id!r} has not replied to update {update_id!r} "
        f"{'yet' if wait is None else f'within {wait:g} s'}; wait again with the same "
        "update_id to get its answer"))
    return from_log(found[0], adapter, f"the reply to update {update_id!r}")


def _reply(chain: list[ExecutionState], update_id: str) -> tuple[Any] | None:
    """The reply the chain holds for ``update_id``: ``(value,)``, or it raises the error."""
    for state in chain:
        reply = state.replies.get(update_id)
        if reply is None:
            continue
        if "error" in reply and reply["error"] is not None:
            error = reply["error"]
            raise UpdateFailedError(
                f"the flow refused update {update_id!r}: {error.get('type', '')}: "
                f"{error.get('message', '')}", error=error)
        return (reply.get("value"),)
    return None


async def _validate(engine: Engine, state: ExecutionState, key: str, data: Any) -> None:
    """The flow's validator for ``key``, when this runtime knows the flow: a refusal raises
    ``UpdateFailedError`` before anything is written."""
    if state.terminal:
        raise ExecutionFinishedError(f"execution {state.execution_id!r} already ended "
                                     f"({state.status}); nothing takes the update")
    definition = engine.flows.latest(state.flow_id or "")
    check = definition.validators.get(key) if definition is not None else None
    if check is None:
        return
    try:
        verdict = check(data)
        if inspect.isawaitable(verdict):
            await verdict
    except Exception as exc:
        error = {"type": type(exc).__name__, "message": printable(str(exc), 4000),
                 "retryable": False}
        raise UpdateFailedError(f"update {key!r} refused by the flow's validator: "
                                f"{error['type']}: {error['message']}", error=error) from exc


__all__ = ["get_value", "update"]
