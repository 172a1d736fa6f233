"""The fold: ``fold(state, event) -> state``. Pure, total, no I/O.

``fold_log(events)`` of a log equals the state the live run held. The fold
never raises: a payload missing a field folds with a default, so a log written
by an older or newer writer still reads. Fields a userspace writer could forge
(``recordedBy``, ``late``, ``innerSteps``, ``scope``) are copied only from a
kernel-stamped envelope.

Two entry points: ``fold`` copies the state first (the pure one, for callers
that keep the old state); ``apply`` mutates in place and is what the journal
uses per event, so a long log folds in linear time.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fleet.kernel.events import TERMINAL_STATUSES, EventEnvelope, EventType

TERMINAL = TERMINAL_STATUSES  # the statuses an execution ends in (events.py holds the table)
DIVERGED_GATE = "__fleet_diverged__"
MESSAGE_GATE = "__fleet_message__"
# Gates whose answer only changes status: it never reaches the flow.
STATUS_ONLY_GATES = frozenset({DIVERGED_GATE, MESSAGE_GATE})
INDOUBT_GATE = "__fleet_indoubt__"


@dataclass(slots=True)
class Frame:
    """What the log says about one step id."""

    step_id: str
    status: str = "started"  # started | completed | failed | retrying | cancelled | indoubt
    attempts: int = 0
    first_seq: int | None = None
    scope: str | None = None
    output: Any = None
    error: dict[str, Any] | None = None
    retry_at: int | None = None
    started_at: int | None = None
    updated_at: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status, "attempts": self.attempts,
                               "firstSeq": self.first_seq}
        if self.scope is not None:
            out["scope"] = self.scope
        if self.status == "completed":
            out["output"] = self.output
        if self.error is not None:
            out["error"] = self.error
        if self.retry_at is not None:
            out["retryAt"] = self.retry_at
        out["startedAt"] = self.started_at
        out["updatedAt"] = self.updated_at
        return out

    @classmethod
    def from_dict(cls, step_id: str, d: dict[str, Any]) -> Frame:
        return cls(step_id=step_id, status=d.get("status", "started"),
                   attempts=d.get("attempts", 0), first_seq=d.get("firstSeq"),
                   scope=d.get("scope"), output=d.get("output"), error=d.get("error"),
                   retry_at=d.get("retryAt"), started_at=d.get("startedAt"),
                   updated_at=d.get("updatedAt"))


@dataclass(slots=True)
class ExecutionState:
    """The folded state of one execution."""

    execution_id: str = ""
    status: str = "pending"
    sequence: int = -1
    flow_id: str | None = None
    flow_version: int | None = None
    flow_hash: str | None = None
    code_hash: str | None = None
    input: Any = None
    owner: dict[str, Any] | None = None
    deadline_at: int | None = None
    continued_from: str | None = None
    next_execution_id: str | None = None
    frames: dict[str, Frame] = field(default_factory=dict)
    decisions: dict[str, dict[str, Any]] = field(default_factory=dict)
    outcomes: list[dict[str, Any]] = field(default_factory=list)
    waiting: dict[str, Any] | None = None
    timers: dict[str, dict[str, Any]] = field(default_factory=dict)
    resume_payloads: dict[str, list[Any]] = field(default_factory=dict)
    messages: dict[str, list[Any]] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    emits: int = 0
    emitted: set[str] = field(default_factory=set)
    scopes: dict[str, dict[str, Any]] = field(default_factory=dict)
    migrated_at_seq: int | None = None
    denials: int = 0
    recoveries: int = 0
    output: Any = None
    error: dict[str, Any] | None = None
    started_at: int | None = None
    updated_at: int | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def parked(self) -> bool:
        return self.status == "parked"

    @property
    def tenant(self) -> str | None:
        return (self.owner or {}).get("tenant")

    def to_dict(self) -> dict[str, Any]:
        """The wire form: what fold vectors pin and snapshot stores keep."""
        return {
            "executionId": self.execution_id, "status": self.status,
            "sequence": self.sequence, "flowId": self.flow_id,
            "flowVersion": self.flow_version, "_flowHash": self.flow_hash,
            "_codeHash": self.code_hash, "input": self.input, "owner": self.owner,
            "deadlineAt": self.deadline_at, "continuedFrom": self.continued_from,
            "nextExecutionId": self.next_execution_id,
            "frames": {k: f.to_dict() for k, f in self.frames.items()},
            "_decisions": copy.deepcopy(self.decisions),
            "_outcomes": copy.deepcopy(self.outcomes),
            "waiting": copy.deepcopy(self.waiting),
            "timers": copy.deepcopy(self.timers),
            "_resumePayloads": copy.deepcopy(self.resume_payloads),
            "_messages": copy.deepcopy(self.messages),
            "_values": copy.deepcopy(self.values), "_emits": self.emits,
            "_emitted": sorted(self.emitted),
            "scopes": copy.deepcopy(self.scopes), "migratedAtSeq": self.migrated_at_seq,
            "denials": self.denials, "recoveries": self.recoveries,
            "output": self.output, "error": self.error,
            "startedAt": self.started_at, "updatedAt": self.updated_at,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExecutionState:
        d = copy.deepcopy(d)
        return cls(
            execution_id=d.get("executionId", ""), status=d.get("status", "pending"),
            sequence=d.get("sequence", -1), flow_id=d.get("flowId"),
            flow_version=d.get("flowVersion"), flow_hash=d.get("_flowHash"),
            code_hash=d.get("_codeHash"), input=d.get("input"), owner=d.get("owner"),
            deadline_at=d.get("deadlineAt"), continued_from=d.get("continuedFrom"),
            next_execution_id=d.get("nextExecutionId"),
            frames={k: Frame.from_dict(k, v) for k, v in (d.get("frames") or {}).items()},
            decisions=d.get("_decisions") or {}, outcomes=d.get("_outcomes") or [],
            waiting=d.get("waiting"), timers=d.get("timers") or {},
            resume_payloads=d.get("_resumePayloads") or {},
            messages=d.get("_messages") or {}, values=d.get("_values") or {},
            emits=d.get("_emits", 0), emitted=set(d.get("_emitted") or ()),
            scopes=d.get("scopes") or {},
            migrated_at_seq=d.get("migratedAtSeq"), denials=d.get("denials", 0),
            recoveries=d.get("recoveries", 0), output=d.get("output"),
            error=d.get("error"), started_at=d.get("startedAt"),
            updated_at=d.get("updatedAt"))

    def copy(self) -> ExecutionState:
        return ExecutionState.from_dict(self.to_dict())


def fold(state: ExecutionState, event: EventEnvelope) -> ExecutionState:
    """Return the state after ``event``; ``state`` is left untouched."""
    nxt = state.copy()
    apply(nxt, event)
    return nxt


def fold_log(events: Iterable[EventEnvelope],
             state: ExecutionState | None = None) -> ExecutionState:
    """Fold a whole log (or a tail onto a snapshot's state)."""
    st = state.copy() if state is not None else ExecutionState()
    for event in events:
        apply(st, event)
    return st


def apply(st: ExecutionState, ev: EventEnvelope) -> None:
    """Fold ``ev`` into ``st`` in place. Total: never raises on a payload."""
    p = ev.payload if isinstance(ev.payload, dict) else {}
    seq, ts, t = ev.sequence, ev.timestamp, ev.type
    if not st.execution_id:
        st.execution_id = ev.execution_id
    st.sequence = max(st.sequence, seq)
    st.updated_at = ts
    handler = _HANDLERS.get(t)
    if handler is not None:
        handler(st, ev, p, seq, ts)


def _started(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
             ts: int) -> None:
    if st.status != "pending":
        return  # a log starts once; a stray second start changes nothing
    st.status = "running"
    st.flow_id = p.get("flowId")
    st.flow_version = p.get("flowVersion")
    st.flow_hash = p.get("flowHash")
    st.code_hash = p.get("codeHash")
    st.input = p.get("input")
    st.owner = p.get("owner")
    st.deadline_at = p.get("deadlineAt")
    st.continued_from = p.get("continuedFrom")
    st.started_at = ts


def _attempt(value: Any, default: int) -> int:
    """An attempt number from a payload; ``default`` when it is not one (total)."""
    try:
        return int(value or 1)
    except (TypeError, ValueError, OverflowError):
        return default


def _frame(st: ExecutionState, p: dict[str, Any], seq: int, ts: int) -> Frame:
    step_id = str(p.get("stepId", ""))
    frame = st.frames.get(step_id)
    if frame is None:
        # firstSeq is set only when the frame is new (ADR 0113 fix round 3 item 1).
        frame = Frame(step_id=step_id, first_seq=seq, started_at=ts)
        st.frames[step_id] = frame
    frame.updated_at = ts
    return frame


def _step_started(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                  ts: int) -> None:
    is_new = str(p.get("stepId", "")) not in st.frames
    frame = _frame(st, p, seq, ts)
    frame.status = "started"
    frame.attempts = _attempt(p.get("attempt", frame.attempts + 1), frame.attempts + 1)
    frame.retry_at = None
    if is_new and ev.kernel and isinstance(p.get("scope"), str):
        frame.scope = p["scope"]


def _step_completed(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                    ts: int) -> None:
    frame = _frame(st, p, seq, ts)
    frame.status = "completed"
    frame.output = p.get("output")
    frame.error = None
    frame.retry_at = None
    frame.attempts = max(frame.attempts, _attempt(p.get("attempt", 1), 1))


def _step_failed(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                 ts: int) -> None:
    frame = _frame(st, p, seq, ts)
    frame.error = p.get("error")
    frame.attempts = max(frame.attempts, _attempt(p.get("attempt", 1), 1))
    if p.get("final", True):
        frame.status = "failed"
        frame.retry_at = None
    else:
        frame.status = "retrying"
        frame.retry_at = p.get("retryAt")


def _step_cancelled(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                    ts: int) -> None:
    frame = _frame(st, p, seq, ts)
    frame.status = "cancelled"
    frame.retry_at = None  # a cancelled step never retries


def _indoubt(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
             ts: int) -> None:
    _frame(st, p, seq, ts).status = "indoubt"


def _decision(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
              ts: int) -> None:
    entry: dict[str, Any] = {"choice": p.get("choice"), "policy": p.get("policy"),
                             "alternatives": p.get("alternatives"),
                             "context": p.get("context"), "seq": seq, "timestamp": ts}
    if ev.kernel:
        if isinstance(p.get("innerSteps"), list):
            entry["innerSteps"] = list(p["innerSteps"])
        if p.get("innerStepsOverflow") is True:
            entry["innerStepsOverflow"] = True
            entry["innerFrom"] = p.get("innerFrom")
    st.decisions[str(p.get("decisionId", ""))] = entry


def _outcome(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
             ts: int) -> None:
    entry: dict[str, Any] = {"decisionId": p.get("decisionId"), "key": p.get("key"),
                             "score": p.get("score"), "success": p.get("success"),
                             "seq": seq, "timestamp": ts}
    if ev.kernel:
        if isinstance(p.get("recordedBy"), str):
            entry["recordedBy"] = p["recordedBy"]
        if p.get("late") is True:
            entry["late"] = True
    st.outcomes.append(entry)


def _emitted(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
             ts: int) -> None:
    name = p.get("name")
    # An emit without a name (an older writer) was the n-th emit of the body.
    st.emitted.add(name if isinstance(name, str) else f"emit#{st.emits}")
    st.emits += 1


def _value(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
           ts: int) -> None:
    st.values[str(p.get("name", ""))] = p.get("value")


def _timer_scheduled(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                     ts: int) -> None:
    st.timers[str(p.get("timerId", ""))] = {"dueAt": p.get("dueAt"), "fired": False}


def _timer_fired(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                 ts: int) -> None:
    timer_id = str(p.get("timerId", ""))
    timer = st.timers.setdefault(timer_id, {"dueAt": None, "fired": False})
    timer["fired"] = True
    if st.status == "parked" and (st.waiting or {}).get("on") == timer_id:
        st.status = "running"
        st.waiting = None


def _suspended(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
               ts: int) -> None:
    if st.terminal:
        return
    st.status = "parked"
    cond = p.get("condition")
    st.waiting = dict(cond) if isinstance(cond, dict) else {"on": "", "kind": "gate"}


def _resumed(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
             ts: int) -> None:
    gate = str(p.get("gate", ""))
    # A status-only gate's answer (divergence retry, message wake) never reaches the flow.
    if gate not in STATUS_ONLY_GATES:
        st.resume_payloads.setdefault(gate, []).append(p.get("payload"))
    if not st.terminal:
        st.status = "running"
        st.waiting = None


def _message(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
             ts: int) -> None:
    st.messages.setdefault(str(p.get("key", "")), []).append(p.get("payload"))


def _parallel_started(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                      ts: int) -> None:
    st.scopes[str(p.get("scope", ""))] = {"branches": p.get("branches", 0), "startSeq": seq,
                                          "completed": False}


def _parallel_completed(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                        ts: int) -> None:
    scope = st.scopes.setdefault(str(p.get("scope", "")), {"branches": 0, "startSeq": None})
    scope["completed"] = True


def _migrated(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
              ts: int) -> None:
    st.flow_hash = p.get("toFlowHash", st.flow_hash)
    st.flow_version = p.get("toVersion", st.flow_version)
    if "toCodeHash" in p:
        st.code_hash = p.get("toCodeHash") or None
    st.migrated_at_seq = seq
    if not ev.kernel:
        return
    # A migration can discard frames (they run again) and reopen a finished
    # execution (resume_as); only the runtime writes either.
    discard = p.get("discard")
    for step_id in discard if isinstance(discard, list) else ():
        st.frames.pop(str(step_id), None)
    if p.get("reopen") is True and st.status in ("completed", "failed", "cancelled"):
        st.status = "running"
        st.waiting = None
        st.output = None
        st.error = None


def _terminal(status: str) -> Any:
    def handler(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                ts: int) -> None:
        # A terminal event on a terminal state changes nothing (the repair of a
        # compacted log writes one with an empty payload).
        if st.terminal:
            return
        st.status = status
        st.waiting = None
        if status == "completed":
            st.output = p.get("output")
        elif status == "failed":
            st.error = p.get("error") or {"type": "ExecutionFailed", "message": ""}
        elif status == "cancelled":
            st.error = {"type": "Cancelled", "message": p.get("reason", "")}
        elif status == "continued":
            st.next_execution_id = p.get("nextExecutionId")
    return handler


def _denied(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
            ts: int) -> None:
    st.denials += 1


def _recovered(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
               ts: int) -> None:
    st.recoveries += 1


def _debounced(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
               ts: int) -> None:
    # A repeat start's input replaces the waiting run's (decision 0057); only the
    # runtime writes it, and only before the run's body first ran.
    if ev.kernel and not st.terminal:
        st.input = p.get("input")


_HANDLERS: dict[EventType, Any] = {
    EventType.EXECUTION_STARTED: _started,
    EventType.STEP_STARTED: _step_started,
    EventType.STEP_COMPLETED: _step_completed,
    EventType.STEP_FAILED: _step_failed,
    EventType.STEP_CANCELLED: _step_cancelled,
    EventType.EFFECT_INDOUBT: _indoubt,
    EventType.DECISION_RECORDED: _decision,
    EventType.OUTCOME_RECORDED: _outcome,
    EventType.EMITTED: _emitted,
    EventType.VALUE_RECORDED: _value,
    EventType.TIMER_SCHEDULED: _timer_scheduled,
    EventType.TIMER_FIRED: _timer_fired,
    EventType.EXECUTION_SUSPENDED: _suspended,
    EventType.EXECUTION_RESUMED: _resumed,
    EventType.MESSAGE_RECEIVED: _message,
    EventType.PARALLEL_STARTED: _parallel_started,
    EventType.PARALLEL_COMPLETED: _parallel_completed,
    EventType.EXECUTION_MIGRATED: _migrated,
    EventType.EXECUTION_CONTINUED: _terminal("continued"),
    EventType.EXECUTION_COMPLETED: _terminal("completed"),
    EventType.EXECUTION_FAILED: _terminal("failed"),
    EventType.EXECUTION_CANCELLED: _terminal("cancelled"),
    EventType.EXECUTION_DENIED: _denied,
    EventType.RECOVERED: _recovered,
    EventType.EXECUTION_DEBOUNCED: _debounced,
}
