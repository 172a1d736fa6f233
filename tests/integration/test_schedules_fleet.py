"""Schedules on the real fleet (issue 27 item 1, decision 0058): ``fleet worker``,
``fleet timers`` (two replicas) and ``fleet recovery`` subprocesses on Postgres and
Redis, schedules made with ``fleet schedule create``.

- A 1-second ``every`` schedule runs every tick of a 30-second window exactly once
  (each body once, each run knowing its tick) while one timer replica is SIGKILLed;
  beside it, a ``skip`` schedule whose runs take longer than the interval never has
  two runs in flight.
- Everything is SIGKILLed for 10 seconds and started again: the schedules go on, the
  ticks of the outage within ``catchup`` run once each, older ones are counted missed.

The timestamps compared are the store's (each event's), written by processes on this
machine. Redis database 11 (queues and node names carry a random token) and a
throwaway Postgres database keep runs apart.
"""

from __future__ import annotations

import itertools
import json
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from fleet_procs_kit import (
    FLEET,
    ROOT,
    Proc,
    StoreView,
    nodename,
    process_env,
    until,
    wait_ready,
)
from postgres_server import throwaway_database
from redis_server import url_with_db
from schedule_flows import ALL

from fleet.config import FleetSettings
from fleet.kernel.flows import load_flows
from fleet.kernel.runtime import Runtime
from fleet.kernel.schedules import ScheduleInfo
from fleet.workers import make_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REDIS_DB = 11
LEASE_MS = 5000
WINDOW_S = 30
OUTAGE_S = 10


