"""The fleet's workers, as real processes: Celery workers on Redis (and one on RabbitMQ),
the store on Postgres, Flower over HTTP.

Redis database 13 is this module's; every test uses queue names of its own and
every worker a node name of its own, so concurrent runs do not meet. The chaos
test runs a bounded version here (about 60 executions in about 30 s);
``FLEET_LONG_TESTS=1`` runs the full one (200).
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fleet_flows import ALL
from fleet_worker_kit import (
    WorkerProcess,
    fleet_env,
    flower,
    get_json,
    get_text,
    start_workers,
)
from rabbitmq_server import delete_queues
from rabbitmq_server import server_url as amqp_url
from redis_server import url_with_db

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher, DriveOrder
from fleet.host.kernel import open_store
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.flows import load_flows
from fleet.kernel.runtime import Runtime
from fleet.kernel.security import Principal
from fleet.workers import make_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REDIS_DB = 13
LEASE_MS = 1500
LONG = os.environ.get("FLEET_LONG_TESTS") == "1"


@dataclass
class Fleet:
    settings: FleetSettings
    env: dict[str, str]
    app: Any
    default: WorkerProcess
    heavy: WorkerProcess
    log_dir: Path

    def settings_for(self, **changes: Any) -> FleetSettings:
        return self.settings.model_copy(update=changes)


@pytest.fixture(scope="module")
def broker_url() -> str:
    # Never flushed: another run of this module may share the server, and its
    # queues and node names (random per run) keep the two apart.
    return url_with_db(REDIS_DB)


def _settings(database_url: str, broker_url: str, queue: str,
              routes: dict[str, str] | None = None) -> FleetSettings:
    return FleetSettings(database_url=database_url, broker_url=broker_url, queue=queue,
                         routes=routes or {}, flows=ALL.split(","), lease_ms=LEASE_MS)


@pytest.fixture(scope="module")
def fleet(database_url: str, broker_url: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A default-queue worker and a worker for the heavy queue (flow and tenant routes)."""
    token = secrets.token_hex(3)
    queue, heavy = f"fleet-w-{token}", f"fleet-heavy-{token}"
    routes = {"flow:fleet-heavy": heavy, "tenant:big": heavy}
    settings = _settings(database_url, broker_url, queue, routes)
    env = fleet_env(database_url=database_url, broker_url=broker_url, queue=queue, flows=ALL,
                    routes=routes, lease_ms=LEASE_MS)
    log_dir = tmp_path_factory.mktemp("workers")
    app = make_app(settings)
    default, heavy_worker = start_workers([("default", [queue]), ("heavy", [heavy])], env,
                                          log_dir, app)
    try:
        yield Fleet(settings, env, app, default, heavy_worker, log_dir)
    finally:
        default.stop()
        heavy_worker.stop()
        app.close()


async def _result(dispatcher: Dispatcher, execution_id: str, timeout: float = 30.0) -> Any:
    runtime = await dispatcher.runtime()
    return await asyncio.wait_for(runtime.result(execution_id), timeout)


async def _log(dispatcher: Dispatcher, execution_id: str) -> list[EventEnvelope]:
    return await (await dispatcher.runtime()).store.read(execution_id)


async def _until(predicate: Any, timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        if asyncio.iscoroutinefunction(predicate):
            value = await predicate()
        else:  # a blocking probe (a file, a control request) runs off the loop
            value = await asyncio.to_thread(predicate)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)


def _types(events: list[EventEnvelope]) -> list[str]:
    return [str(e.type) for e in events]


# ---------------------------------------------------------------------------
# A start through the dispatcher completes on a worker; routes.
# ---------------------------------------------------------------------------

async def test_execution_started_through_the_dispatcher_completes_on_a_worker(
        fleet: Fleet) -> None:
    async with Dispatcher(fleet.settings) as dispatcher:
        ids = [await dispatcher.start("fleet-three", n) for n in range(5)]
        assert [await _result(dispatcher, eid) for eid in ids] == [3, 4, 5, 6, 7]
        who = await dispatcher.start("fleet-whoami", "plain")
        assert (await _result(dispatcher, who))["worker"] == "default"
        events = await _log(dispatcher, ids[0])
        assert _types(events)[0] == "EXECUTION_STARTED"
        assert _types(events)[-1] == "EXECUTION_COMPLETED"
        assert "RECOVERED" not in _types(events)  # the first drive of a write is no recovery
    stats = fleet.default.stats(fleet.app)
    assert stats["completed"] >= 6
    assert stats["drives"] >= 6


