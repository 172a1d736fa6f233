"""`fleet replay export` and `fleet replay check` on a real SQLite file (a deploy gate).

The executions are recorded by ``replay_cli_flows:linear``; the checks name
the current code with ``--flow``. Every check asserts that nothing was written
to the store and that no step function ran (the replay is dry).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import replay_cli_flows as flows
from click.testing import CliRunner
from kernel_kit import settle

from fleet import Runtime
from fleet.cli import main
from fleet.kernel.fold import fold_log
from fleet.kernel.store.spi import Snapshot
from fleet.kernel.store.sqlite import SqliteEventStore
from fleet.kernel.store.sqlite_snapshots import SqliteSnapshotStore

LINEAR = "replay_cli_flows:linear"
DROPPED = "replay_cli_flows:dropped_a"
RECODED = "replay_cli_flows:recoded"
OTHER = "replay_cli_flows:other"


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


class Recorded:
    """Two parked executions of ``linear`` and a finished ``other`` in one SQLite file."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.url = f"sqlite:///{path}"
        self.ids: list[str] = []

    async def record(self) -> None:
        store = SqliteEventStore(self.path)
        try:
            runtime = Runtime(store, flows=[flows.linear, flows.other])
            for eid in ("exec-1", "exec-2"):
                await runtime.start("cli-linear", execution_id=eid)
            await runtime.start("cli-other", execution_id="exec-other")
            await settle(runtime)
        finally:
            await store.close()
        flows.CALLS.clear()

    async def logs(self) -> dict[str, list[dict[str, Any]]]:
        store = SqliteEventStore(self.path)
        try:
            return {eid: [e.to_dict() for e in await store.read(eid)]
                    for eid in ("exec-1", "exec-2", "exec-other")}
        finally:
            await store.close()


@pytest.fixture
def recorded(tmp_path: Path) -> Recorded:
    rec = Recorded(tmp_path / "fleet.db")
    asyncio.run(rec.record())
    return rec


def test_export_writes_the_log_as_json(recorded: Recorded, tmp_path: Path) -> None:
    out = tmp_path / "exec-1.json"
    code, text = cli("replay", "export", "exec-1", "-o", str(out), "--db", recorded.url)
    assert code == 0, text
    doc = json.loads(out.read_text())
    assert doc["executionId"] == "exec-1"
    assert doc["log"] == asyncio.run(recorded.logs())["exec-1"]
    assert "snapshot" not in doc
    code, text = cli("replay", "export", "exec-1", "--db", recorded.url)
    assert code == 0
    assert json.loads(text) == doc
    code, text = cli("replay", "export", "missing", "--db", recorded.url)
    assert code != 0
    assert "no execution 'missing'" in text


def test_export_adds_the_checkpoint_of_a_compacted_log_and_check_replays_it(
        recorded: Recorded, tmp_path: Path) -> None:
    async def compact() -> int:
        store = SqliteEventStore(recorded.path)
        snaps = SqliteSnapshotStore(recorded.path)
        try:
            events = await store.read("exec-1")
            cut = events[3].sequence  # a, b recorded; the tail holds the park
            await snaps.save(Snapshot("exec-1", cut, fold_log(events[:cut + 1]).to_dict()))
            await store.compact_through("exec-1", cut)
            return cut
        finally:
            await snaps.close()
            await store.close()
    cut = asyncio.run(compact())
    out = tmp_path / "compacted.json"
    assert cli("replay", "export", "exec-1", "-o", str(out), "--db", recorded.url)[0] == 0
    doc = json.loads(out.read_text())
    assert doc["snapshot"]["sequence"] == cut
    # Sequence 0 (the creation anchor) stays; 1..cut live only in the checkpoint.
    assert [e["sequence"] for e in doc["log"][:2]] == [0, cut + 1]
    assert cli("replay", "check", "--flow", LINEAR, "--log", str(out))[0] == 0
    code, text = cli("replay", "check", "--flow", DROPPED, "--log", str(out), "--json")
    assert code == 1
    assert json.loads(text)["executions"][0]["skipped"] == ["a"]
    assert flows.CALLS == {}