@dataclass
class Fleet:
    env: dict[str, str]
    settings: FleetSettings
    app: Any
    store: StoreView
    runtime: Runtime
    log_dir: Path
    token: str
    queue: str
    procs: dict[str, Proc] = field(default_factory=dict)

    def env_for(self, name: str) -> dict[str, str]:
        env = dict(self.env)
        env["FLEET_HEARTBEAT_DIR"] = str(self.log_dir / "heartbeats" / name)
        return env

    def start(self, name: str) -> Proc:
        """``fleet worker`` (names starting ``worker``), else the service ``name`` says."""
        if name.startswith("worker"):
            node = nodename(name, self.token)
            args = ["worker", "--queues", self.queue, "--concurrency", "8", "-n", node,
                    "--without-mingle", "--without-gossip"]
        else:
            node, args = None, [name.rstrip("0123456789")]
        proc = Proc(name, args, self.env_for(name), self.log_dir, node)
        self.procs[name] = proc
        return proc

    def start_all(self, names: tuple[str, ...]) -> None:
        started = [self.start(name) for name in names]
        for proc in started:
            wait_ready(proc, self.app)

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.signal(signal.SIGKILL)
        proc.wait_exit(10)
        proc.stop()

    def cli(self, *args: str) -> str:
        done = subprocess.run([FLEET, *args], env=self.env_for("cli"), cwd=str(ROOT),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done.stdout

    def schedule(self, schedule_id: str) -> ScheduleInfo:
        [info] = [i for i in self.store.run(self.runtime.schedules(system=True))
                  if i.schedule_id == schedule_id]
        return info

    def ticks(self, schedule_id: str) -> dict[int, str]:
        """The runs of ``schedule_id`` by their tick (whole seconds since the epoch)."""
        rows = self.store.run(self.store.store.list_executions(limit=10_000))
        out: dict[int, str] = {}
        for row in rows:
            sid, at, tick = row.execution_id.partition("@")
            if at and sid == schedule_id:
                second = int(datetime.fromisoformat(tick).timestamp())
                assert second not in out, f"two runs of tick {tick}"
                out[second] = row.execution_id
        return out


ORDER = ("worker-a", "worker-b", "timers1", "timers2", "recovery")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    token = secrets.token_hex(3)
    queue = f"sched-{token}"
    broker = url_with_db(REDIS_DB)
    log_dir = tmp_path_factory.mktemp("schedules-fleet")
    with throwaway_database() as database_url:
        env = process_env({
            "FLEET_DATABASE_URL": database_url, "FLEET_BROKER_URL": broker,
            "FLEET_REDIS_URL": broker, "FLEET_QUEUE": queue, "FLEET_FLOWS": ",".join(ALL),
            "FLEET_LEASE_MS": str(LEASE_MS), "FLEET_RECOVERY_GRACE_MS": "2000",
            "FLEET_RECOVERY_INTERVAL_S": "0.5", "FLEET_TIMER_INTERVAL_S": "0.2",
            "FLEET_EVENTS_STREAM": f"fleet-test:{token}:events"})
        settings = FleetSettings(database_url=database_url, broker_url=broker,
                                 redis_url=broker, queue=queue, lease_ms=LEASE_MS)
        app = make_app(settings)
        store = StoreView(settings)
        runtime = Runtime(store.store, flows=load_flows(ALL), local_timers=False)
        built = Fleet(env, settings, app, store, runtime, log_dir, token, queue)
        try:
            built.cli("db", "upgrade")
            built.start_all(ORDER)
            yield built
        finally:
            for proc in built.procs.values():
                proc.stop()
            store.close()
            app.close()


def _stamps(fleet: Fleet, execution_id: str) -> tuple[int, int | None, list[Any]]:
    """When a run started and ended (the store's timestamps), and its steps' outputs."""
    events = fleet.store.read(execution_id)
    ended = [e.timestamp for e in events if str(e.type) == "EXECUTION_COMPLETED"]
    outputs = [e.payload.get("output") for e in events if str(e.type) == "STEP_COMPLETED"]
    return events[0].timestamp, ended[0] if ended else None, outputs


def test_each_second_runs_once_while_a_timer_replica_dies_and_skip_never_overlaps(
        fleet: Fleet) -> None:
    made = json.loads(fleet.cli("schedule", "create", "each-second", "sched-job",
                                "--every", "1s", "--overlap", "allow", "--catchup", "15s",
                                "--input", '{"who": "cli"}', "--json"))
    assert made["executionId"] == "__fleet_schedule__:each-second/1"
    fleet.cli("schedule", "create", "slow-skip", "sched-slow", "--every", "1s")
    start = int(time.time()) + 1  # the window: the 30 ticks after this second
    end = start + WINDOW_S - 1
    time.sleep(max(0.0, start + 9.5 - time.time()))
    fleet.kill("timers1")  # mid-window, wherever it was in its claims
    until(lambda: max(fleet.ticks("each-second"), default=0) >= end + 1,
          "the window's last tick to have run", timeout=WINDOW_S + 30)
    skipped = fleet.schedule("slow-skip")
    fleet.cli("schedule", "delete", "each-second")
    fleet.cli("schedule", "delete", "slow-skip")
    assert fleet.store.run(fleet.runtime.schedules(system=True)) == []

    ticks = fleet.ticks("each-second")
    window = [s for s in sorted(ticks) if start <= s <= end]
    assert window == list(range(start, end + 1)), sorted(set(range(start, end + 1)) -
                                                         set(window))
    for second in window:
        _, ended, outputs = _stamps(fleet, ticks[second])
        assert ended is not None
        assert len(outputs) == 1  # the body's step ran once
        assert outputs[0]["input"] == {"who": "cli"}
        assert datetime.fromisoformat(outputs[0]["tick"]).timestamp() == second

    slow = fleet.ticks("slow-skip")
    spans = sorted(_stamps(fleet, eid)[:2] for eid in slow.values())
    done = [(a, b) for a, b in spans if b is not None]
    assert len(done) >= 4, spans
    for (_, ended), (started, _) in itertools.pairwise(spans):
        assert started >= ended, f"two runs of the skip schedule overlap: {spans}"
    assert skipped.overlapped >= len(done)  # each run outlasted at least one tick
    assert skipped.duplicates == 0


def test_after_ten_seconds_with_nothing_running_missed_ticks_within_catchup_run_once(
        fleet: Fleet) -> None:
    fleet.cli("schedule", "create", "catch-all", "sched-job", "--every", "1s", "--overlap",
              "allow", "--catchup", "60s")
    fleet.cli("schedule", "create", "catch-some", "sched-job", "--every", "1s", "--overlap",
              "allow", "--catchup", "3s")
    until(lambda: len(fleet.ticks("catch-all")) >= 2 and len(fleet.ticks("catch-some")) >= 2,
          "both schedules to run", timeout=30)
    for name in list(fleet.procs):
        fleet.kill(name)  # the whole fleet, mid-whatever
    down = time.time()
    time.sleep(OUTAGE_S)
    back = time.time()
    fleet.start_all(ORDER)
    until(lambda: max(fleet.ticks("catch-all")) >= back + 3
          and max(fleet.ticks("catch-some")) >= back + 3,
          "both schedules to run after the restart", timeout=60)
    for name in ("catch-all", "catch-some"):  # stop them where their counts are published
        fleet.cli("schedule", "pause", name)
        until(lambda n=name: fleet.schedule(n).paused, f"{name} to pause", timeout=30)

    every = fleet.ticks("catch-all")
    first, last = min(every), max(every)
    assert sorted(every) == list(range(first, last + 1))  # the outage's ticks ran, once each
    assert any(down < s < back for s in every)
    assert fleet.schedule("catch-all").missed == 0

    some = fleet.ticks("catch-some")
    first, last = min(some), max(some)
    missing = set(range(first, last + 1)) - set(some)
    assert len(missing) >= OUTAGE_S - 5, sorted(missing)  # older than catchup: not run
    assert all(down - 1 <= s <= back + 5 for s in missing), (down, back, sorted(missing))
    info = fleet.schedule("catch-some")
    assert info.missed == len(missing)
    assert info.runs == len(some)
    assert info.duplicates == 0
