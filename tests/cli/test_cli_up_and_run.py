"""The command line as a new user runs it: real ``fleet`` processes in a directory of
their own (issue 15 items 4 and 6, issue 10 item 11).

``fleet up`` runs on the embedded defaults (SQLite in ``.fleet``, an embedded
Valkey) with no ``FLEET_*`` variable, as on a fresh clone; ``fleet status`` at
80 columns reads a real worker process through a Redis database of this
module's own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fleet_worker_kit import WorkerProcess, fleet_env
from redis_server import prefix, url_with_db

from fleet.host.celery_api import broker_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

FLEET = str(Path(sys.executable).with_name("fleet"))
BROKER_DB = 15  # this module's own Redis database (the workers' control broadcasts)

FLOWS = '''
from fleet import Context, flow


@flow("nap", version=1)
async def nap(ctx: Context, seconds: float) -> str:
    await ctx.sleep(seconds)
    return "rested"


@flow("ask", version=1)
async def ask(ctx: Context, n: int) -> str:
    return await ctx.wait("approval")
'''


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLEET_", "FLOWER_", "PYTHONPATH", "COLUMNS"))}
    # The shell scripts call `fleet` by name, as a user's shell with the venv active
    # would: this interpreter's scripts come first even when pytest ran unactivated.
    env["PATH"] = os.pathsep.join(filter(None, (str(Path(sys.executable).parent),
                                                env.get("PATH"))))
    env.update(extra)
    return env


def fleet(cwd: Path, *args: str, env: dict[str, str] | None = None,
          timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FLEET, *args], cwd=cwd, env=env or clean_env(), text=True,
                          capture_output=True, timeout=timeout, check=False)


@pytest.fixture
def here(tmp_path: Path) -> Path:
    """An empty directory holding one module of flows, as a new project has."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "myflows.py").write_text(FLOWS)
    return project


# -- settings (issue 10 item 11) ---------------------------------------------------------

def test_a_malformed_setting_is_one_line_in_every_process(here: Path) -> None:
    for command in (["status"], ["worker"], ["timers"], ["relay"], ["up"]):
        done = fleet(here, *command, env=clean_env(FLEET_LEASE_MS="abc"))
        assert done.returncode == 2, (command, done.stderr)
        assert done.stderr.strip().splitlines() == [
            "Error: FLEET_LEASE_MS=abc: input should be a valid integer, unable to parse "
            "string as an integer; e.g. FLEET_LEASE_MS=30000"], command
        assert done.stdout == ""
    done = fleet(here, "status", env=clean_env(FLEET_ROUTES="{bad"))
    assert done.returncode == 2
    assert done.stderr.startswith("Error: FLEET_ROUTES is not JSON (")
    assert "Traceback" not in done.stderr
    debug = fleet(here, "--debug", "status", env=clean_env(FLEET_LEASE_MS="abc"))
    assert debug.returncode == 2
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1].startswith("Error: FLEET_LEASE_MS=abc:")
    assert sorted(os.listdir(here)) == ["myflows.py"]


# -- fleet run ---------------------------------------------------------------------------