async def test_routes_send_a_flow_and_a_tenant_to_their_own_queue(fleet: Fleet) -> None:
    async with Dispatcher(fleet.settings) as dispatcher:
        before = fleet.default.stats(fleet.app)["deliveries"]
        heavy = await dispatcher.start("fleet-heavy", "by-flow")
        tenant = await dispatcher.start("fleet-whoami", "by-tenant",
                                        principal=Principal("ops", tenant="big"))
        plain = await dispatcher.start("fleet-whoami", "plain",
                                       principal=Principal("ops", tenant="small"))
        assert (await _result(dispatcher, heavy))["worker"] == "heavy"
        assert (await _result(dispatcher, tenant))["worker"] == "heavy"
        assert (await _result(dispatcher, plain))["worker"] == "default"
    # The default worker saw only the plain one: routed drives never reached it.
    after = fleet.default.stats(fleet.app)["deliveries"]
    assert after == before + 1, (before, after, fleet.default.log()[-6000:])
    assert fleet.heavy.stats(fleet.app)["completed"] >= 2


async def test_a_prefork_worker_runs_a_loop_per_child(fleet: Fleet, tmp_path: Path) -> None:
    queue = f"fleet-prefork-{secrets.token_hex(3)}"
    env = fleet_env(database_url=fleet.settings.database_url, broker_url=fleet.settings.broker,
                    queue=queue, flows=ALL, lease_ms=LEASE_MS,
                    extra={"FLEET_WORKER_POOL": "prefork"})
    (worker,) = start_workers([("forked", [queue])], env, tmp_path, fleet.app, concurrency=2)
    try:
        async with Dispatcher(fleet.settings_for(queue=queue, routes={})) as dispatcher:
            ids = [await dispatcher.start("fleet-whoami", f"p{i}") for i in range(8)]
            outputs = [await _result(dispatcher, eid) for eid in ids]
        assert {o["worker"] for o in outputs} == {"forked"}
        assert worker.pid not in {o["pid"] for o in outputs}  # the children drove them
        # inspect stats is answered by the parent: it sums its children's rows. A
        # child writes its row when its drive returns, just after the log says the
        # run completed (what _result waited for): give the last row a moment.
        deadline = time.monotonic() + 10
        stats = worker.stats(fleet.app)
        while stats["completed"] < 8 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            stats = worker.stats(fleet.app)
        assert stats["completed"] == 8
        assert stats["deliveries"] == 8
    finally:
        worker.stop()


def test_a_worker_that_cannot_load_its_flows_exits_at_start(fleet: Fleet,
                                                            tmp_path: Path) -> None:
    env = dict(fleet.env, FLEET_FLOWS="fleet_flows:no_such_flow")
    worker = WorkerProcess("broken", env, [f"fleet-broken-{secrets.token_hex(3)}"], tmp_path)
    try:
        assert worker.proc.wait(60) != 0
        log = worker.log()
        assert "fleet worker cannot start" in log
        assert "no_such_flow" in log
    finally:
        worker.stop()


# ---------------------------------------------------------------------------
# At least once: a duplicate delivery steps aside.
# ---------------------------------------------------------------------------

async def test_a_duplicate_delivery_steps_aside_while_the_lease_is_live(
        fleet: Fleet, tmp_path: Path) -> None:
    marker, release = tmp_path / "running", tmp_path / "release"
    before = fleet.default.stats(fleet.app)
    async with Dispatcher(fleet.settings) as dispatcher:
        eid = await dispatcher.start("fleet-hold", {"marker": str(marker),
                                                    "release": str(release), "limit": 30})
        await _until(marker.exists, 15, "the step to run")
        # Celery delivers at least once: the same drive again, while the run is live.
        await dispatcher.enqueue_async(DriveOrder(eid))
        await _until(lambda: fleet.default.stats(fleet.app)["stepped_aside"]
                     > before["stepped_aside"], 15, "the duplicate to step aside")
        release.write_text("go")
        assert await _result(dispatcher, eid) == {"hold": "default", "after": "default"}
        types = _types(await _log(dispatcher, eid))
    assert "RECOVERED" not in types
    assert "EFFECT_INDOUBT" not in types
    assert types.count("STEP_STARTED") == 2
    after = fleet.default.stats(fleet.app)
    assert after["stepped_aside"] == before["stepped_aside"] + 1
    assert after["completed"] == before["completed"] + 1


# ---------------------------------------------------------------------------
# The zombie: paused mid-step past its lease, taken over, then resumed.
# ---------------------------------------------------------------------------

