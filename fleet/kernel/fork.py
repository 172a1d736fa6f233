"""Fork an execution from a step: ``Runtime.fork`` (issue 29.4, decision 0052).

``fork(execution_id, from_step=, version=None)`` starts a new execution whose log
is the source's up to (not including) the first ``STEP_STARTED`` of ``from_step``:
every step, decision, timer, gate answer and recorded value before it is served
from that copy when the fork runs, and ``from_step`` and everything after it run
live, on ``version`` of the flow (None: the source's own). DBOS's
``fork_workflow`` and Temporal's reset do the same; here the source is never
touched.

What the new log says of its origin: its ``EXECUTION_STARTED`` carries
``forkedFrom`` (``executionId``, ``step``, ``sequence``: the source's sequence of
that ``STEP_STARTED``, and ``by``: the principal's actor), its owner is the
principal who forked it (the source's owner when there is none), and the copied
events are re-stamped with the fork's time (the source keeps when they first
happened), and the copy ends with ``RECOVERED`` (``reason: "fork"``): the run is
taken over from there, so its first drive is not counted a recovery of a dead
holder. The source's ``EXECUTION_DENIED`` audit is not copied: it is about the
source. A refused fork writes nothing new; a refusal by the access policy is
audited on the source (``read``, as decision 0007 audits).

Refused with a typed error before anything is written: no such execution
(``ExecutionNotFoundError``), a principal who may not read it
(``AccessDeniedError``), a step it never started or a log compacted below it
(``ValidationError``), a version that is not registered (``FlowNotFoundError``),
a new id that exists (``ExecutionConflictError``) or is reserved.
"""

from __future__ import annotations

import uuid
from typing import Any

from fleet.kernel.engine import Engine
from fleet.kernel.errors import (
    DuplicateSequenceError,
    ExecutionBusyError,
    ExecutionConflictError,
    ExecutionNotFoundError,
    FlowNotFoundError,
    StaleFenceError,
    ValidationError,
)
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.flows import Features, FlowDefinition, FlowRegistry
from fleet.kernel.fold import fold_log
from fleet.kernel.ids import check_explicit_id
from fleet.kernel.security import Principal
from fleet.kernel.values import check_text

#: Events of the source that are about the source, not its run: never copied.
_NOT_COPIED = frozenset({EventType.EXECUTION_DENIED})


def _cut(events: list[EventEnvelope], execution_id: str, from_step: str) -> int:
    """The sequence of the first ``STEP_STARTED`` of ``from_step`` in ``events``."""
    for event in events:
        if event.type is EventType.STEP_STARTED and event.payload.get("stepId") == from_step:
            return event.sequence
    started = sorted({str(e.payload.get("stepId")) for e in events
                      if e.type is EventType.STEP_STARTED})
    raise ValidationError(f"execution {execution_id!r} never started step {from_step!r}; "
                          f"it started {started[:20]}: fork from one of those")


def _definition(flows: FlowRegistry, flow_id: str, version: int | None,
                recorded: int) -> FlowDefinition:
    wanted = recorded if version is None else version
    for definition in flows.versions(flow_id):
        if definition.version == wanted:
            return definition
    known = [d.version for d in flows.versions(flow_id)]
    raise FlowNotFoundError(f"flow {flow_id!r} version {wanted} is not registered here "
                            f"(registered: {known}); a fork runs on a registered version")


def _started(first: EventEnvelope, definition: FlowDefinition, features: Features,
             principal: Principal | None, source: str, from_step: str, cut: int,
             now: int) -> dict[str, Any]:
    payload = dict(first.payload)
    payload.update({"flowVersion": definition.version,
                    "flowHash": definition.content_hash(features)})
    payload.pop("codeHash", None)
    payload.pop("continuedFrom", None)
    if definition.code_fingerprint:
        payload["codeHash"] = definition.code_fingerprint
    payload.pop("deadlineAt", None)
    if definition.deadline is not None:
        payload["deadlineAt"] = now + int(definition.deadline * 1000)
    if principal is not None:
        payload["owner"] = principal.to_owner()
    payload["forkedFrom"] = {"executionId": source, "step": from_step, "sequence": cut,
                             "by": principal.actor if principal is not None else None}
    return payload


async def fork(engine: Engine, flows: FlowRegistry, features: Features, execution_id: str,
               *, from_step: str, version: int | None = None,
               principal: Principal | None = None,
               new_execution_id: str | None = None) -> str:
    """Write the forked execution's log (see the module); its id. It is not driven here."""
    check_text(execution_id, "execution id")
    if not isinstance(from_step, str) or not from_step:
        raise ValidationError("from_step must be a step id (a non-empty string)")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise ValidationError(f"version must be an int or None, got {version!r}")
    if new_execution_id is not None:
        check_explicit_id(new_execution_id)
    events = await engine.store.read(execution_id)
    if not events:
        raise ExecutionNotFoundError(f"no execution {execution_id!r}")
    state = fold_log(events)
    await engine.access.check(state, "read", principal, audit=True)
    if [e.sequence for e in events] != list(range(len(events))):
        raise ValidationError(f"execution {execution_id!r} was compacted: the events before "
                              "its checkpoint are gone, so it cannot be forked")
    cut = _cut(events, execution_id, from_step)
    first = events[0]
    definition = _definition(flows, str(first.payload.get("flowId")), version,
                             int(first.payload.get("flowVersion") or 0))
    new_id = new_execution_id or uuid.uuid4().hex
    now = engine.clock()
    copied = [e for e in events[1:cut] if e.type not in _NOT_COPIED]
    log = [EventEnvelope.make(new_id, 0, EventType.EXECUTION_STARTED, now,
                              _started(first, definition, features, principal, execution_id,
                                       from_step, cut, now))]
    log += [EventEnvelope.make(new_id, i, e.type, now, e.payload, kernel=e.kernel,
                               metadata={k: v for k, v in e.metadata.items() if k != "kernel"})
            for i, e in enumerate(copied, start=1)]
    # The copy ends mid-run; RECOVERED (reason "fork") says the run is taken over from
    # here, so the first drive replays the copy and runs ``from_step`` live without
    # counting itself a recovery of a dead holder.
    log.append(EventEnvelope.make(new_id, len(log), EventType.RECOVERED, now,
                                  {"by": engine.holder, "reason": "fork"}))
    lease = engine.deferred(new_id)
    async with lease:
        try:
            # The first write takes the fence and, being the last, ends the lease.
            await engine.writer.write(lease, log, last=True)
        except (DuplicateSequenceError, StaleFenceError, ExecutionBusyError) as exc:
            raise ExecutionConflictError(
                f"execution {new_id!r} exists already; fork to a new id") from exc
    return new_id


__all__ = ["fork"]