def test_run_imports_a_module_of_this_directory_and_says_where_it_parks(here: Path) -> None:
    done = fleet(here, "run", "--flow", "myflows:nap", "--input", "2")
    assert done.returncode == 0, done.stderr
    found = re.search(r"parked on timer sleep#0 until (\d\d:\d\d:\d\d) \(in (\d+) s\)",
                      done.stdout)
    assert found, done.stdout
    assert found.group(2) == "2"
    assert "TIMER_FIRED" in done.stdout
    assert 'result: "rested"' in done.stdout

    done = fleet(here, "run", "--flow", "myflows:ask", "--input", "1")
    assert done.returncode == 0, done.stderr
    found = re.search(r"parked on gate 'approval': nothing here answers it; `fleet resume "
                      r"(\w+) approval --input JSON`", done.stdout)
    assert found, done.stdout
    listed = fleet(here, "list", "--json", "--status", "parked")
    assert [json.loads(line)["executionId"] for line in listed.stdout.splitlines()] == [
        found.group(1)]

    # --json: the log on standard output, what it parks on on standard error.
    done = fleet(here, "run", "--flow", "myflows:ask", "--json")
    assert done.returncode == 0
    assert [json.loads(line)["type"] for line in done.stdout.splitlines()] == [
        "EXECUTION_STARTED", "EXECUTION_SUSPENDED"]
    assert "parked on gate 'approval'" in done.stderr

    # A long sleep waits here, saying until when; Ctrl-C leaves it parked in the store.
    proc = subprocess.Popen([FLEET, "run", "--flow", "myflows:nap", "--input", "3600"],
                            cwd=here, env=clean_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        # An hour ahead may be tomorrow: then the date is shown too.
        assert re.match(r"parked on timer sleep#0 until (\d{4}-\d\d-\d\d )?\d\d:\d\d:\d\d "
                        r"\(in 3600 s\)", line), line
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:  # a failed assertion must not leave an hour-long run behind the session
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, (out, err)
    assert "stays parked in sqlite:///fleet.db" in err
    assert "Traceback" not in err


def test_run_refuses_a_flow_it_cannot_import_in_one_line(here: Path) -> None:
    done = fleet(here, "run", "--flow", "nosuch:flow")
    assert done.returncode == 2
    assert "Invalid value for '--flow'" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (here / "fleet.db").exists()


# -- fleet up ------------------------------------------------------------------------------

def _wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_fleet_up_tells_another_shell_how_to_reach_it(here: Path) -> None:
    out, err = here / "up.out", here / "up.err"
    env = clean_env(FLEET_FLOWS="myflows:nap,myflows:ask")
    with open(out, "w") as stdout, open(err, "w") as stderr:
        up = subprocess.Popen([FLEET, "up", "--workers", "1", "--no-flower", "--json"],
                              cwd=here, env=env, stdout=stdout, stderr=stderr,
                              start_new_session=True)
    env_file = here / ".fleet" / "env"
    try:
        _wait_for(lambda: env_file.exists() and out.read_text().strip(), 90, "fleet up")
        where = json.loads(out.read_text().splitlines()[0])
        assert where["env_file"] == str(env_file)
        assert oct(env_file.stat().st_mode & 0o777) == "0o600"
        exports = where["exports"]
        assert exports["FLEET_DATABASE_URL"] == f"sqlite:///{here / '.fleet' / 'fleet.db'}"
        assert exports["FLEET_REDIS_URL"] == where["redis"]
        assert exports["FLEET_FLOWS"] == "myflows:nap,myflows:ask"
        text = env_file.read_text()
        for name, _value in exports.items():
            assert f"export {name}=" in text
        # The reward keys travel as their file's path, never as the secrets.
        assert exports["FLEET_REWARD_KEYS_FILE"] == str(here / ".fleet" / "reward-keys.json")
        assert "FLEET_REWARD_KEYS=" not in text

        # Another shell: nothing set but what the file exports.
        script = (". .fleet/env && fleet start nap --input 0.2 && "
                  "fleet status --json --inspect-timeout 2 && env | grep ^FLEET_REWARD_KEYS_FILE=")
        other = subprocess.run(["sh", "-c", script], cwd=here, env=clean_env(), text=True,
                               capture_output=True, timeout=60, check=False)
        assert other.returncode == 0, other.stderr
        eid, status, keys = other.stdout.splitlines()
        assert [w["name"] for w in json.loads(status)["workers"]] == [
            w["node"] for w in where["workers"]]
        assert json.loads(Path(keys.split("=", 1)[1]).read_text())["local"]
        assert not (here / "fleet.db").exists()  # the fleet's store, not ./fleet.db

        # fleet up says when it finished.
        def finished() -> list[dict[str, Any]]:
            return [json.loads(line) for line in out.read_text().splitlines()[1:]]
        _wait_for(lambda: any(f["finished"] == eid for f in finished()), 60, "the line")
        [line] = [f for f in finished() if f["finished"] == eid]
        assert (line["status"], line["flow"]) == ("completed", "nap")
        assert line["tookS"] >= 0.2
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)
    assert up.returncode == 0, err.read_text()
    assert not env_file.exists()  # it pointed at a fleet that is gone


