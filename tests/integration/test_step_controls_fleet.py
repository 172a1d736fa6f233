"""Step controls on the fleet (issue 27 item 4; decisions 0053, 0054): real ``celery
worker`` processes (threads pool, one event loop each), Postgres, Redis.

- A blocking step does not delay other runs on the same worker: its sync function
  runs in a thread, so a second execution starts, runs and completes on that worker
  while the first one's step is still blocked.
- A step over its timeout is retried and then fails with ``StepTimeoutError``; the
  sync function is abandoned in its thread and nothing of it is recorded.
- A heartbeat step whose worker is SIGKILLed is retried on another worker once its
  heartbeat is late (its lease was held to the 2 s heartbeat timeout), long before the
  worker's 120 s lease would have expired, and the retry reads the last details.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fleet_worker_kit import WorkerProcess, fleet_env, start_workers
from redis_server import url_with_db
from step_control_flows import ALL, HEARTBEAT

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher
from fleet.kernel.events import EventEnvelope, wall_clock_ms
from fleet.kernel.runtime import Runtime
from fleet.recovery import RecoverySweeper
from fleet.workers import make_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REDIS_DB = 11  # shared with other modules; queues and node names are random per run
LONG_LEASE_MS = 120_000  # what a dead worker's execution would wait without heartbeats


@dataclass
class Fleet:
    settings: FleetSettings
    env: dict[str, str]
    app: Any
    dispatcher: Dispatcher
    runtime: Runtime
    log_dir: Path

    def workers(self, *names: str) -> list[WorkerProcess]:
        return start_workers([(name, [self.settings.queue]) for name in names], self.env,
                             self.log_dir, self.app)

    async def read(self, execution_id: str) -> list[EventEnvelope]:
        return list(await self.runtime.store.read(execution_id))

    async def until(self, execution_id: str, statuses: set[str],
                    timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            state = await self.runtime.load_state(execution_id, system=True)
            if state.status in statuses:
                return str(state.status)
            if time.monotonic() > deadline:
                kinds = [str(e.type) for e in await self.read(execution_id)]
                raise AssertionError(f"{execution_id} is {state.status}, not {statuses}, "
                                     f"after {timeout} s: {kinds}")
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def fleet_of(database_url: str, log_dir: Path, *,
                   lease_ms: int = 1500) -> AsyncIterator[Fleet]:
    queue = f"fleet-steps-{secrets.token_hex(3)}"
    broker = url_with_db(REDIS_DB)
    settings = FleetSettings(database_url=database_url, broker_url=broker, queue=queue,
                             routes={}, flows=ALL.split(","), lease_ms=lease_ms)
    env = fleet_env(database_url=database_url, broker_url=broker, queue=queue, flows=ALL,
                    lease_ms=lease_ms, worker_drives=8,
                    extra={"FLEET_HEARTBEAT_DIR": str(log_dir)})
    app = make_app(settings, main="fleet-steps-test")
    dispatcher = Dispatcher(settings)
    try:
        runtime = await dispatcher.runtime()
        yield Fleet(settings, env, app, dispatcher, runtime, log_dir)
    finally:
        await dispatcher.aclose()
        app.close()


def _of(log: list[EventEnvelope], kind: str) -> list[EventEnvelope]:
    return [e for e in log if str(e.type) == kind]


def _wait_for(path: Path, timeout: float = 60.0) -> str:
    """The text of ``path`` once a step wrote it (run off the loop)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)
    return path.read_text()


async def _exists(path: Path, timeout: float = 60.0) -> str:
    return await asyncio.to_thread(_wait_for, path, timeout)


async def test_a_blocking_step_does_not_delay_other_runs_on_the_same_worker(
        database_url: str, tmp_path: Path) -> None:
    async with fleet_of(database_url, tmp_path) as fleet:
        (worker,) = await asyncio.to_thread(fleet.workers, "w1")  # the only worker
        try:
            blocked = await fleet.dispatcher.start("sc-block", str(tmp_path))
            entered = await _exists(tmp_path / "entered")
            # The second run is started, driven and completed while the first one's
            # step blocks (a sync step on the loop would hold it until the release).
            quick = await fleet.dispatcher.start("sc-quick", 41)
            await fleet.until(quick, {"completed"}, timeout=60)
            assert not await asyncio.to_thread((tmp_path / "release").exists)
            log = await fleet.read(blocked)
            assert [str(e.type) for e in log] == ["EXECUTION_STARTED", "STEP_STARTED"]
            quick_out = (await fleet.runtime.load_state(quick, system=True)).output
            assert quick_out["n"] == 42
            # The same worker process ran both.
            assert entered.split() == ["w1", str(quick_out["pid"])]
            assert quick_out["worker"] == "w1"

            await asyncio.to_thread((tmp_path / "release").write_text, "go")
            await fleet.until(blocked, {"completed"}, timeout=60)
            out = (await fleet.runtime.load_state(blocked, system=True)).output
            assert out == {"worker": "w1", "pid": quick_out["pid"]}
        finally:
            await asyncio.to_thread(worker.stop)


