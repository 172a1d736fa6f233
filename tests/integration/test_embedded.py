"""The embedded fleet as real processes: up and down with nothing left behind, and
``fleet demo --json`` end to end, on SQLite + an embedded Valkey (no ``FLEET_*`` at all)
and on Postgres + Redis.

An orphan is looked for by what every process of a fleet carries: the data
directory's path, in its command line, its environment or its working
directory (the workers' store URL, Valkey's directory). ``/proc`` is scanned
for it after the fleet stopped.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from postgres_server import throwaway_database
from redis_server import url_with_db

from fleet.config import FleetSettings
from fleet.embedded import EmbeddedFleet
from fleet.host.keys import read_reward_keys, reward_keys_of
from fleet.kernel.errors import ConfigurationError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REDIS_DB = 12
FLEET = str(Path(sys.executable).with_name("fleet"))


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}


@pytest.fixture
def no_fleet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``FLEET_*`` variable: the embedded defaults (SQLite, Valkey) apply."""
    for key in [k for k in os.environ if k.startswith("FLEET_")]:
        monkeypatch.delenv(key)


def processes_mentioning(marker: str) -> list[tuple[int, str]]:
    """Live processes whose command line, environment or working directory contains
    ``marker``."""
    found = []
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes() + os.readlink(entry / "cwd").encode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (needle in cmdline or needle in environ):
            found.append((int(entry.name), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry.name))
    return kids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def wait_for(predicate: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.usefixtures("no_fleet_env")
def test_up_and_down_leaves_no_process_and_removes_its_temporary_directory() -> None:
    fleet = EmbeddedFleet(workers=2)
    with fleet:
        assert fleet.embedded_redis
        assert fleet.settings.database_url == f"sqlite:///{fleet.data_dir / 'fleet.db'}"
        assert (fleet.settings.redis_url or "").startswith("redis://127.0.0.1:")
        pids = fleet.child_pids()
        assert len(pids) == 3  # two workers and Valkey
        assert all(alive(pid) for pid in pids)
        assert {pid for pid, _ in processes_mentioning(str(fleet.data_dir))} >= set(pids)
        # It works: a start goes through the dispatcher to a worker and completes.
        execution_id = fleet.dispatcher.start_sync("onboard", "u-1")
        wait_for(lambda: (fleet.call(fleet.store.get_execution(execution_id)) or
                          _Missing).status == "completed")
        stats = fleet.stats()
        assert stats["worker_totals"]["completed"] == 1
        assert set(stats["services"]) == {"timers", "recovery", "attacher", "relay"}
        # Each role runs what its own pod runs: its heartbeat too, and no publisher.
        for role in ("timers", "recovery", "attacher", "relay"):
            assert "heartbeat" in stats["roles"][role]
            assert "event-publisher" not in stats["roles"][role]
            assert (fleet.data_dir / "heartbeats" / f"fleet-{role}.heartbeat").exists()
        data_dir = fleet.data_dir
        assert (data_dir / "fleet.db").exists()
    assert not fleet.running
    assert [pid for pid in pids if alive(pid)] == []
    assert processes_mentioning(str(data_dir)) == []
    assert not data_dir.exists()  # a temporary directory is removed
    fleet.stop()  # a second stop is harmless


class _Missing:
    status = "missing"


def test_a_data_dir_given_is_kept_and_the_next_fleet_finds_its_executions(
        no_fleet_env: None, tmp_path: Path) -> None:
    data_dir = tmp_path / "fleet-data"
    with EmbeddedFleet(workers=1, data_dir=data_dir) as fleet:
        execution_id = fleet.dispatcher.start_sync("onboard", "u-1")
        wait_for(lambda: (fleet.call(fleet.store.get_execution(execution_id)) or
                          _Missing).status == "completed")
        assert fleet.settings.reward_keys_file == str(data_dir / "reward-keys.json")
        key = read_reward_keys(data_dir / "reward-keys.json")["local"]
    assert (data_dir / "fleet.db").exists()
    assert (data_dir / "logs" / "worker-1.log").read_text()
    assert oct((data_dir / "reward-keys.json").stat().st_mode & 0o777) == "0o600"
    assert processes_mentioning(str(data_dir)) == []
    with EmbeddedFleet(workers=1, data_dir=data_dir) as again:
        row = again.call(again.store.get_execution(execution_id))
        assert row is not None
        assert row.status == "completed"
        assert reward_keys_of(again.settings) == {"local": key}  # the producers' key survives
    assert processes_mentioning(str(data_dir)) == []


def test_the_reward_key_file_is_read_in_the_one_format_and_never_overwritten(
        no_fleet_env: None, tmp_path: Path) -> None:
    """Issue 15 item 5: `fleet up`'s .fleet/reward-keys.json is read with the reader every
    reward command uses. It used to be silently replaced (its other producers lost)
    whenever it did not hold a `local` key or did not parse."""
    given = FleetSettings(redis_url="redis://127.0.0.1:1/0",
                          flows=["fleet.examples.onboarding:onboard"])
    key_file = tmp_path / "reward-keys.json"
    key_file.write_text('{"crm": "k-crm-secret"}')
    settings = EmbeddedFleet(given, data_dir=tmp_path)._resolve(given)
    keys = reward_keys_of(settings)
    assert set(keys) == {"crm", "local"}  # kept, and local added
    assert keys["crm"] == "k-crm-secret"
    assert EmbeddedFleet(given, data_dir=tmp_path)._resolve(given).reward_keys_file == str(
        key_file)
    assert reward_keys_of(settings) == keys  # the same keys on the next start
    key_file.write_text("a-bare-secret\n")
    with pytest.raises(ConfigurationError, match="looks like a bare secret"):
        EmbeddedFleet(given, data_dir=tmp_path)._resolve(given)
    assert key_file.read_text() == "a-bare-secret\n"  # refused, not overwritten


def test_a_killed_worker_takes_its_pool_with_it_and_stop_reaps_the_rest(
        no_fleet_env: None) -> None:
    # Prefork: each worker is a parent with children, all of which must go.
    settings = FleetSettings(worker_pool="prefork")
    fleet = EmbeddedFleet(settings, workers=2)
    with fleet:
        wait_for(lambda: all(len(children_of(w.pid)) >= 2 for w in fleet.workers))
        doomed = [fleet.workers[0].pid, *children_of(fleet.workers[0].pid)]
        survivors = [fleet.workers[1].pid, *children_of(fleet.workers[1].pid)]
        victim = fleet.kill_worker(0)
        assert victim.killed
        assert victim.proc.returncode == -signal.SIGKILL
        wait_for(lambda: not any(alive(pid) for pid in doomed))
        assert all(alive(pid) for pid in survivors)
        assert [w.name for w in fleet.alive_workers()] == ["worker-2"]
        replacement = fleet.start_worker()
        assert replacement.alive()
        data_dir = fleet.data_dir
    assert not any(alive(pid) for pid in survivors)
    assert processes_mentioning(str(data_dir)) == []


def test_valkey_ignores_the_terminals_ctrl_c(no_fleet_env: None) -> None:
    # A Ctrl-C reaches the whole foreground process group, Valkey included;
    # the fleet must still have its broker while the workers shut down.
    with EmbeddedFleet(workers=1) as fleet:
        assert fleet.valkey_pid is not None
        os.kill(fleet.valkey_pid, signal.SIGINT)
        time.sleep(0.3)
        assert alive(fleet.valkey_pid)
        assert fleet.app.control.ping(timeout=2.0)
        valkey = fleet.valkey_pid
    assert not alive(valkey)


# ------------------------------------------------------------------- fleet demo --json


def run_demo(env: dict[str, str], cwd: Path, *extra: str) -> dict[str, Any]:
    began = time.monotonic()
    done = subprocess.run([FLEET, "demo", "--json", *extra], env=env, cwd=cwd,
                          capture_output=True, timeout=90, check=False)
    took = time.monotonic() - began
    assert done.returncode == 0, (done.stdout.decode()[-3000:], done.stderr.decode()[-5000:])
    summary: dict[str, Any] = json.loads(done.stdout)
    assert took < 60, f"fleet demo took {took:.1f} s"
    return summary


def check_summary(summary: dict[str, Any]) -> None:
    assert summary["ok"], summary["problems"]
    executions = summary["executions"]
    assert executions["started"] == 30
    assert executions["completed"] == executions["started"]
    assert executions["failed"] == 0
    # Every run drafted at least once (a step in doubt runs again: at least once);
    # every run sent or escalated exactly once.
    effects = executions["effects"]
    assert effects["draft"] > executions["started"]
    assert effects.get("send", 0) + effects.get("escalate", 0) == executions["started"]
    recovery = summary["recovery"]
    assert recovery["recovered"] >= 1
    assert recovery["effect_indoubt"] >= 1
    # A run the dead worker held mid-step is taken over with RECOVERED; one it had
    # only just taken (nothing written yet) is simply driven, without it.
    assert set(summary["crash"]["orphaned"]) & set(recovery["recovered_ids"])
    rewards = summary["rewards"]
    assert rewards["attached"] == rewards["submitted_valid"] == 2 * executions["started"]
    assert rewards["duplicates"] == 0
    assert sum(rewards["dead_lettered"].values()) == rewards["submitted_invalid"] == 4
    assert set(rewards["dead_lettered"]) == {"bad_signature", "unknown_producer", "unsigned",
                                             "malformed"}
    for decision in ("reply_style", "discount"):
        evaluation = summary["evaluation"][decision]
        assert evaluation["samples"] == executions["started"]
        assert math.isfinite(evaluation["snips"])
        assert math.isfinite(evaluation["ips"])
    assert summary["stats"]["timers_fired"] == executions["started"]
    # The events stream is the log: every event any process committed, each once.
    stats = summary["stats"]
    assert stats["events_committed"] > executions["started"] * 5
    assert stats["events_stream_length"] == stats["events_committed"] == (
        stats["events_published"])
    assert summary["shutdown"]["left_running"] == []
    assert summary["shutdown"]["sigkilled_after_timeout"] == []


def test_fleet_demo_json_with_nothing_configured(tmp_path: Path) -> None:
    summary = run_demo(_clean_env(), tmp_path)
    check_summary(summary)
    assert summary["fleet"]["sqlite"]
    assert summary["fleet"]["embedded_redis"]
    assert summary["rewards"]["stream"] == "fleet:rewards"
    assert summary["shutdown"]["data_removed"]
    assert list(tmp_path.iterdir()) == []  # nothing written where it ran
    assert processes_mentioning(summary["fleet"]["data_dir"]) == []
    assert not any(alive(pid) for pid in summary["fleet"]["workers"])


@pytest.fixture
def postgres_url() -> Iterator[str]:
    with throwaway_database() as url:
        yield url


def test_fleet_demo_json_on_postgres_and_redis(postgres_url: str, tmp_path: Path) -> None:
    import redis

    env = _clean_env()
    env["FLEET_DATABASE_URL"] = postgres_url
    env["FLEET_REDIS_URL"] = url_with_db(REDIS_DB)
    summary = run_demo(env, tmp_path)
    check_summary(summary)
    assert not summary["fleet"]["sqlite"]
    assert not summary["fleet"]["embedded_redis"]
    run = summary["run"]
    # On a Redis others use, the demo kept to keys of its own and removed them.
    assert summary["fleet"]["queue"] == f"fleet.demo.{run}"
    assert summary["rewards"]["stream"] == f"fleet:demo:{run}:rewards"
    client = redis.Redis.from_url(url_with_db(REDIS_DB))
    try:
        assert client.keys(f"*{run}*") == []
        assert not any(json.loads(raw)[2] == f"fleet.demo.{run}"
                       for raw in client.hvals("unacked"))
    finally:
        client.close()


def test_fleet_up_serves_flower_with_the_fleet_page(no_fleet_env: None, tmp_path: Path) -> None:
    """``fleet up``'s Flower is ``fleet flower``: the Fleet page, behind its own password,
    with every process of the embedded fleet reporting (issue 14)."""
    import urllib.request
    from base64 import b64encode

    with EmbeddedFleet(workers=1, flower=True, data_dir=tmp_path / "up") as fleet:
        assert fleet.flower_url is not None
        assert fleet.flower_auth is not None
        auth = "Basic " + b64encode(fleet.flower_auth.encode()).decode()

        def status() -> dict[str, Any]:
            request = urllib.request.Request(f"{fleet.flower_url}/fleet/api/status",
                                             headers={"Authorization": auth})
            with urllib.request.urlopen(request, timeout=30) as reply:
                data: dict[str, Any] = json.loads(reply.read())
                return data
        wait_for(lambda: {"worker", "timers", "recovery", "attacher", "relay"} <= {
            p["role"] for p in status()["processes"] if not p["stale"]}, timeout=60)
        assert status()["operator"] == {"principal": "operator:local", "retry": True}
        request = urllib.request.Request(f"{fleet.flower_url}/fleet",
                                         headers={"Authorization": auth})
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert b'id="fleet-nav"' in reply.read()
