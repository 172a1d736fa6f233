"""The report page (self-contained, escaped) and the decision export (CSV, Parquet)."""

from __future__ import annotations

import csv
import io
import json
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from fleet import (
    Context,
    Decision,
    EventEnvelope,
    EventType,
    MemoryEventStore,
    Policy,
    Principal,
    Runtime,
    flow,
)
from fleet.learning import evaluate_policy, trajectories
from fleet.learning.comparison import compare_policies, logged_summary
from fleet.learning.export import COLUMNS, decision_rows, write_csv, write_parquet
from fleet.learning.html_report import render_html
from fleet.learning.simulation import BANDIT

ALICE = Principal("alice", tenant="acme")


@flow("quote")
async def quote(ctx: Context, spec: dict[str, Any]) -> Any:
    choice = await ctx.decide("tier", lambda: Decision(
        spec["choice"], policy=Policy("tiers", 2, spec["p"]), alternatives=["a", "b"],
        context={"segment": spec["segment"], "note": "<b>&</b>"}))
    await ctx.outcome("tier", "clicked", success=True)
    return choice


async def _logged(clock: list[int]) -> list[EventEnvelope]:
    store = MemoryEventStore()
    runtime = Runtime(store, flows=[quote], clock=lambda: clock[0])
    events: list[EventEnvelope] = []
    for i, (choice, p) in enumerate([("a", 0.5), ("b", 0.5), ("a", 0.25)]):
        handle = await runtime.start("quote", {"choice": choice, "p": p, "segment": "smb"},
                                     principal=ALICE, execution_id=f"q{i}")
        await handle.result()
        clock[0] += 90_000  # the late reward comes 90 s after the end
        if i < 2:
            await runtime.record_outcome(f"q{i}", decision_id="tier", key="csat:1",
                                         score=0.25 * (i + 1), principal=ALICE)
        events += await store.read(f"q{i}")
    return events


async def test_one_row_per_decision_with_its_rewards_and_late_delay(tmp_path: Path) -> None:
    clock = [1_800_000_000_000]
    events = await _logged(clock)
    rows = decision_rows(events)
    assert [(r.execution_id, r.choice, r.propensity) for r in rows] == [
        ("q0", "a", 0.5), ("q1", "b", 0.5), ("q2", "a", 0.25)]
    first = rows[0]
    assert (first.flow_id, first.status, first.policy_name, first.policy_version) == (
        "quote", "completed", "tiers", 2)
    # The reward is direct_reward's: the in-run success (1) plus the late score.
    assert [r.reward for r in rows] == [1.25, 1.5, 1.0]
    paths = trajectories(events)
    assert [r.reward for r in rows] == pytest.approx(
        [evaluate_policy(paths[i:i + 1] * 2, lambda c, ch, a: 0.5).logged_value
         for i in range(3)])
    assert [(j.key, j.late) for j in first.rewards] == [("clicked", False), ("csat:1", True)]
    assert first.late_rewards == 1
    assert first.late_reward_delay == timedelta(seconds=90)
    assert first.rewards[0].delay == timedelta(0)
    assert rows[2].late_reward_delay is None
    assert first.decided_at.timestamp() == pytest.approx(1_800_000_000)
    assert first.terminal_reward == 1.0

    out = io.StringIO()
    assert write_csv(rows, out) == 3
    read = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert tuple(read[0]) == COLUMNS
    assert read[0]["late_reward_delay_s"] == "90.0"
    assert read[2]["late_reward_delay_s"] == ""
    assert json.loads(read[0]["context"]) == {"segment": "smb", "note": "<b>&</b>"}
    assert json.loads(read[0]["choice"]) == "a"
    assert [j["key"] for j in json.loads(read[0]["rewards"])] == ["clicked", "csat:1"]
    assert read[0]["decided_at"].startswith("2027-01-15T08:00:00")

    path = tmp_path / "decisions.parquet"
    assert write_parquet(rows, path) == 3
    table = pq.read_table(path)
    assert table.column_names == list(COLUMNS)
    back = table.to_pylist()
    assert back[0]["late_reward_delay_s"] == 90.0
    assert back[0]["decided_at"] == first.decided_at
    assert [r["reward"] for r in back] == [1.25, 1.5, 1.0]
    assert str(table.schema.field("decided_at").type) == "timestamp[ms, tz=UTC]"


async def test_a_flow_cannot_forge_a_late_reward_in_the_export() -> None:
    clock = [1_800_000_000_000]
    events = await _logged(clock)
    # A userspace outcome that claims `late` (no kernel stamp) is an in-run one.
    forged = [e if e.type != EventType.OUTCOME_RECORDED or e.payload.get("key") != "clicked"
              else EventEnvelope.make(e.execution_id, e.sequence, e.type, e.timestamp,
                                      {**e.payload, "late": True}, kernel=False)
              for e in events]
    rows = decision_rows(forged)
    assert rows[2].late_rewards == 0


def _report(targets: dict[str, Any]) -> dict[str, Any]:
    paths = BANDIT.logs(200, seed=4)
    return {"title": "fleet policy evaluation", "source": "sqlite:///x.db", "executions": 200,
            "policies": logged_summary(paths),
            "targets": [c.to_dict() for c in compare_policies(paths, targets)],
            "filters": {"decision": None}, "confidence": 0.95, "compactedUnread": []}


def test_the_page_is_self_contained_and_shows_every_estimator_and_policy() -> None:
    def uniform(context: Any, choice: Any, alternatives: Any) -> float:
        return 1 / 3

    report = _report({"soft-best": BANDIT.target, "uniform": uniform})
    page = render_html(report)
    assert page.startswith("<!DOCTYPE html>")
    # Nothing fetched from anywhere: no script, stylesheet link, image or font URL.
    assert "<script" not in page
    assert "<link" not in page
    assert not re.search(r"\b(src|href)=", page)
    assert re.findall(r"https?://[^\"' )]+", page) == ["http://www.w3.org/2000/svg"] * (
        page.count("<svg"))
    assert "@import" not in page
    assert "url(" not in page
    for name in ("soft-best", "uniform", "IPS", "SNIPS", "DR", "SNDR", "Importance weights"):
        assert name in page
    # One line per policy compared: an interval per estimator per policy in the plot.
    assert page.count('data-estimator="snips"') == 2
    assert page.count('data-estimator="dr"') == 2
    # The figures are the report's (the JSON), to 4 places.
    snips = report["targets"][0]["estimates"]["snips"]
    assert f"{snips['estimated_value']:.4f}" in page
    assert f"{report['targets'][0]['weights']['effective_sample_size']:.1f}" in page


def test_the_page_escapes_what_the_logs_and_the_names_hold() -> None:
    hostile = '<script>alert("x")</script>'
    report = _report({hostile: BANDIT.target, "broken": lambda c, ch, a: 2.0})
    report["policies"][0]["policy"] = hostile
    report["filters"] = {"decision": hostile}
    page = render_html(report)
    assert hostile not in page
    assert "&lt;script&gt;" in page
    # A target that failed is shown with its reason, once per message.
    [line] = re.findall(r'<p class="err">(.*?)</p>', page)
    assert line.startswith("broken: IPS, SNIPS, DR, SNDR: InvalidTargetPolicyError: ")
    assert page.count(">n/a</td>") == 4
