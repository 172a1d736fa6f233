"""A broker that accepts connections and never answers, or refuses them (issue 10, items 4, 12).

The broker is a real TCP server that accepts and stays silent (``blackhole.BlackHole``),
or a real port nobody listens on; the store is a real Postgres database. On
the main branch before this change ``fleet start`` and ``fleet status`` hung
(500 s and more), async ``Dispatcher.start`` never returned, ``fleet recovery``
wedged with its liveness ``ok`` and ignored SIGTERM, and ``fleet start`` with
the broker refused exited 0 with nothing enqueued.

Each test measures how long the fault took to surface and prints it (the
report quotes them); the bounds asserted are the deadlines' sums with a wide
margin for this shared machine, not speed targets.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from blackhole import BlackHole
from fleet_worker_kit import HERE, ROOT

from fleet import BrokerUnavailableError, Runtime
from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher
from fleet.host.kernel import open_store
from fleet.kernel.flows import load_flows

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

FLOWS = "fleet_flows:three,fleet_flows:gate"


@pytest.fixture
def hole() -> Iterator[BlackHole]:
    with BlackHole() as server:
        yield server


def refused_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def env_for(database_url: str, broker_url: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update({"FLEET_DATABASE_URL": database_url, "FLEET_BROKER_URL": broker_url,
                "FLEET_FLOWS": FLOWS, "FLEET_HEARTBEAT_DIR": str(tmp_path / "hb"),
                "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])})
    env.update(extra)
    return env


def fleet(*args: str) -> list[str]:
    return [sys.executable, "-m", "fleet.cli", *args]


async def status_of(database_url: str, execution_id: str) -> str | None:
    store = open_store(FleetSettings(database_url=database_url))
    try:
        summary = await store.get_execution(execution_id)
        return None if summary is None else summary.status
    finally:
        await store.close()


def test_fleet_start_prints_the_id_at_once_and_fails_by_the_deadline(
        database_url: str, hole: BlackHole, tmp_path: Path) -> None:
    """Default deadlines (what a user gets): the id as soon as it is written, exit 3."""
    began = time.monotonic()
    proc = subprocess.Popen(fleet("start", "fleet-three", "--input", "1"),
                            env=env_for(database_url, hole.url(), tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    printed = time.monotonic() - began
    assert proc.poll() is None  # the id came while the broker was still being asked
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - began
    print(f"fleet start vs a silent broker: id after {printed:.1f} s, exit {proc.returncode} "
          f"after {took:.1f} s")
    assert proc.returncode == 3, err
    assert out == ""
    assert f"execution {line} is written, but its drive was not enqueued" in err
    assert "no answer within 10 s" in err
    assert "recovery sweeper" in err
    assert "Traceback" not in err
    assert took < 40
    assert hole.accepted >= 1
    assert asyncio.run(status_of(database_url, line)) == "running"  # the write stands


def test_fleet_start_resume_and_send_with_the_broker_refused_exit_3(
        database_url: str, tmp_path: Path) -> None:
    """Issue 10 item 12: the write stands, the command says so, and exits non-zero."""
    env = env_for(database_url, refused_url(), tmp_path)
    started = subprocess.run(fleet("start", "fleet-gate", "--input", "1", "--json"), env=env,
                             capture_output=True, text=True, timeout=60)
    assert started.returncode == 3, started.stderr
    assert '"enqueued": false' in started.stdout
    eid = started.stdout.split('"executionId": "')[1].split('"')[0]
    assert "is written, but its drive was not enqueued" in started.stderr
    assert "Connection" in started.stderr
    assert asyncio.run(status_of(database_url, eid)) == "running"

    async def park() -> None:  # what a worker would do once the broker is back
        settings = FleetSettings(database_url=database_url, flows=FLOWS.split(","))
        store = open_store(settings)
        try:
            runtime = Runtime(store, flows=load_flows(settings.flows))
            await runtime.drive(eid, wait=True)
        finally:
            await store.close()

    asyncio.run(park())
    resumed = subprocess.run(fleet("resume", eid, "approval", "--payload", "true"), env=env,
                             capture_output=True, text=True, timeout=60)
    assert resumed.returncode == 3, resumed.stderr
    assert f"the answer to 'approval' of {eid} is written" in resumed.stderr
    assert asyncio.run(status_of(database_url, eid)) == "running"


def test_fleet_status_reports_a_silent_broker_within_its_deadline(
        database_url: str, hole: BlackHole, tmp_path: Path) -> None:
    began = time.monotonic()
    proc = subprocess.run(fleet("status", "--json"), capture_output=True, text=True,
                          env=env_for(database_url, hole.url(), tmp_path), timeout=60)
    took = time.monotonic() - began
    print(f"fleet status vs a silent broker: exit {proc.returncode} after {took:.1f} s")
    assert proc.returncode == 1, proc.stderr
    assert '"problems": ["broker: ' in proc.stdout
    assert '"executions": {' in proc.stdout  # the store part is still reported
    assert took < 40


async def test_the_dispatcher_async_and_sync_against_a_silent_broker(
        database_url: str, hole: BlackHole) -> None:
    settings = FleetSettings(database_url=database_url, broker_url=hole.url(),
                             flows=FLOWS.split(","), publish_timeout_s=2.0)
    async with Dispatcher(settings) as dispatcher:
        began = time.monotonic()
        eid = await asyncio.wait_for(dispatcher.start("fleet-three", 1), 30)
        took = time.monotonic() - began
        assert dispatcher.enqueue_failed == 1
        assert await status_of(database_url, eid) == "running"
        with pytest.raises(BrokerUnavailableError, match="no answer within 2 s") as info:
            await asyncio.wait_for(dispatcher.enqueue_drive(eid), 30)
        assert info.value.retryable
    print(f"async Dispatcher.start vs a silent broker: returned after {took:.1f} s")
    assert took < 20

    def sync() -> tuple[str, float]:
        with Dispatcher(settings) as twin:
            began = time.monotonic()
            eid = twin.start_sync("fleet-three", 2)
            spent = time.monotonic() - began
            with pytest.raises(BrokerUnavailableError):
                twin.enqueue_drive_sync(eid)
            assert twin.enqueue_failed == 1
            return eid, spent

    eid, took = await asyncio.wait_for(asyncio.to_thread(sync), 60)
    print(f"Dispatcher.start_sync vs a silent broker: returned after {took:.1f} s")
    assert await status_of(database_url, eid) == "running"


def test_fleet_recovery_goes_not_live_and_honours_sigterm_when_the_broker_is_silent(
        database_url: str, hole: BlackHole, tmp_path: Path) -> None:
    """A tick wedged past its deadline fails liveness; SIGTERM ends the process in time."""

    async def lose_one() -> str:  # a start whose drive was never enqueued
        settings = FleetSettings(database_url=database_url, flows=FLOWS.split(","))
        store = open_store(settings)
        try:
            runtime = Runtime(store, flows=load_flows(settings.flows))
            return (await runtime.start("fleet-three", 7, drive=False)).execution_id
        finally:
            await store.close()

    asyncio.run(lose_one())
    env = env_for(database_url, hole.url(), tmp_path, FLEET_RECOVERY_GRACE_MS="0",
                  FLEET_RECOVERY_INTERVAL_S="0.2", FLEET_PUBLISH_TIMEOUT_S="30",
                  FLEET_SERVICE_TICK_DEADLINE_S="1", FLEET_SERVICE_STOP_S="2")
    log = tmp_path / "recovery.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(fleet("recovery"), env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        liveness = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            liveness = subprocess.run(fleet("health", "--component", "recovery", "--liveness"),
                                      env=env, capture_output=True, text=True, timeout=30)
            if liveness.returncode != 0 and "not live" in liveness.stdout + liveness.stderr:
                break
            time.sleep(0.5)
        assert liveness is not None
        assert liveness.returncode != 0, liveness.stdout
        assert "recovery: a tick has run for" in liveness.stdout + liveness.stderr
        assert proc.poll() is None
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        took = time.monotonic() - began
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text(errors="replace")
    print(f"fleet recovery vs a silent broker: SIGTERM honoured in {took:.1f} s "
          f"(FLEET_SERVICE_STOP_S=2)")
    assert code == 0, text[-3000:]
    assert took < 15, text[-3000:]
    assert "cut_short" in text  # the stats it logged on the way out
    assert "Traceback" not in text, text[-3000:]
