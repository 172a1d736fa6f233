"""`fleet db status|upgrade` against a real Postgres: a fresh database is brought to the
latest schema, a second upgrade applies nothing, a newer schema is refused untouched.

Each test gets its own throwaway database (created and dropped here).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest
from click.testing import CliRunner
from postgres_server import run_async, throwaway_database

from fleet.cli import main
from fleet.kernel.errors import SchemaVersionError
from fleet.kernel.store.conformance import make_event, started
from fleet.kernel.store.pg_migrations import MIGRATIONS, OLDEST_CODE, SCHEMA_VERSION
from fleet.kernel.store.postgres import PostgresEventStore

pytestmark = pytest.mark.integration
ALL = list(range(1, SCHEMA_VERSION + 1))


@pytest.fixture
def database_url() -> Iterator[str]:
    with throwaway_database() as url:
        yield url


def fleet_db(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["db", *args], catch_exceptions=False)
    return result.exit_code, result.output


def status_json(*args: str) -> dict[str, Any]:
    code, out = fleet_db(*args, "--json")
    assert code == 0, out
    return dict(json.loads(out))


def query(url: str, sql: str) -> list[Any]:
    async def go() -> list[Any]:
        conn = await asyncpg.connect(url)
        try:
            return [tuple(row) for row in await conn.fetch(sql)]
        finally:
            await conn.close()

    return run_async(go)


def test_upgrade_brings_a_fresh_database_to_the_latest_schema(database_url: str) -> None:
    assert status_json("status", "--db", database_url) == {
        "version": 0, "latest": SCHEMA_VERSION, "state": "behind", "applied": [],
        "pending": ALL, "schema": None, "oldest_code": 0, "compatible": True}
    assert query(database_url, "SELECT to_regclass('events')") == [(None,)]  # status wrote nothing

    assert status_json("upgrade", "--db", database_url) == {
        "version": SCHEMA_VERSION, "latest": SCHEMA_VERSION, "state": "current",
        "applied": ALL, "pending": [], "schema": None,
        "oldest_code": max(OLDEST_CODE.values()), "compatible": True}
    # Each migration records the oldest code that runs against it (decision 0049).
    assert query(database_url, "SELECT version, oldest_code FROM fleet_schema_version "
                               "ORDER BY version") == sorted(OLDEST_CODE.items())

    again = status_json("upgrade", "--db", database_url)
    assert (again["applied"], again["state"]) == ([], "current")
    assert status_json("status", "--db", database_url)["state"] == "current"


def test_a_store_that_may_not_migrate_runs_after_the_upgrade(database_url: str) -> None:
    async def use() -> list[int]:
        store = PostgresEventStore(database_url, migrate=False, pool_max=2)
        try:
            await store.append(started("x"))
            await store.append(make_event("x", 1))
            return [event.sequence for event in await store.read("x")]
        finally:
            await store.close()

    with pytest.raises(SchemaVersionError, match="fleet db upgrade"):
        run_async(use)
    assert fleet_db("upgrade", "--db", database_url)[0] == 0
    assert run_async(use) == [0, 1]


def test_the_schema_in_the_url_is_the_one_upgraded(database_url: str) -> None:
    url = f"{database_url}?schema=tenant_a"
    code, out = fleet_db("upgrade", "--db", url)  # the table, not JSON
    assert code == 0, out
    assert "tenant_a" in out
    assert "current" in out
    assert status_json("status", "--db", url)["schema"] == "tenant_a"
    assert query(database_url, "SELECT count(*) FROM tenant_a.fleet_schema_version") \
        == [(SCHEMA_VERSION,)]
    assert status_json("status", "--db", database_url)["version"] == 0  # public untouched


def test_the_url_comes_from_the_settings(database_url: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_DATABASE_URL", database_url)
    assert status_json("upgrade")["applied"] == ALL


def test_a_newer_schema_is_reported_and_never_touched(database_url: str) -> None:
    assert fleet_db("upgrade", "--db", database_url)[0] == 0
    query(database_url, f"INSERT INTO fleet_schema_version (version) "
                        f"VALUES ({SCHEMA_VERSION + 5}) RETURNING version")
    status = status_json("status", "--db", database_url)
    assert (status["version"], status["state"], status["pending"]) == (
        SCHEMA_VERSION + 5, "newer", [])
    code, out = fleet_db("upgrade", "--db", database_url)
    assert code == 1
    assert "SchemaVersionError" in out
    assert "upgrade fleet" in out
    assert query(database_url, "SELECT max(version) FROM fleet_schema_version") \
        == [(SCHEMA_VERSION + 5,)]


def test_concurrent_upgrades_apply_each_migration_once(database_url: str) -> None:
    async def race() -> list[tuple[int, ...]]:
        stores = [PostgresEventStore(database_url, migrate=False) for _ in range(4)]
        try:
            done = await asyncio.gather(*(s.upgrade_schema() for s in stores))
        finally:
            for store in stores:
                await store.close()
        return [status.applied for status in done]

    applied = run_async(race)
    assert sorted(v for one in applied for v in one) == ALL  # each applied by exactly one
    assert query(database_url, "SELECT version FROM fleet_schema_version ORDER BY version") \
        == [(v,) for v in ALL]


@pytest.mark.parametrize("url", ["sqlite:///fleet.db", "memory:"])
def test_only_postgres_has_migrations(url: str) -> None:
    code, out = fleet_db("status", "--db", url)
    assert code == 1
    assert "not a Postgres URL" in out


def test_an_unreachable_server_is_a_typed_error() -> None:
    code, out = fleet_db("status", "--db", "postgresql://postgres@127.0.0.1:1/nothing")
    assert code == 1
    assert "StoreUnavailableError" in out


def test_a_newer_schema_that_declares_this_code_compatible_is_run(database_url: str) -> None:
    """A rollback (decision 0049): the database was upgraded by newer code whose
    migration declared code of this version compatible; this code starts and writes."""
    assert fleet_db("upgrade", "--db", database_url)[0] == 0
    query(database_url, f"INSERT INTO fleet_schema_version (version, oldest_code) "
                        f"VALUES ({SCHEMA_VERSION + 1}, {SCHEMA_VERSION}) RETURNING version")
    status = status_json("status", "--db", database_url)
    assert (status["version"], status["state"], status["oldest_code"], status["compatible"]) \
        == (SCHEMA_VERSION + 1, "newer", SCHEMA_VERSION, True)
    assert status_json("upgrade", "--db", database_url)["applied"] == []

    async def use() -> list[int]:
        store = PostgresEventStore(database_url, pool_max=2)
        try:
            await store.append(started("rolled-back"))
            return [event.sequence for event in await store.read("rolled-back")]
        finally:
            await store.close()

    assert run_async(use) == [0]
    # One more migration that needs newer code: refused, with what to do, nothing written.
    query(database_url, f"INSERT INTO fleet_schema_version (version, oldest_code) "
                        f"VALUES ({SCHEMA_VERSION + 2}, {SCHEMA_VERSION + 2}) RETURNING version")
    assert status_json("status", "--db", database_url)["compatible"] is False

    async def refused() -> None:
        store = PostgresEventStore(database_url, pool_max=2)
        try:
            await store.append(started("too-old"))
        finally:
            await store.close()

    with pytest.raises(SchemaVersionError, match=f"knows version {SCHEMA_VERSION + 2}"):
        run_async(refused)
    assert query(database_url, "SELECT count(*) FROM executions WHERE execution_id = 'too-old'") \
        == [(0,)]


def test_a_database_made_before_oldest_code_gains_it_on_upgrade(database_url: str) -> None:
    """A version-6 database (its version table without ``oldest_code``, as code before
    decision 0049 made it) is upgraded: the column is added and every row filled in."""
    old_table = ("CREATE TABLE fleet_schema_version (version integer PRIMARY KEY, "
                 "applied_at timestamptz NOT NULL DEFAULT now())")

    async def make_v6() -> None:
        conn = await asyncpg.connect(database_url)
        try:
            async with conn.transaction():
                await conn.execute(old_table)
                for version, sql in MIGRATIONS[:6]:
                    await conn.execute(sql)
                    await conn.execute("INSERT INTO fleet_schema_version VALUES ($1)", version)
        finally:
            await conn.close()

    run_async(make_v6)
    before = status_json("status", "--db", database_url)
    assert (before["version"], before["oldest_code"], before["pending"]) == (
        6, 6, list(range(7, SCHEMA_VERSION + 1)))
    after = status_json("upgrade", "--db", database_url)
    assert after["applied"] == list(range(7, SCHEMA_VERSION + 1))
    assert query(database_url, "SELECT version, oldest_code FROM fleet_schema_version "
                               "ORDER BY version") == sorted(OLDEST_CODE.items())


def test_the_schema_gate_passes_current_and_compatible_schemas_only(database_url: str) -> None:
    """``fleet db status --check``: what every pod's ``wait-for-schema`` runs."""
    code, out = fleet_db("status", "--db", database_url, "--check")
    assert code == 1  # behind: the Job has not run
    assert "needs it current" in out
    assert fleet_db("upgrade", "--db", database_url)[0] == 0
    assert fleet_db("status", "--db", database_url, "--check") == (0, "")
    query(database_url, f"INSERT INTO fleet_schema_version (version, oldest_code) "
                        f"VALUES ({SCHEMA_VERSION + 1}, {SCHEMA_VERSION - 1}) RETURNING version")
    assert fleet_db("status", "--db", database_url, "--check") == (0, "")  # a rollback
    query(database_url, f"INSERT INTO fleet_schema_version (version, oldest_code) "
                        f"VALUES ({SCHEMA_VERSION + 2}, {SCHEMA_VERSION + 2}) RETURNING version")
    code, out = fleet_db("status", "--db", database_url, "--check")
    assert code == 1
    assert f"needs code of version {SCHEMA_VERSION + 2}" in out
