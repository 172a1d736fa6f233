"""The queue tables arrive by migration (Postgres 7, SQLite 3), and what operators read
of the queues (the Fleet page's rows, ``/metrics``' gauges) comes from the real store.

Real Postgres (a throwaway database, a schema per test) and SQLite files.
"""

from __future__ import annotations

import secrets
import sqlite3
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from fleet import Context, Queue, Runtime, flow
from fleet.config import FleetSettings
from fleet.kernel.errors import SchemaVersionError
from fleet.kernel.store.conformance import started
from fleet.kernel.store.pg_migrations import MIGRATIONS, VERSION_TABLE
from fleet.kernel.store.postgres import PostgresEventStore
from fleet.kernel.store.spi_queues import QueueEntry, QueueLimits
from fleet.kernel.store.sqlite import SqliteEventStore
from fleet.kernel.store.sqlite_schema import SCHEMA_VERSION as SQLITE_VERSION
from fleet.services.backlog import BacklogReader
from fleet.services.counters import FleetCounters
from fleet.services.metrics import FleetCollector

pytestmark = pytest.mark.integration


@flow("qs-wait")
async def wait(ctx: Context, _: Any) -> None:
    await ctx.wait("go")


async def test_a_version_6_postgres_schema_gets_the_queue_tables_on_first_use(
        database_url: str) -> None:
    schema = f"t_{secrets.token_hex(5)}"
    raw = await asyncpg.connect(database_url)
    try:
        await raw.execute(f'CREATE SCHEMA "{schema}"; SET search_path = "{schema}"')
        await raw.execute(VERSION_TABLE)
        for number, sql in MIGRATIONS[:6]:
            await raw.execute(sql)
            await raw.execute("INSERT INTO fleet_schema_version (version) VALUES ($1)", number)
    finally:
        await raw.close()
    reader = PostgresEventStore(database_url, schema=schema, pool_max=1, migrate=False)
    with pytest.raises(SchemaVersionError):
        await reader.queue_depths(0)  # a reader never migrates: it says the schema is behind
    await reader.close()
    store = PostgresEventStore(database_url, schema=schema, pool_max=2)
    try:
        await store.append(started("before"))
        done = await store.queue_pass(QueueLimits("q", concurrency=1), 10,
                                      entry=QueueEntry("x", "q"))
        assert (done.entered, done.entry_at) == (True, 10)
        status = await store.schema_status()
        assert status.version == MIGRATIONS[-1][0] >= 7
        assert await store.head("before") == 0
    finally:
        await store.close()


async def test_a_version_2_sqlite_file_gets_the_queue_tables_when_opened(
        tmp_path: Path) -> None:
    path = tmp_path / "fleet.db"
    store = SqliteEventStore(path)
    await store.append(started("kept"))
    await store.close()
    conn = sqlite3.connect(path)  # make it a file version 2 wrote
    for table in ("fleet_queues", "fleet_queue_entries", "fleet_debounce"):
        conn.execute(f"DROP TABLE {table}")
    conn.execute("PRAGMA user_version = 2")
    conn.commit()
    conn.close()
    store = SqliteEventStore(path)
    try:
        done = await store.queue_pass(QueueLimits("q", concurrency=1), 10,
                                      entry=QueueEntry("x", "q"))
        assert done.entry_at == 10
        assert await store.head("kept") == 0
    finally:
        await store.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SQLITE_VERSION == 3
    conn.close()


async def test_the_fleet_page_and_metrics_read_the_queues_from_the_store(
        database_url: str) -> None:
    schema = f"t_{secrets.token_hex(5)}"
    url = f"{database_url}?schema={schema}"
    store = PostgresEventStore(url, pool_max=2)
    runtime = Runtime(store, flows=[wait], queues=[Queue("desk", concurrency=1)],
                      local_timers=False)
    try:
        for n in range(3):
            await runtime.start("qs-wait", n, queue="desk", drive=False)
        await runtime.start("qs-wait", 9, queue="desk", drive=False,
                            start_in=timedelta(hours=1))
    finally:
        await runtime.close()
        await store.close()
    # What Flower reads: the backlog reader's snapshot, refreshed off its loop, with the
    # queues' depths among it (decision 0046); the page and /metrics answer from it.
    reader = BacklogReader(FleetSettings(database_url=url, queues={"desk": {"concurrency": 1}}),
                           lambda flow_id, tenant: "fleet.drive")
    try:
        (desk,) = reader.read().queues
        assert (desk.queue, desk.waiting, desk.running, desk.delayed) == ("desk", 2, 1, 1)
        assert desk.oldest_wait_ms is not None
        assert desk.oldest_wait_ms >= 0
        shown = desk.to_dict()
        assert shown["limits"] == {"concurrency": 1, "per_key": None, "priority": False,
                                   "rate_ms": None, "rate_n": None}
        collector = FleetCollector(lambda: FleetCounters(()), backlog=reader.read)
        samples = {(m.name, s.labels.get("queue")): s.value
                   for m in collector.collect() for s in m.samples}
        assert samples[("fleet_queue_waiting", "desk")] == 2
        assert samples[("fleet_queue_running", "desk")] == 1
        assert samples[("fleet_queue_delayed", "desk")] == 1
        assert samples[("fleet_queue_oldest_wait_seconds", "desk")] >= 0
    finally:
        reader.close()
