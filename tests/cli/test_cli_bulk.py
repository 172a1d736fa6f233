"""``fleet executions cancel|retry|resume`` on a real SQLite store (issue 29.5)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from divergence_kit import Drill, Effects, ab_go_c, dropped_a
from kernel_kit import settle

from fleet import Principal, SqliteEventStore
from fleet.cli import main
from fleet.cli.bulk import parse_age
from fleet.kernel.fold import DIVERGED_GATE

ALICE = Principal("alice", tenant="acme")


async def _seed(path: Path, count: int) -> list[str]:
    store = SqliteEventStore(str(path))
    try:
        drill, fx = Drill(store), Effects()
        ids = [await drill.park(ab_go_c(fx), principal=ALICE, execution_id=f"d-{i}")
               for i in range(count)]
        runtime = drill.runtime(dropped_a(fx))
        for eid in ids:
            await runtime.resume(eid, "go", "ok", principal=ALICE)
        await settle(runtime)
        return ids
    finally:
        await store.close()


async def _last(path: Path, eid: str) -> dict[str, object]:
    store = SqliteEventStore(str(path))
    try:
        event = (await store.read(eid))[-1]
        return {"type": str(event.type), **event.payload}
    finally:
        await store.close()


@pytest.fixture
def fleet_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in list(os.environ):
        if name.startswith(("FLEET_", "FLOWER_")):
            monkeypatch.delenv(name)
    path = tmp_path / "bulk.db"
    monkeypatch.setenv("FLEET_DATABASE_URL", f"sqlite:///{path}")
    monkeypatch.setenv("FLEET_BROKER_URL", "memory://")
    monkeypatch.setenv("FLEET_OPERATOR", "operator:oncall")
    return path


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_parse_age() -> None:
    assert parse_age("90") == parse_age("90s")
    assert parse_age("2h") is not None
    assert parse_age("2h").total_seconds() == 7200  # type: ignore[union-attr]
    assert parse_age(None) is None


def test_dry_run_lists_then_retry_resumes_from_its_cursor_file(fleet_env: Path,
                                                              tmp_path: Path) -> None:
    ids = asyncio.run(_seed(fleet_env, 4))
    code, out = run("executions", "retry", "--dry-run", "--json")
    assert code == 0, out
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["executionId"] for line in lines[:-1]] == ids
    assert {line["result"] for line in lines[:-1]} == {"would"}
    assert lines[-1]["summary"]["matched"] == 4
    assert asyncio.run(_last(fleet_env, ids[0]))["type"] == "EXECUTION_SUSPENDED"  # untouched
    cursor = tmp_path / "cursor"
    code, out = run("executions", "retry", "--limit", "1", "--cursor-file", str(cursor))
    assert code == 0, out
    assert "1 done" in out
    assert "limit of 1" in out
    assert cursor.read_text() == ids[0]
    code, out = run("executions", "retry", "--cursor-file", str(cursor), "--rate", "100")
    assert code == 0, out
    assert "3 done" in out
    assert cursor.read_text() == ids[-1]
    for eid in ids:
        last = asyncio.run(_last(fleet_env, eid))
        assert (last["type"], last["gate"], last["by"]) == ("EXECUTION_RESUMED", DIVERGED_GATE,
                                                           "operator:oncall")


def test_cancel_needs_a_filter_and_an_operator(fleet_env: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ids = asyncio.run(_seed(fleet_env, 2))
    code, out = run("executions", "cancel")
    assert code == 1
    assert "needs a filter" in out
    monkeypatch.delenv("FLEET_OPERATOR")
    code, out = run("executions", "cancel", "--flow", "shape")
    assert code == 1
    assert "FLEET_OPERATOR" in out
    code, out = run("executions", "cancel", "--flow", "shape", "--dry-run")
    assert code == 0, out
    assert "2 execution(s) would be cancel" in out
    monkeypatch.setenv("FLEET_OPERATOR", "operator:oncall")
    code, out = run("executions", "cancel", "--flow", "shape", "--older-than", "1d")
    assert "0 done" in out
    code, out = run("executions", "cancel", "--flow", "shape", "--json")
    assert code == 0, out
    assert json.loads(out.splitlines()[-1])["summary"]["acted"] == 2
    for eid in ids:  # requested, who by and why; a worker delivers it (decision 0033)
        last = asyncio.run(_last(fleet_env, eid))
        assert last["type"] == "CANCEL_REQUESTED"
        assert last["by"] == "operator:oncall"
        assert str(last["reason"]).startswith("bulk cancel by operator:oncall (flow=shape")
    code, out = run("executions", "cancel", "--flow", "shape", "--older-than", "soon")
    assert code == 2
