"""Leases on the store's clock, bounded (issue 25 items 8 and 9; decision 0044).

Before schema 7 a lease's expiry was computed and judged on the clock of whoever took
or checked it: with workers' clocks 2 s apart, 4 of 200 executions ran an effect twice
(item 9), and an expiry set far ahead by a skewed or forged clock was honoured until
that time came, so nobody could take the run (item 8). Now Postgres sets and judges
every lease with its own clock (``fleet_now_ms()``), and an expiry further out than the
store's ``max_lease_ms`` is taken over.

Against a real Postgres server (its own clock, never a test's), and a fleet of real
``fleet worker`` / ``fleet recovery`` processes whose wall clocks run an hour apart.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import redis
from fleet_procs_kit import Proc, StoreView, nodename, process_env, stop_all, until, wait_ready
from lease_clock_flows import ALL
from redis_server import url_with_db

from fleet import Context, Principal, Runtime, flow
from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.store.conformance import make_event, started
from fleet.kernel.store.postgres import PostgresEventStore
from fleet.kernel.store.spi import AcquiringAppend, append_acquiring
from fleet.services.counters import PREFIX as COUNTERS_PREFIX
from fleet.workers import make_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

HOUR = 3_600_000
LEASE = 3_000
REDIS_DB = 11


def skew_clock(monkeypatch: pytest.MonkeyPatch, ms: int) -> None:
    """This process's wall clock ``ms`` off the real one (as ``skewed_clock`` does)."""
    real_ns, real = time.time_ns, time.time
    monkeypatch.setattr(time, "time_ns", lambda: real_ns() + ms * 1_000_000)
    monkeypatch.setattr(time, "time", lambda: real() + ms / 1000)


@pytest.fixture
async def pg(database_url: str) -> AsyncIterator[tuple[PostgresEventStore, asyncpg.Connection]]:
    store = await PostgresEventStore(database_url, schema=f"lc_{secrets.token_hex(5)}",
                                     pool_max=2).open()
    raw = await asyncpg.connect(database_url,
                                server_settings={"search_path": f'"{store.schema}"'})
    try:
        yield store, raw
    finally:
        await raw.close()
        await store.close()


async def server_now(raw: asyncpg.Connection) -> int:
    return int(await raw.fetchval("SELECT fleet_now_ms()"))


async def test_leases_are_set_and_judged_on_the_servers_clock_whatever_the_callers(
        pg: tuple[PostgresEventStore, asyncpg.Connection],
        monkeypatch: pytest.MonkeyPatch) -> None:
    store, raw = pg
    await store.append(started("held"))
    before = await server_now(raw)
    held = await store.acquire_fence("held", holder="worker", lease_ms=LEASE)
    assert before + LEASE <= held.lease_expires_at <= await server_now(raw) + LEASE
    for skew in (HOUR, -HOUR):  # a worker whose clock runs an hour fast, then slow
        skew_clock(monkeypatch, skew)
        # It cannot take the live lease (fast: it used to see it long expired) ...
        assert await store.acquire_fence_if("held", holder="skewed", lease_ms=LEASE) is None
        assert await append_acquiring(store, [make_event("held", 1)], holder="skewed",
                                      lease_ms=LEASE) is None
        answers = await store.append_many_leased(
            [AcquiringAppend([make_event("held", 1)], "skewed", LEASE),
             AcquiringAppend([started(f"other{skew}")], "skewed", LEASE)])
        assert answers[0] is None
        # ... and what it takes lasts LEASE on the server's clock (slow: it used to be
        # expired on arrival; fast: an hour too long).
        other = answers[1]
        assert other is not None
        assert not isinstance(other, BaseException)
        mine = f"free{skew}"
        before = await server_now(raw)
        grant = await store.acquire_fence_if(mine, holder="skewed", lease_ms=LEASE)
        assert grant is not None
        assert await store.renew_lease(mine, grant.token, lease_ms=LEASE)
        row = await store.get_execution(f"other{skew}")
        after = await server_now(raw)
        assert before + LEASE <= grant.lease_expires_at <= after + LEASE
        assert other.lease_expires_at <= after + LEASE
        assert row is not None
        assert row.lease_expires_at == other.lease_expires_at
        tip = (await store.append_if_unchanged(mine, None)).tip
        assert tip.lease_expires_at is not None
        assert before + LEASE <= tip.lease_expires_at <= after + LEASE  # the renewal too
        monkeypatch.undo()
    assert await store.head("held") == 0  # nothing written past the live lease
    assert (await store.get_execution("held")).holder == "worker"  # type: ignore[union-attr]