def test_fleet_up_prints_the_exports_and_a_line_per_finished_execution(here: Path) -> None:
    out = here / "up.out"
    with open(out, "w") as stdout:
        up = subprocess.Popen([FLEET, "up", "--workers", "1", "--no-flower"], cwd=here,
                              env=clean_env(FLEET_FLOWS="myflows:nap",
                                            FLEET_LEASE_MS="20000"),
                              stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(lambda: "Each execution that finishes" in out.read_text(), 90, "fleet up")
        text = out.read_text()
        assert "`. .fleet/env` points fleet status, fleet start, fleet list" in text
        assert f"  export FLEET_DATABASE_URL=sqlite:///{here / '.fleet' / 'fleet.db'}\n" in text
        assert "  export FLEET_FLOWS=myflows:nap\n" in text
        assert "  export FLEET_LEASE_MS=20000\n" in text  # a setting it runs with
        started = subprocess.run(["sh", "-c", ". .fleet/env && fleet start nap --input 0"],
                                 cwd=here, env=clean_env(), text=True, capture_output=True,
                                 timeout=60, check=False)
        assert started.returncode == 0, started.stderr
        eid = started.stdout.strip()
        pattern = rf"^\d\d:\d\d:\d\d completed nap {eid} in \d+\.\d s$"
        _wait_for(lambda: re.search(pattern, out.read_text(), re.M), 60, "the line")
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)
    assert "stopped; the data stays in" in out.read_text()


# -- fleet status and fleet list at 80 columns ----------------------------------------------

@pytest.fixture
def worker(tmp_path: Path) -> Iterator[tuple[WorkerProcess, dict[str, str]]]:
    queue = prefix() + "status"
    env = fleet_env(database_url=f"sqlite:///{tmp_path / 'fleet.db'}",
                    broker_url=url_with_db(BROKER_DB), queue=queue,
                    flows="fleet.examples.onboarding:onboard",
                    extra={"FLEET_HEARTBEAT_DIR": str(tmp_path / "hb")})
    process = WorkerProcess("a-worker-with-a-rather-long-name", env, [queue], tmp_path,
                            fleet_cli=True)
    app = broker_app("status-test", url_with_db(BROKER_DB))
    try:
        process.wait_ready(app)
        yield process, env
    finally:
        process.stop()
        app.close()


def test_status_and_list_fit_80_columns_and_cut_no_name(
        worker: tuple[WorkerProcess, dict[str, str]], tmp_path: Path) -> None:
    process, env = worker
    long_id = "an-execution-id-long-enough-to-be-cut-" + "x" * 30
    started = fleet(tmp_path, "start", "onboard", "--input", '"u-1"', "--execution-id",
                    long_id, env={**env, "COLUMNS": "80"})
    assert started.returncode == 0, started.stderr

    def status(*extra: str, columns: int = 80) -> str:
        done = fleet(tmp_path, "status", "--inspect-timeout", "2", *extra,
                     env={**env, "COLUMNS": str(columns)})
        assert done.returncode == 0, done.stderr
        return done.stdout

    narrow = status()
    assert max(len(line) for line in narrow.splitlines()) <= 80, narrow
    assert "…" not in narrow
    assert f"  {process.nodename}: thread, " in narrow
    assert "drives=" in narrow
    assert "errors=" in narrow
    wide = status("--wide")
    assert "…" not in wide
    assert "stepped_aside" in wide
    assert process.nodename in wide
    roomy = status(columns=200)
    assert "…" not in roomy
    assert re.search(rf"│ {re.escape(process.nodename)} +│ +thread │", roomy), roomy

    listed = fleet(tmp_path, "list", env={**env, "COLUMNS": "80"})
    assert listed.returncode == 0, listed.stderr
    assert long_id in listed.stdout  # whole, on one line: it copies into fleet log
    assert "…" not in listed.stdout
    assert max(len(line) for line in listed.stdout.splitlines()) <= 80  # nothing cropped
    roomy = fleet(tmp_path, "list", env={**env, "COLUMNS": "200"})
    assert re.search(rf"│ {long_id} +│ onboard +│ \w+ +│", roomy.stdout), roomy.stdout
    logged = fleet(tmp_path, "log", long_id, "--json", env=env)
    assert logged.returncode == 0
