"""What a flow says to the world besides steps: messages, resumes, values and replies.

- ``ctx.send(execution_id, key, payload)`` / ``ctx.resume(execution_id, gate,
  payload)``: reach another execution exactly once. The call is recorded
  (``MESSAGE_SENT``) after the delivery, and the delivery carries the sender and
  its call (``sendId``), so a replay does not send again and a crash between the
  two delivers nothing twice. Authorised as the flow's own principal (its owner);
  a refusal (``AccessDeniedError``, ``ExecutionNotFoundError``...) is recorded and
  raised in the flow, again on every replay.
- ``ctx.set_value(key, value)``: a value a caller reads while the flow runs
  (``runtime.get_value``); durable, last write wins (``VALUE_SET``).
- ``ctx.reply(update, value)`` / ``ctx.reply(update, error=...)``: the answer to a
  ``runtime.update`` the flow took with ``ctx.receive`` (``UPDATE_REPLIED``); a
  second reply to one update is refused (``DuplicateReplyError``).

Decision 0033.
"""

from __future__ import annotations

from typing import Any

from fleet.kernel.errors import (
    AccessDeniedError,
    DuplicateReplyError,
    ExecutionFinishedError,
    ExecutionNotFoundError,
    ExecutionStateError,
    FleetError,
    GateMismatchError,
    ValidationError,
)
from fleet.kernel.events import EventType
from fleet.kernel.flow_run import RESERVED_PREFIX, Where
from fleet.kernel.typed import to_log
from fleet.kernel.values import check_text, printable
from fleet.kernel.waits import Update

# Refusals a flow's send or resume records and raises again on replay: what the
# target or the access rules answered, which a retry would answer the same way.
_RECORDED = (AccessDeniedError, ExecutionNotFoundError, ExecutionFinishedError,
             GateMismatchError, ExecutionStateError)
_RAISED: dict[str, type[FleetError]] = {cls.__name__: cls for cls in (
    AccessDeniedError, ExecutionNotFoundError, ExecutionFinishedError, GateMismatchError,
    ExecutionStateError)}


def _check_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValidationError(f"a {what} must be a non-empty string")
    check_text(value, what)
    if value.startswith(RESERVED_PREFIX):
        raise ValidationError(f"{what} {value!r} uses the reserved prefix {RESERVED_PREFIX}")
    return value


async def deliver(where: Where, target: Any, *, key: str | None = None,
                  gate: str | None = None, payload: Any = None) -> None:
    """``ctx.send`` (``key``) or ``ctx.resume`` (``gate``); see the module."""
    run = where.run
    run.check_unwinding()
    target = _check_name(target, "target execution id")
    if key is not None:
        _check_name(key, "message key")
    else:
        _check_name(gate, "gate name")
    data = to_log(payload, "the payload of ctx.send" if key is not None
                  else "the payload of ctx.resume")
    name = where.name("send" if key is not None else "resume")
    recorded = run.state.sent.get(name)
    if recorded is not None:
        _raise_recorded(recorded)
        return
    await run.before_new_work(EventType.MESSAGE_SENT, name)
    # Reaching another execution acts outside a step: only under the run's fence.
    await run.journal.hold()
    body: dict[str, Any] = {"name": name, "target": target}
    body["key" if key is not None else "gate"] = key if key is not None else gate
    try:
        await run.services.deliver(run.state, target, key=key, gate=gate, payload=data,
                                   send_id=f"{run.state.execution_id}:{name}")
    except _RECORDED as refused:
        body["error"] = {"type": type(refused).__name__, "code": refused.code,
                         "message": printable(refused.message, 4000),
                         "retryable": refused.retryable}
        run.journal.commit(EventType.MESSAGE_SENT, body)
        raise
    run.journal.commit(EventType.MESSAGE_SENT, body)


def _raise_recorded(recorded: dict[str, Any]) -> None:
    error = recorded.get("error")
    if not isinstance(error, dict):
        return
    cls = _RAISED.get(str(error.get("type")), ExecutionStateError)
    raise cls(str(error.get("message", "")))


async def set_value(where: Where, key: Any, value: Any) -> None:
    """``ctx.set_value``: record ``value`` under ``key`` (see the module)."""
    run = where.run
    run.check_unwinding()
    _check_name(key, "value key")
    data = to_log(value, f"the value {key!r}")
    name = where.name("set")
    if name in run.state.published_names:
        return
    run.journal.commit(EventType.VALUE_SET, {"name": name, "key": key, "value": data})


async def reply(where: Where, update: Any, value: Any = None, *,
                error: BaseException | str | None = None) -> None:
    """``ctx.reply``: answer ``update`` with ``value``, or with ``error`` (see the module)."""
    run = where.run
    run.check_unwinding()
    if not isinstance(update, Update):
        raise DuplicateReplyError(
            f"ctx.reply answers an update (what ctx.receive returns for runtime.update); got "
            f"a {type(update).__name__}: a plain message (runtime.send) takes no reply")
    if update.update_id in run.replied:
        raise DuplicateReplyError(f"update {update.update_id!r} was replied to already")
    run.replied.add(update.update_id)
    if update.update_id in run.state.replies:
        return  # a replay: the log holds this reply
    body: dict[str, Any] = {"updateId": update.update_id}
    if error is not None:
        if isinstance(error, BaseException):
            body["error"] = {"type": type(error).__name__,
                             "message": printable(str(error), 4000), "retryable": False}
        else:
            body["error"] = {"type": "UpdateRejected", "message": printable(str(error), 4000),
                             "retryable": False}
    else:
        body["value"] = to_log(value, f"the reply to update {update.update_id!r}")
    run.journal.commit(EventType.UPDATE_REPLIED, body)


__all__ = ["deliver", "reply", "set_value"]
