"""``fleet describe EXECUTION_ID`` (issue 29.7) and did-you-mean (a real SQLite store)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from click.testing import CliRunner
from divergence_kit import Drill, Effects, ab_go_c, dropped_a
from kernel_kit import settle

from fleet import Principal, SqliteEventStore
from fleet.cli import main
from fleet.kernel.fold import DIVERGED_GATE

ALICE = Principal("alice", tenant="acme")


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


async def _seed(path: Path) -> tuple[str, str]:
    """A diverged execution and a fork of another (completed) one."""
    store = SqliteEventStore(str(path))
    try:
        drill, fx = Drill(store), Effects()
        eid = await drill.park(ab_go_c(fx), principal=ALICE, execution_id="parked-1")
        runtime = drill.runtime(dropped_a(fx))
        await runtime.resume(eid, "go", "ok", principal=ALICE)
        await settle(runtime)
        done = drill.runtime(ab_go_c(fx))
        source = await done.start("shape", None, principal=ALICE, execution_id="src-1")
        await settle(done)
        await done.resume(source.execution_id, "go", "ok", principal=ALICE)
        await settle(done)
        forked = await done.fork("src-1", from_step="b", principal=ALICE,
                                 new_execution_id="fork-1")
        await settle(done)
        return eid, forked.execution_id
    finally:
        await store.close()


def test_describe_says_status_flow_reason_origin_and_last_events(tmp_path: Path) -> None:
    path = tmp_path / "d.db"
    parked, forked = asyncio.run(_seed(path))
    url = f"sqlite:///{path}"
    code, out = run("describe", parked, "--db", url, "--json")
    assert code == 0, out
    shown = json.loads(out)
    assert (shown["status"], shown["flow"], shown["version"]) == ("parked", "shape", 1)
    assert (shown["waitingOn"], shown["reason"]) == (DIVERGED_GATE, "skipped 1: a")
    assert shown["owner"] == {"actor": "alice", "tenant": "acme"}
    assert [e["type"] for e in shown["lastEvents"]][-1] == "EXECUTION_SUSPENDED"
    assert len(shown["lastEvents"]) == shown["events"] == 8  # all of them (10 by default)
    code, out = run("describe", parked, "--db", url, "--events", "2")
    assert code == 0, out
    assert "skipped 1: a" in out
    assert "last 2 of" in out
    code, out = run("describe", forked, "--db", url, "--json")
    origin = json.loads(out)["forkedFrom"]
    assert (origin["executionId"], origin["step"], origin["by"]) == ("src-1", "b", "alice")
    code, out = run("describe", "nope", "--db", url)
    assert code == 1
    assert "no execution 'nope'" in out


def test_a_mistyped_command_is_a_usage_error_naming_the_closest() -> None:
    code, out = run("descibe", "x")
    assert code == 2
    assert "Did you mean 'describe'?" in out
    code, out = run("stauts")
    assert "Did you mean 'status' or 'start'?" in out
    code, out = run("diverged", "lst")
    assert code == 2
    assert "Did you mean 'list'?" in out


def test_the_readme_documents_every_exit_code_the_commands_use() -> None:
    from fleet.cli.dispatch import NOT_ENQUEUED
    from fleet.cli.diverged import REPARKED
    from fleet.cli.failures import SETTINGS_EXIT_CODE

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    codes = readme[readme.index("Exit codes:"):]
    codes = codes[:codes.index("\n\n")]
    for code, what in ((0, "done"), (1, "a failure"), (SETTINGS_EXIT_CODE, "a usage error"),
                       (REPARKED, "diverged again"), (NOT_ENQUEUED, "not enqueued"),
                       (130, "interrupted")):
        assert f"{code} " in codes, code
        assert what in " ".join(codes.split()), what
