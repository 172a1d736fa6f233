"""The divergence corpus: recorded logs replayed dry against the current code.

Each vector is ``{"name", "description", "flow", "log", "expect"}`` (and
``"snapshot"`` when the log is the tail after a checkpoint): ``replay_check``
of the log against ``divergence_corpus.FLOWS[flow]`` must give
``expect.status`` and ``expect.skipped``, and must call no step function and
no decider (a dry replay never runs an effect).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from divergence_corpus import CALLS, FLOWS, SPECS, VECTOR_DIR

from fleet.kernel.events import EventEnvelope
from fleet.kernel.fold import ExecutionState, fold_log
from fleet.kernel.replay import replay_check


def _load() -> list[dict[str, Any]]:
    vectors = []
    for path in sorted(VECTOR_DIR.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        data["_file"] = path.name
        vectors.append(data)
    return vectors


VECTORS = _load()


def test_the_corpus_covers_every_verdict_and_legacy_logs() -> None:
    assert len(VECTORS) >= 20
    names = [v["name"] for v in VECTORS]
    assert len(set(names)) == len(names)
    assert names == [s.name for s in SPECS], "re-record: divergence_corpus.py"
    statuses = {v["expect"]["status"] for v in VECTORS}
    assert statuses == {"ok", "diverged", "code_mismatch"}
    assert all(v["flow"] in FLOWS for v in VECTORS)
    legacy = [v for v in VECTORS if v["name"].startswith("legacy_")]
    assert len(legacy) >= 4
    # The legacy vectors really lack what an older writer did not write.
    for vector in legacy:
        log = vector["log"]
        lacks_inner = all("innerSteps" not in e["payload"] for e in log
                          if e["type"] == "DECISION_RECORDED")
        lacks_scope = all("scope" not in e["payload"] for e in log
                          if e["type"] == "STEP_STARTED")
        frames = (vector.get("snapshot") or {}).get("state", {}).get("frames", {})
        lacks_first_seq = bool(frames) and all("firstSeq" not in f for f in frames.values())
        assert (lacks_inner and lacks_scope) or lacks_first_seq, vector["name"]


@pytest.mark.parametrize("vector", VECTORS, ids=[v["_file"] for v in VECTORS])
async def test_vector_verdict(vector: dict[str, Any]) -> None:
    events = [EventEnvelope.from_dict(raw) for raw in vector["log"]]
    state = None
    if "snapshot" in vector:
        state = fold_log(events, ExecutionState.from_dict(vector["snapshot"]["state"]))
        assert events[0].sequence == vector["snapshot"]["sequence"] + 1
    CALLS.clear()
    verdict = await replay_check(events, [FLOWS[vector["flow"]]], state=state)
    assert CALLS == {}, f"a dry replay ran {dict(CALLS)}"
    expect = vector["expect"]
    assert (verdict.status, verdict.skipped) == (expect["status"], expect["skipped"]), \
        verdict.detail
    if verdict.status == "ok":
        assert verdict.frontier  # where it stopped: a live step, a park, the end


def test_the_readme_describes_the_corpus() -> None:
    readme = Path(VECTOR_DIR / "README.md").read_text(encoding="utf-8")
    for key in ("name", "description", "flow", "log", "expect", "snapshot"):
        assert f"`{key}`" in readme
