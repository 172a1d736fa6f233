"""Two ``fleet timers`` processes on one Postgres fire every due timer exactly once
(issue 28 item 2, decision 0048).

Both replicas poll the same store; each tick claims a batch with ``FOR UPDATE SKIP
LOCKED`` (``fleet_claim_timers``), appends the ``TIMER_FIRED``s under the claimed
fences and publishes the drives. The test parks executions on timers that fall due
at one instant while both replicas run, then reads what they did: every log holds
one ``TIMER_FIRED``, the queue holds one drive per execution, and the replicas'
own counters (reported to Redis, read from there) add up to the number of timers.
Nothing consumes the queue: the drives are counted, not run.

How fast they do it is measured in ``bench/timers.py``, not here.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fleet_procs_kit import Proc, process_env, stop_all, until, wait_ready
from postgres_server import run_async, throwaway_database
from redis_server import url_with_db
from timer_flows import timer_nap

from fleet import PostgresEventStore, Runtime
from fleet.kernel.events import EventType
from fleet.services.counters import PREFIX as COUNTERS_PREFIX

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REDIS_DB = 15
N = 400          # timers due at one instant
BATCH = "25"     # small batches: many claims, so the replicas meet often


def _drive_ids(client: redis.Redis, queue: str) -> list[str]:
    """Every execution id the drive messages on ``queue`` carry (``fleet.drive`` and
    ``fleet.drives`` alike), read from kombu's envelopes on the list."""
    ids: list[str] = []
    for raw in client.lrange(queue, 0, -1):
        envelope = json.loads(raw)
        args, _kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
        first = args[0]
        ids.extend(first if isinstance(first, list) else [first])
    return ids


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[str, str, list[Proc]]]:
    token = secrets.token_hex(3)
    queue = f"tr-{token}"
    broker = url_with_db(REDIS_DB)
    with throwaway_database() as database_url:
        env = process_env({"FLEET_DATABASE_URL": database_url, "FLEET_BROKER_URL": broker,
                           "FLEET_REDIS_URL": broker, "FLEET_QUEUE": queue,
                           "FLEET_FLOWS": "timer_flows:timer_nap", "FLEET_TIMER_INTERVAL_S": "0.05",
                           "FLEET_TIMER_BATCH": BATCH, "FLEET_STATS_INTERVAL_S": "0.2"})
        procs = []
        for n in range(2):
            beats = tmp_path / f"timers-{n}"
            procs.append(Proc(f"timers-{n}", ["timers"],
                              {**env, "FLEET_HEARTBEAT_DIR": str(beats)}, tmp_path))
        try:
            for proc in procs:
                wait_ready(proc)
            yield database_url, queue, procs
        finally:
            stop_all(procs)
            client = redis.Redis.from_url(broker)
            client.delete(queue)
            client.close()


def _park(database_url: str, due_at: float) -> list[str]:
    """N executions parked on timers due at ``due_at`` (started here, driven to the park)."""
    async def go() -> list[str]:
        store = PostgresEventStore(database_url, pool_max=8)
        runtime = Runtime(store, flows=[timer_nap], local_timers=False, inline_sleep_max=0)
        try:
            ids: list[str] = []
            for first in range(0, N, 50):
                handles = await asyncio.gather(*(runtime.start("timer-nap", due_at)
                                                 for _ in range(first, min(N, first + 50))))
                ids.extend(h.execution_id for h in handles)
            for execution_id in ids:
                summary = await store.get_execution(execution_id)
                assert summary is not None
                assert (summary.status, summary.waiting_on) == ("parked", "sleep#0")
            return ids
        finally:
            await runtime.close()
            await store.close()
    return run_async(go)


def _fired_counts(database_url: str, ids: list[str]) -> Counter[str]:
    async def go() -> Counter[str]:
        store = PostgresEventStore(database_url, pool_max=4)
        try:
            counts: Counter[str] = Counter()
            for execution_id in ids:
                events = await store.read(execution_id)
                counts[execution_id] = sum(e.type is EventType.TIMER_FIRED for e in events)
            return counts
        finally:
            await store.close()
    return run_async(go)


def _reported(client: redis.Redis, procs: list[Proc]) -> dict[int, dict[str, float]]:
    """Each replica's counters, as it reported them to Redis (decision 0022)."""
    out: dict[int, dict[str, float]] = {}
    for key in client.zrange(f"{COUNTERS_PREFIX}index", 0, -1):
        report = client.hgetall(key)
        if report.get(b"role") == b"timers":
            pid = int(report[b"pid"])
            if pid in {p.proc.pid for p in procs}:
                out[pid] = json.loads(report[b"counters"])
    return out


def test_two_replicas_fire_every_due_timer_exactly_once(
        replicas: tuple[str, str, list[Proc]]) -> None:
    database_url, queue, procs = replicas
    due_at = time.time() + 6   # both replicas are polling when the timers fall due
    ids = _park(database_url, due_at)
    client = redis.Redis.from_url(url_with_db(REDIS_DB))
    try:
        until(lambda: len(_drive_ids(client, queue)) >= N, "a drive for every timer",
              timeout=60)
        fired_before = _fired_counts(database_url, ids)
        # Let both replicas poll on past the last firing: a second firing would show now.
        ticks = {pid: c.get("ticks", 0) for pid, c in _reported(client, procs).items()}
        until(lambda: all(c.get("ticks", 0) > ticks.get(pid, 0) + 3
                          for pid, c in _reported(client, procs).items())
              and len(_reported(client, procs)) == 2, "both replicas to tick on", timeout=30)
        fired = _fired_counts(database_url, ids)
        drives = Counter(_drive_ids(client, queue))
        reports = _reported(client, procs)
    finally:
        client.close()
    assert fired == fired_before
    assert set(fired) == set(ids)
    assert set(fired.values()) == {1}, {k: v for k, v in fired.items() if v != 1}
    assert set(drives) == set(ids)
    assert set(drives.values()) == {1}
    # The replicas' own counters, fetched from Redis: together, each timer once.
    assert sum(r.get("fired", 0) for r in reports.values()) == N
    assert sum(r.get("enqueue_errors", 0) for r in reports.values()) == 0
    for proc in procs:
        assert proc.alive(), proc.log()[-3000:]
