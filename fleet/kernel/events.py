"""The log: the envelope and one payload model per event kind.

The log is a wire format. Field names are camelCase exactly as the decision
records spell them; a second implementation must read what this one writes.
``EVENT_SCHEMA`` is bumped for every additive change.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from fleet.kernel.errors import CorruptLogError, NotSerializableError, UnstorableValueError
from fleet.kernel.values import has_lone_surrogate, printable

EVENT_SCHEMA = "1.4.0"
# 1.1.0: EXECUTION_DENIED.count. 1.2.0 (decision 0033): CANCEL_REQUESTED, CANCEL_DELIVERED,
# FIRST_RESOLVED, TIMER_CANCELLED; a "first" park condition (its "waits"); CHILD_STARTED,
# CHILD_ENDED, MESSAGE_SENT, VALUE_SET, UPDATE_REPLIED; EXECUTION_STARTED.parent and
# .messages; MESSAGE_RECEIVED.sendId and .updateId; EXECUTION_RESUMED.sendId.
# 1.3.0 (decision 0053): STEP_HEARTBEAT.
# 1.4.0 (decision 0057): EXECUTION_DEBOUNCED.


class EventType(StrEnum):
    EXECUTION_STARTED = "EXECUTION_STARTED"
    STEP_STARTED = "STEP_STARTED"
    STEP_COMPLETED = "STEP_COMPLETED"
    STEP_FAILED = "STEP_FAILED"
    STEP_CANCELLED = "STEP_CANCELLED"
    EFFECT_INDOUBT = "EFFECT_INDOUBT"
    DECISION_RECORDED = "DECISION_RECORDED"
    OUTCOME_RECORDED = "OUTCOME_RECORDED"
    EMITTED = "EMITTED"
    VALUE_RECORDED = "VALUE_RECORDED"
    TIMER_SCHEDULED = "TIMER_SCHEDULED"
    TIMER_FIRED = "TIMER_FIRED"
    EXECUTION_SUSPENDED = "EXECUTION_SUSPENDED"
    EXECUTION_RESUMED = "EXECUTION_RESUMED"
    MESSAGE_RECEIVED = "MESSAGE_RECEIVED"
    PARALLEL_STARTED = "PARALLEL_STARTED"
    PARALLEL_COMPLETED = "PARALLEL_COMPLETED"
    EXECUTION_MIGRATED = "EXECUTION_MIGRATED"
    EXECUTION_CONTINUED = "EXECUTION_CONTINUED"
    EXECUTION_COMPLETED = "EXECUTION_COMPLETED"
    EXECUTION_FAILED = "EXECUTION_FAILED"
    EXECUTION_CANCELLED = "EXECUTION_CANCELLED"
    EXECUTION_DENIED = "EXECUTION_DENIED"
    RECOVERED = "RECOVERED"
    CANCEL_REQUESTED = "CANCEL_REQUESTED"
    CANCEL_DELIVERED = "CANCEL_DELIVERED"
    FIRST_RESOLVED = "FIRST_RESOLVED"
    TIMER_CANCELLED = "TIMER_CANCELLED"
    CHILD_STARTED = "CHILD_STARTED"
    CHILD_ENDED = "CHILD_ENDED"
    MESSAGE_SENT = "MESSAGE_SENT"
    VALUE_SET = "VALUE_SET"
    UPDATE_REPLIED = "UPDATE_REPLIED"
    STEP_HEARTBEAT = "STEP_HEARTBEAT"
    EXECUTION_DEBOUNCED = "EXECUTION_DEBOUNCED"  # decision 0057


def wall_clock_ms() -> int:
    """Milliseconds since the epoch: the unit of every timestamp, due time and lease."""
    return time.time_ns() // 1_000_000


# -- statuses: the one table the fold, the stores' index and the lifecycle share --------

Status = Literal["running", "parked", "completed", "failed", "cancelled", "continued"]
# The status an event leaves an execution in (the kinds not listed leave it as it was;
# an EXECUTION_STARTED above sequence 0 is a successor's marker and changes nothing).
STATUS_AFTER: dict[EventType, Status] = {
    EventType.EXECUTION_STARTED: "running",
    EventType.EXECUTION_RESUMED: "running",
    EventType.TIMER_FIRED: "running",
    EventType.RECOVERED: "running",
    EventType.CANCEL_REQUESTED: "running",
    EventType.EXECUTION_SUSPENDED: "parked",
    EventType.EXECUTION_COMPLETED: "completed",
    EventType.EXECUTION_FAILED: "failed",
    EventType.EXECUTION_CANCELLED: "cancelled",
    EventType.EXECUTION_CONTINUED: "continued",
}
# The event that ends an execution in each terminal status.
TERMINAL_EVENT: dict[str, EventType] = {
    "completed": EventType.EXECUTION_COMPLETED, "failed": EventType.EXECUTION_FAILED,
    "cancelled": EventType.EXECUTION_CANCELLED, "continued": EventType.EXECUTION_CONTINUED}
TERMINAL_STATUSES: frozenset[str] = frozenset(TERMINAL_EVENT)
TERMINAL_TYPES: frozenset[EventType] = frozenset(TERMINAL_EVENT.values())

# Fields the fold copies only from a kernel-stamped envelope (metadata.kernel = true);
# the emit guard refuses the two a flow could forge (security.OUTCOME_KERNEL_FIELDS).
KERNEL_ONLY_FIELDS = frozenset({"recordedBy", "late", "innerSteps", "innerStepsOverflow",
                                "innerFrom", "scope"})

Json = Any


class _Payload(BaseModel):
    # Additive optional fields from newer writers are kept, not refused.
    model_config = ConfigDict(extra="allow", frozen=True)


class Owner(_Payload):
    actor: str
    tenant: str | None = None


class ErrorInfo(_Payload):
    type: str
    message: str
    code: str | None = None
    retryable: bool = False


class PolicyInfo(_Payload):
    name: str
    version: str | int | None = None
    propensity: float = Field(gt=0, le=1)


class ExecutionStarted(_Payload):
    flowId: str
    flowVersion: int
    flowHash: str
    codeHash: str | None = None
    input: Json = None
    owner: Owner | None = None
    deadlineAt: int | None = None
    continuedFrom: str | None = None
    # A child flow's parent: {"executionId", "name", "onParentClose"} (ctx.start_child).
    parent: dict[str, Any] | None = None
    # Messages a continue_as_new predecessor received and the body had not taken:
    # {key: [{"payload", "updateId"?}...]}.
    messages: dict[str, list[dict[str, Any]]] | None = None


class StepStarted(_Payload):
    stepId: str
    attempt: int = Field(ge=1)
    scope: str | None = None


class StepCompleted(_Payload):
    stepId: str
    attempt: int = Field(ge=1)
    output: Json = None


class StepFailed(_Payload):
    stepId: str
    attempt: int = Field(ge=1)
    error: ErrorInfo
    final: bool
    retryAt: int | None = None


class StepCancelled(_Payload):
    stepId: str
    reason: str = ""


class EffectIndoubt(_Payload):
    stepId: str
    attempt: int = Field(ge=1)
    idempotent: bool = True


class DecisionRecorded(_Payload):
    decisionId: str
    choice: Json = None
    policy: PolicyInfo | None = None
    alternatives: list[Json] | None = None
    context: Json = None
    innerSteps: list[str] | None = None
    innerStepsOverflow: bool | None = None
    innerFrom: int | None = None


class OutcomeRecorded(_Payload):
    decisionId: str
    key: str
    score: float | None = None
    success: bool | None = None
    recordedBy: str | None = None
    late: bool | None = None


class Emitted(_Payload):
    type: str
    payload: Json = None
    name: str | None = None


class ValueRecorded(_Payload):
    name: str
    kind: Literal["now", "random", "uuid"]
    value: Json = None


class TimerScheduled(_Payload):
    timerId: str
    dueAt: int


class TimerFired(_Payload):
    timerId: str


class Condition(_Payload):
    on: str
    kind: Literal["gate", "timer", "message", "indoubt", "diverged", "first", "child"] = "gate"
    correlationKey: str | None = None
    # kind "first" (ctx.first, a wait with a timeout): what it waits on, any of them.
    waits: list[dict[str, Any]] | None = None


class ExecutionSuspended(_Payload):
    condition: Condition


class ExecutionResumed(_Payload):
    gate: str
    payload: Json = None
    by: str | None = None
    sendId: str | None = None  # a flow's ctx.resume: "<sender>:<call>"


class MessageReceived(_Payload):
    key: str
    payload: Json = None
    sendId: str | None = None    # a flow's ctx.send: "<sender>:<call>" (a repeat is dropped)
    updateId: str | None = None  # runtime.update: the caller waits for its reply


class ParallelStarted(_Payload):
    scope: str
    branches: int = Field(ge=0)


class ParallelCompleted(_Payload):
    scope: str


class ExecutionMigrated(_Payload):
    fromFlowHash: str
    toFlowHash: str
    toVersion: int
    toCodeHash: str | None = None
    discard: list[str] | None = None
    reopen: bool | None = None


class ExecutionContinued(_Payload):
    nextExecutionId: str
    input: Json = None


class ExecutionCompleted(_Payload):
    output: Json = None


class ExecutionFailed(_Payload):
    error: ErrorInfo | None = None


class ExecutionCancelled(_Payload):
    reason: str = ""


class ExecutionDenied(_Payload):
    op: str
    actor: str | None = None
    tenant: str | None = None
    reason: str = ""
    count: int | None = None  # denials this record stands for (1.1.0; decision 0007)


class Recovered(_Payload):
    by: str = ""
    reason: str = ""


class CancelRequested(_Payload):
    reason: str = ""
    by: str | None = None


class CancelDelivered(_Payload):
    at: str                 # the call the flow got asyncio.CancelledError at
    branch: str = ""        # the parallel branch it was in ("": the body itself)


class FirstResolved(_Payload):
    name: str               # the race: "<branch>first#<n>"
    index: int = Field(ge=0)  # which of its waits won


class TimerCancelled(_Payload):
    timerId: str


class ChildStarted(_Payload):
    name: str               # the parent's call: "<branch>child#<n>"
    childId: str
    flowId: str
    onParentClose: Literal["cancel", "abandon"] = "cancel"


class ChildEnded(_Payload):
    name: str
    childId: str            # the execution that ended (the last of a continued chain)
    status: Literal["completed", "failed", "cancelled"]
    output: Json = None
    error: ErrorInfo | None = None


class MessageSent(_Payload):
    name: str               # the sender's call: "<branch>send#<n>" / "<branch>resume#<n>"
    target: str
    key: str | None = None  # a message's key, or
    gate: str | None = None  # the gate a resume answered
    error: ErrorInfo | None = None  # refused (access, not found): the flow got this error


class ValueSet(_Payload):
    name: str               # "<branch>set#<n>"
    key: str
    value: Json = None


class UpdateReplied(_Payload):
    updateId: str
    value: Json = None
    error: ErrorInfo | None = None


class StepHeartbeat(_Payload):
    """A running step's progress (``fleet.heartbeat(details)``; decision 0053)."""

    stepId: str
    attempt: int = Field(ge=1)
    details: Json = None


