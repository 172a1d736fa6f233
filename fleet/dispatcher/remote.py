"""``fleet.dispatch``: start/resume/send/cancel from any Celery client.

A producer in any language sends a Celery message for the task
``fleet.dispatch`` to the fleet's default queue (``FLEET_QUEUE``), with JSON
keyword arguments (or one JSON object as the only positional argument)::

    {"op": "start", "flow_id": "onboard", "input": {"user": "u-1"},
     "principal": {"actor": "billing", "tenant": "acme"},
     "idempotency_key": "order-1234"}
    {"op": "resume", "execution_id": "...", "gate": "approval", "payload": true,
     "principal": {...}}
    {"op": "send", "execution_id": "...", "key": "payment", "payload": {...}}
    {"op": "cancel", "execution_id": "...", "reason": "customer left"}

A worker validates it (pydantic), writes, enqueues the drive, and answers (the
task's result, if the app has a result backend) with a ``DispatchReply``:
``{"ok": true, "op", "execution_id", "enqueued", "woke"}`` or ``{"ok": false,
"error": {"type", "code", "message", "retryable", "details"}}``. A bad message
is answered, never raised: it does not crash or wedge the worker.

The principal is taken from the message as given: whoever can write to the
broker can act as any principal, so the broker is the trust boundary here.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic import ValidationError as PydanticValidationError

from fleet.dispatcher.dispatcher import Dispatcher, DriveOrder
from fleet.kernel.errors import FleetError
from fleet.kernel.security import Principal

T = TypeVar("T")
RunOnLoop = Callable[[Coroutine[Any, Any, Any]], Any]


class PrincipalIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    actor: str = Field(min_length=1)
    tenant: str | None = None


class DispatchRequest(BaseModel):
    """One ``fleet.dispatch`` message's arguments."""

    model_config = ConfigDict(extra="forbid")

    op: Literal["start", "resume", "send", "cancel"]
    flow_id: str | None = Field(None, min_length=1)
    input: Any = None
    principal: PrincipalIn | None = None
    execution_id: str | None = Field(None, min_length=1)
    idempotency_key: str | None = Field(None, min_length=1)
    gate: str | None = Field(None, min_length=1)
    payload: Any = None
    key: str | None = Field(None, min_length=1)
    reason: str = ""

    @model_validator(mode="after")
    def _fields_for_op(self) -> DispatchRequest:
        needed = {"start": ("flow_id",), "resume": ("execution_id", "gate"),
                  "send": ("execution_id", "key"), "cancel": ("execution_id",)}[self.op]
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"op {self.op!r} needs {', '.join(missing)}")
        if self.op == "start" and self.execution_id and self.idempotency_key:
            raise ValueError("give execution_id or idempotency_key, not both")
        return self

    def who(self) -> Principal | None:
        if self.principal is None:
            return None
        return Principal(self.principal.actor, tenant=self.principal.tenant)


class DispatchError(BaseModel):
    type: str
    code: str
    message: str
    retryable: bool = False
    details: list[dict[str, Any]] = Field(default_factory=list)


class DispatchReply(BaseModel):
    """What ``fleet.dispatch`` answers."""

    ok: bool
    op: str | None = None
    execution_id: str | None = None
    enqueued: bool = False
    woke: bool | None = None
    error: DispatchError | None = None


def parse_request(args: Any, kwargs: Any) -> DispatchRequest:
    """The request in a message: keyword arguments, or one object as the only argument."""
    if args:
        if len(args) != 1 or kwargs or not isinstance(args[0], dict):
            raise ValueError("fleet.dispatch takes keyword arguments, or one JSON object as "
                             "its only positional argument")
        return DispatchRequest.model_validate(args[0])
    return DispatchRequest.model_validate(kwargs or {})


def handle_dispatch(dispatcher: Dispatcher, run_on_loop: RunOnLoop, args: Any,
                    kwargs: Any) -> dict[str, Any]:
    """Validate, write (on the loop), enqueue (here); the reply as JSON. Never raises."""
    try:
        request = parse_request(args, kwargs)
    except PydanticValidationError as exc:
        details = [{"loc": list(map(str, e.get("loc", ()))), "msg": e.get("msg", ""),
                    "type": e.get("type", "")} for e in exc.errors()]
        reasons = "; ".join(f"{'.'.join(d['loc']) or 'request'}: {d['msg']}"
                            for d in details[:5])
        return _refusal(None, "RequestValidationError", "validation",
                        f"fleet.dispatch: invalid request: {reasons}", details=details)
    except ValueError as exc:
        return _refusal(None, "RequestValidationError", "validation", str(exc))
    try:
        order, woke = run_on_loop(_write(dispatcher, request))
        if order is not None:
            dispatcher.enqueue(order)
    except FleetError as exc:
        return _refusal(request, type(exc).__name__, exc.code, exc.message,
                        retryable=exc.retryable)
    except Exception as exc:  # noqa: BLE001 - answered, not raised: the worker goes on
        return _refusal(request, type(exc).__name__, "internal", str(exc)[:2000],
                        retryable=True)
    execution_id = order.execution_id if order is not None else request.execution_id
    return DispatchReply(ok=True, op=request.op, execution_id=execution_id,
                         enqueued=order is not None, woke=woke).model_dump(mode="json")


async def _write(dispatcher: Dispatcher,
                 request: DispatchRequest) -> tuple[DriveOrder | None, bool | None]:
    who = request.who()
    if request.op == "start":
        assert request.flow_id is not None
        return await dispatcher.write_start(request.flow_id, request.input, principal=who,
                                            execution_id=request.execution_id,
                                            idempotency_key=request.idempotency_key), None
    assert request.execution_id is not None
    if request.op == "resume":
        assert request.gate is not None
        return await dispatcher.write_resume(request.execution_id, request.gate,
                                             request.payload, principal=who), None
    if request.op == "send":
        assert request.key is not None
        order = await dispatcher.write_send(request.execution_id, request.key, request.payload,
                                            principal=who)
        return order, order is not None
    await dispatcher.cancel(request.execution_id, principal=who, reason=request.reason)
    return None, None


def _refusal(request: DispatchRequest | None, type_: str, code: str, message: str, *,
             retryable: bool = False, details: list[dict[str, Any]] | None = None,
             ) -> dict[str, Any]:
    return DispatchReply(
        ok=False, op=request.op if request else None,
        execution_id=request.execution_id if request else None,
        error=DispatchError(type=type_, code=code, message=message, retryable=retryable,
                            details=details or [])).model_dump(mode="json")


__all__ = ["DispatchError", "DispatchReply", "DispatchRequest", "handle_dispatch",
           "parse_request"]
