"""The command line a new user meets (issue 15 item 6, issue 10 item 11), in process.

Every command is found by walking the click command tree, so a command added
later is held to the same rules: a malformed setting is one line naming it;
everything that prints takes ``--json`` and prints JSON; readers never create a
database. Real SQLite files, a real Redis (the rewards and events streams, under
keys of this test's own) and a real Postgres for ``fleet db``; Celery's
``memory://`` broker where a drive is only enqueued. The subprocess versions
(``fleet up``, ``fleet run``, ``fleet status`` at 80 columns) are in
``test_cli_up_and_run.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cli_first_hour_flows
import cli_fleet_flows
import pytest
import redis
from click.testing import CliRunner, Result
from postgres_server import throwaway_database
from redis_server import prefix, server_url

from fleet.assembly.roles import ROLES, open_relay
from fleet.cli import main
from fleet.config import FleetSettings
from fleet.kernel.runtime import Runtime
from fleet.kernel.store.sqlite import SqliteEventStore

#: The long-running processes: they log, they print no result (no --json).
PROCESSES = set(ROLES)
#: Commands whose --json is exercised by a subprocess test elsewhere (they start a fleet).
COVERED_ELSEWHERE = {
    "up": "tests/cli/test_cli_up_and_run.py::test_fleet_up_tells_another_shell_how_to_reach_it",
    "demo": "tests/integration/test_embedded.py::test_fleet_demo_json_with_nothing_configured",
    # A fleet with workers, a diverged execution and an operator (issue 14).
    "diverged list": "tests/integration/test_fleet_page.py::"
                     "test_a_diverged_run_is_listed_with_its_reason_and_retry_reparks_until_fixed",
    "diverged retry": "tests/integration/test_fleet_page.py::"
                      "test_a_diverged_run_is_listed_with_its_reason_and_retry_reparks_until_fixed",
}


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env)


def leaf_commands() -> dict[str, Any]:
    """Every command of the ``fleet`` tree by its path ("learn eval")."""
    found: dict[str, Any] = {}
    ctx = main.make_context("fleet", [], resilient_parsing=True)

    def walk(group: Any, path: list[str]) -> None:
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            if hasattr(command, "list_commands"):
                walk(command, [*path, name])
            else:
                found[" ".join([*path, name])] = command
    walk(main, [])
    return found


def takes_json(command: Any) -> bool:
    return any("--json" in getattr(p, "opts", ()) for p in command.params)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No FLEET_* variable, the working directory an empty temporary one."""
    for name in list(os.environ):
        if name.startswith(("FLEET_", "FLOWER_")):
            monkeypatch.delenv(name)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    return here


# -- malformed settings (issue 10 item 11) ------------------------------------------------

def test_a_malformed_setting_ends_every_command_with_one_line_naming_it(
        clean_env: Path) -> None:
    commands = leaf_commands()
    assert {"status", "worker", "timers", "recovery", "attacher", "relay", "flower", "up",
            "learn eval", "reward submit"} <= set(commands)
    for path in commands:
        result = invoke(*path.split(), env={"FLEET_LEASE_MS": "abc"})
        assert result.exit_code == 2, (path, result.output)
        lines = result.stderr.strip().splitlines()
        assert lines == ["Error: FLEET_LEASE_MS=abc: input should be a valid integer, unable "
                         "to parse string as an integer; e.g. FLEET_LEASE_MS=30000"], path
        assert "Traceback" not in result.output
    assert os.listdir(clean_env) == []  # nothing was started, nothing created


def test_every_bad_setting_is_named_with_a_good_value_and_secrets_are_not_repeated(
        clean_env: Path) -> None:
    result = invoke("status", env={"FLEET_WORKER_POOL": "gevent", "FLEET_LEASE_MS": "5",
                                   "FLEET_REWARD_KEYS": '{"billing": ["s3cret"]}'})
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("Error: FLEET_LEASE_MS=5: input should be greater than or equal "
                               "to 100; e.g. FLEET_LEASE_MS=30000")
    assert lines[1].startswith("Error: FLEET_WORKER_POOL=gevent: string should match pattern")
    assert lines[1].endswith("e.g. FLEET_WORKER_POOL=threads")
    assert lines[2].startswith("Error: FLEET_REWARD_KEYS: input should be a valid string "
                               "(at billing); e.g. FLEET_REWARD_KEYS=")
    assert "s3cret" not in result.output
    for name, value in (("FLEET_ROUTES", "{fleet.heavy"), ("FLEET_REWARD_KEYS", "secret-1"),
                        ("FLEET_DISPATCH_KEYS", "[oops")):
        result = invoke("status", env={name: value})
        assert result.exit_code == 2
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"Error: {name} is not JSON (")
        assert f"e.g. {name}='{{" in line
        assert value not in line