class ExecutionDebounced(_Payload):
    """A repeat start joined a debounce window: the run's new input and due time (0057)."""

    input: Json = None
    dueAt: int
    by: str | None = None


PAYLOAD_MODELS: dict[EventType, type[_Payload]] = {
    EventType.EXECUTION_STARTED: ExecutionStarted,
    EventType.STEP_STARTED: StepStarted,
    EventType.STEP_COMPLETED: StepCompleted,
    EventType.STEP_FAILED: StepFailed,
    EventType.STEP_CANCELLED: StepCancelled,
    EventType.EFFECT_INDOUBT: EffectIndoubt,
    EventType.DECISION_RECORDED: DecisionRecorded,
    EventType.OUTCOME_RECORDED: OutcomeRecorded,
    EventType.EMITTED: Emitted,
    EventType.VALUE_RECORDED: ValueRecorded,
    EventType.TIMER_SCHEDULED: TimerScheduled,
    EventType.TIMER_FIRED: TimerFired,
    EventType.EXECUTION_SUSPENDED: ExecutionSuspended,
    EventType.EXECUTION_RESUMED: ExecutionResumed,
    EventType.MESSAGE_RECEIVED: MessageReceived,
    EventType.PARALLEL_STARTED: ParallelStarted,
    EventType.PARALLEL_COMPLETED: ParallelCompleted,
    EventType.EXECUTION_MIGRATED: ExecutionMigrated,
    EventType.EXECUTION_CONTINUED: ExecutionContinued,
    EventType.EXECUTION_COMPLETED: ExecutionCompleted,
    EventType.EXECUTION_FAILED: ExecutionFailed,
    EventType.EXECUTION_CANCELLED: ExecutionCancelled,
    EventType.EXECUTION_DENIED: ExecutionDenied,
    EventType.RECOVERED: Recovered,
    EventType.CANCEL_REQUESTED: CancelRequested,
    EventType.CANCEL_DELIVERED: CancelDelivered,
    EventType.FIRST_RESOLVED: FirstResolved,
    EventType.TIMER_CANCELLED: TimerCancelled,
    EventType.CHILD_STARTED: ChildStarted,
    EventType.CHILD_ENDED: ChildEnded,
    EventType.MESSAGE_SENT: MessageSent,
    EventType.VALUE_SET: ValueSet,
    EventType.UPDATE_REPLIED: UpdateReplied,
    EventType.STEP_HEARTBEAT: StepHeartbeat,
    EventType.EXECUTION_DEBOUNCED: ExecutionDebounced,
}


