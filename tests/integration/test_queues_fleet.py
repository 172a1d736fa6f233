"""Queues, delayed starts and debounce on a real fleet (decisions 0055, 0056, 0057).

Three ``fleet worker`` processes, ``fleet timers`` and ``fleet recovery`` subprocesses
on a throwaway Postgres database and Redis; the test starts through a ``Dispatcher``
and the ``fleet start`` command, and judges from the log (each run's admission is
its queue timer's ``TIMER_FIRED``, its end its terminal event, all stamped by one
machine's clock):

- ``concurrency=3``: 300 starts, never more than 3 running (the log's intervals, and
  the store's index sampled while they run), all 300 complete, on several workers;
- ``per_key_concurrency=1``: the runs of each key never overlap, the keys do;
- ``rate=(10, 1 s)``: 200 +- 10 % admissions over 20 s, no planned window over 10;
- debounce: a burst of 50 starts is one run, with the last input;
- a delayed start (``fleet start --in``) runs when the timer service fires it;
- a worker killed mid-run frees its queue's slot after its lease: the sweeper
  re-drives the run elsewhere, and the next run is admitted only after it ended.

Redis database 11 with a random token in every queue, stream and stats name.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
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
    stop_all,
    until,
    wait_ready,
)
from postgres_server import throwaway_database
from queue_flows import ALL
from redis_server import url_with_db

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher, Start
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.start_plan import START_GATE
from fleet.workers import make_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REDIS_DB = 11
LEASE_MS = 3000
QUEUES = {"three": {"concurrency": 3}, "users": {"per_key_concurrency": 1},
          "paced": {"rate": [10, 1.0]}, "crash": {"concurrency": 1}}


@dataclass
class Fleet:
    env: dict[str, str]
    settings: FleetSettings
    app: Any
    store: StoreView
    dispatcher: Dispatcher
    log_dir: Path
    token: str
    procs: dict[str, Proc] = field(default_factory=dict)

    def start_worker(self, name: str) -> Proc:
        node = nodename(name, self.token)
        env = {**self.env, "FLEET_HEARTBEAT_DIR": str(self.log_dir / "hb" / name),
               "FLEET_TEST_WORKER_NAME": name}
        proc = Proc(name, ["worker", "--queues", self.settings.queue, "--concurrency", "8",
                           "-n", node, "--without-mingle", "--without-gossip"], env,
                    self.log_dir, node)
        self.procs[name] = proc
        return proc

    def start_service(self, component: str) -> Proc:
        env = {**self.env, "FLEET_HEARTBEAT_DIR": str(self.log_dir / "hb" / component)}
        proc = Proc(component, [component], env, self.log_dir)
        self.procs[component] = proc
        return proc

    def wait_all(self, ids: list[str], status: str = "completed",
                 timeout: float = 120.0) -> None:
        def done() -> bool:
            return all(self.store.status(eid) == status for eid in ids)
        until(done, f"{len(ids)} executions to be {status}", timeout, interval=0.25)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    token = secrets.token_hex(3)
    broker = url_with_db(REDIS_DB)
    log_dir = tmp_path_factory.mktemp("queues-fleet")
    with throwaway_database() as database_url:
        queue = f"qf-{token}"
        values = {"FLEET_DATABASE_URL": database_url, "FLEET_BROKER_URL": broker,
                  "FLEET_REDIS_URL": broker, "FLEET_QUEUE": queue, "FLEET_FLOWS": ALL,
                  "FLEET_QUEUES": json.dumps(QUEUES), "FLEET_LEASE_MS": str(LEASE_MS),
                  "FLEET_RECOVERY_GRACE_MS": "1500", "FLEET_RECOVERY_INTERVAL_S": "0.5",
                  "FLEET_TIMER_INTERVAL_S": "0.1",
                  "FLEET_STATS_PREFIX": f"fleet-test:{token}:stats:",
                  "FLEET_EVENTS_STREAM": f"fleet-test:{token}:events"}
        env = process_env(values)
        settings = FleetSettings(database_url=database_url, broker_url=broker,
                                 redis_url=broker, queue=queue, lease_ms=LEASE_MS,
                                 flows=ALL.split(","), queues=QUEUES)
        app = make_app(settings)
        store = StoreView(settings)
        dispatcher = Dispatcher(settings)
        built = Fleet(env, settings, app, store, dispatcher, log_dir, token)
        try:
            # The schema first (every process applies it on open), then everything at once.
            upgraded = subprocess.run([FLEET, "db", "upgrade"], env=env, cwd=str(ROOT),
                                      capture_output=True, text=True, timeout=60)
            assert upgraded.returncode == 0, upgraded.stderr
            procs = [built.start_worker(name) for name in ("w1", "w2", "w3")]
            procs += [built.start_service(c) for c in ("timers", "recovery")]
            for proc in procs:
                wait_ready(proc, app)
            yield built
        finally:
            stop_all(built.procs.values())
            dispatcher.close()
            store.close()
            app.close()


def _gate(name: str) -> str:
    return f"__fleet_queue__:{name}"


def _interval(events: list[EventEnvelope], gate: str) -> tuple[int, int]:
    """When the run was admitted (its queue timer fired) and when it ended."""
    start = next(e.timestamp for e in events if e.type is EventType.TIMER_FIRED
                 and e.payload.get("timerId") == gate)
    end = next(e.timestamp for e in events if e.type in (
        EventType.EXECUTION_COMPLETED, EventType.EXECUTION_FAILED,
        EventType.EXECUTION_CANCELLED))
    return start, end


def max_overlap(intervals: list[tuple[int, int]]) -> int:
    """The most half-open intervals ``[start, end)`` that hold one instant."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = now = 0
    for _, step in points:  # an end at t sorts before a start at t
        now += step
        most = max(most, now)
    return most