def test_debug_shows_the_traceback_of_the_same_error(clean_env: Path) -> None:
    result = invoke("--debug", "status", env={"FLEET_LEASE_MS": "abc"})
    assert result.exit_code == 2
    assert "Traceback (most recent call last)" in result.stderr
    assert "pydantic" in result.stderr
    assert result.stderr.strip().endswith(
        "Error: FLEET_LEASE_MS=abc: input should be a valid integer, unable to parse string "
        "as an integer; e.g. FLEET_LEASE_MS=30000")
    db = f"sqlite:///{clean_env / 'x.db'}"
    invoke("run", "--db", db, "--json")  # a store with one execution
    plain = invoke("log", "nope", "--db", db)
    debug = invoke("--debug", "log", "nope", "--db", db)
    assert (plain.exit_code, debug.exit_code) == (1, 1)
    assert "Traceback" not in plain.output
    resumed = invoke("resume", "nope", "approval", env={"FLEET_DATABASE_URL": db,
                                                         "FLEET_BROKER_URL": "memory://"})
    assert resumed.exit_code == 1
    assert "ExecutionNotFoundError" in resumed.stderr
    assert "Traceback" not in resumed.output
    traced = invoke("--debug", "resume", "nope", "approval",
                    env={"FLEET_DATABASE_URL": db, "FLEET_BROKER_URL": "memory://"})
    assert traced.exit_code == 1
    assert "Traceback (most recent call last)" in traced.stderr
    assert "ExecutionNotFoundError" in traced.stderr.strip().splitlines()[-1]


