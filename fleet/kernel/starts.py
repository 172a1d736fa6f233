"""Many starts in one store round trip: ``Runtime.start_many``.

``Runtime.start`` takes the new execution's fence, writes its
``EXECUTION_STARTED`` under it and releases it: three round trips (four when
the caller names the id, which is looked up first). A submission path as fast
as Celery's cannot pay that per start, nor per start of a batch.

``start_many`` writes the ``EXECUTION_STARTED`` of every new execution of a
batch in one ``append_many`` (``spi.AppendsMany``: one statement and one
commit on Postgres) under ``fence=0``, which a store accepts only when the
execution's fence was never taken. Every acquire bumps the token, so token 0
means nobody ever held the execution: no start is in flight through
``Runtime.start`` (it takes the fence first), and no holder of a deleted log
is still running (its real token stays as a tombstone). Sequence 0 arbitrates
between two such starts: exactly one writes it. So the fence-0 write needs no
lease and no release, and a drive later takes the fence as it always does.

A request the store refuses (the log exists, or its fence was taken) is
answered by ``Runtime.start(..., drive=False)``, which returns the existing
execution (or waits out a start in flight) with every check it makes: an
idempotent repeat costs what it always did, a new execution one share of one
round trip.

Everything is judged before anything is written: every flow must be
registered, every start authorised, every input JSON and every named id
usable (an explicit id may not take a derived form, decision 0024; an
``idempotency_key`` is turned into its id here); one bad request refuses the
batch with a typed error and writes nothing. Requests that name the same
execution (an idempotency key sent twice in one batch) write it once and
answer the same id; the same id for two different flows is refused.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fleet.kernel.engine import Engine
from fleet.kernel.errors import FlowNotFoundError, ValidationError
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.flows import Features, FlowDefinition, FlowRegistry
from fleet.kernel.ids import check_explicit_id, idempotent_execution_id
from fleet.kernel.security import Principal
from fleet.kernel.typed import encode_input


class Runtime(Protocol):
    """What ``start_many`` uses of ``fleet.kernel.runtime.Runtime`` (not imported:
    the runtime imports this module)."""

    engine: Engine
    flows: FlowRegistry
    features: Features

    async def start(self, flow_id: str, input: Any = None, *,
                    principal: Principal | None = None, execution_id: str | None = None,
                    idempotency_key: str | None = None, drive: bool = True) -> Any: ...


__all__ = ["StartRequest", "start_many", "start_payload"]


@dataclass(frozen=True, slots=True)
class StartRequest:
    """One start of a batch: what ``Runtime.start`` takes, without ``drive``."""

    flow_id: str
    input: Any = None
    principal: Principal | None = None
    execution_id: str | None = None
    idempotency_key: str | None = None


def start_payload(definition: FlowDefinition, data: Any, principal: Principal | None,
                  now: int, features: Features) -> dict[str, Any]:
    """The ``EXECUTION_STARTED`` payload ``Runtime.start`` writes (the same fields;
    ``tests/kernel/runtime/test_start_many.py`` compares the two)."""
    payload: dict[str, Any] = {
        "flowId": definition.flow_id, "flowVersion": definition.version,
        "flowHash": definition.content_hash(features), "input": data,
        "owner": principal.to_owner() if principal else None}
    if definition.code_fingerprint:
        payload["codeHash"] = definition.code_fingerprint
    if definition.deadline is not None:
        payload["deadlineAt"] = now + int(definition.deadline * 1000)
    return payload


@dataclass(slots=True)
class _Judged:
    request: StartRequest
    definition: FlowDefinition
    data: Any
    execution_id: str


async def _judge(runtime: Runtime, index: int, request: StartRequest) -> _Judged:
    """What ``Runtime.start`` checks before it writes, for one request of a batch."""
    where = f"start_many: request {index}"
    if not isinstance(request, StartRequest):
        raise ValidationError(f"{where} is a {type(request).__name__}, not a StartRequest")
    definition = runtime.flows.latest(request.flow_id)
    if definition is None:
        known = sorted({d.flow_id for d in runtime.flows})
        raise FlowNotFoundError(f"{where}: no flow {request.flow_id!r} is registered; "
                                f"known flows: {known}")
    await runtime.engine.access.check(None, "start", request.principal, audit=False)
    data = encode_input(definition.body, request.input,
                        f"the input of flow {request.flow_id!r} ({where})")
    execution_id = request.execution_id
    if execution_id is not None and request.idempotency_key is not None:
        raise ValidationError(f"{where}: give execution_id or idempotency_key, not both")
    if request.idempotency_key is not None:
        # Derived here, as Runtime.start derives it: the form is reserved (decision 0024).
        execution_id = idempotent_execution_id(
            definition.flow_id, request.idempotency_key,
            request.principal.tenant if request.principal else None)
    elif execution_id is None:
        execution_id = uuid.uuid4().hex
    else:
        try:
            check_explicit_id(execution_id)
        except ValidationError as exc:
            raise type(exc)(f"{where}: {exc.message}") from exc
    return _Judged(request, definition, data, execution_id)


async def start_many(runtime: Runtime, requests: Sequence[StartRequest]) -> list[str]:
    """Start every request durably (none is driven here); the execution id of each, in order.

    See the module docstring. Raises what ``Runtime.start`` raises for a bad
    request (``FlowNotFoundError``, ``AccessDeniedError``, ``ValidationError``...)
    before anything is written, and ``StoreUnavailableError`` when the store
    could not be reached (some starts may have been written: retry with the
    same ids, or idempotency keys, to make the retry safe).
    """
    judged = [await _judge(runtime, i, request) for i, request in enumerate(requests)]
    first: dict[str, _Judged] = {}
    for item in judged:
        seen = first.setdefault(item.execution_id, item)
        if seen.definition.flow_id != item.definition.flow_id:
            raise ValidationError(
                f"start_many: execution {item.execution_id!r} is asked for twice, for flows "
                f"{seen.definition.flow_id!r} and {item.definition.flow_id!r}")
    now = runtime.engine.clock()
    made = {eid: EventEnvelope.make(eid, 0, EventType.EXECUTION_STARTED, now,
                                    start_payload(item.definition, item.data,
                                                  item.request.principal, now,
                                                  runtime.features))
            for eid, item in first.items()}
    order = list(made)
    # The one write path outside a run (writes.LogWriter): one append_many, the stored
    # ones reported to on_event / on_durable_event.
    answers = await runtime.engine.writer.create_many([made[eid] for eid in order])
    refused: list[str] = []
    for eid, answer in zip(order, answers, strict=True):
        if answer is None:
            continue
        if isinstance(answer, Exception) and getattr(answer, "retryable", False):
            raise answer
        refused.append(eid)
    for eid in refused:
        # The log exists, or its fence was taken: Runtime.start answers it, with its
        # checks (only a reader of the same flow gets an existing one: decision 0024).
        item = first[eid]
        key = item.request.idempotency_key
        await runtime.start(item.definition.flow_id, item.request.input,
                            principal=item.request.principal,
                            execution_id=None if key is not None else eid,
                            idempotency_key=key, drive=False)
    return [item.execution_id for item in judged]
