"""``evidence_events``: an execution's learning evidence, whether or not it was compacted.

Compaction (ADR 0116 round 3, item i) keeps no learning evidence in place: a
checkpoint absorbs the ``DECISION_RECORDED`` and ``OUTCOME_RECORDED`` events at or
below it, and its folded state holds them (``_decisions`` with choice,
alternatives, context, policy and the envelope ``seq`` the fold stamps on each
entry, ADR 0128; ``_outcomes`` with key, score, success, seq, and the
kernel-only ``recordedBy`` / ``late``). This module rebuilds those events from
the state, so ``trajectories(evidence_events(state, log))`` is the same for a
compacted log as for the log before compaction.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fleet.kernel.errors import ConfigurationError
from fleet.kernel.events import TERMINAL_EVENT, TERMINAL_TYPES, EventEnvelope, EventType
from fleet.kernel.fold import ExecutionState

# Ties in sequence (only possible for a pre-0128 checkpoint's ordinals) read
# decisions before outcomes before the end.
_RANK = {EventType.EXECUTION_STARTED: 0, EventType.DECISION_RECORDED: 1,
         EventType.OUTCOME_RECORDED: 2}
_DECISION_FIELDS = ("policy", "alternatives", "context")
_KERNEL_DECISION_FIELDS = ("innerSteps", "innerStepsOverflow", "innerFrom")


def evidence_events(state: ExecutionState,
                    log: Iterable[EventEnvelope]) -> list[EventEnvelope]:
    """Rebuild one execution's decisions, outcomes and end from its state and log.

    Events still on the log are kept as they are: its ``EXECUTION_STARTED``,
    every ``DECISION_RECORDED`` (matched by decision id) and ``OUTCOME_RECORDED``
    (matched by sequence), and its terminal events. Whatever the state holds
    that the log no longer does (a checkpoint absorbed it) is rebuilt at the
    sequence the fold stamped on it, so absorbed decisions keep their true
    order whatever their ids look like ("10" and "2" included) and whatever
    key order the snapshot store kept (ADR 0128). A terminal state whose
    terminal event is not on the log (a pre-0116 compaction removed it) gets
    one synthesised from the state, stamped ``metadata.synthesised``.

    Typical use::

        state = await runtime.load_state(execution_id)
        log = await store.read(execution_id)
        paths = trajectories(evidence_events(state, log))

    Args:
        state: The execution's full folded state (snapshot + tail), e.g.
            ``Runtime.load_state``.
        log: The events the store still holds for that execution.

    Returns:
        The evidence events in sequence order, ready for ``trajectories``.

    Raises:
        ConfigurationError: the log holds events of another execution.
    """
    execution_id = state.execution_id
    out: list[EventEnvelope] = []
    started = terminal = False
    logged_decisions: set[str] = set()
    logged_outcomes: set[int] = set()
    for ev in log:
        if ev.execution_id != execution_id:
            raise ConfigurationError(
                f"evidence_events: the log holds {ev.execution_id!r}, the state is "
                f"{execution_id!r}; pass one execution's state and its own log")
        if ev.type == EventType.DECISION_RECORDED:
            logged_decisions.add(str(ev.payload.get("decisionId", "")))
        elif ev.type == EventType.OUTCOME_RECORDED:
            logged_outcomes.add(ev.sequence)
        elif ev.type in TERMINAL_TYPES:
            terminal = True
        elif ev.type == EventType.EXECUTION_STARTED:
            started = True
        else:
            continue
        out.append(ev)
    if not started and state.flow_id is not None:
        out.append(_started(state))
    absorbed_seq: dict[str, int] = {}
    ordinal = 0
    for decision_id, entry in state.decisions.items():
        if decision_id in logged_decisions:
            continue
        ordinal += 1
        seq = entry.get("seq")
        if isinstance(seq, bool) or not isinstance(seq, int):
            # A checkpoint folded before ADR 0128 has no seq: its map order is
            # all there is (exact only when the ids are not index-like and the
            # snapshot store kept key order).
            seq = ordinal
        absorbed_seq[decision_id] = seq
        out.append(_decision(execution_id, seq, _timestamp(entry, state), decision_id, entry))
    for entry in state.outcomes:
        seq = entry.get("seq")
        if isinstance(seq, int) and not isinstance(seq, bool):
            if seq in logged_outcomes:
                continue
        else:
            seq = absorbed_seq.get(str(entry.get("decisionId", "")), 0)
        out.append(_outcome(execution_id, seq, _timestamp(entry, state), entry))
    if state.terminal and not terminal:
        out.append(_terminal(state))
    out.sort(key=lambda e: (e.sequence, _RANK.get(e.type, 3)))
    return out


def _timestamp(entry: dict[str, Any], state: ExecutionState) -> int:
    ts = entry.get("timestamp")
    if isinstance(ts, int) and not isinstance(ts, bool):
        return ts
    return state.started_at or 0


def _decision(execution_id: str, seq: int, ts: int, decision_id: str,
              entry: dict[str, Any]) -> EventEnvelope:
    payload: dict[str, Any] = {"decisionId": decision_id, "choice": entry.get("choice")}
    for name in _DECISION_FIELDS + _KERNEL_DECISION_FIELDS:
        if entry.get(name) is not None:
            payload[name] = entry[name]
    return EventEnvelope.make(execution_id, seq, EventType.DECISION_RECORDED, ts, payload,
                              metadata={"rebuilt": True})


def _outcome(execution_id: str, seq: int, ts: int, entry: dict[str, Any]) -> EventEnvelope:
    payload: dict[str, Any] = {"decisionId": entry.get("decisionId"), "key": entry.get("key")}
    for name in ("score", "success"):
        if entry.get(name) is not None:
            payload[name] = entry[name]
    # The fold copies recordedBy / late only from a kernel-stamped envelope, so
    # an entry that has them came from one; an in-run outcome did not.
    kernel = "recordedBy" in entry or entry.get("late") is True
    if "recordedBy" in entry:
        payload["recordedBy"] = entry["recordedBy"]
    if entry.get("late") is True:
        payload["late"] = True
    return EventEnvelope.make(execution_id, seq, EventType.OUTCOME_RECORDED, ts, payload,
                              kernel=kernel, metadata={"rebuilt": True})


def _started(state: ExecutionState) -> EventEnvelope:
    payload: dict[str, Any] = {"flowId": state.flow_id, "flowVersion": state.flow_version,
                               "flowHash": state.flow_hash, "input": state.input,
                               "owner": state.owner}
    return EventEnvelope.make(state.execution_id, 0, EventType.EXECUTION_STARTED,
                              state.started_at or 0, payload, metadata={"synthesised": True})


def _terminal(state: ExecutionState) -> EventEnvelope:
    payload: dict[str, Any]
    if state.status == "completed":
        payload = {"output": state.output}
    elif state.status == "failed":
        payload = {"error": state.error}
    elif state.status == "cancelled":
        payload = {"reason": str((state.error or {}).get("message", ""))}
    else:
        payload = {"nextExecutionId": state.next_execution_id}
    # Below every late outcome (they sit above the terminal event, ADR 0116 Q3),
    # else at the folded head, where a pre-0116 checkpoint left the end.
    late = [o["seq"] for o in state.outcomes
            if o.get("late") is True and isinstance(o.get("seq"), int)]
    seq = min(late) - 1 if late else state.sequence
    return EventEnvelope.make(state.execution_id, seq, TERMINAL_EVENT[state.status],
                              state.updated_at or 0, payload, metadata={"synthesised": True})
