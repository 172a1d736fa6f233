"""The fleet's commands without servers: the CLI parses and calls the library.

SQLite files and Celery's in-memory broker (``memory://``) stand in for Postgres
and Redis; the hand-back a worker does on SIGTERM is tested here on the kernel
and on an in-process ``WorkerProcess``. The real-process versions (workers,
timers, sweeper, attacher and Flower as ``fleet ...`` subprocesses, SIGTERM vs
SIGKILL) are in ``tests/integration/test_fleet_processes.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cli_fleet_flows
import pytest
import worker_unit_flows as hold_flows
from click.testing import CliRunner
from kernel_kit import drove

import fleet.assembly.roles
import fleet.cli.processes
import fleet.cli.status
from fleet.assembly.roles import flower_argv, open_role, serve
from fleet.cli import main
from fleet.config import FleetSettings
from fleet.kernel.errors import ConfigurationError
from fleet.kernel.events import EventType
from fleet.kernel.runtime import Runtime
from fleet.kernel.store.coalescing import CoalescingEventStore
from fleet.kernel.store.spi import EventStore, SnapshotStore
from fleet.kernel.store.sqlite import SqliteEventStore
from fleet.services.health import Heartbeat, check_heartbeat, heartbeat_path
from fleet.services.status import execution_counts
from fleet.workers.process import WorkerProcess
from fleet.workers.run import worker_argv, worker_settings


@dataclass
class Env:
    db: Path
    url: str
    heartbeats: Path


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Env:
    """A fleet configured by environment, as the commands read it: SQLite, memory broker."""
    for name in list(os.environ):
        if name.startswith(("FLEET_", "FLOWER_")):
            monkeypatch.delenv(name)
    db = tmp_path / "fleet.db"
    url = f"sqlite:///{db}"
    heartbeats = tmp_path / "hb"
    for name, value in {"FLEET_DATABASE_URL": url, "FLEET_BROKER_URL": "memory://",
                        "FLEET_FLOWS": ",".join(cli_fleet_flows.ALL),
                        "FLEET_HEARTBEAT_DIR": str(heartbeats),
                        "FLEET_QUEUE": "cli-unit"}.items():
        monkeypatch.setenv(name, value)
    return Env(db, url, heartbeats)


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def _events(env: Env, execution_id: str) -> list[Any]:
    async def read() -> list[Any]:
        store = SqliteEventStore(str(env.db))
        try:
            return await store.read(execution_id)
        finally:
            await store.close()
    return asyncio.run(read())


def _drive(env: Env, execution_id: str) -> str:
    """What a worker would do with the enqueued drive: drive it here; the status after."""
    async def go() -> str:
        store = SqliteEventStore(str(env.db))
        try:
            runtime = Runtime(store, flows=[cli_fleet_flows.gate, cli_fleet_flows.receive])
            await runtime.drive(execution_id, wait=True)
            summary = await store.get_execution(execution_id)
            assert summary is not None
            return summary.status
        finally:
            await store.close()
    return asyncio.run(go())


def _types(events: list[Any]) -> list[str]:
    return [str(e.type) for e in events]


# -- dispatch: start, resume, send, cancel -------------------------------------------

def test_start_resume_send_and_cancel_write_first_then_enqueue(env: Env) -> None:
    code, out = run("start", "cli-gate", "--input", "1", "--json")
    assert code == 0, out
    eid = json.loads(out)["executionId"]
    # Written, not driven: a worker takes the drive from the queue.
    assert _types(_events(env, eid)) == ["EXECUTION_STARTED"]
    assert _drive(env, eid) == "parked"
    code, out = run("resume", eid, "approval", "--payload", '"yes"')
    assert code == 0, out
    assert f"resumed {eid} at approval" in out
    assert _types(_events(env, eid))[-1] == "EXECUTION_RESUMED"
    assert _drive(env, eid) == "completed"
    assert _events(env, eid)[-1].payload["output"] == {"before": 2, "approved": "yes"}

    code, out = run("start", "cli-receive", "--input", "5")
    assert code == 0, out
    waiting = out.strip()
    assert _drive(env, waiting) == "parked"
    code, out = run("send", waiting, "ping", "--payload", '{"n": 1}', "--json")
    assert code == 0, out
    assert json.loads(out) == {"executionId": waiting, "woke": True}
    assert _drive(env, waiting) == "completed"

    code, out = run("start", "cli-gate", "--input", "2", "--execution-id", "fixed-id")
    assert (code, out.strip()) == (0, "fixed-id")
    code, out = run("start", "cli-gate", "--input", "2", "--execution-id", "fixed-id")
    assert (code, out.strip()) == (0, "fixed-id")  # idempotent: one execution
    assert _types(_events(env, "fixed-id")) == ["EXECUTION_STARTED"]
    code, out = run("cancel", "fixed-id", "--reason", "unit test")
    assert code == 0, out
    # The request is written and its drive enqueued: the flow sees the cancellation
    # when a worker drives it.
    assert _types(_events(env, "fixed-id"))[-1] == "CANCEL_REQUESTED"
    assert _drive(env, "fixed-id") == "cancelled"
    assert _types(_events(env, "fixed-id"))[-2:] == ["CANCEL_DELIVERED", "EXECUTION_CANCELLED"]

    code, out = run("start", "cli-gate", "--input", "2", "--execution-id", "forced-id")
    code, out = run("cancel", "forced-id", "--force", "--json")
    assert code == 0, out
    assert json.loads(out) == {"executionId": "forced-id", "cancelled": True, "force": True}
    assert _types(_events(env, "forced-id")) == ["EXECUTION_STARTED", "EXECUTION_CANCELLED"]


def test_dispatch_commands_refuse_bad_arguments_in_one_line(env: Env) -> None:
    code, out = run("start", "cli-gate", "--input", "{not json")
    assert code != 0
    assert "--input is not JSON" in out
    code, out = run("start", "cli-gate", "--tenant", "t1")
    assert code != 0
    assert "--tenant needs --actor" in out
    code, out = run("start", "no-such-flow")
    assert code != 0
    assert "FlowNotFoundError" in out
    assert "Traceback" not in out
    code, out = run("resume", "no-such-execution", "approval")
    assert code != 0
    assert "ExecutionNotFoundError" in out


# -- status ------------------------------------------------------------------------

def test_status_counts_executions_by_state_and_lists_workers(env: Env) -> None:
    for n in range(3):
        code, out = run("start", "cli-gate", "--input", str(n), "--execution-id", f"s-{n}")
        assert code == 0, out
    assert _drive(env, "s-0") == "parked"
    code, out = run("status", "--json", "--inspect-timeout", "0.2")
    assert code == 0, out
    status = json.loads(out)
    assert status["executions"]["running"] == 2
    assert status["executions"]["parked"] == 1
    assert status["executions"]["completed"] == 0
    assert status["workers"] == []  # nobody answers on this broker
    assert status["problems"] == []
    code, out = run("status", "--inspect-timeout", "0.2")
    assert code == 0, out
    assert "executions" in out
    assert "workers (0)" in out


class _Ticks:
    """Stands in for ``time`` in fleet.cli.status: the second wait is a Ctrl-C."""

    localtime = staticmethod(time.localtime)
    strftime = staticmethod(time.strftime)

    def __init__(self) -> None:
        self.waits = 0

    def sleep(self, seconds: float) -> None:
        self.waits += 1
        if self.waits == 2:
            raise KeyboardInterrupt


def test_status_watch_refreshes_until_interrupted(env: Env,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    code, out = run("start", "cli-gate", "--input", "1")  # the store exists
    assert code == 0, out
    monkeypatch.setattr(fleet.cli.status, "time", _Ticks())
    code, out = run("status", "--watch", "--json", "--interval", "0.2",
                    "--inspect-timeout", "0.2")
    assert code == 0, out
    assert [json.loads(line)["workers"] for line in out.splitlines()] == [[], []]
    monkeypatch.setattr(fleet.cli.status, "time", _Ticks())
    code, out = run("status", "--watch", "--interval", "0.2", "--inspect-timeout", "0.2")
    assert code == 0, out
    assert "workers (0)" in out


async def test_every_backend_counts_its_executions_by_state(
        stores: tuple[EventStore, SnapshotStore]) -> None:
    store = stores[0]
    runtime = Runtime(store, flows=[cli_fleet_flows.gate])
    for n in range(3):
        await runtime.start("cli-gate", n, execution_id=f"count-{n}", drive=False)
    await runtime.drive("count-0", wait=True)
    expected = {"running": 2, "parked": 1}
    for reader in (store, CoalescingEventStore(store)):
        counts, capped = await execution_counts(reader)
        assert {k: v for k, v in counts.items() if v} == expected
        assert not capped

    class NoCounts:
        """A store that only lists: the counts are paged."""

        async def list_executions(self, **kwargs: Any) -> Any:
            return await store.list_executions(**kwargs)

    counts, capped = await execution_counts(NoCounts())  # type: ignore[arg-type]
    assert {k: v for k, v in counts.items() if v} == expected


# -- health ------------------------------------------------------------------------

def test_health_liveness_reads_only_the_heartbeat(env: Env) -> None:
    code, out = run("health", "--component", "worker", "--liveness")
    assert code == 1
    assert "unhealthy: worker: heartbeat: no heartbeat at" in out
    path = heartbeat_path(FleetSettings(), "worker")
    Heartbeat(path).beat()
    code, out = run("health", "--component", "worker", "--liveness")
    assert (code, out.startswith("ok: worker: heartbeat:")) == (0, True), out
    # A stale heartbeat: the loop stopped beating (stuck, or the process is gone).
    path.write_text(json.dumps({"pid": 4242, "at": time.time() - 30}))
    code, out = run("health", "--component", "worker", "--liveness", "--max-age", "10")
    assert code == 1
    assert "event loop is stuck or gone" in out
    assert "30." in out
    assert "pid 4242" in out
    assert len(out.strip().splitlines()) == 1
    # The store and broker are not asked: a liveness probe survives their outage.
    code, out = run("health", "--component", "worker", "--liveness", "--max-age", "60",
                    "--json")
    report = json.loads(out)
    assert (code, report["ok"], report["mode"]) == (0, True, "liveness")
    assert [c["name"] for c in report["checks"]] == ["heartbeat"]


def test_health_readiness_fails_on_an_unreachable_broker_or_store(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    Heartbeat(heartbeat_path(FleetSettings(), "timers")).beat()
    monkeypatch.setenv("FLEET_BROKER_URL", "redis://127.0.0.1:1/0")
    code, out = run("health", "--component", "timers", "--timeout", "1")
    assert code == 1
    assert "unhealthy: timers: broker: redis://127.0.0.1:1/0 unreachable" in out
    monkeypatch.setenv("FLEET_DATABASE_URL", f"sqlite:///{env.db.parent / 'missing.db'}")
    code, out = run("health", "--component", "timers", "--timeout", "1", "--json")
    report = json.loads(out)
    assert code == 1
    assert [(c["name"], c["ok"]) for c in report["checks"]] == [
        ("heartbeat", True), ("broker", False), ("store", False)]
    assert "no SQLite database" in report["checks"][2]["detail"]
    # The attacher's broker is Redis streams: without FLEET_REDIS_URL it is not ready.
    Heartbeat(heartbeat_path(FleetSettings(), "attacher")).beat()
    code, out = run("health", "--component", "attacher")
    assert code == 1
    assert "broker: no broker configured" in out


def test_health_checks_every_prefork_child_heartbeat(env: Env) -> None:
    settings = FleetSettings()
    Heartbeat(heartbeat_path(settings, "worker", slot=0)).beat()
    stale = heartbeat_path(settings, "worker", slot=1)
    stale.write_text(json.dumps({"pid": 7, "at": time.time() - 20}))
    check = check_heartbeat(settings, "worker", max_age_s=5)
    assert not check.ok
    assert stale.name in check.detail
    Heartbeat(stale).beat()
    assert check_heartbeat(settings, "worker", max_age_s=5).ok


async def test_a_heartbeat_stops_while_its_loop_is_blocked(tmp_path: Path) -> None:
    settings = FleetSettings(heartbeat_dir=str(tmp_path))
    beat = Heartbeat.for_component(settings, "recovery", interval_s=0.05)
    await beat.start()
    await asyncio.sleep(0.2)
    assert check_heartbeat(settings, "recovery", max_age_s=0.3).ok
    time.sleep(0.6)  # noqa: ASYNC251 - blocks the loop on purpose: a stuck loop
    stuck = check_heartbeat(settings, "recovery", max_age_s=0.3)
    assert not stuck.ok
    assert "stuck or gone" in stuck.detail
    await asyncio.sleep(0.2)
    assert check_heartbeat(settings, "recovery", max_age_s=0.3).ok
    await beat.stop()
    gone = check_heartbeat(settings, "recovery", max_age_s=0.3)
    assert not gone.ok
    assert "no heartbeat" in gone.detail
    assert beat.stats()["beats"] >= 4


# -- flower ------------------------------------------------------------------------

def test_flower_refuses_to_serve_without_authentication(env: Env) -> None:
    code, out = run("flower", "--port", "1")
    assert code == 1
    assert "refuses to serve without authentication" in out
    with pytest.raises(ConfigurationError):
        flower_argv(environ={})
    assert flower_argv(environ={"FLOWER_BASIC_AUTH": "u:p"}, port=5555) == [
        "flower", "--port=5555"]
    assert flower_argv(environ={}, basic_auth="u:p", address="0.0.0.0") == [
        "flower", "--address=0.0.0.0", "--basic-auth=u:p"]
    assert flower_argv(environ={"FLOWER_AUTH": ".*@example.com"}) == ["flower"]
    assert flower_argv(environ={}, unauthenticated=True) == ["flower"]
    assert flower_argv(environ={"FLOWER_UNAUTHENTICATED_API": "true"},
                       extra=["--purge_offline_workers=60"]) == [
        "flower", "--purge_offline_workers=60"]


# -- the process commands parse and call the library ----------------------------------

def test_worker_takes_the_manifest_arguments_and_passes_the_rest_to_celery(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_run_worker(settings: FleetSettings, **kwargs: Any) -> int:
        seen.update(kwargs, settings=settings)
        return 0

    monkeypatch.setattr(fleet.cli.processes, "run_worker", fake_run_worker)
    code, out = run("worker", "--queues", "fleet.drive,heavy", "--concurrency", "64",
                    "--pool", "threads", "-n", "w1@host", "--without-gossip")
    assert code == 0, out
    assert seen["queues"] == ["fleet.drive", "heavy"]
    assert seen["concurrency"] == 64
    assert seen["pool"] == "threads"
    assert seen["hostname"] == "w1@host"
    assert seen["loglevel"] == "INFO"
    assert seen["extra"] == ("--without-gossip",)

    settings = FleetSettings()
    assert worker_argv(settings, concurrency=8, hostname="n@h", extra=["-E"]) == [
        "worker", "--queues", "cli-unit", "--loglevel", "INFO", "--without-mingle",
        "--concurrency", "8", "--hostname", "n@h", "-E"]
    assert worker_settings(settings, concurrency=8).worker_drives == 8
    prefork = worker_settings(settings, pool="prefork", concurrency=4)
    assert (prefork.worker_pool, prefork.worker_drives) == ("prefork", settings.worker_drives)
    with pytest.raises(ConfigurationError):
        worker_settings(settings, pool="gevent")


def test_service_commands_serve_their_component(env: Env,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[str] = []

    async def fake_serve(settings: FleetSettings, component: str) -> dict[str, Any]:
        served.append(component)
        return {}

    monkeypatch.setattr(fleet.assembly.roles, "serve", fake_serve)
    for component in ("timers", "recovery", "attacher"):
        code, out = run(component, "--loglevel", "warning")
        assert code == 0, out
    assert served == ["timers", "recovery", "attacher"]


def _appears(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


async def test_a_service_component_runs_with_a_heartbeat_and_stops_cleanly(
        env: Env) -> None:
    settings = FleetSettings(timer_interval_s=0.05, recovery_interval_s=0.05)
    for component in ("timers", "recovery"):
        path = heartbeat_path(settings, component)
        stop = asyncio.get_running_loop().create_future()

        async def watch(path: Path = path, stop: asyncio.Future[None] = stop) -> None:
            assert await asyncio.to_thread(_appears, path, 5.0)
            await asyncio.sleep(0.2)
            stop.set_result(None)

        watcher = asyncio.ensure_future(watch())
        stats = await asyncio.wait_for(serve(settings, component, until=stop), 10)
        await watcher
        assert stats[component]["ticks"] >= 2
        assert stats["heartbeat"]["beats"] >= 1
        assert not path.exists()  # a stopped process has no heartbeat
    with pytest.raises(ConfigurationError, match="FLEET_REDIS_URL"):
        await open_role(settings, "attacher")
    keyless = settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})
    with pytest.raises(ConfigurationError, match="no producer keys"):
        await open_role(keyless, "attacher")
    with pytest.raises(ConfigurationError, match="unknown service role"):
        await open_role(settings, "worker")


# -- rewards -----------------------------------------------------------------------

def test_reward_submit_refuses_before_it_sends(env: Env, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    args = ["reward", "submit", "--execution", "e1", "--decision", "d1", "--key", "csat:1",
            "--producer", "p1"]
    code, out = run(*args, "--score", "1")
    assert code == 1
    assert "RewardKeyError: FLEET_REWARD_KEYS holds no key for producer 'p1' (it holds: none)" \
        in out
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    code, out = run(*args, "--score", "1", "--key-file", str(empty))
    assert code == 1
    assert f"the reward key file {empty} is empty" in out
    for bad, says in ((["p1"], "got list"), ({"p1": 7}, "secret of producer 'p1' must be"),
                      ({"p1": ""}, "secret of producer 'p1' must be")):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        code, out = run(*args, "--score", "1", "--key-file", str(path))
        assert code == 1
        assert says in out, out
    monkeypatch.setenv("FLEET_REWARD_KEYS", '{"p1": "secret"}')
    monkeypatch.setenv("FLEET_REWARD_KEYS_FILE", str(empty))
    code, out = run(*args, "--score", "1")
    assert code == 1
    assert "not both" in out
    monkeypatch.delenv("FLEET_REWARD_KEYS_FILE")
    code, out = run(*args)
    assert code == 1
    assert "a score, a success flag or both" in out
    for bad, says in ((["--score", "1e12"], "out of range"),
                      (["--score", "1", "--execution", "e\udcff"], "reward refused")):
        code, out = run(*args, *bad)  # what the attacher would refuse is not sent
        assert code == 1
        assert says in out, out
    code, out = run(*args, "--score", "1")
    assert code == 1
    assert "needs FLEET_REDIS_URL" in out  # signed and valid; nowhere to send it
    monkeypatch.setenv("FLEET_REDIS_URL", "redis://127.0.0.1:1/0")
    code, out = run(*args, "--success")
    assert code == 1  # signed and valid, but nothing answers at that port
    assert "the broker did not answer" in out
    assert "Traceback" not in out


# -- hand-back: what a worker does on SIGTERM ---------------------------------------

def _hold_events(key: str) -> None:
    hold_flows.STARTED[key] = threading.Event()
    hold_flows.RELEASE[key] = threading.Event()


async def _until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_a_run_handed_back_stops_at_its_next_durable_point(store: EventStore) -> None:
    key = "hand-back-1"
    _hold_events(key)
    runtime = Runtime(store, flows=[hold_flows.hold], lease_ms=60_000, holder="leaving")
    handle = await runtime.start("unit-hold", key)
    eid = handle.execution_id
    await _until(hold_flows.STARTED[key].is_set)
    assert runtime.hand_back() == 1
    hold_flows.RELEASE[key].set()  # the step finishes; the run stops before the next
    await _until(lambda: runtime.active == 0)
    assert _types(await store.read(eid)) == ["EXECUTION_STARTED", "STEP_STARTED",
                                             "STEP_COMPLETED"]
    outcome = await handle.outcome()
    assert outcome is not None
    assert (runtime.handed_back, runtime.aborted, outcome.kind, outcome.last_sequence) == (
        1, 0, "handed_back", 2)
    # The lease was released: another runtime takes the run at once, and the
    # step that completed is not run again.
    other = Runtime(store, flows=[hold_flows.hold], holder="taker")
    assert await drove(other, eid)
    assert await asyncio.wait_for(other.result(eid), 5) == key
    types = _types(await store.read(eid))
    assert types[3:] == ["RECOVERED", "STEP_STARTED", "STEP_COMPLETED",
                         "EXECUTION_COMPLETED"]
    assert "EFFECT_INDOUBT" not in types
    # A drive started after hand_back stops at its first new work.
    late = (await runtime.start("unit-hold", "late", execution_id="late")).execution_id
    await _until(lambda: runtime.active == 0)
    assert _types(await store.read(late)) == ["EXECUTION_STARTED"]
    assert runtime.handed_back == 2


async def test_hand_back_now_cuts_a_long_step_and_releases_the_lease(
        store: EventStore) -> None:
    key = "hand-back-2"
    _hold_events(key)
    runtime = Runtime(store, flows=[hold_flows.hold], lease_ms=60_000, holder="leaving")
    eid = (await runtime.start("unit-hold", key)).execution_id
    await _until(hold_flows.STARTED[key].is_set)
    runtime.hand_back()
    assert runtime.hand_back_now() == 1
    await _until(lambda: runtime.active == 0)
    assert _types(await store.read(eid)) == ["EXECUTION_STARTED", "STEP_STARTED"]
    assert (runtime.handed_back, runtime.aborted) == (1, 0)
    hold_flows.RELEASE[key].set()
    other = Runtime(store, flows=[hold_flows.hold], holder="taker")
    assert await drove(other, eid)  # no waiting for a 60 s lease
    assert await asyncio.wait_for(other.result(eid), 5) == key
    types = _types(await store.read(eid))
    assert types[2:5] == ["RECOVERED", "EFFECT_INDOUBT", "STEP_STARTED"]


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[WorkerProcess]:
    process = WorkerProcess(FleetSettings(
        database_url="memory:", broker_url="memory://", lease_ms=60_000,
        flows=["worker_unit_flows:hold"], heartbeat_dir=str(tmp_path), worker_drain_s=5))
    process.open()
    try:
        yield process
    finally:
        process.close()


def test_a_draining_worker_hands_its_drives_back(worker: WorkerProcess) -> None:
    assert heartbeat_path(worker.settings, "worker").exists()
    key, cut = "drain-1", "drain-2"
    _hold_events(key)
    _hold_events(cut)
    start = worker.runtime.start
    first = worker.loop.run_coroutine(start("unit-hold", key, drive=False)).execution_id
    second = worker.loop.run_coroutine(start("unit-hold", cut, drive=False)).execution_id
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(worker.drive, first)
        assert hold_flows.STARTED[key].wait(5)
        worker.begin_drain()
        hold_flows.RELEASE[key].set()
        assert running.result(5) == "handed_back"
    # Draining: a delivery is handed on without taking the fence.
    assert worker.drive(second) == "handed_back"
    store = worker.runtime.store
    tip = worker.loop.run_coroutine(store.get_execution(second))
    assert tip is not None
    assert tip.holder is None
    events = worker.loop.run_coroutine(store.read(first))
    assert events[-1].type is EventType.STEP_COMPLETED
    stats = worker.snapshot()
    assert (stats["handed_back"], stats["deliveries"], stats["aborted"]) == (2, 2, 0)


def test_the_drain_deadline_cuts_what_is_still_running(worker: WorkerProcess) -> None:
    key = "drain-3"
    _hold_events(key)
    eid = worker.loop.run_coroutine(worker.runtime.start("unit-hold", key,
                                                         drive=False)).execution_id
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(worker.drive, eid)
        assert hold_flows.STARTED[key].wait(5)
        begun = time.monotonic()
        worker.begin_drain(deadline_s=0.2)
        assert running.result(5) == "handed_back"
        assert time.monotonic() - begun < 2
    hold_flows.RELEASE[key].set()
    store = worker.runtime.store
    grant = worker.loop.run_coroutine(store.acquire_fence_if(eid, holder="taker",
                                                             lease_ms=1000))
    assert grant is not None  # released at once, not after the 60 s lease