class Sampler:
    """Counts the running executions of a flow in the store's index, every 50 ms."""

    def __init__(self, fleet: Fleet, flow_id: str) -> None:
        self.fleet, self.flow_id = fleet, flow_id
        self.most = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        store = self.fleet.store
        while not self._stop.is_set():
            rows = store.run(store.store.list_executions(status="running",
                                                         flow_id=self.flow_id, limit=1000))
            self.most = max(self.most, len(rows))
            self.samples += 1
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_concurrency_3_never_runs_more_than_3_across_the_fleet_and_all_300_complete(
        fleet: Fleet) -> None:
    sampler = Sampler(fleet, "qf-work")
    try:
        ids = [fleet.dispatcher.start_sync("qf-work", {"n": i, "ms": 40}, queue="three")
               for i in range(300)]
        fleet.wait_all(ids, timeout=240)
    finally:
        sampler.stop()
    logs = {eid: fleet.store.read(eid) for eid in ids}
    intervals = [_interval(events, _gate("three")) for events in logs.values()]
    most = max_overlap(intervals)
    pids = {e.payload["output"]["pid"] for events in logs.values() for e in events
            if e.type is EventType.STEP_COMPLETED}
    print(f"concurrency 3: {len(ids)} runs, at most {most} at once in the log, "
          f"{sampler.most} in {sampler.samples} samples of the index, on {len(pids)} workers")
    assert most == 3  # the limit was reached, and never passed
    assert 1 <= sampler.most <= 3
    assert len(pids) >= 2
    for events in logs.values():  # each started once, ran its step once
        kinds = [e.type for e in events]
        assert kinds.count(EventType.EXECUTION_STARTED) == 1
        assert kinds.count(EventType.STEP_STARTED) == 1


def test_per_key_concurrency_1_serialises_each_key(fleet: Fleet) -> None:
    users = ("ada", "bob", "cy")
    ids: dict[str, list[str]] = {u: [] for u in users}
    for i in range(8):
        for user in users:
            ids[user].append(fleet.dispatcher.start_sync(
                "qf-work", {"n": i, "ms": 60}, queue="users", key=user))
    fleet.wait_all([eid for group in ids.values() for eid in group])
    every = []
    for user, group in ids.items():
        intervals = sorted(_interval(fleet.store.read(eid), _gate("users")) for eid in group)
        every += intervals
        assert max_overlap(intervals) == 1, (user, intervals)
    assert max_overlap(every) >= 2  # a limit per key, not one for the queue


