"""The folded state of one execution: ``ExecutionState`` and its ``Frame`` per step.

``fleet.kernel.fold`` builds it from a log; this module is the state itself, its
wire form (``to_dict``/``from_dict``: what fold vectors pin and snapshot stores
keep) and the reserved gates. Fields added after the first fold vectors appear in
the wire form only when set (decision 0033), so a log that uses none of them
folds to the same form as before.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from fleet.kernel.events import TERMINAL_STATUSES

TERMINAL = TERMINAL_STATUSES  # the statuses an execution ends in (events.py holds the table)
DIVERGED_GATE = "__fleet_diverged__"
MESSAGE_GATE = "__fleet_message__"
# Gates whose answer only changes status: it never reaches the flow.
STATUS_ONLY_GATES = frozenset({DIVERGED_GATE, MESSAGE_GATE})
INDOUBT_GATE = "__fleet_indoubt__"
# The timer of a flow's deadline, kept in the timer index from the start on.
DEADLINE_TIMER = "__fleet_deadline__"


def condition_waits(condition: dict[str, Any] | None) -> list[dict[str, Any]]:
    """What a park condition waits on: itself, or each wait of a ``first`` (any of them)."""
    if not isinstance(condition, dict):
        return []
    if condition.get("kind") == "first":
        waits = condition.get("waits")
        return [w for w in waits if isinstance(w, dict)] if isinstance(waits, list) else []
    return [condition]


def waits_on(condition: dict[str, Any] | None, kind: str, on: str,
             correlation_key: str | None = None) -> bool:
    """Whether a park ``condition`` is woken by an answer of ``kind`` to ``on`` (a gate name,
    a timer id, the message gate with ``correlation_key``)."""
    for wait in condition_waits(condition):
        if wait.get("kind") == kind and wait.get("on") == on and (
                correlation_key is None or wait.get("correlationKey") == correlation_key):
            return True
    return False


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
    heartbeat: Any = None  # the details of its last STEP_HEARTBEAT (decision 0053)

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
        if self.heartbeat is not None:
            out["heartbeat"] = self.heartbeat
        return out

    @classmethod
    def from_dict(cls, step_id: str, d: dict[str, Any]) -> Frame:
        return cls(step_id=step_id, status=d.get("status", "started"),
                   attempts=d.get("attempts", 0), first_seq=d.get("firstSeq"),
                   scope=d.get("scope"), output=d.get("output"), error=d.get("error"),
                   retry_at=d.get("retryAt"), started_at=d.get("startedAt"),
                   updated_at=d.get("updatedAt"), heartbeat=d.get("heartbeat"))


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
    # Cancellation the flow sees (decision 0033): the request, and where it was delivered.
    cancel: dict[str, Any] | None = None
    cancel_deliveries: list[dict[str, Any]] = field(default_factory=list)
    # ctx.first: which wait won each race, by the race's name.
    races: dict[str, int] = field(default_factory=dict)
    # Child flows: this one's parent ({"executionId", "name", "onParentClose"}), and the
    # children it started by call name ({"childId", "flowId", "onParentClose", and once
    # ended "status", "output", "error", "endSeq"}).
    parent: dict[str, Any] | None = None
    children: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Messages and resumes this flow sent, by call name (ctx.send / ctx.resume).
    sent: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The sendIds of messages and resumes received (a repeat is dropped), and each
    # message's updateId (None: a plain message), in step with ``messages``.
    send_ids: set[str] = field(default_factory=set)
    message_ids: dict[str, list[str | None]] = field(default_factory=dict)
    # ctx.set_value: the values by key (last write wins) and the calls recorded.
    published: dict[str, Any] = field(default_factory=dict)
    published_names: set[str] = field(default_factory=set)
    # ctx.reply: the answer to each update, by updateId ({"value"} or {"error"}).
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Derived, not part of the wire form: the sequence of each answer, so a race
    # resolved live picks the answer that came first (a snapshot's state has none:
    # a race then falls back to the order of its waits).
    resume_seqs: dict[str, list[int]] = field(default_factory=dict)
    message_seqs: dict[str, list[int]] = field(default_factory=dict)
    timer_fired_seqs: dict[str, int] = field(default_factory=dict)
    # Derived too: the sequence of the last event a run wrote (not an answer from
    # outside): ctx.log is silent for what a drive replays up to it.
    run_seq: int = -1

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
            **self._added_fields(),
        }

    def _added_fields(self) -> dict[str, Any]:
        """Fields added after the first fold vectors (decision 0033), only when set, so
        the wire form of a log that uses none of them is unchanged."""
        out: dict[str, Any] = {}
        if self.cancel is not None:
            out["cancel"] = dict(self.cancel)
        if self.cancel_deliveries:
            out["_cancelDeliveries"] = copy.deepcopy(self.cancel_deliveries)
        if self.races:
            out["_races"] = dict(self.races)
        if self.parent is not None:
            out["parent"] = dict(self.parent)
        if self.children:
            out["_children"] = copy.deepcopy(self.children)
        if self.sent:
            out["_sent"] = copy.deepcopy(self.sent)
        if self.send_ids:
            out["_sendIds"] = sorted(self.send_ids)
        if any(i is not None for ids in self.message_ids.values() for i in ids):
            # Every key's ids, as long as its messages (a state restored from a form
            # without them, or older, pads with None as the fold does).
            out["_messageIds"] = {
                key: [*ids, *[None] * (len(messages) - len(ids))]
                for key, messages in self.messages.items()
                if (ids := self.message_ids.get(key, [])) is not None}
        if self.published_names:
            out["_published"] = copy.deepcopy(self.published)
            out["_publishedNames"] = sorted(self.published_names)
        if self.replies:
            out["_replies"] = copy.deepcopy(self.replies)
        return out

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
            updated_at=d.get("updatedAt"), cancel=d.get("cancel"),
            cancel_deliveries=d.get("_cancelDeliveries") or [],
            races=d.get("_races") or {}, parent=d.get("parent"),
            children=d.get("_children") or {}, sent=d.get("_sent") or {},
            send_ids=set(d.get("_sendIds") or ()), message_ids=d.get("_messageIds") or {},
            published=d.get("_published") or {},
            published_names=set(d.get("_publishedNames") or ()),
            replies=d.get("_replies") or {})

    def copy(self) -> ExecutionState:
        out = ExecutionState.from_dict(self.to_dict())
        out.resume_seqs = {k: list(v) for k, v in self.resume_seqs.items()}
        out.message_seqs = {k: list(v) for k, v in self.message_seqs.items()}
        out.timer_fired_seqs = dict(self.timer_fired_seqs)
        out.run_seq = self.run_seq
        return out


__all__ = ["DEADLINE_TIMER", "DIVERGED_GATE", "INDOUBT_GATE", "MESSAGE_GATE",
           "STATUS_ONLY_GATES", "TERMINAL", "ExecutionState", "Frame", "condition_waits",
           "waits_on"]