async def test_a_paused_zombie_is_fenced_out_after_another_worker_took_over(
        fleet: Fleet, tmp_path: Path) -> None:
    token = secrets.token_hex(3)
    zq, sq = f"fleet-zombie-{token}", f"fleet-successor-{token}"
    zombie, successor = start_workers([("zombie", [zq]), ("successor", [sq])], fleet.env,
                                      fleet.log_dir, fleet.app)
    marker, release = tmp_path / "running", tmp_path / "release"
    try:
        async with Dispatcher(fleet.settings) as dispatcher:
            order = await dispatcher.write_start(
                "fleet-hold", {"marker": str(marker), "release": str(release), "limit": 60})
            eid = order.execution_id
            fleet.app.send_task("fleet.drive", args=[eid], queue=zq)
            await _until(marker.exists, 15, "the zombie's step to run")
            zombie.signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            # Its lease runs out: nobody renews it while the process is stopped.
            store = (await dispatcher.runtime()).store

            async def lease_expired() -> bool:
                summary = await store.get_execution(eid)
                now = int(time.time() * 1000)
                return summary is not None and (summary.lease_expires_at or 0) < now

            await _until(lease_expired, LEASE_MS / 1000 + 5, "the zombie's lease to expire")
            fleet.app.send_task("fleet.drive", args=[eid], queue=sq)  # the sweeper's re-drive
            assert await _result(dispatcher, eid) == {"hold": "successor", "after": "successor"}
            taken_over = await _log(dispatcher, eid)
            types = _types(taken_over)
            recovered = types.index("RECOVERED")
            assert types[recovered + 1] == "EFFECT_INDOUBT"
            assert taken_over[recovered + 1].payload["stepId"] == "hold"
            assert types.count("EXECUTION_COMPLETED") == 1
            assert time.monotonic() - stopped_at < 30

            # Wake the zombie: its step finishes and its write is refused, or its lease
            # renewal (due while it was stopped) finds the fence taken and stops it first
            # (decision 0033); either way it is fenced out.
            release.write_text("go")
            zombie.signal(signal.SIGCONT)
            stats = await _until(lambda: (s := zombie.stats(fleet.app)).get("fenced_out") and s,
                                 20, "the zombie to be fenced out")
            assert stats["fenced_out"] == 1
            assert stats["completed"] == 0
            log = zombie.log()
            assert "StaleFenceError" in log or "fenced out" in log
            # Nothing from the zombie reached the log after the takeover.
            assert await _log(dispatcher, eid) == taken_over
            assert successor.stats(fleet.app)["recovered"] == 1
    finally:
        zombie.stop()
        successor.stop()


# ---------------------------------------------------------------------------
# Chaos: SIGKILL a random worker every 2 s while executions run.
# ---------------------------------------------------------------------------

class _Killer(threading.Thread):
    """Every ``every`` s, SIGKILL a random worker and start a replacement."""

    def __init__(self, workers: list[WorkerProcess], spawn: Any, every: float) -> None:
        super().__init__(daemon=True)
        self.workers = workers
        self.spawn = spawn
        self.every = every
        self.kills = 0
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.done.wait(self.every):
                i = random.randrange(len(self.workers))
                self.workers[i].kill()
                self.kills += 1
                self.workers[i] = self.spawn(self.kills)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


