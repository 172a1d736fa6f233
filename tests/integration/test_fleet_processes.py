"""The fleet's commands as real processes: ``fleet worker``, ``fleet timers``,
``fleet recovery``, ``fleet attacher``, ``fleet relay`` and ``fleet flower``
subprocesses on Redis and Postgres, driven by ``fleet start/resume/send/cancel``,
``fleet reward submit`` and ``fleet status``, probed by ``fleet health``; a
worker's graceful shutdown against a crash, told apart by the fence records:
SIGTERM mid-run hands the execution back before its lease would lapse, SIGKILL
leaves it to the lease expiry and the recovery sweeper; and at the end, the
events stream holding every event every one of them (and the command line) wrote.

Redis database 11 is this module's; queues, streams and node names carry a
random token, and the store is a throwaway Postgres database, so concurrent
runs do not meet. Each process has its own heartbeat directory, as each pod has
its own ``/tmp``.
"""

from __future__ import annotations

import json
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from base64 import b64encode
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from fleet_process_flows import ALL, UNTIL_HANDED_BACK
from fleet_procs_kit import (
    FLEET,
    ROOT,
    Proc,
    StoreView,
    nodename,
    process_env,
    stop_all,
    wait_ready,
)
from postgres_server import throwaway_database
from redis_server import url_with_db
from relay_kit import assert_stream_is_the_log, stream_events, wait_published

from fleet.config import FleetSettings
from fleet.kernel.events import EventEnvelope
from fleet.kernel.flows import load_flows
from fleet.kernel.fold import fold_log
from fleet.kernel.runtime import Runtime
from fleet.kernel.store.factory import open_snapshot_store
from fleet.kernel.store.spi import CommittedEvent, Snapshot
from fleet.services.counters import PREFIX as COUNTERS_PREFIX
from fleet.streams.events import EventStreamConsumer, RedisCheckpoint
from fleet.workers import make_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REDIS_DB = 11
LEASE_MS = 5000          # the lease a SIGKILLed worker leaves behind
GRACE_MS = 2000          # the sweeper waits this long after the last write
DRAIN_S = 2.0            # FLEET_WORKER_DRAIN_S: SIGTERM's deadline for a long step
PRODUCER, SECRET = "p1", "test-secret"