class _EnvelopeWire(BaseModel):
    """The envelope's wire schema: what a stored or received event must satisfy."""

    model_config = ConfigDict(extra="forbid")

    id: str
    executionId: str
    sequence: int = Field(ge=0)
    type: EventType
    timestamp: int
    payload: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EventEnvelope:
    """One entry of an execution's log.

    ``id`` is ``f"{execution_id}-{sequence}"``; ``timestamp`` is milliseconds
    since the epoch; ``metadata["kernel"] is True`` marks what the runtime wrote.
    The in-memory form is a plain slotted dataclass (the runtime makes one per
    event on the hot path); everything read from storage or the wire is
    validated against ``_EnvelopeWire`` and the kind's payload model first.
    """

    id: str
    execution_id: str
    sequence: int
    type: EventType
    timestamp: int
    payload: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def make(cls, execution_id: str, sequence: int, type: EventType, timestamp: int,
             payload: dict[str, Any], *, kernel: bool = True,
             metadata: dict[str, Any] | None = None) -> EventEnvelope:
        """Build an envelope the runtime itself writes (trusted: no validation)."""
        meta = dict(metadata) if metadata else {}
        if kernel:
            meta["kernel"] = True
        return cls(f"{execution_id}-{sequence}", execution_id, sequence, type, timestamp,
                   payload, meta)

    @property
    def kernel(self) -> bool:
        return self.metadata.get("kernel") is True

    def with_sequence(self, sequence: int) -> EventEnvelope:
        return replace(self, sequence=sequence, id=f"{self.execution_id}-{sequence}")

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "executionId": self.execution_id, "sequence": self.sequence,
                "type": self.type._value_, "timestamp": self.timestamp, "payload": self.payload,
                "metadata": self.metadata}

    def to_json(self) -> str:
        """``dumps(self.to_dict())``: the stored form (compact, in this key order).

        The envelope's own fields are written here around the C encoder's text of
        ``payload`` and ``metadata``, not through it: the encoder escapes each of the
        7 keys and builds a fragment per item on every call, twice the work of the
        event's payload (decision 0031). The same function escapes the strings
        (``json.encoder.encode_basestring``, as the encoder does) and ints print
        alike, so the text is the same; anything but exact ``str`` ids and ``int``
        numbers takes the encoder's path.
        """
        sequence, timestamp, eid, execution_id = (self.sequence, self.timestamp, self.id,
                                                  self.execution_id)
        if type(sequence) is not int or type(timestamp) is not int \
                or type(eid) is not str or type(execution_id) is not str:
            return dumps(self.to_dict())
        meta = self.metadata
        if type(meta) is dict and len(meta) == 1 and meta.get("kernel") is True:
            meta_json = _KERNEL_META
        else:
            meta_json = dumps(meta)
        return (f'{{"id":{_encode_str(eid)},"executionId":{_encode_str(execution_id)},'
                f'"sequence":{sequence},"type":{_encode_str(self.type._value_)},'
                f'"timestamp":{timestamp},"payload":{dumps(self.payload)},'
                f'"metadata":{meta_json}}}')

    @classmethod
    def from_dict(cls, data: Any, *, validate_payload: bool = True) -> EventEnvelope:
        """Parse and check an envelope read from storage or the wire."""
        try:
            wire = _EnvelopeWire.model_validate(data)
        except PydanticValidationError as exc:
            raise CorruptLogError(f"event is not a valid envelope: {exc.errors()[:1]}") from exc
        if wire.id != f"{wire.executionId}-{wire.sequence}":
            raise CorruptLogError(f"event id {wire.id!r} does not match "
                                  f"{wire.executionId!r}-{wire.sequence}")
        if validate_payload:
            validate_payload_for(wire.type, wire.payload)
        return cls(wire.id, wire.executionId, wire.sequence, wire.type, wire.timestamp,
                   wire.payload, wire.metadata)

    @classmethod
    def from_json(cls, text: str | bytes, *, validate_payload: bool = True) -> EventEnvelope:
        try:
            data = json.loads(text)
        except (ValueError, TypeError) as exc:
            raise CorruptLogError(f"event is not JSON: {exc}") from exc
        return cls.from_dict(data, validate_payload=validate_payload)