@flow("pinned", version=1, steps=["work"])
async def pinned(ctx: Context, n: int) -> int:
    return int(await ctx.step("work", lambda: n + 1))


async def test_a_lease_set_an_hour_ahead_is_taken_over_by_recovery(
        pg: tuple[PostgresEventStore, asyncpg.Connection]) -> None:
    """Item 8: a running execution whose lease a clock an hour fast wrote (through the
    schema-6 function a process of the previous release still calls), and one whose
    row was forged ten years ahead: the sweeper re-drives both; one with a live lease
    stays alone."""
    store, raw = pg
    runtime = Runtime(store, flows=[pinned], lease_ms=LEASE)
    owner = Principal("ops").to_owner()
    for x in ("fast-clock", "forged", "live"):
        await store.append(EventEnvelope.make(x, 0, EventType.EXECUTION_STARTED, time.time_ns()
                                              // 1_000_000, {
            "flowId": "pinned", "flowVersion": 1, "input": 1, "owner": owner,
            "flowHash": pinned.content_hash(runtime.features)}))
    await raw.execute("SELECT fleet_acquire(fleet_key('fast-clock'), 'old-release', "
                      "fleet_now_ms() + $1, NULL)", HOUR + LEASE)
    forged = await store.acquire_fence("forged", holder="mallory", lease_ms=LEASE)
    await raw.execute("UPDATE fences SET lease_expires_at = fleet_now_ms() + $1 "
                      "WHERE ekey = fleet_key('forged')", 10 * 365 * 24 * HOUR)
    live = await store.acquire_fence("live", holder="worker", lease_ms=60_000)
    try:
        report = await runtime.recover_abandoned()
        assert report.recovered == 2, report
        for x in ("fast-clock", "forged"):
            assert await runtime.result(x) == 2
            row = await store.get_execution(x)
            assert row is not None
            assert (row.status, row.holder) == ("completed", None), row
        row = await store.get_execution("live")
        assert row is not None
        assert (row.status, row.fence, row.holder) == ("running", live.token, "worker")
        assert await store.head("live") == 0
        # The forged holder is fenced out.
        assert await store.renew_lease("forged", forged.token, lease_ms=LEASE) is False
    finally:
        await runtime.close()


# ---------------------------------------------------------------------------------------
# A fleet whose processes' clocks run an hour apart
# ---------------------------------------------------------------------------------------

@dataclass
class ClockFleet:
    env: dict[str, str]
    settings: FleetSettings
    app: Any
    store: StoreView
    effects: Path
    log_dir: Path
    token: str
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, args: list[str], skew_ms: int = 0) -> Proc:
        env = dict(self.env)
        env["FLEET_HEARTBEAT_DIR"] = str(self.log_dir / "heartbeats" / name)
        env["FLEET_TEST_WORKER_NAME"] = name
        node = nodename(name, self.token) if args[0] == "worker" else None
        if node is not None:
            args = [*args, "-n", node, "--concurrency", "8", "--without-mingle",
                    "--without-gossip"]
        proc = Proc(name, args, env, self.log_dir, node, skew_ms=skew_ms)
        self.procs.append(proc)
        if skew_ms:  # its control replies are judged on its clock: wait for its heartbeat
            until(lambda: proc.beats() or not proc.alive(), f"{name} to beat", 60)
            if not proc.alive():
                raise proc.exited()
        else:
            wait_ready(proc, self.app)
        return proc

    def run_flows(self, n: int, hold: float) -> list[str]:
        async def starts() -> list[str]:
            async with Dispatcher(self.settings) as dispatcher:
                return [await dispatcher.start("clock-effect", {
                    "dir": str(self.effects), "hold": hold}) for _ in range(n)]
        return asyncio.run(starts())

    def effects_of(self, execution_id: str) -> list[str]:
        path = self.effects / execution_id
        return path.read_text().split() if path.exists() else []

    def role_counter(self, role: str, name: str) -> int:
        """``name`` summed over every report of ``role`` (the recovery sweeper's)."""
        client = redis.Redis.from_url(self.settings.broker, decode_responses=True)
        try:
            return sum(int(json.loads(client.hget(key, "counters") or "{}").get(name, 0))
                       for key in client.scan_iter(f"{COUNTERS_PREFIX}{role}:*"))
        finally:
            client.close()

    def counter(self, proc: Proc, name: str) -> int:
        client = redis.Redis.from_url(self.settings.broker, decode_responses=True)
        try:
            report = client.hget(f"{COUNTERS_PREFIX}worker:{proc.nodename}", "counters")
            return int(json.loads(report or "{}").get(name, 0))
        finally:
            client.close()