@dataclass
class Fleet:
    env: dict[str, str]
    settings: FleetSettings
    app: Any
    store: StoreView
    log_dir: Path
    token: str
    nap_queue: str
    procs: dict[str, Proc] = field(default_factory=dict)
    nap_workers: list[str] = field(default_factory=list)  # take proc-nap (the last case's)

    def env_for(self, name: str, **extra: str) -> dict[str, str]:
        env = dict(self.env)
        env["FLEET_HEARTBEAT_DIR"] = str(self.log_dir / "heartbeats" / name)
        env["FLEET_TEST_WORKER_NAME"] = name
        env.update(extra)
        return env

    def start_worker(self, name: str, queues: list[str], **extra: str) -> Proc:
        node = nodename(name, self.token)
        proc = Proc(name, ["worker", "--queues", ",".join(queues), "--concurrency", "8",
                           "-n", node, "--without-mingle", "--without-gossip"],
                    self.env_for(name, **extra), self.log_dir, node)
        self.procs[name] = proc
        return proc

    def start_service(self, component: str) -> Proc:
        proc = Proc(component, [component], self.env_for(component), self.log_dir)
        self.procs[component] = proc
        return proc

    def wait_ready(self, proc: Proc) -> None:
        wait_ready(proc, self.app)

    def cli(self, *args: str, env: dict[str, str] | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([FLEET, *args], env=env or self.env_for("cli"), cwd=str(ROOT),
                              capture_output=True, text=True, timeout=60)
        if check:
            assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done

    def stats_report(self, worker: Proc) -> dict[str, str]:
        """The worker's last report of its counters (``fleet.services.counters``)."""
        import redis

        client = redis.Redis.from_url(self.settings.broker, decode_responses=True)
        try:
            report: dict[str, str] = client.hgetall(
                f"{COUNTERS_PREFIX}worker:{worker.nodename}")
            return report
        finally:
            client.close()

    def health(self, component: str, proc: Proc, *args: str,
               **env: str) -> subprocess.CompletedProcess[str]:
        return self.cli("health", "--component", component, *args, check=False,
                        env={**proc.env, **env})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    token = secrets.token_hex(3)
    queue, nap_queue, block_queue = f"fp-{token}", f"fp-nap-{token}", f"fp-block-{token}"
    broker = url_with_db(REDIS_DB)
    log_dir = tmp_path_factory.mktemp("fleet-processes")
    with throwaway_database() as database_url:
        env = process_env({
            "FLEET_DATABASE_URL": database_url, "FLEET_BROKER_URL": broker,
            "FLEET_REDIS_URL": broker, "FLEET_QUEUE": queue, "FLEET_FLOWS": ALL,
            "FLEET_ROUTES": json.dumps({"flow:proc-nap": nap_queue,
                                        "flow:proc-block": block_queue}),
            "FLEET_LEASE_MS": str(LEASE_MS), "FLEET_RECOVERY_GRACE_MS": str(GRACE_MS),
            "FLEET_RECOVERY_INTERVAL_S": "0.5", "FLEET_TIMER_INTERVAL_S": "0.2",
            "FLEET_WORKER_DRAIN_S": str(DRAIN_S),
            "FLEET_REWARD_KEYS": json.dumps({PRODUCER: SECRET}),
            "FLEET_REWARDS_STREAM": f"fleet-test:{token}:rewards",
            "FLEET_REWARDS_DEAD": f"fleet-test:{token}:rewards:dead",
            "FLEET_REWARDS_GROUP": f"fleet-test-{token}",
            "FLEET_EVENTS_STREAM": f"fleet-test:{token}:events"})
        settings = FleetSettings(database_url=database_url, broker_url=broker,
                                 redis_url=broker, queue=queue, lease_ms=LEASE_MS)
        app = make_app(settings)
        store = StoreView(settings)
        built = Fleet(env, settings, app, store, log_dir, token, nap_queue)
        try:
            # The schema first (a worker applies it on open), then everything at once.
            built.cli("db", "upgrade")
            starting = [built.start_worker("a", [queue, block_queue]),
                        built.start_worker("b", [queue]),
                        *(built.start_service(c)
                          for c in ("timers", "recovery", "attacher", "relay"))]
            for proc in starting:
                built.wait_ready(proc)
            yield built
        finally:
            stop_all(built.procs.values())
            store.close()
            app.close()


def _types(events: list[EventEnvelope]) -> list[str]:
    return [str(e.type) for e in events]


def _first(events: list[EventEnvelope], kind: str) -> EventEnvelope:
    return next(e for e in events if str(e.type) == kind)


# -- health ---------------------------------------------------------------------------

def test_every_process_is_healthy_and_says_so_in_one_line(fleet: Fleet) -> None:
    for component in ("worker", "timers", "recovery", "attacher", "relay"):
        proc = fleet.procs["a" if component == "worker" else component]
        done = fleet.health(component, proc)
        assert done.returncode == 0, (component, done.stdout, done.stderr)
        assert done.stdout.startswith(f"ok: {component}: heartbeat:")
        assert "broker: redis://" in done.stdout
        assert "store: postgresql://" in done.stdout
        assert len(done.stdout.strip().splitlines()) == 1
        live = fleet.health(component, proc, "--liveness", "--json")
        report = json.loads(live.stdout)
        assert (live.returncode, report["ok"], len(report["checks"])) == (0, True, 1)


def test_health_fails_when_the_broker_or_the_store_is_unreachable(fleet: Fleet) -> None:
    worker = fleet.procs["a"]
    down = fleet.health("worker", worker, "--timeout", "1",
                        FLEET_BROKER_URL="redis://127.0.0.1:1/0")
    assert down.returncode == 1
    assert "unhealthy: worker: broker: redis://127.0.0.1:1/0 unreachable" in down.stderr
    no_store = {"FLEET_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/fleet"}
    down = fleet.health("worker", worker, "--timeout", "1", **no_store)
    assert down.returncode == 1
    assert "unhealthy: worker: store: postgresql://postgres@127.0.0.1:1/fleet" in down.stderr
    # Liveness asks only the loop: a store outage does not restart the pod.
    assert fleet.health("worker", worker, "--liveness", **no_store).returncode == 0
    # A process that is not running here has no heartbeat.
    gone = fleet.health("worker", worker, FLEET_HEARTBEAT_DIR=str(fleet.log_dir / "none"))
    assert gone.returncode == 1
    assert "no heartbeat" in gone.stderr


def test_health_fails_while_a_step_blocks_the_worker_loop(fleet: Fleet) -> None:
    a, b = fleet.procs["a"], fleet.procs["b"]
    # proc-block is routed to a queue only worker a takes; its async step
    # time.sleep()s on the loop, as a step that forgot to await would.
    eid = fleet.cli("start", "proc-block", "--input", "3.0").stdout.strip()
    failed = None
    deadline = time.monotonic() + 10
    while failed is None and time.monotonic() < deadline:
        done = fleet.health("worker", a, "--liveness", "--max-age", "1")
        if done.returncode == 1:
            failed = done.stderr
    assert failed is not None, "the stuck loop was never reported"
    assert "event loop is stuck or gone" in failed
    assert fleet.health("worker", b, "--liveness", "--max-age", "1").returncode == 0
    fleet.store.until(eid, "completed", timeout=15)
    deadline = time.monotonic() + 5
    while fleet.health("worker", a, "--liveness", "--max-age", "1").returncode != 0:
        assert time.monotonic() < deadline, "the loop did not beat again"


# -- dispatch, status ----------------------------------------------------------------

def test_start_resume_send_and_cancel_run_on_the_workers(fleet: Fleet) -> None:
    gate = json.loads(fleet.cli("start", "proc-gate", "--input", "1", "--json").stdout)
    eid = gate["executionId"]
    fleet.store.until(eid, "parked")
    fleet.cli("resume", eid, "approval", "--payload", '"yes"')
    fleet.store.until(eid, "completed")
    assert fleet.store.read(eid)[-1].payload["output"] == {"before": 2, "approved": "yes"}

    waiting = fleet.cli("start", "proc-receive", "--input", "2").stdout.strip()
    fleet.store.until(waiting, "parked")
    sent = json.loads(fleet.cli("send", waiting, "ping", "--payload", '{"m": 1}',
                                "--json").stdout)
    assert sent == {"executionId": waiting, "woke": True}
    fleet.store.until(waiting, "completed")

    doomed = fleet.cli("start", "proc-gate", "--input", "3").stdout.strip()
    fleet.store.until(doomed, "parked")
    fleet.cli("cancel", doomed, "--reason", "test")
    fleet.store.until(doomed, "cancelled")

    status = json.loads(fleet.cli("status", "--json").stdout)
    assert status["executions"]["completed"] >= 2
    assert status["executions"]["cancelled"] >= 1
    workers = {w["name"]: w for w in status["workers"]}
    ours = [fleet.procs[n].nodename for n in ("a", "b")]
    assert set(ours) <= set(workers)
    assert sum(workers[n]["fleet"]["completed"] for n in ours) >= 2
    assert {workers[n]["pool"] for n in ours} == {"thread"}
    table = fleet.cli("status").stdout
    assert "executions" in table
    assert "workers (" in table


def test_the_timer_service_fires_a_parked_sleep(fleet: Fleet) -> None:
    eid = fleet.cli("start", "proc-timer", "--input", "1.5").stdout.strip()
    fleet.store.until(eid, "parked")
    fleet.store.until(eid, "completed", timeout=15)
    types = _types(fleet.store.read(eid))
    assert "TIMER_FIRED" in types
    assert types[-1] == "EXECUTION_COMPLETED"


def test_a_reward_from_the_command_line_is_attached_and_a_forged_one_dead_lettered(
        fleet: Fleet, tmp_path: Path) -> None:
    eid = fleet.cli("start", "proc-decide", "--input", "7").stdout.strip()
    fleet.store.until(eid, "completed")
    submit = ["reward", "submit", "--execution", eid, "--decision", "size",
              "--producer", PRODUCER]
    entry = json.loads(fleet.cli(*submit, "--key", "csat:1", "--score", "0.9",
                                 "--json").stdout)["entry"]
    assert entry
    deadline = time.monotonic() + 15
    while "OUTCOME_RECORDED" not in _types(fleet.store.read(eid)):
        assert time.monotonic() < deadline, "the attacher did not attach the reward"
        time.sleep(0.1)
    outcome = _first(fleet.store.read(eid), "OUTCOME_RECORDED")
    assert outcome.payload["score"] == 0.9
    raw = tmp_path / "raw.key"  # a bare secret is not a key file: refused, nothing sent
    raw.write_text("not-the-secret\n")
    done = fleet.cli(*submit, "--key", "csat:2", "--success", "--key-file", str(raw),
                     check=False)
    assert done.returncode == 1
    assert "looks like a bare secret" in done.stderr
    forged = tmp_path / "forged.json"  # the right format, the wrong secret: a forgery
    forged.write_text(json.dumps({PRODUCER: "not-the-secret"}))
    fleet.cli(*submit, "--key", "csat:2", "--success", "--key-file", str(forged))
    import redis

    client = redis.Redis.from_url(fleet.settings.broker, decode_responses=True)
    try:
        deadline = time.monotonic() + 15
        while not client.xlen(fleet.env["FLEET_REWARDS_DEAD"]):
            assert time.monotonic() < deadline, "the forged reward was not dead-lettered"
            time.sleep(0.1)
        (_, dead), = client.xrange(fleet.env["FLEET_REWARDS_DEAD"])
    finally:
        client.close()
    assert dead["dead_reason"] == "bad_signature"
    assert _types(fleet.store.read(eid)).count("OUTCOME_RECORDED") == 1


def test_a_late_reward_attached_by_the_attacher_reaches_a_stream_consumer(
        fleet: Fleet) -> None:
    # The reward is written by the attacher's process, the start by the client's
    # (the command line), the steps by a worker's: a consumer of the events
    # stream sees all of it, in order, ending with the late reward.
    eid = fleet.cli("start", "proc-decide", "--input", "9").stdout.strip()
    fleet.store.until(eid, "completed")
    seen: list[EventEnvelope] = []

    async def handle(committed: CommittedEvent) -> None:
        if committed.event.execution_id == eid:
            seen.append(committed.event)

    async def open_consumer() -> tuple[aioredis.Redis, EventStreamConsumer]:
        client = aioredis.Redis.from_url(fleet.settings.broker)
        consumer = EventStreamConsumer(
            client, handle, stream=fleet.env["FLEET_EVENTS_STREAM"],
            group=f"trainer-{fleet.token}", block_ms=100,
            checkpoint=RedisCheckpoint(client, f"{fleet.env['FLEET_EVENTS_STREAM']}:cp"))
        await consumer.start()
        return client, consumer

    client, consumer = fleet.store.loop.run_coroutine(open_consumer(), timeout=30)
    try:
        fleet.cli("reward", "submit", "--execution", eid, "--decision", "size",
                  "--producer", PRODUCER, "--key", "csat:late", "--score", "0.75")
        deadline = time.monotonic() + 30
        while not (seen and str(seen[-1].type) == "OUTCOME_RECORDED"):
            assert time.monotonic() < deadline, _types(seen)
            time.sleep(0.05)
    finally:
        fleet.store.loop.run_coroutine(consumer.stop(), timeout=30)
        fleet.store.loop.run_coroutine(client.aclose(), timeout=30)
    reward = seen[-1]
    assert reward.payload["score"] == 0.75
    assert reward.payload["late"] is True
    assert reward.payload["recordedBy"] == f"producer:{PRODUCER}"
    assert [e.to_json() for e in seen] == [e.to_json() for e in fleet.store.read(eid)]
    assert str(seen[0].type) == "EXECUTION_STARTED"  # the client's write, not a worker's


# -- flower ---------------------------------------------------------------------------

def _get(url: str, auth: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if auth is not None:
        request.add_header("Authorization", "Basic " + b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=15) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def test_flower_serves_only_behind_authentication(fleet: Fleet) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    refused = fleet.cli("flower", "--port", str(port), check=False)
    assert refused.returncode == 1
    assert "refuses to serve without authentication" in refused.stderr
    # ops reads every tenant's tasks (the operator role; decision 0043).
    env = fleet.env_for("flower", FLOWER_BASIC_AUTH="ops:pw", FLEET_OPERATORS="ops")
    proc = Proc("flower", ["flower", "--port", str(port), "--address", "127.0.0.1"], env,
                fleet.log_dir)
    fleet.procs["flower"] = proc
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, healthcheck=f"{base}/healthcheck", timeout=30)
        assert _get(f"{base}/api/workers")[0] == 401
        assert _get(f"{base}/api/workers", "ops:wrong")[0] == 401
        status, body = _get(f"{base}/api/workers?refresh=1", "ops:pw")
        assert status == 200
        workers = json.loads(body)
        node = fleet.procs["a"].nodename
        assert node in workers
        assert "fleet" in workers[node]["stats"]
    finally:
        proc.stop()


# -- graceful shutdown: SIGTERM against SIGKILL ---------------------------------------
#
# Which worker takes a run and when a signal lands are left to the scheduler (and to
# load); what is asserted does not depend on them. A first attempt waits for what the
# case is about (its worker's hand-back, or a signal), never for a time, and the fence
# records decide: the store grants no fence over a live lease (``acquire_fence_if``),
# so the next holder's RECOVERED stamped before the victim's lease would have lapsed
# proves the victim let the run go, and one stamped at or after it proves it did not.
# The SIGTERMed workers hold leases far longer than the test, and the sweeper is
# stopped meanwhile: only the hand-back (release and re-enqueue) can bring their runs
# to another worker. The SIGKILLed one holds the module's short lease, and the sweeper
# runs again to find its run once the lease has lapsed.

LONG_LEASE_MS = 600_000
NAP_ON = 600.0  # a first attempt that is still running when its signal lands


@dataclass
class Takeover:
    how: str
    victim: Proc
    holder: str               # the victim in the fence record, mid-step
    lease_expires_at: int     # its lease's expiry (ms), read then: renewals only extend it
    events: list[EventEnvelope]
    report: dict[str, str]    # the victim's last stats report (Redis)

    @property
    def recovered(self) -> EventEnvelope:
        return _first(self.events, "RECOVERED")  # the next holder's first write

    @property
    def taker(self) -> str:
        return str(self.events[-1].payload["output"]["after"])

    @property
    def before_lapse_ms(self) -> int:
        """How long before the victim's lease would have lapsed the next holder took over."""
        return self.lease_expires_at - self.recovered.timestamp

    def counter(self, name: str) -> int:
        return int(json.loads(self.report.get("counters", "{}")).get(name, 0))


def _nap_workers(fleet: Fleet, names: tuple[str, ...], **env: str) -> None:
    """Only these workers take proc-nap: the ones a case started before stopped."""
    for name in [n for n in fleet.nap_workers if n not in names and n in fleet.procs]:
        fleet.procs.pop(name).stop()
    fleet.nap_workers = list(names)
    for name in names:
        fleet.start_worker(name, [fleet.nap_queue], **env)
    for name in names:
        fleet.wait_ready(fleet.procs[name])


def _run_until_signal(fleet: Fleet, marker: Path, first: float | str, again: float,
                      sig: int, how: str) -> Takeover:
    spec = {"marker": str(marker), "first": first, "again": again}
    eid = fleet.cli("start", "proc-nap", "--input", json.dumps(spec)).stdout.strip()
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert time.monotonic() < deadline, "the nap step never started"
        time.sleep(0.02)
    victim = fleet.procs[marker.read_text().split()[0]]
    # Mid-step (the step waits for the signal): the victim holds the fence.
    held = fleet.store.summary(eid)
    assert held is not None
    assert held.holder is not None, held
    assert held.lease_expires_at is not None, held
    victim.signal(sig)
    victim.wait_exit(120)
    fleet.store.until(eid, "completed", timeout=120)
    events = fleet.store.read(eid)
    assert str(events[-1].type) == "EXECUTION_COMPLETED"
    report = fleet.stats_report(victim)
    fleet.procs.pop(victim.name).stop()
    return Takeover(how, victim, held.holder, held.lease_expires_at, events, report)


def test_sigterm_hands_the_run_back_sooner_than_sigkill_loses_it(
        fleet: Fleet, tmp_path: Path) -> None:
    sweeper = fleet.procs.pop("recovery")
    sweeper.stop()
    long_lease = {"FLEET_LEASE_MS": str(LONG_LEASE_MS)}

    # 1. SIGTERM mid-step: the step finishes (a durable point), the run is handed
    #    back with its lease released, and re-enqueued: the other worker goes on.
    #    (A drain deadline longer than the test: nothing is cut.)
    _nap_workers(fleet, ("x", "y"), **long_lease, FLEET_WORKER_DRAIN_S="600")
    durable = _run_until_signal(fleet, tmp_path / "m1", UNTIL_HANDED_BACK, 0.0,
                                signal.SIGTERM, "SIGTERM, next durable point")
    assert "EFFECT_INDOUBT" not in _types(durable.events)  # the step ran once
    assert _first(durable.events, "STEP_COMPLETED").payload["output"] == {
        "worker": durable.victim.name, "attempt": 1}

    # 2. SIGTERM in a step longer than the drain deadline: cut after DRAIN_S, the
    #    step is in doubt and runs again elsewhere, and the lease is released.
    _nap_workers(fleet, ("u", "v"), **long_lease)
    cut = _run_until_signal(fleet, tmp_path / "m2", NAP_ON, 0.1, signal.SIGTERM,
                            f"SIGTERM, cut at the {DRAIN_S:g} s drain deadline")
    assert "EFFECT_INDOUBT" in _types(cut.events)
    assert _first(cut.events, "STEP_COMPLETED").payload["output"] == {
        "worker": cut.taker, "attempt": 2}
    assert (f"drain deadline ({DRAIN_S:g} s) passed: 1 run(s) handed back mid-step"
            in cut.victim.log())

    # 3. The same run, SIGKILLed: the lease must lapse and the sweeper find the run.
    fleet.wait_ready(fleet.start_service("recovery"))
    _nap_workers(fleet, ("k", "l"))
    killed = _run_until_signal(fleet, tmp_path / "m3", NAP_ON, 0.0, signal.SIGKILL,
                               "SIGKILL")
    assert "EFFECT_INDOUBT" in _types(killed.events)
    assert _first(killed.events, "STEP_COMPLETED").payload["output"] == {
        "worker": killed.taker, "attempt": 2}

    for t in (durable, cut, killed):
        print(f"\n{t.how}: {t.victim.name} -> {t.taker}: taken over "
              f"{t.before_lapse_ms / 1000:.2f} s before the victim's lease would have "
              f"lapsed; handed back {t.counter('handed_back')}")
    for t in (durable, cut, killed):
        assert t.taker != t.victim.name
        assert t.recovered.payload["by"] != t.holder
    # Handed back: taken over while the victim's lease was live, which only its
    # release allows; the victim counted the run it let go (and any re-enqueued
    # drive it received while draining and handed on unopened), and stopped cleanly.
    for t in (durable, cut):
        assert t.before_lapse_ms > 0, t.how
        assert t.counter("handed_back") >= 1, (t.how, t.report)
        assert t.report.get("stopped_at"), (t.how, t.report)
    # Lost: nobody took the run over before the lease the dead worker held lapsed.
    assert killed.before_lapse_ms <= 0
    assert killed.counter("handed_back") == 0


# -- the events stream is the log: every writer, every event, once ------------------------

def test_the_events_stream_holds_every_event_every_writer_committed(fleet: Fleet) -> None:
    """Last in the module, after every other writer ran: the dispatcher (start, resume,
    send, cancel), the workers (including the ones SIGTERMed and SIGKILLed), the timer
    service, the sweeper, the attacher; then the command line (``fleet outcome
    attach``, ``fleet repair terminal-event``) and a migration (``resume_as``)."""
    attach = fleet.cli("start", "proc-decide", "--input", "2").stdout.strip()
    repaired = fleet.cli("start", "proc-decide", "--input", "3").stdout.strip()
    migrated = fleet.cli("start", "proc-decide", "--input", "4").stdout.strip()
    for eid in (attach, repaired, migrated):
        fleet.store.until(eid, "completed")
    done = fleet.cli("outcome", "attach", "--execution", attach, "--decision", "size",
                     "--key", "ops:1", "--score", "1", "--json")
    assert json.loads(done.stdout)["appended"] is True
    # A log an older kernel compacted without its terminal event, repaired from the CLI.
    original = fleet.store.read(repaired)

    async def old_compaction() -> None:
        snapshots = open_snapshot_store(fleet.settings.database_url)
        try:
            await snapshots.save(Snapshot(repaired, original[-1].sequence,
                                          fold_log(original).to_dict()))
        finally:
            await snapshots.close()
        await fleet.store.store.compact_through(repaired, original[-1].sequence)

    fleet.store.loop.run_coroutine(old_compaction(), timeout=30)
    fixed = fleet.cli("repair", "terminal-event", repaired, "--apply", "--json")
    assert json.loads(fixed.stdout)["action"] == "written", fixed.stdout

    async def migrate() -> None:
        runtime = Runtime(fleet.store.store, flows=load_flows(ALL.split(",")))
        handle = await runtime.resume_as(migrated, version=1)
        await handle.result(timeout=30)

    fleet.store.loop.run_coroutine(migrate(), timeout=60)
    assert "EXECUTION_MIGRATED" in _types(fleet.store.read(migrated))

    restored = fleet.store.read(repaired)[-1]
    assert restored.metadata.get("restoredTerminal") is True

    async def check() -> None:
        client = aioredis.Redis.from_url(fleet.settings.broker)
        stream = fleet.env["FLEET_EVENTS_STREAM"]
        try:
            await wait_published(client, stream, fleet.store.store, timeout=60)
            # Compaction removed events from the repaired log after the relay had
            # published them: the stream still has them, then the restored end.
            published = await assert_stream_is_the_log(client, stream, fleet.store.store,
                                                       ignore={repaired})
            ours = [c.event for c in await stream_events(client, stream)
                    if c.event.execution_id == repaired]
            assert [e.to_json() for e in ours] == [e.to_json() for e in
                                                    (*original, restored)]
            writers = {str(c.event.type) for c in published}
            assert {"EXECUTION_STARTED", "EXECUTION_RESUMED", "MESSAGE_RECEIVED",
                    "EXECUTION_CANCELLED", "TIMER_FIRED", "RECOVERED", "OUTCOME_RECORDED",
                    "EXECUTION_MIGRATED", "EXECUTION_COMPLETED"} <= writers
        finally:
            await client.aclose()

    fleet.store.loop.run_coroutine(check(), timeout=120)
