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

Each message is signed with a client key (``fleet.dispatcher.signing``:
``kid``, ``issued_at``, ``expires_at``, ``nonce``, ``signature`` beside these
fields; decision 0018). A worker checks the signature, the times, the nonce
and that the key may speak for the principal's tenant before anything is
written; then it validates the request (pydantic), writes, enqueues the drive,
and answers (the task's result, if the app has a result backend) with a
``DispatchReply``: ``{"ok": true, "op", "execution_id", "enqueued", "woke"}``
or ``{"ok": false, "error": {"type", "code", "message", "retryable",
"details"}}``. A refused or bad message is answered, never raised (and so never
retried): it does not crash or wedge the worker. The kernel then authorises
the principal against the execution as for any caller.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic import ValidationError as PydanticValidationError

from fleet.dispatcher.dispatcher import Dispatcher, DriveOrder
from fleet.dispatcher.signing import DispatchRefusedError, DispatchVerifier, invalid, refusal
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
    force: bool = False

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


def handle_dispatch(dispatcher: Dispatcher, run_on_loop: RunOnLoop, args: Any, kwargs: Any,
                    verifier: DispatchVerifier) -> dict[str, Any]:
    """Verify, validate, write (on the loop), enqueue (here); the reply as JSON. Never raises."""
    message: dict[str, Any] | None = None
    try:
        message = verifier.message_of(args, kwargs)
        entry = verifier.authenticate(message)
        try:
            request = DispatchRequest.model_validate(verifier.request_fields(message))
        except PydanticValidationError as exc:
            verifier.refuse(invalid(exc), message)
            details = [{"loc": list(map(str, e.get("loc", ()))), "msg": e.get("msg", ""),
                        "type": e.get("type", "")} for e in exc.errors()]
            reasons = "; ".join(f"{'.'.join(d['loc']) or 'request'}: {d['msg']}"
                                for d in details[:5])
            return _refusal(None, "RequestValidationError", "validation",
                            f"fleet.dispatch: invalid request: {reasons}", details=details)
        if (entry is not None and request.op == "start" and not request.execution_id
                and not request.idempotency_key):
            raise refusal("invalid", "a signed start names its execution (execution_id or "
                          "idempotency_key), so a replayed message is the same start")
        who = request.who()
        verifier.check_scope(entry, who.tenant if who else None, who is not None)
    except DispatchRefusedError as exc:
        verifier.refuse(exc, message)
        return _refusal(None, type(exc).__name__, exc.code, exc.message,
                        retryable=exc.retryable, details=[{"reason": exc.reason}])
    except Exception as exc:  # noqa: BLE001 - nothing was written; judging it is pure
        # Whatever else reading a message raises (a RecursionError in pydantic, ...),
        # the same message raises it every time: refused, never retried.
        refused = refusal("malformed", f"unreadable: {type(exc).__name__}: {str(exc)[:200]}")
        verifier.refuse(refused, message)
        return _refusal(None, type(refused).__name__, refused.code, refused.message,
                        details=[{"reason": refused.reason}])
    try:
        order, woke = run_on_loop(_claim_and_write(dispatcher, verifier, entry, message,
                                                   request))
        if order is not None:
            dispatcher.enqueue(order)
    except DispatchRefusedError as exc:  # replayed
        verifier.refuse(exc, message)
        return _refusal(request, type(exc).__name__, exc.code, exc.message,
                        details=[{"reason": exc.reason}])
    except FleetError as exc:
        return _refusal(request, type(exc).__name__, exc.code, exc.message,
                        retryable=exc.retryable)
    except Exception as exc:  # noqa: BLE001 - answered, not raised: the worker goes on
        return _refusal(request, type(exc).__name__, "internal", str(exc)[:2000],
                        retryable=True)
    verifier.accepted += 1
    execution_id = order.execution_id if order is not None else request.execution_id
    return DispatchReply(ok=True, op=request.op, execution_id=execution_id,
                         enqueued=order is not None, woke=woke).model_dump(mode="json")


async def _claim_and_write(dispatcher: Dispatcher, verifier: DispatchVerifier, entry: Any,
                           message: dict[str, Any],
                           request: DispatchRequest) -> tuple[DriveOrder | None, bool | None]:
    await verifier.claim_nonce(entry, message)  # last: a forged message uses up nothing
    return await _write(dispatcher, request)


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
    order = await dispatcher.write_cancel(request.execution_id, principal=who,
                                          reason=request.reason, force=request.force)
    return order, None


def _refusal(request: DispatchRequest | None, type_: str, code: str, message: str, *,
             retryable: bool = False, details: list[dict[str, Any]] | None = None,
             ) -> dict[str, Any]:
    return DispatchReply(
        ok=False, op=request.op if request else None,
        execution_id=request.execution_id if request else None,
        error=DispatchError(type=type_, code=code, message=message, retryable=retryable,
                            details=details or [])).model_dump(mode="json")


__all__ = ["DispatchError", "DispatchReply", "DispatchRequest", "handle_dispatch"]
