"""The fleet's real processes on deploy/redis/users.acl, each as its own Redis user.

A private ``redis-server`` loads the dev overlay's redis.conf and the rendered
ACL (never the shared server: its ACL stays untouched). On it, as the
containers run them (mingle, gossip and heartbeats on): two ``fleet worker``
processes as ``worker``, ``fleet timers`` / ``recovery`` / ``attacher`` /
``relay`` as their users, ``fleet flower`` as ``flower`` (``FLOWER_UNAUTHENTICATED_API`` for
the test), and the ``fleet`` CLI as ``client`` (start, resume, status) and as
``producer`` (reward submit); the store is a throwaway Postgres database.

Executions complete through the workers, the timer service fires, the sweeper
re-drives, a reward is attached, a SIGTERMed worker hands its run back and the
other finishes it, ``fleet status`` and Flower's dashboard and API show the
workers, their counters, the queues and the task events: and Redis refused
none of them anything (ACL LOG stays empty). Flower's
``POST /api/task/async-apply/fleet.dispatch`` (and the other publishing
endpoints) is refused by Redis with NOPERM, even in a Flower whose app knows
the fleet's tasks: the ACL LOG names the flower user, nothing reaches a queue
and no execution starts.

Issue 10 item 13.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import acl_flows
import pytest
from fleet_procs_kit import (
    FLEET,
    Proc,
    StoreView,
    nodename,
    process_env,
    stop_all,
    wait_ready,
)
from k8s_kit import ROOT
from postgres_server import throwaway_database
from redis_acl_kit import PrivateRedis, free_port

from fleet.assembly.roles import flower_app
from fleet.config import FleetSettings
from fleet.host.celery_api import broker_app
from fleet.kernel.events import EventEnvelope
from fleet.kernel.runtime import Runtime

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

QUEUE, SLOW = "fleet.drive", "fleet.slow"
PRODUCER, REWARD_KEY = "p1", "acl-test-secret"
CONTROL_KEY = "acl-test-operator-key-0123456789"


@dataclass
class Fleet:
    redis: PrivateRedis
    database_url: str
    env: dict[str, str]
    log_dir: Path
    store: StoreView
    control: Any  # a Celery app on the flower user (the console), for pings
    token: str = field(default_factory=lambda: secrets.token_hex(3))
    procs: dict[str, Proc] = field(default_factory=dict)
    flower_url: str = ""
    startup_denials: list[dict[str, Any]] = field(default_factory=list)

    def env_for(self, name: str, user: str, **extra: str) -> dict[str, str]:
        env = dict(self.env)
        env.update({"FLEET_REDIS_URL": self.redis.url(user), "FLEET_TEST_WORKER_NAME": name,
                    "FLEET_HEARTBEAT_DIR": str(self.log_dir / "heartbeats" / name)})
        env.update(extra)
        return env

    def start_worker(self, name: str) -> Proc:
        node = nodename(name, secrets.token_hex(3))  # restarted under its name: a new node
        # As the container runs it (base/worker.yaml): mingle, gossip, heartbeats on.
        proc = Proc(name, ["worker", "--queues", f"{QUEUE},{SLOW}", "--concurrency", "4",
                           "-n", node], self.env_for(name, "worker"), self.log_dir, node)
        self.procs[name] = proc
        return proc

    def start_service(self, component: str) -> Proc:
        proc = Proc(component, [component], self.env_for(component, component), self.log_dir)
        self.procs[component] = proc
        return proc

    def start_flower(self) -> Proc:
        port = free_port()
        env = self.env_for("flower", "flower", FLOWER_UNAUTHENTICATED_API="true")
        proc = Proc("flower", ["flower", "--port", str(port), "--address", "127.0.0.1",
                               "--inspect_timeout=1000"], env, self.log_dir)
        self.procs["flower"] = proc
        self.flower_url = f"http://127.0.0.1:{port}"
        return proc

    def wait_ready(self, proc: Proc) -> None:
        wait_ready(proc, self.control, healthcheck=f"{self.flower_url}/healthcheck"
                   if proc.name == "flower" else None)

    def cli(self, user: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([FLEET, *args], env=self.env_for("cli", user, **extra),
                              cwd=str(ROOT), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done

    def start(self, flow_id: str, payload: Any) -> str:
        return self.cli("client", "start", flow_id, "--input", json.dumps(payload)).stdout.strip()

    def denials(self) -> list[dict[str, Any]]:
        return self.redis.denials()


def http(url: str, *, data: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    log_dir = tmp_path_factory.mktemp("acl-fleet")
    server = PrivateRedis("redis", log_dir / "redis")
    try:
        with throwaway_database() as database_url:
            env = process_env({
                "FLEET_DATABASE_URL": database_url, "FLEET_QUEUE": QUEUE,
                "FLEET_ROUTES": json.dumps({"flow:acl-nap": SLOW}), "FLEET_FLOWS": acl_flows.ALL,
                "FLEET_LEASE_MS": "3000", "FLEET_RECOVERY_GRACE_MS": "1000",
                "FLEET_RECOVERY_INTERVAL_S": "0.3", "FLEET_TIMER_INTERVAL_S": "0.2",
                "FLEET_WORKER_DRAIN_S": "1",
                "FLEET_REWARD_KEYS": json.dumps({PRODUCER: REWARD_KEY}),
                # The operators' key: Flower signs its control commands (enable_events
                # here) with it, the workers obey only those (decision 0042).
                "FLEET_CONTROL_KEYS": json.dumps({"ops-acl": CONTROL_KEY})})
            control = broker_app("acl-test-control", server.url("flower"))
            store = StoreView(FleetSettings(database_url=database_url), "acl-test-store")
            built = Fleet(server, database_url, env, log_dir, store, control)
            try:
                built.cli("client", "db", "upgrade")
                server.reset_denials()
                starting = [built.start_worker("a"), built.start_worker("b"),
                            *(built.start_service(c)
                              for c in ("timers", "recovery", "attacher", "relay")),
                            built.start_flower()]
                for proc in starting:
                    built.wait_ready(proc)
                time.sleep(1.0)  # the first periodic kombu work (restore, binding sweeps)
                built.startup_denials = server.denials()
                yield built
            finally:
                stop_all(built.procs.values())
                store.close()
                control.close()
    finally:
        server.stop()


@pytest.fixture
def quiet(fleet: Fleet) -> Iterator[Fleet]:
    """A clean ACL LOG before the test; none of the fleet's users refused anything after."""
    fleet.redis.reset_denials()
    yield fleet
    assert fleet.denials() == [], "Redis refused a fleet process something it needs"


