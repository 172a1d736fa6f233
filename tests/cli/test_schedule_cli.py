"""``fleet schedule ...`` without servers: SQLite and Celery's in-memory broker.

Each command writes through the dispatcher's runtime and drives nothing itself; the
test then does what a worker does with the drive (drives the schedule's run here).
The same commands against Postgres, Redis and real worker and timer processes are in
``tests/integration/test_schedules_fleet.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import schedule_flows
from click.testing import CliRunner

from fleet.cli import main
from fleet.kernel.runtime import Runtime
from fleet.kernel.store.sqlite import SqliteEventStore


@pytest.fixture
def db(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in list(os.environ):
        if name.startswith(("FLEET_", "FLOWER_")):
            monkeypatch.delenv(name)
    path = tmp_path / "fleet.db"
    for name, value in {"FLEET_DATABASE_URL": f"sqlite:///{path}",
                        "FLEET_BROKER_URL": "memory://",
                        "FLEET_FLOWS": ",".join(schedule_flows.ALL),
                        "FLEET_QUEUE": "schedule-cli"}.items():
        monkeypatch.setenv(name, value)
    return path


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["schedule", *args], catch_exceptions=False)
    return result.exit_code, result.output


def listed() -> list[dict[str, Any]]:
    code, out = run("list", "--json")
    assert code == 0, out
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def drive(db: Path, execution_id: str) -> None:
    """What a worker does with the drive the command enqueued (and the runs it starts)."""
    async def go() -> None:
        store = SqliteEventStore(str(db))
        runtime = Runtime(store, flows=[schedule_flows.job, schedule_flows.slow],
                          local_timers=False)
        try:
            await runtime.drive(execution_id, wait=True)
        finally:
            await runtime.close()
            await store.close()
    asyncio.run(go())


def executions(db: Path, flow_id: str | None = None) -> list[str]:
    async def go() -> list[str]:
        store = SqliteEventStore(str(db))
        try:
            return sorted(r.execution_id for r in await store.list_executions(
                flow_id=flow_id, limit=1000))
        finally:
            await store.close()
    return asyncio.run(go())


def test_create_list_control_and_delete_a_schedule(db: Path) -> None:
    code, out = run("create", "nightly", "sched-job", "--cron", "0 3 * * *",
                    "--timezone", "Europe/Riga", "--input", '{"a": 1}', "--json")
    assert code == 0, out
    made = json.loads(out)
    assert (made["scheduleId"], made["flow"], made["cron"], made["timezone"]) == (
        "nightly", "sched-job", "0 3 * * *", "Europe/Riga")
    assert made["nextTick"] is not None
    eid = made["executionId"]
    assert executions(db) == [eid]  # written, not driven: a worker takes the drive
    drive(db, eid)
    # The same settings again: accepted, nothing new. Other settings: refused, named.
    assert run("create", "nightly", "sched-job", "--cron", "0 3 * * *", "--timezone",
               "Europe/Riga", "--input", '{"a": 1}')[0] == 0
    code, out = run("create", "nightly", "sched-job", "--cron", "0 4 * * *", "--timezone",
                    "Europe/Riga", "--input", '{"a": 1}')
    assert code == 1
    assert "ConfigurationError: cron:" in out
    assert executions(db) == [eid]
    [shown] = listed()
    assert (shown["scheduleId"], shown["paused"], shown["runs"]) == ("nightly", False, 0)

    code, out = run("trigger", "nightly", "--json")
    assert code == 0, out
    triggered = json.loads(out)["executionId"]
    assert triggered.startswith("nightly@")
    drive(db, eid)
    assert executions(db, "sched-job") == [triggered]

    assert run("pause", "nightly")[0] == 0
    drive(db, eid)
    assert listed()[0]["paused"] is True
    assert run("resume", "nightly")[0] == 0
    drive(db, eid)
    assert listed()[0]["paused"] is False

    code, out = run("backfill", "nightly", "--start", "2025-06-01T00:00:00+03:00",
                    "--end", "2025-06-03T12:00:00+03:00", "--json")
    assert code == 0, out
    ids = json.loads(out)["executionIds"]
    assert ids == ["nightly@2025-06-01T00:00:00Z", "nightly@2025-06-02T00:00:00Z",
                   "nightly@2025-06-03T00:00:00Z"]  # 03:00 in Riga is 00:00 UTC in June
    drive(db, eid)
    assert set(ids) <= set(executions(db, "sched-job"))
    code, out = run("list")
    assert code == 0
    assert "nightly" in out
    assert "sched-job" in out

    assert run("delete", "nightly")[0] == 0
    assert listed() == []
    code, out = run("pause", "nightly")
    assert code == 1
    assert "ExecutionNotFoundError" in out


def test_bad_settings_are_refused_naming_the_field_and_nothing_is_written(db: Path) -> None:
    for args, expected in (
            (["--cron", "61 * * * *"], "ValidationError: cron:"),
            (["--every", "0"], "ValidationError: every:"),
            (["--cron", "0 3 * * *", "--timezone", "Mars/Base"], "ValidationError: timezone:"),
            (["--every", "1h", "--cron", "0 3 * * *"], "ValidationError: cron:")):
        code, out = run("create", "bad", "sched-job", *args)
        assert code == 1, out
        assert expected in out
    code, out = run("create", "bad", "sched-job", "--every", "soon")
    assert code == 2
    assert "not a duration" in out
    code, out = run("create", "bad", "sched-job", "--every", "1h", "--overlap", "queue")
    assert code == 2
    code, out = run("create", "bad", "no-such-flow", "--every", "1h")
    assert code == 1
    assert "FLEET_FLOWS registers" in out
    assert executions(db) == []


def test_every_takes_durations_and_backfill_refuses_a_future_window(db: Path) -> None:
    code, out = run("create", "often", "sched-job", "--every", "1h30m", "--json")
    assert code == 0, out
    assert json.loads(out)["every"] == 5400.0
    code, out = run("backfill", "often", "--start", "2025-06-01T00:00:00Z",
                    "--end", "2999-01-01T00:00:00Z")
    assert code == 1
    assert "ValidationError: end:" in out
    code, out = run("backfill", "often", "--start", "yesterday", "--end", "today")
    assert code == 2
