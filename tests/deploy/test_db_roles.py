"""The two database roles of deploy/postgres/roles.sql, on a real Postgres.

The script runs (through psql, as an operator would) in a database of its own
with role names of its own; ``fleet db upgrade`` runs as the migrator; then the
runtime role runs the store: a flow start to finish through ``Runtime``, the
whole event- and snapshot-store conformance kit (each test on a schema the
migrator just created), and ``fleet db status``. Every DDL statement an
attacker holding the runtime role's password would try is refused with
SQLSTATE 42501 and leaves the schema and the rows as they were; the runtime
role cannot migrate a database that is behind. The dev overlay's first-start
hook (postgres-init/fleet-roles.sh) runs against the same server and leaves
both roles with SCRAM passwords read from the environment.

Issue 10 item 13 (separate roles for migration and runtime).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
import pytest
from k8s_kit import K8S, ROOT, secret_example
from postgres_server import psql, run_async, server_url, throwaway_database

from fleet.kernel.context import Context
from fleet.kernel.flows import flow
from fleet.kernel.runtime import Runtime
from fleet.kernel.store.conformance import (
    EventStoreConformance,
    SnapshotStoreConformance,
    make_event,
    started,
)
from fleet.kernel.store.postgres import PostgresEventStore, PostgresSnapshotStore
from fleet.kernel.store.spi import EventStore, FenceGrant, SnapshotStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROLES_SQL = ROOT / "deploy" / "postgres" / "roles.sql"
DEV_INIT = K8S / "overlays" / "dev" / "postgres-init"
FLEET = str(Path(sys.executable).with_name("fleet"))
SCHEMA = "fleet"


def as_role(url: str, role: str, password: str, schema: str | None = SCHEMA) -> str:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{role}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port
                                                            else "")
    return urlunsplit(parts._replace(netloc=netloc, query=f"schema={schema}" if schema else ""))


def scaler_of(runtime: str) -> str:
    """The scaler role a test's run of the script creates beside ``runtime`` (a role of
    its own, dropped with the others: roles are the whole server's)."""
    return f"{runtime}_sc"