def _types(events: list[EventEnvelope]) -> list[str]:
    return [str(e.type) for e in events]


# -- the fleet runs on its users ------------------------------------------------------------


def test_every_process_starts_without_a_refusal_and_is_healthy(fleet: Fleet) -> None:
    assert fleet.startup_denials == []
    for component, proc in (("worker", "a"), ("timers", "timers"), ("recovery", "recovery"),
                            ("attacher", "attacher"), ("relay", "relay")):
        env = fleet.procs[proc].env
        done = subprocess.run([FLEET, "health", "--component", component], env=env,
                              cwd=str(ROOT), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (component, done.stdout, done.stderr)
        assert "broker: redis://" in done.stdout


def test_no_password_is_on_any_process_command_line(fleet: Fleet) -> None:
    """What ``ps`` shows on the node: the Redis server and every fleet process."""
    pids = [fleet.redis.proc.pid, *(p.proc.pid for p in fleet.procs.values() if p.alive())]
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", ",".join(map(str, pids))],
                              capture_output=True, text=True).stdout.split()
    seen = 0
    for pid in [*pids, *map(int, children)]:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            seen += 1
            for user, password in fleet.redis.passwords.items():
                assert password not in argv, (user, pid, argv)
            assert "@127.0.0.1" not in argv, argv  # no URL with credentials
    assert seen >= len(pids)


def test_executions_complete_through_workers_on_the_worker_user(quiet: Fleet) -> None:
    fleet = quiet
    eid = fleet.start("acl-steps", 1)
    fleet.store.until(eid, "completed")
    assert fleet.store.read(eid)[-1].payload["output"]["two"] == 3
    gated = fleet.start("acl-gate", 4)
    fleet.store.until(gated, "parked")
    fleet.cli("client", "resume", gated, "approval", "--payload", "true")
    fleet.store.until(gated, "completed")
    assert fleet.store.read(gated)[-1].payload["output"] == {"before": 5, "approved": True}