def test_rate_10_per_second_holds_within_10_percent_over_20_seconds(fleet: Fleet) -> None:
    items = [Start("qf-quick", n, queue="paced") for n in range(260)]
    ids: list[str] = []
    for chunk in range(0, len(items), 20):
        ids += fleet.dispatcher.start_many_sync(items[chunk:chunk + 20])
    fleet.wait_all(ids, timeout=120)
    planned, fired = [], []
    for eid in ids:
        for event in fleet.store.read(eid):
            if event.payload.get("timerId") != _gate("paced"):
                continue
            if event.type is EventType.TIMER_SCHEDULED:
                planned.append(int(event.payload["dueAt"]))
            elif event.type is EventType.TIMER_FIRED:
                fired.append(event.timestamp)
    planned.sort()
    fired.sort()
    assert len(planned) == len(fired) == 260
    # The plan: no window of a second ever holds more than 10 admissions.
    assert max(sum(1 for u in planned[i:] if u < t + 1000)
               for i, t in enumerate(planned)) <= 10
    # What ran: 200 +- 10 % wakes in the 20 s from the first.
    in_window = sum(1 for t in fired if t < fired[0] + 20_000)
    print(f"rate 10/s: {in_window} admissions in the first 20 s")
    assert 180 <= in_window <= 220


def test_a_burst_of_50_debounced_starts_is_one_run_with_the_last_input(
        fleet: Fleet) -> None:
    window = timedelta(seconds=3)
    key = f"digest-{fleet.token}"
    ids = [fleet.dispatcher.start_sync("qf-work", {"n": n, "ms": 0}, debounce=window, key=key)
           for n in range(50)]
    assert len(set(ids)) == 1
    (eid,) = set(ids)
    last_start = time.time()
    fleet.wait_all([eid], timeout=60)
    events = fleet.store.read(eid)
    kinds = [e.type for e in events]
    assert kinds.count(EventType.EXECUTION_DEBOUNCED) == 49
    assert kinds.count(EventType.STEP_STARTED) == 1
    step = next(e for e in events if e.type is EventType.STEP_COMPLETED)
    assert step.payload["output"]["n"] == 49
    fired = next(e for e in events if e.type is EventType.TIMER_FIRED)
    assert fired.timestamp >= (last_start - 1) * 1000 + window.total_seconds() * 1000
    runs = fleet.store.run(fleet.store.store.list_executions(flow_id="qf-work", limit=10_000))
    assert sum(1 for r in runs if r.started_at >= events[0].timestamp) == 1


def test_a_delayed_start_from_the_command_line_runs_when_the_timer_service_fires_it(
        fleet: Fleet) -> None:
    env = {**fleet.env, "FLEET_HEARTBEAT_DIR": str(fleet.log_dir / "hb" / "cli")}
    done = subprocess.run([FLEET, "start", "qf-quick", "--input", '"later"', "--in", "2s",
                           "--json"], env=env, cwd=str(ROOT), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    eid = answer["executionId"]
    assert answer["waits"] is True
    row = fleet.store.summary(eid)
    assert row is not None
    assert (row.status, row.waiting_on) == ("parked", START_GATE)
    fleet.store.until(eid, "completed", timeout=30)
    events = fleet.store.read(eid)
    fired = next(e for e in events if e.type is EventType.TIMER_FIRED)
    assert fired.timestamp >= events[0].timestamp + 2000
    past = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    refused = subprocess.run([FLEET, "start", "qf-quick", "--at", past], env=env,
                             cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
    assert "in the past" in refused.stderr


def test_a_killed_worker_frees_its_queue_slot_after_its_lease(fleet: Fleet) -> None:
    marker = fleet.log_dir / f"stall-{secrets.token_hex(3)}"
    first = fleet.dispatcher.start_sync("qf-stall", str(marker), queue="crash")
    second = fleet.dispatcher.start_sync("qf-quick", "next", queue="crash")
    until(marker.exists, "the first run to start its step", 60)
    victim = marker.read_text().split()[0]
    killed_at = time.time()
    os.kill(fleet.procs[victim].proc.pid, signal.SIGKILL)
    try:
        # The slot stays with the first run while its dead worker's lease lasts.
        while time.time() < killed_at + LEASE_MS / 1000 - 0.5:
            assert fleet.store.summary(second).waiting_on == _gate("crash")  # type: ignore[union-attr]
            time.sleep(0.2)
        fleet.wait_all([first, second], timeout=60)
        a = fleet.store.read(first)
        b = fleet.store.read(second)
        assert EventType.RECOVERED in {e.type for e in a}  # the sweeper re-drove it
        _, a_end = _interval(a, _gate("crash"))
        b_start, _ = _interval(b, _gate("crash"))
        assert b_start >= a_end  # admitted only once the first ended
        assert a_end >= killed_at * 1000 + LEASE_MS - 1000
    finally:
        fleet.procs[victim].stop()
        wait_ready(fleet.start_worker(victim), fleet.app)