async def test_a_step_over_its_timeout_is_retried_then_fails_with_step_timeout_error(
        database_url: str, tmp_path: Path) -> None:
    async with fleet_of(database_url, tmp_path) as fleet:
        (worker,) = await asyncio.to_thread(fleet.workers, "w1")
        try:
            eid = await fleet.dispatcher.start("sc-timeout", 3.0)  # sleeps 3 s; limit 0.5 s
            assert await fleet.until(eid, {"completed", "failed"}) == "failed"
            log = await fleet.read(eid)
            assert [str(e.type) for e in log] == [
                "EXECUTION_STARTED", "STEP_STARTED", "STEP_FAILED", "STEP_STARTED",
                "STEP_FAILED", "EXECUTION_FAILED"]
            failed = _of(log, "STEP_FAILED")
            assert [(e.payload["attempt"], e.payload["final"]) for e in failed] == [
                (1, False), (2, True)]
            assert {e.payload["error"]["type"] for e in failed} == {"StepTimeoutError"}
            end = log[-1].payload["error"]
            assert (end["type"], end["code"]) == ("StepTimeoutError", "step_timeout")
            # The abandoned sleeps end in their threads (3 s): nothing more is written.
            await asyncio.sleep(3.5)
            assert len(await fleet.read(eid)) == len(log)
            assert worker.alive()
        finally:
            await asyncio.to_thread(worker.stop)


async def test_a_killed_workers_heartbeat_step_is_retried_after_its_heartbeat_timeout(
        database_url: str, tmp_path: Path) -> None:
    async with fleet_of(database_url, tmp_path, lease_ms=LONG_LEASE_MS) as fleet:
        (first,) = await asyncio.to_thread(fleet.workers, "w1")
        others: list[WorkerProcess] = []
        sweeper = RecoverySweeper(fleet.runtime, enqueue=fleet.dispatcher.enqueue_drive,
                                  interval_s=0.5, grace_ms=1000)
        try:
            eid = await fleet.dispatcher.start("sc-export", str(tmp_path))
            assert (await _exists(tmp_path / "first")).startswith("w1 ")
            deadline = time.monotonic() + 60
            while len(_of(await fleet.read(eid), "STEP_HEARTBEAT")) < 2:
                assert time.monotonic() < deadline, "no heartbeat details were recorded"
                await asyncio.sleep(0.1)

            await asyncio.to_thread(first.kill)  # SIGKILL mid-step
            killed_at = wall_clock_ms()
            # The dead worker's lease was held to the heartbeat timeout, not its 120 s.
            row = await fleet.runtime.store.get_execution(eid)
            assert row is not None
            assert row.lease_expires_at is not None
            assert row.lease_expires_at <= killed_at + HEARTBEAT.total_seconds() * 1000 + 1000
            before = await fleet.read(eid)
            recorded = _of(before, "STEP_HEARTBEAT")[-1].payload

            others = await asyncio.to_thread(fleet.workers, "w2")
            await sweeper.start()
            assert await fleet.until(eid, {"completed", "failed"}, timeout=90) == "completed"
        finally:
            await sweeper.stop()
            for worker in others:
                await asyncio.to_thread(worker.stop)
        log = await fleet.read(eid)
        out = (await fleet.runtime.load_state(eid, system=True)).output
        assert out == {"attempt": 2, "last": recorded["details"], "worker": "w2"}
        assert recorded["attempt"] == 1
        kinds = [str(e.type) for e in log[len(before):]]
        assert kinds == ["RECOVERED", "EFFECT_INDOUBT", "STEP_STARTED", "STEP_COMPLETED",
                         "EXECUTION_COMPLETED"]
        retried = _of(log, "STEP_STARTED")[-1]
        assert retried.payload["attempt"] == 2
        # Long before the 120 s lease would have let anyone take the execution.
        assert retried.timestamp - killed_at < LONG_LEASE_MS / 2
        print(f"heartbeat {HEARTBEAT}: retried {retried.timestamp - killed_at} ms after "
              f"the SIGKILL (lease {LONG_LEASE_MS} ms)")