def test_the_timer_service_fires_on_the_timers_user(quiet: Fleet) -> None:
    fleet = quiet
    eid = fleet.start("acl-sleep", 2.0)
    fleet.store.until(eid, "parked")
    fleet.store.until(eid, "completed", timeout=20)
    assert "TIMER_FIRED" in _types(fleet.store.read(eid))


def test_the_sweeper_redrives_on_the_recovery_user(quiet: Fleet) -> None:
    """A start written with no drive message (what a lost enqueue leaves): only
    the sweeper can get it driven."""
    fleet = quiet
    runtime = Runtime(fleet.store.store, flows=[acl_flows.steps])
    handle = fleet.store.run(runtime.start("acl-steps", 10, drive=False))
    assert fleet.store.status(handle.execution_id) == "running"
    fleet.store.until(handle.execution_id, "completed", timeout=20)
    assert fleet.store.read(handle.execution_id)[-1].payload["output"]["two"] == 12


def test_a_reward_goes_from_the_producer_user_to_the_attacher_user(quiet: Fleet) -> None:
    fleet = quiet
    eid = fleet.start("acl-decide", 7)
    fleet.store.until(eid, "completed")
    fleet.cli("producer", "reward", "submit", "--execution", eid, "--decision", "size",
              "--producer", PRODUCER, "--key", "csat:1", "--score", "0.75")
    deadline = time.monotonic() + 20
    while "OUTCOME_RECORDED" not in _types(fleet.store.read(eid)):
        assert time.monotonic() < deadline, "the attacher did not attach the reward"
        time.sleep(0.1)
    (outcome,) = [e for e in fleet.store.read(eid) if str(e.type) == "OUTCOME_RECORDED"]
    assert outcome.payload["score"] == 0.75