@pytest.fixture
def clock_fleet(tmp_path: Path, database_url: str) -> Iterator[ClockFleet]:
    token = secrets.token_hex(3)
    queue = f"lc-{token}"
    broker = url_with_db(REDIS_DB)
    effects = tmp_path / "effects"
    effects.mkdir()
    env = process_env({
        "FLEET_DATABASE_URL": database_url, "FLEET_BROKER_URL": broker,
        "FLEET_REDIS_URL": broker, "FLEET_QUEUE": queue, "FLEET_FLOWS": ALL,
        "FLEET_ROUTES": json.dumps({}), "FLEET_LEASE_MS": str(LEASE),
        "FLEET_RECOVERY_GRACE_MS": "500", "FLEET_RECOVERY_INTERVAL_S": "0.5",
        "FLEET_STATS_INTERVAL_S": "0.5"})
    settings = FleetSettings(database_url=database_url, broker_url=broker, queue=queue,
                             flows=[ALL], lease_ms=LEASE)
    app = make_app(settings)
    view = StoreView(settings)
    fleet = ClockFleet(env, settings, app, view, effects, tmp_path, token)
    try:
        yield fleet
    finally:
        stop_all(fleet.procs)
        view.close()
        client = redis.Redis.from_url(broker)
        client.delete(queue)
        client.close()


def test_workers_and_a_sweeper_an_hour_apart_never_run_an_effect_twice_nor_pin_a_run(
        clock_fleet: ClockFleet) -> None:
    fleet = clock_fleet
    on_time = fleet.start("on-time", ["worker", "--queues", fleet.settings.queue])
    fast = fleet.start("fast", ["worker", "--queues", fleet.settings.queue], skew_ms=HOUR)
    fleet.start("recovery", ["recovery"], skew_ms=HOUR)

    # Item 9. The sweeper's clock says every lease expired an hour ago: before, it sent
    # each running execution's drive again and again while its step held, and the fast
    # worker that got one judged the holder's lease on its own clock and ran the effect
    # again. Now a drive a live worker holds is left alone (decision 0048), and one sent
    # again anyway is stepped aside on the server's clock (decision 0044).
    ids = fleet.run_flows(12, hold=4.0)
    for execution_id in ids:
        fleet.store.until(execution_id, "completed", timeout=120)
    ran = {execution_id: fleet.effects_of(execution_id) for execution_id in ids}
    assert all(len(workers) == 1 for workers in ran.values()), ran
    until(lambda: fleet.counter(on_time, "stepped_aside") + fleet.counter(
        fast, "stepped_aside") + fleet.role_counter("recovery", "held") > 0,
          "the sweeper's re-drives to be held off or stepped aside", 30)

    # Item 8. The fast worker takes runs alone and dies mid-step: the leases it leaves
    # end LEASE after its last renewal on the server's clock, not an hour later.
    on_time.stop()
    pinned = fleet.run_flows(3, hold=120.0)
    until(lambda: all(fleet.effects_of(x) == ["fast"] for x in pinned),
          "the fast worker to run every effect", 60)
    fast.signal(9)
    fast.wait_exit(10)
    fleet.start("on-time-2", ["worker", "--queues", fleet.settings.queue])
    for execution_id in pinned:
        fleet.store.until(execution_id, "completed", timeout=90)
        # At least once across a crash: the dead worker's attempt and the recovery's.
        assert fleet.effects_of(execution_id) == ["fast", "on-time-2"]
