"""``fleet demo --json``: one seed gives one set of figures, and the deploy stage's
divergence is parked, then completed, as the log shows (issue 15 item 7).

Three real demos on SQLite and an embedded Valkey (no ``FLEET_*``): ``--seed 7``
twice (the second keeps its data directory, so its logs can be read) and
``--seed 11`` once. Each kills a worker at a moment the machine decides, so
which runs recover differs run to run; the figures must not.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleet.kernel.events import EventType
from fleet.kernel.fold import DIVERGED_GATE
from fleet.kernel.store.sqlite import SqliteEventStore

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(400)]

FLEET = str(Path(sys.executable).with_name("fleet"))


def _demo(cwd: Path, *extra: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    done = subprocess.run([FLEET, "demo", "--json", *extra], env=env, cwd=cwd,
                          capture_output=True, timeout=120, check=False)
    assert done.returncode == 0, (done.stdout.decode()[-3000:], done.stderr.decode()[-5000:])
    summary: dict[str, Any] = json.loads(done.stdout)
    assert summary["ok"], summary["problems"]
    return summary


@pytest.fixture(scope="module")
def demos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cwd = tmp_path_factory.mktemp("demo")
    kept = tmp_path_factory.mktemp("demo-data") / "data"
    return {"first": _demo(cwd, "--seed", "7"),
            "again": _demo(cwd, "--seed", "7", "--data-dir", str(kept)),
            "other": _demo(cwd, "--seed", "11"),
            "data_dir": kept}


def figures(summary: dict[str, Any]) -> dict[str, Any]:
    """What a seed must decide: approvals, rewards attached, the whole evaluation."""
    ex = summary["executions"]
    return {"executions": {k: ex[k] for k in ("started", "completed", "approved",
                                              "escalated")},
            "sends": ex["effects"].get("send", 0), "escalations": ex["effects"].get("escalate", 0),
            "rewards": {k: summary["rewards"][k] for k in ("submitted_valid", "attached")},
            "evaluation": summary["evaluation"],
            "divergence": {"parked": summary["divergence"]["parked"]["count"],
                           "completed": summary["divergence"]["completed"]}}


def test_the_same_seed_gives_the_same_figures(demos: dict[str, Any]) -> None:
    first, again = demos["first"], demos["again"]
    assert figures(first) == figures(again)
    # ... though they are two fleets: other runs, other ids, another crash.
    assert first["run"] != again["run"]
    assert not set(first["executions"]["ids"]) & set(again["executions"]["ids"])
    for summary in (first, again):
        evaluation = summary["evaluation"]["reply_style"]
        assert evaluation["samples"] == summary["executions"]["started"] == 30
        assert summary["recovery"]["recovered"] >= 1


def test_another_seed_gives_other_figures(demos: dict[str, Any]) -> None:
    first, other = figures(demos["first"]), figures(demos["other"])
    assert other["evaluation"]["reply_style"]["snips"] != first["evaluation"]["reply_style"][
        "snips"]
    assert other["evaluation"]["discount"] != first["evaluation"]["discount"]
    assert demos["other"]["options"]["seed"] == 11


def _logs(data_dir: Path, ids: list[str]) -> dict[str, list[Any]]:
    async def read() -> dict[str, list[Any]]:
        store = SqliteEventStore(str(data_dir / "fleet.db"))
        try:
            return {eid: list(await store.read(eid)) for eid in ids}
        finally:
            await store.close()
    return asyncio.run(read())


def test_the_deploy_stage_parks_the_changed_runs_then_completes_them(
        demos: dict[str, Any]) -> None:
    summary = demos["again"]
    stage = summary["divergence"]
    held = stage["executions"]
    assert len(held) == 3
    assert held == summary["executions"]["ids"][-3:]  # the last ones started
    assert stage["changed_flow"] == "fleet.examples.agent_changed:support_reply"
    assert stage["parked"]["count"] == 3
    assert stage["parked"]["skipped"] == dict.fromkeys(held, "skipped 1: classify")
    assert stage["parked"]["worker_divergence_parked"] == 3  # as fleet status read it
    assert stage["parked"]["status_parked"] == 3
    assert stage["deployed"]["pid"] != stage["fixed"]["pid"]
    assert stage["completed"] == 3
    assert "diverge" in summary["stages_s"]
    # The log says the same: parked on the gate before any effect of the changed
    # code, retried, then the send or escalation, then completed.
    logs = _logs(demos["data_dir"], summary["executions"]["ids"])
    for eid, log in logs.items():
        parks = [e.sequence for e in log if e.type == EventType.EXECUTION_SUSPENDED
                 and (e.payload.get("condition") or {}).get("on") == DIVERGED_GATE]
        if eid not in held:
            assert parks == [], eid  # healthy runs under divergence="fail": never refused
            continue
        assert len(parks) == 1, eid
        park = next(e for e in log if e.sequence == parks[0])
        assert park.payload["condition"]["correlationKey"] == "skipped 1: classify"
        retries = [e.sequence for e in log if e.type == EventType.EXECUTION_RESUMED
                   and e.payload.get("gate") == DIVERGED_GATE]
        assert len(retries) == 1
        assert retries[0] > parks[0]
        last_steps = [e for e in log if e.type == EventType.STEP_STARTED
                      and e.payload.get("stepId") in ("send", "escalate")]
        assert len(last_steps) == 1
        assert last_steps[0].sequence > retries[0]
        (completed,) = [e for e in log if e.type == EventType.EXECUTION_COMPLETED]
        assert completed.sequence > last_steps[0].sequence  # then the rewards, late
    # One send or escalation per run in all: the changed code ran none.
    effects = [json.loads(line) for line in
               (demos["data_dir"] / "effects.jsonl").read_text().splitlines()]
    finals = [e["execution"] for e in effects if e["step"] in ("send", "escalate")]
    assert sorted(finals) == sorted(summary["executions"]["ids"])
