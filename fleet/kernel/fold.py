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

from collections.abc import Iterable
from typing import Any

from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.state import (
    DIVERGED_GATE,
    INDOUBT_GATE,
    MESSAGE_GATE,
    STATUS_ONLY_GATES,
    TERMINAL,
    ExecutionState,
    Frame,
    condition_waits,
    waits_on,
)


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
    if t not in _ANSWERS:
        st.run_seq = seq
    handler = _HANDLERS.get(t)
    if handler is not None:
        handler(st, ev, p, seq, ts)


# What reaches a run from outside (an answer, a wake): the rest the runs wrote.
_ANSWERS = frozenset({EventType.EXECUTION_RESUMED, EventType.MESSAGE_RECEIVED,
                      EventType.TIMER_FIRED, EventType.CHILD_ENDED, EventType.CANCEL_REQUESTED,
                      EventType.RECOVERED, EventType.EXECUTION_DENIED,
                      EventType.OUTCOME_RECORDED})


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
    parent = p.get("parent")
    if isinstance(parent, dict) and ev.kernel:
        st.parent = dict(parent)
    carried = p.get("messages")
    if isinstance(carried, dict) and ev.kernel:
        # Messages a continue_as_new predecessor had not taken (decision 0033).
        for key, entries in carried.items():
            for entry in entries if isinstance(entries, list) else ():
                if isinstance(entry, dict):
                    _add_message(st, str(key), entry.get("payload"), entry.get("updateId"),
                                 seq)


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
    st.timer_fired_seqs[timer_id] = seq
    if st.status == "parked" and ((st.waiting or {}).get("on") == timer_id
                                  or waits_on(st.waiting, "timer", timer_id)):
        st.status = "running"
        st.waiting = None


def _timer_cancelled(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                     ts: int) -> None:
    timer = st.timers.get(str(p.get("timerId", "")))
    if timer is not None and not timer.get("fired"):
        timer["cancelled"] = True


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
    send_id = p.get("sendId")
    if isinstance(send_id, str):
        if send_id in st.send_ids:
            return  # a flow's resume repeated after a crash: answered once
        st.send_ids.add(send_id)
    # A status-only gate's answer (divergence retry, message wake) never reaches the flow.
    if gate not in STATUS_ONLY_GATES:
        st.resume_payloads.setdefault(gate, []).append(p.get("payload"))
        st.resume_seqs.setdefault(gate, []).append(seq)
    if not st.terminal:
        st.status = "running"
        st.waiting = None


def _message(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
             ts: int) -> None:
    send_id = p.get("sendId")
    if isinstance(send_id, str):
        if send_id in st.send_ids:
            return  # a flow's send repeated after a crash: delivered once
        st.send_ids.add(send_id)
    update_id = p.get("updateId")
    _add_message(st, str(p.get("key", "")), p.get("payload"),
                 update_id if isinstance(update_id, str) else None, seq)


def _add_message(st: ExecutionState, key: str, payload: Any, update_id: str | None,
                 seq: int) -> None:
    messages = st.messages.setdefault(key, [])
    ids = st.message_ids.setdefault(key, [])
    ids.extend([None] * (len(messages) - len(ids)))  # a state from before message ids
    messages.append(payload)
    ids.append(update_id)
    st.message_seqs.setdefault(key, []).append(seq)


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


def _cancel_requested(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                      ts: int) -> None:
    # The first request stands (a second one changes nothing: decision 0033); it wakes a
    # parked execution so its run can deliver it.
    if st.terminal or st.cancel is not None:
        return
    st.cancel = {"reason": p.get("reason", ""), "by": p.get("by"), "seq": seq}
    st.status = "running"
    st.waiting = None


def _cancel_delivered(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                      ts: int) -> None:
    st.cancel_deliveries.append({"at": str(p.get("at", "")), "branch": str(p.get("branch", "")),
                                 "seq": seq})


def _first_resolved(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                    ts: int) -> None:
    index = p.get("index")
    if isinstance(index, int) and not isinstance(index, bool):
        st.races[str(p.get("name", ""))] = index


def _child_started(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                   ts: int) -> None:
    name = str(p.get("name", ""))
    if name not in st.children:
        st.children[name] = {"childId": p.get("childId"), "flowId": p.get("flowId"),
                             "onParentClose": p.get("onParentClose", "cancel")}


def _child_ended(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                 ts: int) -> None:
    name = str(p.get("name", ""))
    child = st.children.setdefault(name, {"childId": p.get("childId")})
    if "status" in child:
        return  # told twice (a notice and the parent's own look): the first stands
    child.update({"status": p.get("status"), "output": p.get("output"),
                  "error": p.get("error"), "endSeq": seq, "endedId": p.get("childId")})
    if st.status == "parked" and waits_on(st.waiting, "child", str(child.get("childId"))):
        st.status = "running"
        st.waiting = None


def _message_sent(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                  ts: int) -> None:
    st.sent[str(p.get("name", ""))] = {k: p.get(k) for k in ("target", "key", "gate", "error")
                                       if p.get(k) is not None}


def _value_set(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
               ts: int) -> None:
    st.published_names.add(str(p.get("name", "")))
    st.published[str(p.get("key", ""))] = p.get("value")


def _update_replied(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                    ts: int) -> None:
    update_id = str(p.get("updateId", ""))
    if update_id not in st.replies:
        st.replies[update_id] = ({"error": p.get("error")} if p.get("error") is not None
                                 else {"value": p.get("value")})


def _denied(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
            ts: int) -> None:
    st.denials += 1


def _recovered(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
               ts: int) -> None:
    st.recoveries += 1


def _step_heartbeat(st: ExecutionState, ev: EventEnvelope, p: dict[str, Any], seq: int,
                    ts: int) -> None:
    # Only the runtime writes heartbeats, and only for a step it started: one
    # for an unknown step id makes no frame (replay and divergence read frames).
    frame = st.frames.get(str(p.get("stepId", "")))
    if frame is None or not ev.kernel:
        return
    frame.heartbeat = p.get("details")
    frame.updated_at = ts


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
    EventType.CANCEL_REQUESTED: _cancel_requested,
    EventType.CANCEL_DELIVERED: _cancel_delivered,
    EventType.FIRST_RESOLVED: _first_resolved,
    EventType.TIMER_CANCELLED: _timer_cancelled,
    EventType.CHILD_STARTED: _child_started,
    EventType.CHILD_ENDED: _child_ended,
    EventType.MESSAGE_SENT: _message_sent,
    EventType.VALUE_SET: _value_set,
    EventType.UPDATE_REPLIED: _update_replied,
    EventType.STEP_HEARTBEAT: _step_heartbeat,
    EventType.EXECUTION_DEBOUNCED: _debounced,
}


__all__ = ["DIVERGED_GATE", "INDOUBT_GATE", "MESSAGE_GATE", "STATUS_ONLY_GATES", "TERMINAL",
           "ExecutionState", "Frame", "apply", "condition_waits", "fold", "fold_log",
           "waits_on"]