def test_check_log_files_ok_and_diverged(recorded: Recorded, tmp_path: Path) -> None:
    out = tmp_path / "exec-1.json"
    cli("replay", "export", "exec-1", "-o", str(out), "--db", recorded.url)
    code, text = cli("replay", "check", "--flow", LINEAR, "--log", str(out))
    assert code == 0, text
    assert "exec-1" in text
    assert "ok" in text
    code, text = cli("replay", "check", "--flow", DROPPED, "--log", str(out))
    assert code == 1
    assert "DIVERGED" in text
    assert "skipped 1: a" in text
    assert flows.CALLS == {}  # dry: the edit's c never ran


def test_check_reads_json_lines_from_fleet_log(recorded: Recorded, tmp_path: Path) -> None:
    code, lines = cli("log", "exec-2", "--db", recorded.url, "--json")
    assert code == 0
    path = tmp_path / "exec-2.jsonl"
    path.write_text(lines)
    code, text = cli("replay", "check", "--flow", DROPPED, "--log", str(path), "--json")
    assert code == 1
    [verdict] = json.loads(text)["executions"]
    assert (verdict["executionId"], verdict["status"]) == ("exec-2", "diverged")


def test_check_executions_and_all_from_the_store(recorded: Recorded) -> None:
    before = asyncio.run(recorded.logs())
    code, text = cli("replay", "check", "--flow", LINEAR, "--flow", OTHER, "--all",
                     "--db", recorded.url, "--json")
    assert code == 0, text
    report = json.loads(text)
    assert report["ok"] is True
    assert report["checked"] == 3
    assert {v["executionId"]: v["status"] for v in report["executions"]} == {
        "exec-1": "ok", "exec-2": "ok", "exec-other": "ok"}
    code, text = cli("replay", "check", "--flow", DROPPED, "--execution", "exec-2",
                     "--db", recorded.url)
    assert code == 1
    assert "DIVERGED" in text
    assert "exec-2" in text
    code, text = cli("replay", "check", "--flow", DROPPED, "--flow", OTHER, "--all",
                     "--db", recorded.url, "--json")
    assert code == 1
    report = json.loads(text)
    assert (report["checked"], report["failed"]) == (3, 2)
    assert asyncio.run(recorded.logs()) == before  # nothing written
    assert flows.CALLS == {}


def test_check_reports_a_code_mismatch(recorded: Recorded) -> None:
    code, text = cli("replay", "check", "--flow", RECODED, "--execution", "exec-1",
                     "--db", recorded.url)
    assert code == 1
    assert "CODE MISMATCH" in text
    assert "build-1" in text
    code, text = cli("replay", "check", "--flow", OTHER, "--execution", "exec-1",
                     "--db", recorded.url, "--json")
    assert code == 1
    assert json.loads(text)["executions"][0]["status"] == "code_mismatch"


def test_check_names_an_unreadable_log_and_a_missing_execution(
        recorded: Recorded, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a log"}')
    code, text = cli("replay", "check", "--flow", LINEAR, "--log", str(bad), "--json")
    assert code == 1
    assert json.loads(text)["executions"][0]["status"] == "error"
    code, text = cli("replay", "check", "--flow", LINEAR, "--execution", "nope",
                     "--db", recorded.url, "--json")
    assert code == 1
    assert "no execution 'nope'" in json.loads(text)["executions"][0]["detail"]


def test_check_replays_a_corpus_vector(tmp_path: Path) -> None:
    vector = Path(__file__).resolve().parents[2] / "tests" / "vectors" / "divergence"
    path = next(vector.glob("*_dropped_step.json"))
    doc = json.loads(path.read_text())
    # The vector file has the export's "log" key; its flow is in the corpus registry.
    assert doc["flow"] == "linear_dropped_a"
    code, text = cli("replay", "check", "--flow", f"divergence_corpus:{doc['flow']}",
                     "--log", str(path), "--json")
    assert code == 1, text
    assert json.loads(text)["executions"][0]["skipped"] == ["a"]


def test_check_needs_exactly_one_source(recorded: Recorded, tmp_path: Path) -> None:
    assert cli("replay", "check", "--flow", LINEAR)[0] == 2
    assert cli("replay", "check", "--flow", LINEAR, "--all", "--execution", "x")[0] == 2
    code, text = cli("replay", "check", "--flow", "replay_cli_flows:nothing", "--all",
                     "--db", recorded.url)
    assert code == 1
    assert "is not a flow" in text