@pytest.mark.timeout(600 if LONG else 180)
async def test_sigkill_chaos_every_execution_completes_exactly_once_per_step(
        fleet: Fleet, tmp_path: Path) -> None:
    total, spread = (200, 60.0) if LONG else (60, 20.0)
    token = secrets.token_hex(3)
    queue = f"fleet-chaos-{token}"
    settings = fleet.settings_for(queue=queue, routes={})
    env = fleet_env(database_url=settings.database_url, broker_url=settings.broker,
                    queue=queue, flows=ALL, lease_ms=LEASE_MS)
    names = iter(range(1000))

    def spawn(_: int) -> WorkerProcess:
        return WorkerProcess(f"chaos{next(names)}", env, [queue], tmp_path)

    workers = start_workers([(f"chaos{next(names)}", [queue]) for _ in range(3)], env,
                            tmp_path, fleet.app)
    killer = _Killer(workers, spawn, every=2.0)
    # The recovery loop: this process re-drives runs whose holder died.
    store = open_store(settings)
    recovery = Runtime(store, flows=load_flows(settings.flows), lease_ms=LEASE_MS,
                       local_timers=False, holder=f"recovery-{token}")
    stop_recovery = asyncio.Event()
    recovered_by_loop = 0

    async def recover() -> None:
        nonlocal recovered_by_loop
        while not stop_recovery.is_set():
            report = await recovery.recover_abandoned(limit=500)
            recovered_by_loop += report.recovered
            await asyncio.sleep(1.0)

    ids: list[str] = []
    try:
        async with Dispatcher(settings) as dispatcher:
            recovery_task = asyncio.create_task(recover())
            killer.start()
            for n in range(total):
                ids.append(await dispatcher.start("fleet-five", {"pause": 0.3, "n": n}))
                await asyncio.sleep(spread / total)

            async def all_completed() -> bool:
                states = [await recovery.load_state(eid, system=True) for eid in ids]
                return all(s.status == "completed" for s in states)

            await _until(all_completed, 60 if not LONG else 120,
                         "every execution to complete", interval=0.5)
            killer.done.set()
            killer.join(30)
            stop_recovery.set()
            await recovery_task
            assert killer.error is None, killer.error
            assert killer.kills >= (spread // 2) - 1

            rerun_steps = recovered = 0
            for eid in ids:
                events = await store.read(eid)
                state = await recovery.load_state(eid, system=True)
                assert state.output == [1, 2, 3, 4, 5]
                assert [e.sequence for e in events] == list(range(len(events)))
                completed = Counter(e.payload["stepId"] for e in events
                                    if e.type is EventType.STEP_COMPLETED)
                assert all(count == 1 for count in completed.values()), (eid, completed)
                assert set(completed) == {f"s{i}" for i in range(1, 6)}
                started: dict[str, int] = {}
                for i, event in enumerate(events):
                    if event.type is not EventType.STEP_STARTED:
                        continue
                    step = event.payload["stepId"]
                    if step in started:
                        # A re-run: the previous attempt was judged in doubt first.
                        between = events[started[step] + 1:i]
                        assert any(e.type is EventType.EFFECT_INDOUBT
                                   and e.payload["stepId"] == step for e in between), \
                            (eid, step, _types(events))
                        rerun_steps += 1
                    started[step] = i
                assert _types(events).count("EXECUTION_COMPLETED") == 1
                recovered += _types(events).count("RECOVERED")
            print(f"chaos: {total} executions, {killer.kills} kills, {recovered} RECOVERED, "
                  f"{rerun_steps} steps re-run, {recovered_by_loop} re-driven by the loop")
            # The run really was chaotic: runs were recovered and steps re-ran.
            assert recovered >= 1, (recovered, rerun_steps)
            assert rerun_steps >= 1, (recovered, rerun_steps)
    finally:
        killer.done.set()
        stop_recovery.set()
        for worker in killer.workers:
            worker.stop()
        await recovery.close()
        await store.close()


# ---------------------------------------------------------------------------
# Flower: the bootstep's counters on the worker page and /api/workers.
# ---------------------------------------------------------------------------

FLEET_KEYS = {"drives", "completed", "failed", "parked", "stepped_aside", "fenced_out",
              "recovered", "timers_fired", "divergence_warnings", "divergence_parked",
              "outcomes_attached", "outcomes_dead_lettered"}


async def test_flower_shows_the_fleet_counters_and_they_move(fleet: Fleet) -> None:
    with flower(fleet.env, fleet.log_dir) as base:

        def fleet_stats() -> dict[str, Any]:
            workers = get_json(f"{base}/api/workers?refresh=1")
            return dict(workers.get(fleet.default.nodename, {}).get("stats", {})
                        .get("fleet", {}))

        before = await _until(lambda: fleet_stats() or None, 20, "flower to see the worker")
        assert set(before) >= FLEET_KEYS
        async with Dispatcher(fleet.settings) as dispatcher:
            eid = await dispatcher.start("fleet-three", 10)
            assert await _result(dispatcher, eid) == 13
        after = fleet_stats()
        assert after["completed"] == before["completed"] + 1
        assert after["drives"] == before["drives"] + 1
        page = get_text(f"{base}/worker/{fleet.default.nodename}")
        assert "fleet" in page
        assert "stepped_aside" in page


# ---------------------------------------------------------------------------
# RabbitMQ works as the broker too.
# ---------------------------------------------------------------------------

async def test_an_execution_completes_with_rabbitmq_as_the_broker(
        fleet: Fleet, tmp_path: Path) -> None:
    broker = amqp_url()
    queue = f"fleet-amqp-{secrets.token_hex(3)}"
    settings = fleet.settings_for(broker_url=broker, queue=queue, routes={})
    env = fleet_env(database_url=settings.database_url, broker_url=broker, queue=queue,
                    flows=ALL, lease_ms=LEASE_MS)
    app = make_app(settings)
    (worker,) = start_workers([("rabbit", [queue])], env, tmp_path, app)
    try:
        async with Dispatcher(settings) as dispatcher:
            ids = [await dispatcher.start("fleet-three", n) for n in range(3)]
            assert [await _result(dispatcher, eid) for eid in ids] == [3, 4, 5]
            who = await dispatcher.start("fleet-whoami", "amqp")
            assert (await _result(dispatcher, who))["worker"] == "rabbit"
        assert worker.stats(app)["completed"] == 4
    finally:
        worker.stop()
        app.close()
        delete_queues(broker, [queue])
