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
from fleet.kernel.store.pg_migrations import SCHEMA_VERSION
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
        "pending": ALL, "schema": None}
    assert query(database_url, "SELECT to_regclass('events')") == [(None,)]  # status wrote nothing

    assert status_json("upgrade", "--db", database_url) == {
        "version": SCHEMA_VERSION, "latest": SCHEMA_VERSION, "state": "current",
        "applied": ALL, "pending": [], "schema": None}
    assert query(database_url, "SELECT version FROM fleet_schema_version ORDER BY version") \
        == [(v,) for v in ALL]

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
