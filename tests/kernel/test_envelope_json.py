"""``EventEnvelope.to_json`` (the stored form, written around the encoder's text of
``payload`` and ``metadata``: decision 0031, fourth round) is byte for byte
``dumps(to_dict())``, the text every store kept before, whatever the event holds."""

from __future__ import annotations

import json
from enum import IntEnum
from typing import Any

import pytest

from fleet.kernel.errors import NotSerializableError
from fleet.kernel.events import EventEnvelope, EventType, dumps
from fleet.kernel.store.conformance import make_event
from fleet.kernel.store.encoding import encode_event


class _Seq(IntEnum):
    TWO = 2


class _Text(str):
    pass


_ODD = ["", "é", "\u2028\u2029", "\x00\x1f\x7f", '"\\/', "\ud800", "日本", "\U0001f600"]
_PAYLOADS: list[dict[str, Any]] = [
    {}, {"stepId": "a", "attempt": 1, "output": 6},
    {"n": 2**70, "f": 1e-05, "g": -0.0, "h": 1e16, "t": True, "z": None},
    {"nested": {"l": [1, [2, {"x": "y"}]], "e": {}}, "odd": _ODD},
    {"input": {v: v for v in _ODD}, "owner": None},
]
_METADATA: list[dict[str, Any]] = [
    {}, {"kernel": True}, {"kernel": 1}, {"kernel": False}, {"kernel": True, "x": 1},
    {"other": True}, {"kernel": "true"},
]


def _old(event: EventEnvelope) -> str:
    return dumps(event.to_dict())


@pytest.mark.parametrize("type_", list(EventType))
def test_every_kind_of_the_conformance_kit_is_written_as_before(type_: EventType) -> None:
    event = make_event("x-1", 3, type_)
    assert event.to_json() == _old(event)
    assert encode_event(event, None) == _old(event)


@pytest.mark.parametrize("payload", _PAYLOADS)
@pytest.mark.parametrize("metadata", _METADATA)
@pytest.mark.parametrize("execution_id", ["e", "é\u2028x", '"q\\', "a" * 300])
def test_odd_payloads_metadata_and_ids_are_written_as_before(
        payload: dict[str, Any], metadata: dict[str, Any], execution_id: str) -> None:
    event = EventEnvelope(f"{execution_id}-7", execution_id, 7, EventType.STEP_COMPLETED,
                          -5, payload, metadata)
    assert event.to_json() == _old(event)
    json.loads(event.to_json())  # and it is JSON


def test_what_is_not_a_plain_int_or_str_takes_the_encoders_path() -> None:
    seq = EventEnvelope("e-2", "e", _Seq.TWO, EventType.STEP_STARTED, 1, {}, {})
    text = EventEnvelope(_Text("e-2"), _Text("e"), 2, EventType.STEP_STARTED, 1, {}, {})
    for event in (seq, text):
        assert event.to_json() == _old(event)
    assert '"sequence":2,' in seq.to_json()


def test_a_payload_the_log_cannot_take_is_refused_alike() -> None:
    looped: dict[str, Any] = {}
    looped["self"] = looped
    for payload, message in (({"s": {1, 2}}, "not JSON serializable"),
                             ({"n": float("nan")}, "Out of range float"),
                             (looped, "Circular reference detected")):
        event = EventEnvelope.make("e", 1, EventType.STEP_COMPLETED, 1, payload)
        with pytest.raises((TypeError, ValueError)) as new:
            event.to_json()
        with pytest.raises((TypeError, ValueError)) as old:
            _old(event)
        assert type(new.value) is type(old.value)
        assert message in str(new.value)
        with pytest.raises(NotSerializableError, match=message):
            encode_event(event, None)