def test_the_relay_alone_publishes_every_event_and_a_reader_reads_them(quiet: Fleet) -> None:
    """Every event the processes above wrote reaches fleet:events, as the relay user
    (no other user may add to it), and ``fleet events`` reads it as the reader user."""
    fleet = quiet
    eid = fleet.start("acl-steps", 2)
    fleet.store.until(eid, "completed")
    log = fleet.store.read(eid)
    deadline = time.monotonic() + 30
    while True:
        done = subprocess.run(
            [FLEET, "events", "tail", "--from", "start", "--no-follow", "--json",
             "--execution", eid], env=fleet.env_for("cli", "reader"), cwd=str(ROOT),
            capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        seen = [json.loads(line) for line in done.stdout.splitlines()]
        if len(seen) >= len(log) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [e["event"] for e in seen] == [json.loads(e.to_json()) for e in log]
    status = json.loads(fleet.cli("reader", "events", "status", "--json").stdout)
    assert status["length"] >= len(log)
    assert int(status["relay"]["published"]) >= len(log)


def test_fleet_status_on_the_client_user_shows_both_workers(quiet: Fleet) -> None:
    fleet = quiet
    status = json.loads(fleet.cli("client", "status", "--json").stdout)
    assert status["problems"] == []
    workers = {w["name"]: w for w in status["workers"]}
    for name in ("a", "b"):
        assert fleet.procs[name].nodename in workers
        assert "completed" in workers[fleet.procs[name].nodename]["fleet"]


# -- Flower on its user ------------------------------------------------------------------------


def test_flowers_dashboard_and_api_read_on_the_flower_user(quiet: Fleet) -> None:
    fleet = quiet
    base = fleet.flower_url
    status, body = http(f"{base}/api/workers?refresh=1")
    assert status == 200
    workers = json.loads(body)
    for name in ("a", "b"):
        node = fleet.procs[name].nodename
        assert node in workers, sorted(workers)
        assert "completed" in workers[node]["stats"]["fleet"]
    status, body = http(f"{base}/api/queues/length")
    assert status == 200
    queues = {q["name"]: q["messages"] for q in json.loads(body)["active_queues"]}
    assert queues == {QUEUE: 0, SLOW: 0}
    # Task events reach Flower: it enables them (a broadcast, every few seconds from
    # its start) and subscribes to /0.celeryev/*, where the workers publish them.
    # A drive that ran before the workers heard the broadcast sent none: start
    # one after another until Flower has seen one.
    started: list[str] = []
    deadline = time.monotonic() + 30
    while True:
        started.append(fleet.start("acl-steps", 2))
        fleet.store.until(started[-1], "completed")
        time.sleep(0.5)
        status, body = http(f"{base}/api/tasks?limit=1000")
        seen = [t for t in json.loads(body).values() if t.get("name") == "fleet.drive"
                and any(eid in f"{t.get('args')} {t.get('kwargs')}" for eid in started)]
        if seen:
            break
        assert time.monotonic() < deadline, ("Flower saw no task event", body[:2000])
    assert seen[0]["state"] == "SUCCESS"
    for page in ("/", "/workers", "/tasks", "/broker", "/fleet", "/metrics"):
        status, body = http(f"{base}{page}")
        assert status == 200, page
    assert QUEUE.encode() in http(f"{base}/broker")[1]
    # The Fleet page reads every process's report on the flower user (decision 0022).
    status, body = http(f"{base}/fleet/api/status")
    assert status == 200
    fleet_status = json.loads(body)
    assert fleet_status["problems"] == []
    roles = {p["role"] for p in fleet_status["processes"] if not p["stale"]}
    assert {"worker", "timers", "recovery", "attacher", "relay"} <= roles
    assert b"fleet_drives_total" in http(f"{base}/metrics")[1]


PUBLISHING = {
    "async-apply fleet.dispatch": ("/api/task/async-apply/fleet.dispatch",
                                   {"kwargs": {"op": "start", "flow_id": "acl-steps",
                                               "input": 99}}),
    "async-apply fleet.drive": ("/api/task/async-apply/fleet.drive",
                                {"kwargs": {"execution_id": "forged"}}),
    "send-task fleet.dispatch": ("/api/task/send-task/fleet.dispatch",
                                 {"kwargs": {"op": "start", "flow_id": "acl-steps",
                                             "input": 98}}),
}


@pytest.fixture(scope="module")
def tasks_flower(fleet: Fleet) -> Iterator[str]:
    """A second Flower, as the same flower user, on the workers' own Celery app
    (``celery -A fleet.workers.main flower``): it knows fleet.drive and
    fleet.dispatch, so its async-apply goes as far as the broker. The deployed
    ``fleet flower`` runs on the dispatcher's app, which registers no task."""
    port = free_port()
    env = fleet.env_for("flower-tasks", "flower", FLOWER_UNAUTHENTICATED_API="true")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("celery")), "-A",
                             "fleet.workers.main", "flower", f"--port={port}",
                             "--address=127.0.0.1"], env=env, cwd=str(ROOT),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the second Flower exited"
            with contextlib.suppress(OSError):
                if http(f"{url}/healthcheck")[0] == 200:
                    break
            assert time.monotonic() < deadline, "the second Flower did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _nothing_queued_or_started(fleet: Fleet, before: tuple[int, int, int]) -> None:
    time.sleep(1.0)
    admin = fleet.redis.admin
    assert (admin.llen(QUEUE), admin.llen(SLOW), fleet.store.count()) == before
    for name in ("a", "b"):
        assert "fleet.dispatch[" not in fleet.procs[name].log()


def _counts(fleet: Fleet) -> tuple[int, int, int]:
    return (fleet.redis.admin.llen(QUEUE), fleet.redis.admin.llen(SLOW), fleet.store.count())


@pytest.mark.parametrize("endpoint", PUBLISHING.values(), ids=list(PUBLISHING))
def test_a_flower_that_knows_the_tasks_is_refused_by_redis(
        fleet: Fleet, tasks_flower: str, endpoint: tuple[str, Any]) -> None:
    """The flower user's password, in a Flower that can name the tasks: Redis
    refuses the publish (NOPERM), and nothing is queued or started."""
    path, payload = endpoint
    before = _counts(fleet)
    fleet.redis.reset_denials()
    status, body = http(f"{tasks_flower}{path}", data=json.dumps(payload).encode())
    assert status >= 500, (status, body)
    assert b"task-id" not in body
    denials = fleet.denials()
    assert {d["username"] for d in denials} == {"flower"}, denials
    # kombu declares the queue's routing table (SADD, in a MULTI) before it
    # pushes: Redis refuses that, so the LPUSH is never even sent.
    assert any(d["object"] == "_kombu.binding.fleet.drive" for d in denials), denials
    _nothing_queued_or_started(fleet, before)


