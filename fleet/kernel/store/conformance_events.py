"""What the conformance kit builds its events with (``conformance`` re-exports these)."""

from __future__ import annotations

from typing import Any

from fleet.kernel.events import EventEnvelope, EventType

__all__ = ["HOSTILE_STRINGS", "T0", "make_event", "started"]

T0 = 1_700_000_000_000  # ms; every event timestamp in the kit is T0 + something
E = EventType

# Ids, flow ids and tenants a store must keep byte for byte: quoting, SQL,
# LIKE wildcards, escapes, unicode outside the BMP and a 10 KB string. (NUL is
# refused in a key by every backend, alike: conformance_values.)
HOSTILE_STRINGS: tuple[str, ...] = (
    "it's \"quoted\"", "x'; DROP TABLE events; --", "a;b;c", "100%_like_\\escape",
    "ünïcødé ∑ 日本語 🚀", "line\nbreak\ttab", " padded ", "k" * 10_240,
)

_DEFAULT_PAYLOADS: dict[EventType, dict[str, Any]] = {
    E.STEP_STARTED: {"stepId": "s", "attempt": 1},
    E.STEP_COMPLETED: {"stepId": "s", "attempt": 1, "output": None},
    E.EXECUTION_SUSPENDED: {"condition": {"on": "approval", "kind": "gate"}},
    E.EXECUTION_RESUMED: {"gate": "approval", "payload": True},
    E.TIMER_SCHEDULED: {"timerId": "t", "dueAt": T0},
    E.TIMER_FIRED: {"timerId": "t"},
    E.EXECUTION_COMPLETED: {"output": None},
    E.EXECUTION_FAILED: {"error": {"type": "Boom", "message": "boom"}},
    E.EXECUTION_CANCELLED: {"reason": "test"},
    E.EXECUTION_CONTINUED: {"nextExecutionId": "next"},
    E.OUTCOME_RECORDED: {"decisionId": "d", "key": "k", "score": 1.0},
    E.CANCEL_REQUESTED: {"reason": "test"},
    E.CANCEL_DELIVERED: {"at": "gate:approval#0"},
    E.FIRST_RESOLVED: {"name": "first#0", "index": 0},
    E.TIMER_CANCELLED: {"timerId": "t"},
    E.CHILD_STARTED: {"name": "child#0", "childId": "c", "flowId": "flow"},
    E.CHILD_ENDED: {"name": "child#0", "childId": "c", "status": "completed"},
    E.MESSAGE_SENT: {"name": "send#0", "target": "t", "key": "k"},
    E.VALUE_SET: {"name": "set#0", "key": "k", "value": 1},
    E.UPDATE_REPLIED: {"updateId": "u", "value": 1},
}


def make_event(execution_id: str, sequence: int, type: EventType = E.STEP_COMPLETED,
               payload: dict[str, Any] | None = None, *, timestamp: int | None = None,
               kernel: bool = True) -> EventEnvelope:
    """An envelope with a valid payload for ``type`` (``payload`` overrides it)."""
    body = dict(_DEFAULT_PAYLOADS.get(type, {}))
    if type is E.STEP_COMPLETED and payload is None:
        body["stepId"] = f"s{sequence}"
    body.update(payload or {})
    return EventEnvelope.make(execution_id, sequence, type,
                              T0 + sequence if timestamp is None else timestamp, body,
                              kernel=kernel)


def started(execution_id: str, *, flow_id: str = "flow", tenant: str | None = "acme",
            owner: str = "alice", timestamp: int = T0) -> EventEnvelope:
    """A sequence-0 ``EXECUTION_STARTED`` carrying the index's flow, tenant and owner."""
    return make_event(execution_id, 0, E.EXECUTION_STARTED, {
        "flowId": flow_id, "flowVersion": 1, "flowHash": "sha256:00",
        "input": {"n": 1}, "owner": {"actor": owner, "tenant": tenant}}, timestamp=timestamp)
