"""``fleet learn eval|report|export`` on a real SQLite store (issue 30 item 3, issue 29 item 9)."""

from __future__ import annotations

import asyncio
import csv
import io
import json
from pathlib import Path
from typing import Any

import cli_first_hour_flows
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from fleet.cli import main
from fleet.kernel.runtime import Runtime
from fleet.kernel.store.sqlite import SqliteEventStore

STYLE = "fleet.examples.agent:better_style"


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("learn") / "fleet.db"

    async def go() -> None:
        store = SqliteEventStore(str(path))
        try:
            runtime = Runtime(store, flows=[cli_first_hour_flows.two_decisions])
            for n in range(30):
                handle = await runtime.start("cli-two-decisions", n)
                await handle.result(timeout=10)
                score = 0.2 + 0.1 * (n % 5)
                # Two rewards for one decision: summed (direct_reward) by every command.
                for key in ("csat:1", "csat:2"):
                    await runtime.record_outcome(handle.execution_id, decision_id="reply_style",
                                                 key=key, score=score)
                await runtime.record_outcome(handle.execution_id, decision_id="discount",
                                             key="margin:1", score=0.5)
            await runtime.close()
        finally:
            await store.close()

    asyncio.run(go())
    return f"sqlite:///{path}"


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_report_and_eval_show_the_same_logged_value(db: str) -> None:
    # Issue 29 item 9: eval printed 1.164 where report printed 0.582 for the same
    # data (a sum of the joined rewards against their mean): one definition now.
    _, out, _ = run("learn", "report", "--db", db, "--json")
    report = json.loads(out)
    [style] = [p for p in report["policies"] if p["policy"] == "style-eps-greedy"]
    code, out, _ = run("learn", "eval", "--db", db, "--policy", STYLE, "--policy-name",
                       "style-eps-greedy", "--json")
    evaluation = json.loads(out)
    assert style["logged_value"] == pytest.approx(evaluation["logged"])
    assert style["logged_value"] == pytest.approx(2 * 0.4)  # the sum, not the mean
    assert (style["decisions"], style["rewarded"]) == (30, 30)
    # The ESS default is the library's, everywhere: 100.
    assert evaluation["minEss"] == 100.0
    assert code == 1
    assert any(r.endswith("below min_ess 100") for r in evaluation["reasons"])
    _, text, _ = run("learn", "eval", "--help")
    assert "100.0" in text


def test_report_compares_targets_under_every_estimator(db: str, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    code, out, err = run("learn", "report", "--db", db, "--policy", STYLE, "--decision",
                         "reply_style", "--html", str(page), "--json")
    assert code == 0, err
    report = json.loads(out)
    [target] = report["targets"]
    assert target["policy"] == STYLE
    assert list(target["estimates"]) == ["ips", "snips", "dr", "sndr"]
    assert target["estimates"]["dr"]["reward_model"] == "cell means, 5-fold cross-fitted"
    _, out, _ = run("learn", "eval", "--db", db, "--policy", STYLE, "--decision", "reply_style",
                    "--json")
    evaluation = json.loads(out)
    snips = target["estimates"]["snips"]
    assert snips["estimated_value"] == pytest.approx(evaluation["snips"])
    assert snips["effective_sample_size"] == pytest.approx(evaluation["ess"])
    assert target["gate"]["passed"] == evaluation["passed"]
    html = page.read_text()
    assert f"{snips['estimated_value']:.4f}" in html
    assert f"{target['estimates']['dr']['estimated_value']:.4f}" in html
    assert "sqlite:///" in html
    # A terminal reward over a flow of two decisions adds PDIS and SNPDIS.
    _, out, _ = run("learn", "report", "--db", db, "--policy", STYLE, "--decision",
                    "reply_style", "--reward", "terminal", "--json")
    assert list(json.loads(out)["targets"][0]["estimates"])[-2:] == ["pdis", "snpdis"]
    # Without --decision a target would price both kinds of decision: refused.
    code, _, err = run("learn", "report", "--db", db, "--policy", STYLE)
    assert code == 2
    assert "give --decision ID or --policy-name NAME" in err


def test_eval_takes_an_estimator_a_bootstrap_and_refuses_too_few_resamples(db: str) -> None:
    args = ["learn", "eval", "--db", db, "--policy", STYLE, "--decision", "reply_style",
            "--json", "--min-ess", "0", "--min-lift", "-1"]
    code, out, err = run(*args, "--estimator", "dr", "--bootstrap", "200", "--seed", "5")
    assert code == 0, err
    dr = json.loads(out)
    assert (dr["estimator"], dr["interval"]) == ("dr", "bootstrap")
    assert dr["rewardModel"] == "cell means, 5-fold cross-fitted"
    low, high = dr["ci"]
    assert low < dr["estimated"] < high
    assert json.loads(run(*args, "--estimator", "dr", "--bootstrap", "200", "--seed", "5")[1]
                      )["ci"] == dr["ci"]
    code, out, err = run(*args, "--bootstrap", "50")
    assert code == 1
    assert out == ""
    assert "ConfigurationError" in err
    assert "ask for at least 200" in err
    code, _, err = run(*args, "--estimator", "magic")
    assert code == 2


def test_export_writes_one_row_per_decision_as_csv_or_parquet(db: str, tmp_path: Path) -> None:
    code, out, err = run("learn", "export", "--db", db, "-o", str(tmp_path / "d.csv"), "--json")
    assert code == 0, err
    assert json.loads(out) == {"written": 60, "executions": 30, "output": str(tmp_path / "d.csv"),
                               "format": "csv", "compactedUnread": []}
    with (tmp_path / "d.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 60
    style = [r for r in rows if r["decision_id"] == "reply_style"]
    assert {r["late_rewards"] for r in style} == {"2"}
    assert all(float(r["late_reward_delay_s"]) >= 0.0 for r in style)
    assert all(0.0 < float(r["propensity"]) <= 1.0 for r in rows)
    code, out, err = run("learn", "export", "--db", db, "-o", "-")
    assert code == 0
    assert list(csv.DictReader(io.StringIO(out))) == rows
    assert "60 decisions of 30 executions" in err
    code, _, err = run("learn", "export", "--db", db, "--format", "parquet", "-o",
                       str(tmp_path / "d.parquet"))
    assert code == 0, err
    table: Any = pq.read_table(tmp_path / "d.parquet")
    assert table.num_rows == 60
    assert sorted(table.column("reward").to_pylist()) == sorted(
        float(r["reward"]) for r in rows)
    code, _, err = run("learn", "export", "--db", db, "--format", "parquet", "-o", "-")
    assert code == 2
    assert "Parquet is written to a file" in err
    # A reader never creates a database.
    code, _, err = run("learn", "export", "--db", f"sqlite:///{tmp_path / 'none.db'}", "-o",
                       str(tmp_path / "x.csv"))
    assert code != 0
    assert not (tmp_path / "none.db").exists()
    assert not (tmp_path / "x.csv").exists()


def test_a_store_password_never_reaches_the_report() -> None:
    from fleet.cli.learn import shown_url

    assert shown_url("postgresql://fleet:s3cret@db.example:5432/fleet?sslmode=require") == (
        "postgresql://fleet:***@db.example:5432/fleet?sslmode=require")
    assert shown_url("postgresql://fleet@db/fleet") == "postgresql://fleet@db/fleet"
    assert shown_url("sqlite:///fleet.db") == "sqlite:///fleet.db"
    assert shown_url("postgresql://u:s3cret@[::1]:5433/x") == "postgresql://u:***@[::1]:5433/x"