@pytest.mark.parametrize("endpoint", PUBLISHING.values(), ids=list(PUBLISHING))
def test_the_deployed_flower_cannot_put_a_task_on_a_queue(fleet: Fleet,
                                                          endpoint: tuple[str, Any]) -> None:
    """``fleet flower`` (the manifests' command) refuses every publishing endpoint
    itself: they need the operator role, which nobody has on a Flower without
    authentication (issue 25 item 5); Redis is not even asked. (Behind that, its
    app registers no task, and the flower user may not push: the Flower above.)"""
    path, payload = endpoint
    before = _counts(fleet)
    fleet.redis.reset_denials()
    status, body = http(f"{fleet.flower_url}{path}", data=json.dumps(payload).encode())
    assert b"task-id" not in body
    assert status == 403, (status, body)
    assert b"operator role" in body
    assert fleet.denials() == []
    _nothing_queued_or_started(fleet, before)


def test_flower_cannot_get_a_task_onto_a_queue_through_a_worker_either(fleet: Fleet) -> None:
    """A confused deputy: kombu routes a control reply through a routing table
    every control client may write (_kombu.binding.reply.celery.pidbox), and the
    worker may push onto the task queues. Flower binds its reply ticket to
    fleet.drive as well and pings: the worker's reply lands on the task queue.
    It is a reply, not a task: the worker that takes it drops it as an unknown
    message, and nothing runs or starts (decision 0017 records the path)."""
    admin = fleet.redis.admin
    executions = fleet.store.count()
    ticket = f"deputy-{fleet.token}"
    flower = fleet.redis.client("flower")
    try:
        flower.sadd("_kombu.binding.reply.celery.pidbox", f"{ticket}\x06\x16\x06\x16{QUEUE}")
    finally:
        flower.close()
    app = flower_app(FleetSettings(database_url=fleet.database_url,
                                   redis_url=fleet.redis.url("flower"), queue=QUEUE))
    try:
        mailbox = app.control.mailbox  # an attacker's client: replies to the chosen ticket
        mailbox.__class__ = type("Deputy", (type(mailbox),), {"oid": property(lambda _: ticket)})
        node = fleet.procs["a"].nodename
        assert app.control.ping(destination=[node], timeout=2) == [{node: {"ok": "pong"}}]
    finally:
        app.close()
    deadline = time.monotonic() + 15
    logs = ""
    while "unknown message" not in logs:
        assert time.monotonic() < deadline, (admin.llen(QUEUE), logs[-2000:])
        time.sleep(0.2)
        logs = "".join(fleet.procs[n].log() for n in ("a", "b"))
    assert admin.llen(QUEUE) == 0
    time.sleep(1.0)
    assert fleet.store.count() == executions


# -- a worker hands back on its user ------------------------------------------------------------


def test_a_sigtermed_worker_hands_its_run_back_on_the_worker_user(quiet: Fleet,
                                                                   tmp_path: Path) -> None:
    """Hand-back re-enqueues the drive (LPUSH onto its routed queue), and kombu's
    warm shutdown settles the taken message: all as the worker user."""
    fleet = quiet
    marker = tmp_path / "nap.marker"
    eid = fleet.start("acl-nap", {"marker": str(marker), "seconds": 20})
    deadline = time.monotonic() + 20
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline, "the nap never started"
        time.sleep(0.05)
    holder = marker.read_text()
    other = "b" if holder == "a" else "a"
    fleet.procs[holder].stop(timeout=30)
    assert fleet.procs[holder].proc.returncode == 0, fleet.procs[holder].log()[-3000:]
    fleet.store.until(eid, "completed", timeout=30)
    assert fleet.store.read(eid)[-1].payload["output"] == other
    # Back to two workers for whatever runs next.
    fleet.wait_ready(fleet.start_worker(holder))
