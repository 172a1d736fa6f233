"""The embedded fleet as real processes: up and down with nothing left behind, a
standby worker deployed, and ``fleet demo --json`` end to end, on SQLite + an embedded
Valkey (no ``FLEET_*`` at all: one seed gives one set of figures, another seed others,
the deploy stage's divergence parked then completed as the log shows) and on
Postgres + Redis.

An orphan is looked for by what every process of a fleet carries: the data
directory's path, in its command line, its environment or its working
directory (the workers' store URL, Valkey's directory). ``/proc`` is scanned
for it after the fleet stopped.
"""

from __future__ import annotations

import asyncio
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
from fleet.kernel.events import EventType
from fleet.kernel.fold import DIVERGED_GATE
from fleet.kernel.store.sqlite import SqliteEventStore

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


def test_a_standby_worker_takes_nothing_until_deployed_then_takes_the_queue(
        no_fleet_env: None) -> None:
    # The demo's blue-green deploy: a worker on other code waits on a queue of its
    # own; deploy() moves the fleet's queues to it and off the others.
    def drives(worker: Any) -> int:
        stats = fleet.stats(timeout=1.0)
        return int(next(w for w in stats["workers"] if w["pid"] == worker.pid)["fleet"].get(
            "drives", 0))

    def run_one(user: str) -> None:
        execution_id = fleet.dispatcher.start_sync("onboard", user)
        assert fleet.dispatcher.result_sync(execution_id, timeout=30)["plan"]

    with EmbeddedFleet(workers=1) as fleet:
        (blue,) = fleet.workers
        with pytest.raises(ConfigurationError, match="cannot import"):
            fleet.start_worker(flows=["fleet.examples.no_such_module:onboard"])
        assert fleet.workers == [blue]  # refused before anything was spawned
        green = fleet.start_worker(flows=["fleet.examples.onboarding:onboard"], standby=True)
        run_one("u-1")
        assert (drives(blue), drives(green)) == (1, 0)
        assert fleet.deploy(green) == [blue]
        run_one("u-2")
        run_one("u-3")
        assert (drives(blue), drives(green)) == (1, 2)
        assert blue.alive()  # switched off, not stopped
        fleet.kill_worker(0)
        with pytest.raises(ConfigurationError, match="worker-1 is not running"):
            fleet.deploy(blue)
        data_dir = fleet.data_dir
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
    # The timeout bounds a hung demo; how fast it is, is the demo's own report.
    done = subprocess.run([FLEET, "demo", "--json", *extra], env=env, cwd=cwd,
                          capture_output=True, timeout=180, check=False)
    assert done.returncode == 0, (done.stdout.decode()[-3000:], done.stderr.decode()[-5000:])
    summary: dict[str, Any] = json.loads(done.stdout)
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
        # DR beside SNIPS (issue 30 item 4), its reward model fitted on the runs.
        assert math.isfinite(evaluation["dr"]["estimated_value"])
        assert evaluation["dr"]["reward_model"] == "cell means, 5-fold cross-fitted"
    assert summary["stats"]["timers_fired"] == executions["started"]
    # The events stream is the log: every event any process committed, each once.
    stats = summary["stats"]
    assert stats["events_committed"] > executions["started"] * 5
    assert stats["events_stream_length"] == stats["events_committed"] == (
        stats["events_published"])
    assert summary["shutdown"]["left_running"] == []
    assert summary["shutdown"]["sigkilled_after_timeout"] == []


