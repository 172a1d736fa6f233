"""Fold edges that no recorded log should produce, but a total fold must survive."""

from __future__ import annotations

from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.fold import fold_log


def _ev(seq: int, type_: EventType, payload: dict[str, object]) -> EventEnvelope:
    return EventEnvelope.make("x", seq, type_, 1_000 + seq, dict(payload))


START = {"flowId": "f", "flowVersion": 1, "flowHash": "fnv1a:00000000", "input": 1}


def test_a_second_start_does_not_reopen_a_finished_execution() -> None:
    log = [_ev(0, EventType.EXECUTION_STARTED, START),
           _ev(1, EventType.EXECUTION_COMPLETED, {"output": 7}),
           _ev(2, EventType.EXECUTION_STARTED, {**START, "input": 2, "flowId": "g"})]
    state = fold_log(log)
    assert state.status == "completed"
    assert state.output == 7
    assert state.flow_id == "f"
    assert state.input == 1
    assert state.sequence == 2


def test_message_wake_is_status_only() -> None:
    log = [_ev(0, EventType.EXECUTION_STARTED, START),
           _ev(1, EventType.EXECUTION_SUSPENDED,
               {"condition": {"on": "__fleet_message__", "kind": "message",
                              "correlationKey": "k"}}),
           _ev(2, EventType.MESSAGE_RECEIVED, {"key": "k", "payload": 5}),
           _ev(3, EventType.EXECUTION_RESUMED, {"gate": "__fleet_message__"})]
    state = fold_log(log)
    assert state.status == "running"
    assert state.messages == {"k": [5]}
    assert state.resume_payloads == {}
