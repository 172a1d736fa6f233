"""Fold vectors: recorded logs in, folded states out (tests/vectors/fold/*.json).

Each vector is ``{"name", "description", "log", "expected"}``: ``log`` is a list
of envelopes as ``EventEnvelope.to_dict()`` writes them and ``expected`` is
``ExecutionState.to_dict()`` of the whole log. The expected states were written
by hand from the fold's semantics, not captured from this implementation, so a
second implementation can be checked against the same files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleet.kernel.events import EventEnvelope, EventType, validate_payload_for
from fleet.kernel.fold import ExecutionState, fold, fold_log

VECTOR_DIR = Path(__file__).resolve().parents[3] / "tests" / "vectors" / "fold"


def load_vectors() -> list[dict[str, Any]]:
    """Every fold vector, in file order."""
    vectors = []
    for path in sorted(VECTOR_DIR.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        data["_file"] = path.name
        vectors.append(data)
    return vectors


VECTORS = load_vectors()


def _envelopes(vector: dict[str, Any]) -> list[EventEnvelope]:
    return [EventEnvelope.from_dict(raw) for raw in vector["log"]]


def _ids(vector: dict[str, Any]) -> str:
    return str(vector["_file"])


def test_the_corpus_is_large_enough() -> None:
    assert len(VECTORS) >= 18
    names = [v["name"] for v in VECTORS]
    assert len(set(names)) == len(names), "vector names repeat"


def test_the_vectors_cover_every_event_type() -> None:
    seen = {raw["type"] for v in VECTORS for raw in v["log"]}
    missing = {t.value for t in EventType} - seen
    assert not missing, f"no fold vector has {sorted(missing)}"


@pytest.mark.parametrize("vector", VECTORS, ids=_ids)
def test_vector_shape(vector: dict[str, Any]) -> None:
    assert set(vector) == {"name", "description", "log", "expected", "_file"}
    assert vector["description"].strip()
    log = vector["log"]
    assert log, "a vector needs at least one event"
    execution_id = log[0]["executionId"]
    # A vector is a real log: one execution, contiguous from 0, born by EXECUTION_STARTED.
    assert log[0]["type"] == EventType.EXECUTION_STARTED
    for seq, raw in enumerate(log):
        assert raw["executionId"] == execution_id
        assert raw["sequence"] == seq
        assert raw["id"] == f"{execution_id}-{seq}"
    assert vector["expected"]["executionId"] == execution_id


@pytest.mark.parametrize("vector", VECTORS, ids=_ids)
def test_fold_of_the_log_is_the_expected_state(vector: dict[str, Any]) -> None:
    state = fold_log(_envelopes(vector))
    assert state.to_dict() == vector["expected"]
    # The expected state is itself a fixed point of the wire form.
    assert ExecutionState.from_dict(vector["expected"]).to_dict() == vector["expected"]


@pytest.mark.parametrize("vector", VECTORS, ids=_ids)
def test_envelopes_round_trip_exactly(vector: dict[str, Any]) -> None:
    for raw in vector["log"]:
        env = EventEnvelope.from_dict(raw)
        assert env.to_dict() == raw, "the file is not in the canonical to_dict form"
        assert EventEnvelope.from_dict(env.to_dict()) == env
        text = env.to_json()
        assert EventEnvelope.from_json(text) == env
        assert EventEnvelope.from_json(text).to_json() == text
        assert json.loads(text) == raw


@pytest.mark.parametrize("vector", VECTORS, ids=_ids)
def test_every_payload_validates(vector: dict[str, Any]) -> None:
    for raw in vector["log"]:
        validate_payload_for(EventType(raw["type"]), raw["payload"])


@pytest.mark.parametrize("vector", VECTORS, ids=_ids)
def test_fold_does_not_mutate_its_input(vector: dict[str, Any]) -> None:
    state = ExecutionState()
    for env in _envelopes(vector):
        before = state.to_dict()
        nxt = fold(state, env)
        assert state.to_dict() == before
        assert nxt is not state
        state = nxt
    assert state.to_dict() == vector["expected"]


@pytest.mark.parametrize("vector", VECTORS, ids=_ids)
def test_fold_from_any_snapshot_equals_one_pass(vector: dict[str, Any]) -> None:
    events = _envelopes(vector)
    whole = fold_log(events).to_dict()
    for cut in range(len(events) + 1):
        head = fold_log(events[:cut])
        # What a snapshot store keeps and gives back: the wire form, through JSON.
        snapshot = ExecutionState.from_dict(json.loads(json.dumps(head.to_dict())))
        assert fold_log(events[cut:], snapshot).to_dict() == whole, f"cut at {cut}"