def run_script(admin_url: str, migrator: str, runtime: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([psql(), admin_url, "-X", "-q", "-v", f"migrator={migrator}",
                           "-v", f"runtime={runtime}", "-v", f"scaler={scaler_of(runtime)}",
                           "-f", str(ROLES_SQL)],
                          capture_output=True, text=True, timeout=60)


@dataclass
class Roles:
    admin: str        # the database's URL as the server's superuser
    migrator: str     # URL as the migrator, ?schema=fleet
    runtime: str      # URL as the runtime role, ?schema=fleet
    names: tuple[str, str]
    passwords: tuple[str, str]

    def runtime_in(self, schema: str) -> str:
        return as_role(self.admin, self.names[1], self.passwords[1], schema)

    def migrator_in(self, schema: str) -> str:
        return as_role(self.admin, self.names[0], self.passwords[0], schema)


async def _admin(url: str, *statements: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


def _drop_roles(*names: str) -> None:
    """The roles, and the scaler role each runtime role's run of the script made."""
    every = [*names, *(scaler_of(n) for n in names)]
    run_async(lambda: _admin(server_url(), *(f'DROP ROLE IF EXISTS "{n}"' for n in every)))


@pytest.fixture(scope="module")
def roles() -> Iterator[Roles]:
    token = secrets.token_hex(4)
    names = (f"fleet_mig_{token}", f"fleet_rt_{token}")
    passwords = (secrets.token_urlsafe(16), secrets.token_urlsafe(16))
    try:
        with throwaway_database() as admin:
            done = run_script(admin, *names)
            assert done.returncode == 0, done.stderr
            # Passwords the way the script's header says: never on a command line.
            run_async(lambda: _admin(admin, *(
                f"ALTER ROLE \"{n}\" PASSWORD '{p}'" for n, p in zip(names, passwords,
                                                                  strict=True))))
            built = Roles(admin, as_role(admin, names[0], passwords[0]),
                          as_role(admin, names[1], passwords[1]), names, passwords)
            upgrade = fleet_cli(built.migrator, "db", "upgrade")
            assert upgrade.returncode == 0, upgrade.stderr
            yield built
    finally:
        _drop_roles(*names)


def fleet_cli(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env["FLEET_DATABASE_URL"] = database_url
    return subprocess.run([FLEET, *args], env=env, capture_output=True, text=True, timeout=60,
                          cwd=str(ROOT))


async def fresh_schema(roles: Roles) -> str:
    """A schema the migrator creates and migrates now (what ``fleet db upgrade`` does)."""
    schema = f"t_{secrets.token_hex(5)}"
    migrator = PostgresEventStore(roles.migrator_in(schema), pool_max=1)
    try:
        status = await migrator.upgrade_schema()
        assert status.version == status.latest
    finally:
        await migrator.close()
    return schema


# -- the runtime role runs the store -------------------------------------------------------


def test_the_migrator_upgrades_and_the_runtime_role_finds_the_schema_current(
        roles: Roles) -> None:
    status = fleet_cli(roles.runtime, "db", "status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["state"] == "current"
    assert json.loads(status.stdout)["schema"] == SCHEMA

    async def owners() -> dict[str, str]:
        conn = await asyncpg.connect(roles.admin)
        try:
            rows = await conn.fetch(
                "SELECT c.relname, pg_get_userbyid(c.relowner) AS owner FROM pg_class AS c "
                "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
                "WHERE n.nspname = $1 AND c.relkind = 'r'", SCHEMA)
            return {r["relname"]: r["owner"] for r in rows}
        finally:
            await conn.close()

    tables = run_async(owners)
    assert set(tables) >= {"events", "executions", "fences", "timers", "snapshots",
                           "fleet_schema_version"}
    assert set(tables.values()) == {roles.names[0]}, "the migrator owns every table"


@flow("roles-flow", version=1, steps=["double"])
async def roles_flow(ctx: Context, n: int) -> dict[str, Any]:
    doubled = await ctx.step("double", _double, n)
    await ctx.sleep(0.05)
    return {"doubled": doubled}


def _double(n: int) -> int:
    return 2 * n


async def test_the_runtime_role_runs_a_flow_start_to_finish(roles: Roles) -> None:
    store = PostgresEventStore(roles.runtime, migrate=False, pool_max=2)
    snapshots = PostgresSnapshotStore(roles.runtime, migrate=False, pool_max=1)
    try:
        runtime = Runtime(store, flows=[roles_flow], snapshots=snapshots)
        handle = await runtime.start("roles-flow", 21)
        deadline = asyncio.get_running_loop().time() + 20
        while (await runtime.load_state(handle.execution_id)).status != "completed":
            assert asyncio.get_running_loop().time() < deadline
            await runtime.fire_due_timers()
            await asyncio.sleep(0.05)
        assert await handle.result() == {"doubled": 42}
        assert await store.compact_through(handle.execution_id, 1) >= 1
        assert await store.delete_execution(handle.execution_id)
    finally:
        await store.close()
        await snapshots.close()


class TestRuntimeRoleEventStore(EventStoreConformance):
    """The whole event-store contract, as the runtime role (nothing it needs is DDL)."""

    @pytest.fixture
    async def store(self, roles: Roles) -> AsyncIterator[EventStore]:
        self.schema = await fresh_schema(roles)
        self.url = as_role(roles.admin, roles.names[1], roles.passwords[1], None)
        store = PostgresEventStore(roles.runtime_in(self.schema), migrate=False, pool_max=4)
        yield store
        await store.close()

    async def forge_lease(self, store: EventStore, execution_id: str, *,
                          ahead_ms: int) -> FenceGrant:
        """The server's clock cannot be moved: the runtime role pushes the expiry of a
        lease it took further out itself (what a compromised worker could do)."""
        grant = await store.acquire_fence(execution_id, holder="fast-clock", lease_ms=60_000)
        conn = await asyncpg.connect(self.url, server_settings={"search_path": self.schema})
        try:
            await conn.execute("UPDATE fences SET lease_expires_at = lease_expires_at + $1 "
                               "WHERE ekey = fleet_key($2)", ahead_ms, execution_id)
        finally:
            await conn.close()
        return FenceGrant(execution_id, grant.token, grant.holder,
                          grant.lease_expires_at + ahead_ms)


class TestRuntimeRoleSnapshotStore(SnapshotStoreConformance):
    @pytest.fixture
    async def snapshot_store(self, roles: Roles) -> AsyncIterator[SnapshotStore]:
        store = PostgresSnapshotStore(roles.runtime_in(await fresh_schema(roles)),
                                      migrate=False, pool_max=2)
        yield store
        await store.close()


# -- and can do nothing else ---------------------------------------------------------------

DDL = {
    "drop a table": "DROP TABLE events",
    "truncate": "TRUNCATE events",
    "alter a table": "ALTER TABLE events ADD COLUMN evil int",
    "add an index": "CREATE INDEX evil ON events (type)",
    "replace the append": ("CREATE OR REPLACE FUNCTION fleet_key(id text) RETURNS bytea "
                           "LANGUAGE sql IMMUTABLE AS $$ SELECT '\\x00'::bytea $$"),
    "drop a function": "DROP FUNCTION fleet_compact(bytea, bigint)",
    "a table in fleet's schema": "CREATE TABLE fleet.evil (a int)",
    "a table in public": "CREATE TABLE public.evil (a int)",
    "a temporary table": "CREATE TEMP TABLE evil (a int)",
    "a schema": "CREATE SCHEMA evil",
    "drop the schema": "DROP SCHEMA fleet CASCADE",
    "take a table over": "ALTER TABLE events OWNER TO CURRENT_USER",
    "a trigger function": ("CREATE FUNCTION public.evil() RETURNS trigger LANGUAGE plpgsql "
                           "AS $$ BEGIN RETURN NEW; END $$"),
}


@pytest.mark.parametrize("statement", DDL.values(), ids=list(DDL))
async def test_the_runtime_role_cannot_change_the_schema(roles: Roles, statement: str) -> None:
    store = PostgresEventStore(roles.runtime, migrate=False, pool_max=1)
    eid = f"ddl-{secrets.token_hex(4)}"
    try:
        await store.append_batch([started(eid), make_event(eid, 1)])
    finally:
        await store.close()
    before = await _catalog(roles)
    conn = await asyncpg.connect(roles.runtime.split("?")[0],
                                 server_settings={"search_path": SCHEMA})
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(statement)
    finally:
        await conn.close()
    assert await _catalog(roles) == before, "the refused statement changed something"


async def _catalog(roles: Roles) -> tuple[Any, ...]:
    """Every object, column, owner, privilege and row count in the database."""
    conn = await asyncpg.connect(roles.admin)
    try:
        objects = await conn.fetch(
            "SELECT n.nspname, c.relname, c.relkind, pg_get_userbyid(c.relowner), "
            "c.relacl::text FROM pg_class AS c JOIN pg_namespace AS n "
            "ON n.oid = c.relnamespace WHERE n.nspname NOT IN ('pg_catalog', "
            "'information_schema', 'pg_toast') ORDER BY 1, 2")
        columns = await conn.fetch(
            "SELECT table_schema, table_name, column_name FROM information_schema.columns "
            "WHERE table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY 1, 2, 3")
        functions = await conn.fetch(
            "SELECT n.nspname, p.proname, md5(p.prosrc), p.proacl::text FROM pg_proc AS p "
            "JOIN pg_namespace AS n ON n.oid = p.pronamespace "
            "WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') ORDER BY 1, 2")
        schemas = await conn.fetch("SELECT nspname, nspacl::text FROM pg_namespace ORDER BY 1")
        rows = await conn.fetchval(f'SELECT count(*) FROM "{SCHEMA}".events')
        return (tuple(map(tuple, objects)), tuple(map(tuple, columns)),
                tuple(map(tuple, functions)), tuple(map(tuple, schemas)), rows)
    finally:
        await conn.close()


async def test_a_grant_by_the_runtime_role_grants_nothing(roles: Roles) -> None:
    """GRANT without the grant option is a warning in Postgres, not an error: the
    catalog shows it granted nothing."""
    before = await _catalog(roles)
    conn = await asyncpg.connect(roles.runtime.split("?")[0],
                                 server_settings={"search_path": SCHEMA})
    try:
        await conn.execute("GRANT TRUNCATE, REFERENCES, TRIGGER ON events TO PUBLIC")
        await conn.execute(f'GRANT CREATE ON SCHEMA "{SCHEMA}" TO PUBLIC')
    finally:
        await conn.close()
    assert await _catalog(roles) == before


def test_the_runtime_role_cannot_migrate_a_database_that_is_behind(roles: Roles) -> None:
    behind = f"behind_{secrets.token_hex(4)}"
    refused = fleet_cli(roles.runtime_in(behind), "db", "upgrade")
    assert refused.returncode != 0
    assert "permission denied" in (refused.stderr + refused.stdout).lower()

    async def exists() -> bool:
        conn = await asyncpg.connect(roles.admin)
        try:
            return bool(await conn.fetchval(
                "SELECT count(*) FROM pg_namespace WHERE nspname = $1", behind))
        finally:
            await conn.close()

    assert not run_async(exists), "the refused upgrade created the schema"
    # The migrator can (the same command, the other role).
    assert fleet_cli(roles.migrator_in(behind), "db", "upgrade").returncode == 0
    status = fleet_cli(roles.runtime_in(behind), "db", "status", "--json")
    assert json.loads(status.stdout)["state"] == "current"


async def test_the_script_bounds_idle_transactions_and_the_runtime_roles_statements(
        roles: Roles) -> None:
    """Issue 25 item 10: an idle transaction holds the relay's feed back, and a held row
    lock stalls writes. Sessions opened without fleet's own settings get the script's:
    every session of the database the idle limit, the runtime role's the statement
    limits too (integration/test_postgres_timeouts.py shows them end a stuck session)."""
    shown = "SELECT current_setting($1)"
    names = ("idle_in_transaction_session_timeout", "statement_timeout", "lock_timeout")
    for url, expected in ((as_role(roles.admin, roles.names[1], roles.passwords[1], None),
                           ("1min", "1min", "10s")),
                          (as_role(roles.admin, roles.names[0], roles.passwords[0], None),
                           ("1min", "0", "0")),
                          (roles.admin, ("1min", "0", "0"))):
        conn = await asyncpg.connect(url)
        try:
            assert tuple([await conn.fetchval(shown, n) for n in names]) == expected, url
        finally:
            await conn.close()


def test_running_the_script_again_changes_nothing(roles: Roles) -> None:
    before = run_async(lambda: _catalog(roles))
    done = run_script(roles.admin, *roles.names)
    assert done.returncode == 0, done.stderr
    assert run_async(lambda: _catalog(roles)) == before


def test_the_runtime_role_rotates_to_a_second_role_without_downtime() -> None:
    """docs/operations.md's rotation: roles.sql for a second runtime role, which
    works at once on the existing schema; the first is then dropped cleanly."""
    token = secrets.token_hex(4)
    migrator, first, second = (f"fleet_mig_{token}", f"fleet_rt_{token}",
                               f"fleet_rt2_{token}")
    password = secrets.token_urlsafe(16)

    def set_password(admin: str, role: str) -> None:
        run_async(lambda: _admin(admin, f"ALTER ROLE \"{role}\" PASSWORD '{password}'"))

    try:
        with throwaway_database() as admin:
            assert run_script(admin, migrator, first).returncode == 0
            set_password(admin, migrator)
            set_password(admin, first)
            upgrade = fleet_cli(as_role(admin, migrator, password), "db", "upgrade")
            assert upgrade.returncode == 0, upgrade.stderr

            async def append_and_read(role: str) -> int:
                store = PostgresEventStore(as_role(admin, role, password), migrate=False,
                                           pool_max=1)
                eid = f"rot-{secrets.token_hex(3)}"
                try:
                    await store.append_batch([started(eid), make_event(eid, 1)])
                    return len(await store.read(eid))
                finally:
                    await store.close()

            assert run_async(lambda: append_and_read(first)) == 2
            done = run_script(admin, migrator, second)
            assert done.returncode == 0, done.stderr
            set_password(admin, second)
            assert run_async(lambda: append_and_read(second)) == 2
            run_async(lambda: _admin(admin, f'DROP OWNED BY "{first}"',
                                     f'DROP ROLE "{first}"'))
            assert run_async(lambda: append_and_read(second)) == 2
    finally:
        _drop_roles(migrator, first, second)


# -- what deploy/ ships -----------------------------------------------------------------------


def test_the_example_secret_gives_each_url_its_own_role_and_the_same_schema() -> None:
    data = secret_example()["fleet-secrets"]
    runtime, migrator = urlsplit(data["database-url"]), urlsplit(data["migration-database-url"])
    assert (runtime.username, migrator.username) == ("fleet_runtime", "fleet_migrator")
    assert runtime.query == migrator.query == f"schema={SCHEMA}"
    assert (runtime.hostname, runtime.path) == (migrator.hostname, migrator.path)


def test_the_dev_postgres_runs_the_same_script_and_sets_scram_passwords() -> None:
    """postgres-init/fleet-roles.sh as the postgres image runs it (sourced, with the
    image's docker_process_sql), here with psql against the test server."""
    assert (DEV_INIT / "roles.psql").read_bytes() == ROLES_SQL.read_bytes(), (
        "the dev overlay's copy of deploy/postgres/roles.sql differs")
    token = secrets.token_hex(4)
    names = (f"fleet_mig_{token}", f"fleet_rt_{token}")
    passwords = (secrets.token_urlsafe(16), secrets.token_urlsafe(16))
    script = (DEV_INIT / "fleet-roles.sh").read_text().replace(
        "/docker-entrypoint-initdb.d/roles.psql", str(DEV_INIT / "roles.psql"))
    try:
        with throwaway_database() as admin:
            env = {**os.environ, "ADMIN_URL": admin, "PSQL": psql(),
                   "DB_MIGRATOR": names[0], "DB_RUNTIME": names[1],
                   "DB_SCALER": scaler_of(names[1]),
                   "DB_MIGRATOR_PASSWORD": passwords[0],
                   "DB_RUNTIME_PASSWORD": passwords[1]}
            shell = ('docker_process_sql() { "$PSQL" -X -q -v ON_ERROR_STOP=1 "$ADMIN_URL" '
                     '"$@"; }\n' + script)
            done = subprocess.run(["bash", "-c", shell], env=env, capture_output=True,
                                  text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            assert not any(p in done.stdout + done.stderr for p in passwords)

            async def hashes() -> dict[str, str]:
                conn = await asyncpg.connect(admin)
                try:
                    rows = await conn.fetch("SELECT rolname, rolpassword FROM pg_authid "
                                            "WHERE rolname = ANY($1::text[])", list(names))
                    return {r["rolname"]: r["rolpassword"] for r in rows}
                finally:
                    await conn.close()

            stored = run_async(hashes)
            assert set(stored) == set(names)
            assert all(h.startswith("SCRAM-SHA-256$") for h in stored.values()), stored
            migrator = as_role(admin, names[0], passwords[0])
            assert fleet_cli(migrator, "db", "upgrade").returncode == 0
            status = fleet_cli(as_role(admin, names[1], passwords[1]), "db", "status", "--json")
            assert json.loads(status.stdout)["state"] == "current", status.stderr
    finally:
        _drop_roles(*names)