@pytest.fixture(scope="module")
def demos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three demos with nothing configured: ``--seed 7`` twice (the second keeps its
    data directory, so its logs can be read) and ``--seed 11``. Each kills every worker
    with every run inside its draft step: the figures, the recovery's too, must not
    differ with one seed."""
    cwd = tmp_path_factory.mktemp("demo")
    kept = tmp_path_factory.mktemp("demo-data") / "data"
    env = _clean_env()
    return {"first": run_demo(env, cwd), "again": run_demo(env, cwd, "--seed", "7",
                                                           "--data-dir", str(kept)),
            "other": run_demo(env, cwd, "--seed", "11"), "cwd": cwd, "data_dir": kept}


@pytest.mark.timeout(400)
def test_fleet_demo_json_with_nothing_configured(demos: dict[str, Any]) -> None:
    summary = demos["first"]
    check_summary(summary)
    assert summary["options"]["seed"] == 7  # the default
    assert summary["fleet"]["sqlite"]
    assert summary["fleet"]["embedded_redis"]
    assert summary["rewards"]["stream"] == "fleet:rewards"
    assert summary["shutdown"]["data_removed"]
    assert list(demos["cwd"].iterdir()) == []  # nothing written where they ran
    for run in ("first", "again", "other"):
        assert processes_mentioning(demos[run]["fleet"]["data_dir"]) == []
        assert not any(alive(pid) for pid in demos[run]["fleet"]["workers"])


def figures(summary: dict[str, Any]) -> dict[str, Any]:
    """What a seed must decide: approvals, rewards attached, the whole evaluation."""
    ex = summary["executions"]
    return {"executions": {k: ex[k] for k in ("started", "completed", "approved",
                                              "escalated")},
            "sends": ex["effects"].get("send", 0),
            "escalations": ex["effects"].get("escalate", 0),
            "rewards": {k: summary["rewards"][k] for k in ("submitted_valid", "attached")},
            "evaluation": summary["evaluation"],
            "divergence": {"parked": summary["divergence"]["parked"]["count"],
                           "completed": summary["divergence"]["completed"]},
            # Issue 29.11: the recovery too (every run held in its draft at the crash).
            "recovery": {k: summary["recovery"][k] for k in ("orphaned", "recovered",
                                                              "effect_indoubt")},
            "drafts": ex["effects"].get("draft", 0),
            "orphaned": len(summary["crash"]["orphaned"]),
            "committed": summary["stats"]["events_committed"]}


@pytest.mark.timeout(400)
def test_the_same_seed_gives_the_same_figures(demos: dict[str, Any]) -> None:
    first, again = demos["first"], demos["again"]
    check_summary(again)
    assert figures(first) == figures(again)
    # ... though they are two fleets: other runs, other ids, another crash.
    assert first["run"] != again["run"]
    assert not set(first["executions"]["ids"]) & set(again["executions"]["ids"])


@pytest.mark.timeout(400)
def test_another_seed_gives_other_figures(demos: dict[str, Any]) -> None:
    check_summary(demos["other"])
    first, other = figures(demos["first"]), figures(demos["other"])
    assert other["evaluation"]["reply_style"]["snips"] != first["evaluation"]["reply_style"][
        "snips"]
    assert other["evaluation"]["discount"] != first["evaluation"]["discount"]
    assert demos["other"]["options"]["seed"] == 11


def _logs(data_dir: Path, ids: list[str]) -> dict[str, list[Any]]:
    async def read() -> dict[str, list[Any]]:
        store = SqliteEventStore(str(data_dir / "fleet.db"))
        try:
            return {eid: list(await store.read(eid)) for eid in ids}
        finally:
            await store.close()
    return asyncio.run(read())


@pytest.mark.timeout(400)
def test_the_deploy_stage_parks_the_changed_runs_then_completes_them(
        demos: dict[str, Any]) -> None:
    summary = demos["again"]
    stage = summary["divergence"]
    held = stage["executions"]
    assert len(held) == 3
    assert held == summary["executions"]["ids"][-3:]  # the last ones started
    assert stage["changed_flow"] == "fleet.examples.agent_changed:support_reply"
    assert stage["parked"]["count"] == 3
    assert stage["parked"]["skipped"] == dict.fromkeys(held, "skipped 1: classify")
    assert stage["parked"]["worker_divergence_parked"] == 3  # as fleet status read it
    assert stage["parked"]["status_parked"] == 3
    assert stage["deployed"]["pid"] != stage["fixed"]["pid"]
    assert stage["completed"] == 3
    assert "diverge" in summary["stages_s"]
    # The log says the same: parked on the gate before any effect of the changed
    # code, retried, then the send or escalation, then completed.
    logs = _logs(demos["data_dir"], summary["executions"]["ids"])
    for eid, log in logs.items():
        parks = [e.sequence for e in log if e.type == EventType.EXECUTION_SUSPENDED
                 and (e.payload.get("condition") or {}).get("on") == DIVERGED_GATE]
        if eid not in held:
            assert parks == [], eid  # healthy runs under divergence="fail": never refused
            continue
        assert len(parks) == 1, eid
        park = next(e for e in log if e.sequence == parks[0])
        assert park.payload["condition"]["correlationKey"] == "skipped 1: classify"
        retries = [e.sequence for e in log if e.type == EventType.EXECUTION_RESUMED
                   and e.payload.get("gate") == DIVERGED_GATE]
        assert len(retries) == 1
        assert retries[0] > parks[0]
        last_steps = [e for e in log if e.type == EventType.STEP_STARTED
                      and e.payload.get("stepId") in ("send", "escalate")]
        assert len(last_steps) == 1
        assert last_steps[0].sequence > retries[0]
        (completed,) = [e for e in log if e.type == EventType.EXECUTION_COMPLETED]
        assert completed.sequence > last_steps[0].sequence  # then the rewards, late
    # One send or escalation per run in all: the changed code ran none.
    effects = [json.loads(line) for line in
               (demos["data_dir"] / "effects.jsonl").read_text().splitlines()]
    finals = [e["execution"] for e in effects if e["step"] in ("send", "escalate")]
    assert sorted(finals) == sorted(summary["executions"]["ids"])


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