_ADAPTERS: dict[EventType, TypeAdapter[Any]] = {
    t: TypeAdapter(m) for t, m in PAYLOAD_MODELS.items()}


def validate_payload_for(type: EventType, payload: dict[str, Any]) -> None:
    try:
        _ADAPTERS[type].validate_python(payload)
    except PydanticValidationError as exc:
        raise CorruptLogError(f"{type} payload is invalid: {exc.errors()[:1]}") from exc


# One encoder for every call (json.dumps with options builds a new one each time).
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _c_encoder() -> Any:
    """The C encoder ``_ENCODER.encode`` builds on every call, built once (None without
    the C accelerator): the same function makes the same bytes, without two Python
    calls and a new encoder object per event (decision 0031)."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    try:
        # No markers (cycle detection): a cycle is a RecursionError, and dumps asks
        # _ENCODER then, for its message. A shared markers dict would keep the ids an
        # error left behind.
        encoder = make(None, _ENCODER.default, json.encoder.encode_basestring, None,
                       _ENCODER.key_separator, _ENCODER.item_separator, False, False, False)
        sample = {"a": [1, 2.5, -0.0, 1e-05, 1e+16, True, None, "\u00e9\n\x00\u2028"], "b": {}}
        if "".join(encoder(sample, 0)) != _ENCODER.encode(sample):  # pragma: no cover
            return None
    except (TypeError, ValueError):  # pragma: no cover - another signature
        return None
    return encoder


_C_ENCODE = _c_encoder()
# What the encoder writes for a string, and for the metadata of nearly every event.
_encode_str = json.encoder.encode_basestring
_KERNEL_META = '{"kernel":true}'


def dumps(value: Any) -> str:
    """Canonical JSON for the log: compact, no NaN/Infinity."""
    if _C_ENCODE is None:  # pragma: no cover - Python without the C accelerator
        return _ENCODER.encode(value)
    try:
        return "".join(_C_ENCODE(value, 0))
    except RecursionError:
        return _ENCODER.encode(value)  # "Circular reference detected" for a cycle


def ensure_json(value: Any, what: str) -> Any:
    """Return ``value`` as it will read back from the log, or refuse it.

    A value that does not survive a JSON round trip (a set, a datetime, NaN, a
    tuple that would come back a list) would make a replay see something other
    than the live run did, so it is refused before anything is written
    (``NotSerializableError``); so is text no store can encode, a lone surrogate
    (``UnstorableValueError``, decision 0023).
    """
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, str):
        if has_lone_surrogate(value):
            raise UnstorableValueError(_surrogate_message(what))
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise NotSerializableError(f"{what} is {value!r}; the log stores finite numbers only")
        return value
    try:
        text = dumps(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise NotSerializableError(
            f"{what} is not JSON-serialisable ({printable(exc, 300)}); return plain dicts, "
            "lists, str, int, float, bool or None") from exc
    if has_lone_surrogate(text):
        raise UnstorableValueError(_surrogate_message(what))
    return json.loads(text)


def _surrogate_message(what: str) -> str:
    return (f"{what} holds text that is not valid Unicode (a lone surrogate, e.g. a file "
            "name os.listdir could not decode); no store can keep it: decode such text with "
            "errors='replace' or keep the bytes as base64")
