"""User data reaches the terminal as text (issue 25.7, issue 29.6).

Ids, payloads, gate names, reasons, error messages and worker names are written by
whoever can start an execution or report as a worker. Each command here is run on a
real store (a SQLite file; the worker report in a real Redis) holding hostile
values: an ESC sequence that clears the screen and sets the title, BEL, a lone C1
CSI (0x9b), a right-to-left override, rich markup that closes a tag it never opened
(``evil[/bold]x``, once a ``MarkupError`` for everyone sharing the store) and an
OSC 8 / ``[link=...]`` link. What must hold: the command succeeds, no control
character reaches the output (each is written as an escape, ``\\x1b``), and the
text in square brackets is printed as it is.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from fleet import Context, Runtime, SqliteEventStore, flow
from fleet.cli import main
from fleet.cli.text import terminal_safe
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.fold import DIVERGED_GATE

ESC = "\x1b[2J\x1b]0;owned\x07"          # clear the screen, set the title, BEL
CSI = "\x9b31m"                          # C1 CSI: red, on terminals that take 8-bit C1
RLO = "\u202e"                           # right-to-left override
OSC8 = "\x1b]8;;https://evil.example\x07click\x1b]8;;\x07"
MARKUP = "evil[/bold]x"
LINK = "[link=https://evil.example]click[/link]"
CONTROLS = ("\x1b", "\x07", "\x9b", "\u202e")


def hostile_id(tag: str) -> str:
    return f"{tag}-{MARKUP}-{ESC}-{CSI}-{RLO}"


def assert_shown_as_text(out: str) -> None:
    for char in CONTROLS:
        assert char not in out, (char, out)
    # The escape is shown, not obeyed (a payload is JSON, where ESC is \u001b).
    assert "\\x1b" in out or "\\u001b" in out


def flat(out: str) -> str:
    """A table's text without its layout (spaces, line ends, cell borders): what a cell
    folded over several lines says."""
    return "".join(ch for ch in out if not ch.isspace() and ch not in "│┃")


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.output


@flow("hostile")
async def hostile(ctx: Context, text: str) -> str:
    await ctx.step(f"step {MARKUP} {ESC}", lambda: {"said": text, "link": LINK})
    return text


async def _seed(path: Path) -> str:
    """A completed execution whose id, step id, payloads and output are hostile."""
    store = SqliteEventStore(str(path))
    runtime = Runtime(store, flows=[hostile])
    try:
        eid = hostile_id("done")
        handle = await runtime.start("hostile", f"{OSC8} {LINK} {MARKUP} {CSI}",
                                     execution_id=eid)
        await handle.result(timeout=10)
        return eid
    finally:
        await runtime.close()
        await store.close()


@pytest.fixture
def seeded(tmp_path: Path) -> tuple[str, str]:
    path = tmp_path / "hostile.db"
    return f"sqlite:///{path}", asyncio.run(_seed(path))


def test_terminal_safe_escapes_controls_and_keeps_text() -> None:
    shown = terminal_safe(f"a{ESC}{CSI}{RLO}\u200bz [b]")
    assert shown == "a\\x1b[2J\\x1b]0;owned\\x07\\x9b31m\\u202e\\u200bz [b]"
    assert terminal_safe("line\nnext") == "line\nnext"
    assert terminal_safe("line\nnext\tx", newlines=False) == "line\\nnext\\tx"
    assert terminal_safe("plain ascii [x]") == "plain ascii [x]"
    assert terminal_safe("ünïcødé 日本") == "ünïcødé 日本"


def test_list_prints_hostile_ids_as_text(seeded: tuple[str, str]) -> None:
    url, eid = seeded
    code, out = run("list", "--db", url)
    assert code == 0, out  # was: rich MarkupError, for everyone sharing the store
    assert_shown_as_text(out)
    assert terminal_safe(eid, newlines=False) in out  # whole, on one line
    code, out = run("list", "--db", url, "--json")
    assert code == 0
    assert json.loads(out)["executionId"] == eid  # the data itself, exact


def test_log_prints_payloads_whole_and_as_text(seeded: tuple[str, str]) -> None:
    url, eid = seeded
    code, out = run("log", eid, "--db", url, "--full")
    assert code == 0, out
    assert_shown_as_text(out)
    assert MARKUP in flat(out)  # text in square brackets is kept (it was dropped as markup)
    assert "[link=https://evil.example]click[/link]" in flat(out)
    code, out = run("log", eid, "--db", url, "--json")
    events = [json.loads(line) for line in out.splitlines()]
    assert events[-1]["payload"]["output"] == f"{OSC8} {LINK} {MARKUP} {CSI}"  # verbatim


def test_log_cuts_a_long_payload_at_width_and_says_so(tmp_path: Path) -> None:
    async def seed() -> str:
        store = SqliteEventStore(str(tmp_path / "long.db"))
        runtime = Runtime(store, flows=[hostile])
        try:
            handle = await runtime.start("hostile", "x" * 1000 + "END")
            await handle.result(timeout=10)
            return handle.execution_id
        finally:
            await runtime.close()
            await store.close()
    eid = asyncio.run(seed())
    url = f"sqlite:///{tmp_path / 'long.db'}"
    shown = flat(run("log", eid, "--db", url)[1])
    assert "END" not in shown  # 400 characters by default: cut, and it says so
    assert "characters;--fullshowsall" in shown
    shown = flat(run("log", eid, "--db", url, "--width", "50")[1])
    assert "x" * 60 not in shown
    shown = flat(run("log", eid, "--db", url, "--full")[1])
    assert "x" * 1000 + "END" in shown  # whole (was: cut at 160 characters, silently)
    code, out = run("log", eid, "--db", url, "--json")
    assert code == 0
    assert "x" * 1000 + "END" in out


def test_an_error_quoting_a_hostile_id_is_text(seeded: tuple[str, str]) -> None:
    url, _ = seeded
    result = CliRunner().invoke(main, ["log", f"missing {ESC}{CSI}", "--db", url])
    assert result.exit_code == 1
    assert_shown_as_text(result.output)


def test_run_prints_a_hostile_result_and_gate_as_text(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    module = f"hostile_flows_{secrets.token_hex(3)}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(f'''
        from fleet import Context, flow

        @flow("hostile-run")
        async def done(ctx: Context, text: str) -> str:
            return text

        @flow("hostile-gate")
        async def gate(ctx: Context, text: str) -> str:
            return await ctx.wait({ESC + MARKUP!r})
    '''))
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'run.db'}"
    code, out = run("run", "--db", url, "--flow", f"{module}:done", "--input",
                    json.dumps(f"{OSC8} {LINK} {MARKUP} {CSI} {RLO}"))
    assert code == 0, out
    assert_shown_as_text(out)
    assert MARKUP in out
    code, out = run("run", "--db", url, "--flow", f"{module}:gate", "--input", '"x"')
    assert code == 0, out
    assert_shown_as_text(out)
    assert "parked on gate" in out


def _diverged_log(eid: str) -> list[EventEnvelope]:
    started = EventEnvelope.make(eid, 0, EventType.EXECUTION_STARTED, 1_700_000_000_000, {
        "flowId": f"flow {MARKUP} {ESC}", "flowVersion": 1, "flowHash": "sha256:00",
        "input": None, "owner": {"actor": "a", "tenant": None}}, kernel=True)
    parked = EventEnvelope.make(eid, 1, EventType.EXECUTION_SUSPENDED, 1_700_000_000_001, {
        "condition": {"on": DIVERGED_GATE, "kind": "diverged",
                      "correlationKey": f"skipped 1: {LINK} {ESC} {CSI}"}}, kernel=True)
    return [started, parked]


def test_diverged_list_prints_hostile_ids_and_reasons_as_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("FLEET_", "FLOWER_")):
            monkeypatch.delenv(name)
    path = tmp_path / "diverged.db"
    eid = hostile_id("parked")

    async def seed() -> None:
        store = SqliteEventStore(str(path))
        try:
            await store.append_batch(_diverged_log(eid))
        finally:
            await store.close()
    asyncio.run(seed())
    env = {"FLEET_DATABASE_URL": f"sqlite:///{path}", "FLEET_BROKER_URL": "memory://"}
    code, out = run("diverged", "list", env=env)
    assert code == 0, out
    assert_shown_as_text(out)
    assert terminal_safe(eid, newlines=False) in out  # the id whole, on one line
    code, out = run("diverged", "list", "--json", env=env)
    assert json.loads(out)["executionId"] == eid


def test_status_prints_a_hostile_worker_name_as_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from redis_server import prefix, server_url

    from fleet.services.counters import StatsReporter

    for name in list(os.environ):
        if name.startswith(("FLEET_", "FLOWER_")):
            monkeypatch.delenv(name)
    stats = f"{prefix()}stats:"
    worker = f"celery@{MARKUP}{ESC}{CSI}{RLO}"
    reporter = StatsReporter(server_url(), "worker", worker,
                             lambda: {"completed": 3, "failed": 1}, prefix=stats)

    async def report() -> None:
        try:
            assert await reporter.report()
        finally:
            await reporter.stop()
    asyncio.run(report())
    path = tmp_path / "status.db"
    asyncio.run(_seed(path))
    env = {"FLEET_DATABASE_URL": f"sqlite:///{path}", "FLEET_BROKER_URL": "memory://",
           "FLEET_REDIS_URL": server_url(), "FLEET_STATS_PREFIX": stats}
    for wide in ((), ("--wide",)):
        code, out = run("status", "--inspect-timeout", "0.2", *wide, env=env)
        assert code == 0, out
        assert "celery@evil[/bold]x" in flat(out), out
        assert_shown_as_text(out)
    _, out = run("status", "--json", "--inspect-timeout", "0.2", env=env)
    assert [w["name"] for w in json.loads(out)["workers"]] == [worker]


def test_describe_prints_hostile_ids_and_payloads_as_text(seeded: tuple[str, str]) -> None:
    url, eid = seeded
    code, out = run("describe", eid, "--db", url)
    assert code == 0, out
    assert_shown_as_text(out)
    assert MARKUP in flat(out)
