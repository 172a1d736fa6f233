"""The `fleet` command, end to end on a real SQLite file (the CLI holds no logic)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fleet.cli import main


@pytest.fixture
def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'cli.db'}"


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def started(db: str, user: str = "u-1") -> str:
    code, out = run("run", "--db", db, "--input", json.dumps(user), "--json")
    assert code == 0, out
    events = [json.loads(line) for line in out.splitlines()]
    assert events[0]["type"] == "EXECUTION_STARTED"
    assert events[-1]["type"] == "EXECUTION_COMPLETED"
    return str(events[0]["executionId"])


def test_run_prints_the_log_as_a_table(db: str) -> None:
    code, out = run("run", "--db", db)
    assert code == 0
    for kind in ("EXECUTION_STARTED", "DECISION_RECORDED", "TIMER_FIRED",
                 "EXECUTION_COMPLETED"):
        assert kind in out
    assert "result:" in out


def test_run_refuses_bad_input_and_an_unknown_flow(db: str) -> None:
    code, out = run("run", "--db", db, "--input", "{not json")
    assert code != 0
    assert "not JSON" in out
    code, out = run("run", "--db", db, "--flow", "fleet.examples.onboarding:nothing")
    assert code != 0
    assert "is not a flow" in out


def test_log_and_list(db: str) -> None:
    eid = started(db)
    code, out = run("log", eid, "--db", db, "--json")
    assert code == 0
    assert json.loads(out.splitlines()[0])["executionId"] == eid
    code, out = run("list", "--db", db, "--json", "--status", "completed")
    assert [json.loads(line)["executionId"] for line in out.splitlines()] == [eid]
    code, out = run("log", "missing", "--db", db)
    assert code != 0


def test_outcome_attach_learn_report_and_eval(db: str) -> None:
    ids = [started(db, f"u-{i}") for i in range(6)]
    for i, eid in enumerate(ids):
        code, out = run("outcome", "attach", "--db", db, "--execution", eid, "--decision",
                        "plan", "--key", "csat:1", "--score", str(i % 2), "--json")
        assert code == 0, out
        assert json.loads(out)["appended"] is True
    code, out = run("outcome", "attach", "--db", db, "--execution", ids[0], "--decision",
                    "plan", "--key", "csat:1", "--score", "0", "--json")
    assert json.loads(out) == {"appended": False, "sequence": None}
    code, out = run("outcome", "attach", "--db", db, "--execution", ids[0], "--decision",
                    "invented", "--key", "k", "--score", "1")
    assert code != 0
    assert "OutcomeRefusedError" in out
    code, out = run("learn", "report", "--db", db, "--json")
    report = json.loads(out)
    assert report["executions"] == 6
    assert report["policies"][0]["decisions"] == 6
    assert report["policies"][0]["rewarded"] == 6
    code, out = run("learn", "eval", "--db", db, "--policy",
                    "fleet.examples.onboarding:prefer_team", "--min-ess", "1", "--json")
    evaluation = json.loads(out)
    assert evaluation["samples"] == 6
    assert 0.0 <= evaluation["snips"] <= 1.0
    assert code == (0 if evaluation["passed"] else 1)


def test_learn_warns_about_compacted_logs_without_snapshots(db: str, tmp_path: Path) -> None:
    import asyncio

    from fleet.kernel.lifecycle import LogLifecycle
    from fleet.kernel.store.sqlite import SqliteEventStore
    from fleet.kernel.store.sqlite_snapshots import SqliteSnapshotStore

    eid = started(db)
    path = str(tmp_path / "cli.db")

    async def compact() -> None:
        store, snaps = SqliteEventStore(path), SqliteSnapshotStore(path)
        try:
            await LogLifecycle(store, snaps).compact(eid)
        finally:
            await snaps.close()
            await store.close()

    asyncio.run(compact())
    code, out = run("learn", "report", "--db", db, "--snapshots", "none", "--json")
    assert code == 0
    assert json.loads(out.splitlines()[-1])["compactedUnread"] == [eid]
    assert "look compacted" in out
    code, out = run("learn", "report", "--db", db, "--json")
    assert code == 0
    assert json.loads(out)["policies"][0]["decisions"] == 1


def test_repair_terminal_event_is_dry_by_default(db: str) -> None:
    eid = started(db)
    code, out = run("repair", "terminal-event", eid, "--db", db, "--json")
    assert code == 0
    assert json.loads(out)["action"] == "intact"