def test_a_fault_in_fleet_is_one_line_saying_how_to_see_it(
        clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fleet.cli.executions

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError(0)

    monkeypatch.setattr(fleet.cli.executions, "log_table", broken)
    db = f"sqlite:///{clean_env / 'x.db'}"
    assert invoke("run", "--db", db, "--json").exit_code == 0
    result = invoke("run", "--db", db)
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: unexpected KeyError: 0 (a fault in fleet, not in what you typed: "
        "`fleet --debug ...` prints the traceback; please report it)")
    assert "Traceback" in invoke("--debug", "run", "--db", db).stderr


def test_a_bad_policy_is_a_usage_error_before_any_work(clean_env: Path) -> None:
    for spec, why in (("nosuch:thing", "cannot import 'nosuch'"),
                      ("fleet.examples.agent:nothing", "has no attribute 'nothing'"),
                      ("fleet.examples.agent:EPSILON", "is not callable"),
                      ("no-colon", "must look like 'package.module:function'")):
        result = invoke("learn", "eval", "--policy", spec)
        assert result.exit_code == 2, result.output
        assert "Error: Invalid value for '--policy'" in result.stderr
        assert why in result.stderr
        assert "Traceback" not in result.output
    assert os.listdir(clean_env) == []


# -- readers never create a database ------------------------------------------------------

READERS = [["status"], ["list"], ["log", "e1"], ["learn", "report"],
           ["learn", "eval", "--policy", "fleet.examples.onboarding:prefer_team"],
           ["replay", "export", "e1"],
           ["replay", "check", "--flow", "fleet.examples.onboarding:onboard", "--all"],
           ["repair", "terminal-event", "e1"],
           ["outcome", "attach", "--execution", "e1", "--decision", "d", "--key", "k",
            "--score", "1"],
           ["resume", "e1", "approval"], ["send", "e1", "ping"], ["cancel", "e1"]]


def test_a_command_that_reads_never_creates_the_database(clean_env: Path) -> None:
    expected = ("Error: no fleet database at ./fleet.db; set FLEET_DATABASE_URL or --db, or "
                "run `fleet up`")
    for args in READERS:
        result = invoke(*args, env={"FLEET_BROKER_URL": "memory://"})
        assert result.exit_code == 1, (args, result.output)
        assert result.stderr.strip() == expected, args
        assert os.listdir(clean_env) == [], args
    # The readiness probe reads the store too: unhealthy, and still nothing created.
    probe = invoke("health", "--component", "timers", "--timeout", "1", "--json",
                   env={"FLEET_BROKER_URL": "memory://", "FLEET_HEARTBEAT_DIR": "hb"})
    assert probe.exit_code == 1
    store = json.loads(probe.stdout)["checks"][-1]
    assert (store["name"], store["ok"]) == ("store", False)
    assert "no SQLite database at fleet.db" in store["detail"]
    assert os.listdir(clean_env) == []
    elsewhere = clean_env / "data" / "fleet.db"
    result = invoke("list", "--db", f"sqlite:///{elsewhere}")
    assert result.exit_code == 1
    assert f"no fleet database at {elsewhere};" in result.stderr
    assert not elsewhere.parent.exists()
    # fleet up here wrote .fleet/env: the refusal says how to use it.
    (clean_env / ".fleet").mkdir()
    (clean_env / ".fleet" / "env").write_text("export FLEET_DATABASE_URL=...\n")
    result = invoke("status")
    assert "`. .fleet/env` points this shell at it" in result.stderr
    assert sorted(os.listdir(clean_env)) == [".fleet"]


def test_start_without_flows_says_how_to_register_them(clean_env: Path) -> None:
    result = invoke("start", "onboard", env={"FLEET_BROKER_URL": "memory://"})
    assert result.exit_code == 1
    assert "no flow 'onboard' is registered" in result.stderr
    assert "set FLEET_FLOWS=module:flow" in result.stderr
    assert os.listdir(clean_env) == []  # refused before a store was opened
    result = invoke("start", "onboard", env={
        "FLEET_BROKER_URL": "memory://", "FLEET_FLOWS": "fleet.examples.agent:support_reply"})
    assert result.exit_code == 1
    assert "FLEET_FLOWS registers fleet.examples.agent:support_reply" in result.stderr


# -- learn eval: only the decisions a policy applies to ---------------------------------

def _store_with_two_decisions(db: Path, executions: int) -> list[str]:
    async def go() -> list[str]:
        store = SqliteEventStore(str(db))
        try:
            runtime = Runtime(store, flows=[cli_first_hour_flows.two_decisions])
            ids = []
            for n in range(executions):
                handle = await runtime.start("cli-two-decisions", n)
                await handle.result(timeout=10)
                ids.append(handle.execution_id)
                for decision, key, score in (("reply_style", "csat:1", 0.2 + 0.1 * (n % 5)),
                                             ("discount", "margin:1", 0.5)):
                    await runtime.record_outcome(handle.execution_id, decision_id=decision,
                                                 key=key, score=score)
            await runtime.close()
            return ids
        finally:
            await store.close()
    return asyncio.run(go())


def test_learn_eval_evaluates_only_the_decisions_its_policy_applies_to(
        clean_env: Path) -> None:
    _store_with_two_decisions(clean_env / "fleet.db", 12)
    policy = ["learn", "eval", "--policy", "fleet.examples.agent:better_style", "--min-ess", "0"]
    # Every decision fed to better_style was a KeyError: 0 (a discount is no style).
    result = invoke(*policy)
    assert result.exit_code == 2, result.output
    assert ("the logs hold 2 kinds of decision: discount (policy discount-eps-greedy, 12), "
            "reply_style (policy style-eps-greedy, 12)") in result.stderr
    assert "give --decision ID or --policy-name NAME" in result.stderr
    assert "Traceback" not in result.output
    by_id = json.loads(invoke(*policy, "--decision", "reply_style", "--json").stdout)
    assert (by_id["samples"], by_id["decision"], by_id["skipped"]) == (12, "reply_style", 0)
    assert 0.0 < by_id["snips"] < 1.0
    by_name = json.loads(invoke(*policy, "--policy-name", "style-eps-greedy", "--json").stdout)
    assert by_name["samples"] == 12
    assert by_name["snips"] == pytest.approx(by_id["snips"])
    table = invoke(*policy, "--decision", "reply_style")
    assert "decision reply_style" in table.stdout
    # The wrong decision for this policy: its KeyError is named, not a traceback.
    wrong = invoke(*policy, "--decision", "discount")
    assert wrong.exit_code == 1
    assert "EvaluationError: fleet.examples.agent:better_style raised KeyError: 0" in \
        wrong.stderr
    assert "--decision ID chooses them" in wrong.stderr
    assert "Traceback" not in wrong.output
    nothing = invoke(*policy, "--decision", "no-such-decision")
    assert nothing.exit_code == 1
    assert "TooFewSamplesError: no decision could be evaluated" in nothing.stderr


# -- --success / --failure -----------------------------------------------------------------

def _outcome(db: Path, execution_id: str, key: str) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        store = SqliteEventStore(str(db))
        try:
            events = await store.read(execution_id)
        finally:
            await store.close()
        return next(e.payload for e in events if e.payload.get("key") == key)
    return asyncio.run(go())


def test_outcome_attach_and_reward_submit_take_the_same_success_flags(
        clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = clean_env / "fleet.db"
    [eid] = _store_with_two_decisions(db, 1)
    attach = ["outcome", "attach", "--execution", eid, "--decision", "reply_style"]
    for key, flags, expected in (("ok:1", ["--success"], True), ("ko:1", ["--failure"], False),
                                 ("old:1", ["--success", "false"], False),
                                 ("old:2", ["--success", "true"], True)):
        result = invoke(*attach, "--key", key, *flags, "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["appended"] is True
        assert _outcome(db, eid, key)["success"] is expected
    both = invoke(*attach, "--key", "both:1", "--success", "--failure")
    assert both.exit_code == 2
    assert "give --success or --failure, not both" in both.stderr

    inbox = prefix() + "rewards:inbox"  # where producers send (issue 25 item 2)
    monkeypatch.setenv("FLEET_REDIS_URL", server_url())
    monkeypatch.setenv("FLEET_REWARDS_INBOX", inbox)
    monkeypatch.setenv("FLEET_REWARD_KEYS", '{"p1": "secret"}')
    client = redis.Redis.from_url(server_url(), decode_responses=True)
    try:
        for flag, expected in (("--success", True), ("--failure", False)):
            result = invoke("reward", "submit", "--execution", eid, "--decision", "reply_style",
                            "--key", f"csat:{flag}", "--producer", "p1", flag, "--json")
            assert result.exit_code == 0, result.output
            entry = json.loads(result.stdout)["entry"]  # the reward's nonce
            sent = json.loads(client.lindex(inbox, 0))
            assert sent["nonce"] == entry
            assert sent["success"] is expected
    finally:
        client.delete(inbox)
        client.close()


# -- --json on every command that prints ----------------------------------------------------

def _drive(db: Path, execution_id: str) -> None:
    async def go() -> None:
        store = SqliteEventStore(str(db))
        try:
            runtime = Runtime(store, flows=[cli_fleet_flows.gate])
            await runtime.drive(execution_id, wait=True)
        finally:
            await store.close()
    asyncio.run(go())


async def _relay_once() -> None:
    """The real relay, until it has published what the store holds."""
    role = await open_relay(FleetSettings(), heartbeat=False)
    relay = role.services[0]
    await relay.start()
    try:
        assert await relay.caught_up(timeout=20)  # type: ignore[attr-defined]
    finally:
        await relay.stop()
        await role.aclose()


@pytest.fixture
def fleet_env(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    keys = prefix()
    settings = {
        "FLEET_DATABASE_URL": f"sqlite:///{clean_env / 'fleet.db'}",
        "FLEET_BROKER_URL": "memory://", "FLEET_REDIS_URL": server_url(),
        "FLEET_FLOWS": ",".join([*cli_fleet_flows.ALL, *cli_first_hour_flows.ALL]),
        "FLEET_QUEUE": keys + "drive", "FLEET_EVENTS_STREAM": keys + "events",
        "FLEET_REWARDS_STREAM": keys + "rewards", "FLEET_REWARD_KEYS": '{"p1": "secret"}',
        "FLEET_HEARTBEAT_DIR": str(clean_env / "hb")}
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    yield clean_env
    client = redis.Redis.from_url(server_url())
    try:
        client.delete(keys + "events", keys + "rewards", keys + "events:relay")
    finally:
        client.close()


def test_every_command_that_prints_takes_json_and_prints_json(fleet_env: Path) -> None:
    commands = leaf_commands()
    without = sorted(path for path, command in commands.items() if not takes_json(command))
    assert without == sorted(PROCESSES), "a command that prints a result takes --json"
    db = fleet_env / "fleet.db"

    def lines(args: list[str], codes: tuple[int, ...] = (0,)) -> list[Any]:
        result = invoke(*args)
        assert result.exit_code in codes, (args, result.output)
        printed = [line for line in result.stdout.splitlines() if line.strip()]
        assert printed, (args, "printed nothing")
        return [json.loads(line) for line in printed]

    ran = lines(["run", "--flow", "cli_first_hour_flows:two_decisions", "--input", "1",
                 "--json"])
    eid = ran[0]["executionId"]
    # A second run: one decision gives no interval (learn eval's TooFewSamplesError).
    lines(["run", "--flow", "cli_first_hour_flows:two_decisions", "--input", "2", "--json"])
    gated = lines(["start", "cli-gate", "--input", "1", "--json"])[0]["executionId"]
    _drive(db, gated)
    waiting = lines(["start", "cli-receive", "--input", "1", "--json"])[0]["executionId"]
    asyncio.run(_relay_once())
    export = fleet_env / "export.json"
    with throwaway_database() as pg:
        invocations: dict[str, tuple[list[str], tuple[int, ...]]] = {
            "run": (["run", "--json"], (0,)),
            "log": (["log", eid, "--json"], (0,)),
            "list": (["list", "--json"], (0,)),
            "describe": (["describe", eid, "--json"], (0,)),
            "start": (["start", "cli-gate", "--input", "2", "--json"], (0,)),
            "resume": (["resume", gated, "approval", "--payload", '"yes"', "--json"], (0,)),
            "send": (["send", waiting, "ping", "--json"], (0,)),
            "cancel": (["cancel", waiting, "--json"], (0,)),
            "status": (["status", "--json", "--inspect-timeout", "0.2"], (0,)),
            "health": (["health", "--component", "timers", "--liveness", "--json"], (1,)),
            "outcome attach": (["outcome", "attach", eid, "--decision",
                                "reply_style", "--key", "csat:1", "--score", "0.5",
                                "--json"], (0,)),
            "learn report": (["learn", "report", "--json"], (0,)),
            "learn eval": (["learn", "eval", "--policy", "fleet.examples.agent:better_style",
                            "--decision", "reply_style", "--reward", "terminal", "--min-ess",
                            "0", "--json"], (0, 1)),
            "learn export": (["learn", "export", "-o", str(fleet_env / "decisions.csv"),
                              "--json"], (0,)),
            "repair terminal-event": (["repair", "terminal-event", eid, "--json"], (0,)),
            "replay export": (["replay", "export", eid, "-o", str(export), "--json"], (0,)),
            "replay check": (["replay", "check", "--flow", "cli_first_hour_flows:two_decisions",
                              "--execution", eid, "--json"], (0,)),
            "reward submit": (["reward", "submit", eid, "--decision",
                               "reply_style", "--key", "csat:2", "--score", "1",
                               "--producer", "p1", "--json"], (0,)),
            "events status": (["events", "status", "--json"], (0,)),
            "events tail": (["events", "tail", "--from", "start", "--no-follow", "--count", "2",
                             "--json"], (0,)),
            "schedule create": (["schedule", "create", "hourly", "cli-gate", "--input", "3",
                                 "--every", "1h", "--json"], (0,)),
            "schedule list": (["schedule", "list", "--json"], (0,)),
            "schedule trigger": (["schedule", "trigger", "hourly", "--json"], (0,)),
            "schedule pause": (["schedule", "pause", "hourly", "--json"], (0,)),
            "schedule resume": (["schedule", "resume", "hourly", "--json"], (0,)),
            "schedule backfill": (["schedule", "backfill", "hourly", "--start",
                                   "2025-01-01T00:00:00Z", "--end", "2025-01-01T03:00:00Z",
                                   "--json"], (0,)),
            "schedule delete": (["schedule", "delete", "hourly", "--json"], (0,)),
            "db status": (["db", "status", "--db", pg, "--json"], (0,)),
            "db upgrade": (["db", "upgrade", "--db", pg, "--json"], (0,)),
            "executions cancel": (["executions", "cancel", "--flow", "cli-gate", "--dry-run",
                                   "--json"], (0,)),
            "executions retry": (["executions", "retry", "--dry-run", "--json"], (0,)),
            "executions resume": (["executions", "resume", "approval", "--dry-run", "--json"],
                                  (0,)),
        }
        json_commands = {path for path in commands if path not in PROCESSES}
        assert set(invocations) | set(COVERED_ELSEWHERE) == json_commands
        for path, (args, codes) in invocations.items():
            printed = lines(args, codes)
            assert all(isinstance(item, dict) for item in printed), path
    assert json.loads(export.read_text())["log"][0]["executionId"] == eid


def test_a_command_that_reads_never_migrates_a_postgres_database(clean_env: Path) -> None:
    async def tables(url: str) -> int:
        import asyncpg

        conn = await asyncpg.connect(url)
        try:
            return int(await conn.fetchval(
                "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"))
        finally:
            await conn.close()

    with throwaway_database() as pg:
        for args in (["list"], ["log", "e1"], ["learn", "report"], ["replay", "export", "e1"],
                     ["status", "--inspect-timeout", "0.2"]):
            result = invoke(*args, env={"FLEET_DATABASE_URL": pg,
                                        "FLEET_BROKER_URL": "memory://"})
            assert result.exit_code == 1, (args, result.output)
            assert "run `fleet db upgrade`" in result.output, args
            assert "Traceback" not in result.output
        assert asyncio.run(tables(pg)) == 0  # nothing created
        assert invoke("db", "upgrade", "--db", pg).exit_code == 0
        listed = invoke("list", "--json", env={"FLEET_DATABASE_URL": pg})
        assert (listed.exit_code, listed.stdout) == (0, "")
