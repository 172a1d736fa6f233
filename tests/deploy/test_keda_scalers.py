"""KEDA's triggers (components/keda, decision 0046) against what they ask, on a real Postgres.

The overlay ``prod-keda`` is rendered with ``kubectl kustomize``. Each ScaledObject
says how it grows and how it shrinks; each trigger is KEDA's PostgreSQL scaler (or
CPU), its query routes as the ConfigMap's ``FLEET_QUEUE`` and ``FLEET_ROUTES`` do,
and its credentials are the ``fleet_scaler`` role of ``deploy/postgres/roles.sql``.
Then, on a Postgres where the script made the roles and the migrator the schema,
the runtime role writes a backlog, and the scaler role runs each rendered query
exactly as KEDA does (a ping, then the query): it answers the number the
exporter's gauges show for that queue, and that role reads no row, calls nothing
that reads one, and creates nothing. Redis is out of it: no trigger reads it, and
the ACL has no KEDA user left (KEDA's Redis scaler sends EVAL, which the ACL
refuses to every fleet user: tests/deploy/test_redis_acl.py).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
import pytest
from k8s_kit import ROOT, configmap_data, kinds, one, render, secret_example
from postgres_server import postgres_binaries, run_async, server_url, throwaway_database

from fleet.config import FleetSettings
from fleet.dispatcher.routing import route_queue
from fleet.kernel.events import EventType
from fleet.kernel.store.conformance import make_event, started
from fleet.kernel.store.postgres import PostgresEventStore
from fleet.services.backlog import BacklogReader

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROLES_SQL = ROOT / "deploy" / "postgres" / "roles.sql"
SCHEMA = "fleet"
UNOWNED = re.compile(r"SELECT fleet\.fleet_scaler_unowned\('([^']+)', '([^']+)', '([^']*)'\)")
TIMERS = "SELECT fleet.fleet_scaler_timers_due()"


def scaled_objects() -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in kinds(render("prod-keda"), "ScaledObject")}


def postgres_queries() -> list[str]:
    return [t["metadata"]["query"] for o in scaled_objects().values()
            for t in o["spec"]["triggers"] if t["type"] == "postgresql"]


# -- what the overlay renders ------------------------------------------------------------


def test_each_scaled_object_scales_a_deployment_both_ways_on_the_store_or_cpu() -> None:
    objs = render("prod-keda")
    scaled = scaled_objects()
    assert set(scaled) == {"fleet-worker", "fleet-timers"}
    assert not kinds(objs, "HorizontalPodAutoscaler")  # KEDA owns the HPAs
    for name, obj in scaled.items():
        spec = obj["spec"]
        target = one(objs, "Deployment", spec["scaleTargetRef"]["name"])
        assert "replicas" not in target["spec"], name  # an apply must not reset KEDA's count
        assert 2 <= spec["minReplicaCount"] < spec["maxReplicaCount"], name
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        for way in ("scaleUp", "scaleDown"):
            assert behavior[way]["policies"], (name, way)
            assert "stabilizationWindowSeconds" in behavior[way], (name, way)
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300  # hand-backs
        assert {t["type"] for t in spec["triggers"]} <= {"postgresql", "cpu"}, name
    assert [t["type"] for t in scaled["fleet-worker"]["spec"]["triggers"]] == [
        "postgresql", "cpu"]
    assert [t["type"] for t in scaled["fleet-timers"]["spec"]["triggers"]] == ["postgresql"]


def test_the_worker_trigger_routes_as_the_configmap_and_the_timers_count_due_timers() -> None:
    data = configmap_data(render("prod-keda"))
    worker = scaled_objects()["fleet-worker"]["spec"]["triggers"][0]["metadata"]
    match = UNOWNED.fullmatch(worker["query"])
    assert match, worker["query"]
    queue, default, routes = match.groups()
    assert queue == default == data["FLEET_QUEUE"]
    assert json.loads(routes) == json.loads(data.get("FLEET_ROUTES", "{}"))
    assert float(worker["targetQueryValue"]) > 0
    timers = scaled_objects()["fleet-timers"]["spec"]["triggers"][0]["metadata"]
    assert timers["query"] == TIMERS
    assert float(timers["targetQueryValue"]) > 0


def test_every_trigger_authenticates_as_the_scaler_role_from_the_example_secret() -> None:
    objs = render("prod-keda")
    example = secret_example()["fleet-keda-postgres"]
    assert example["userName"] == "fleet_scaler"  # roles.sql's default name
    assert "fleet-keda-redis" not in secret_example()  # no Redis credentials for KEDA
    for obj in scaled_objects().values():
        for trigger in obj["spec"]["triggers"]:
            if trigger["type"] != "postgresql":
                continue
            assert not ({"password", "connection", "userName"} & set(trigger["metadata"]))
            auth = one(objs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
            refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
            assert set(refs) == {"host", "port", "dbName", "sslmode", "userName", "password"}
            assert {r["name"] for r in refs.values()} == {"fleet-keda-postgres"}
            assert {r["key"] for r in refs.values()} == set(example)


def test_the_redis_acl_has_no_keda_user() -> None:
    template = (ROOT / "deploy" / "redis" / "users.acl").read_text()
    assert not re.search(r"^user keda\b", template, flags=re.M)
    assert all(t["type"] != "redis" for o in scaled_objects().values()
               for t in o["spec"]["triggers"])


# -- on a real Postgres ---------------------------------------------------------------------


def psql() -> str:
    found = shutil.which("psql") or os.path.join(postgres_binaries(), "psql")
    if not os.path.exists(found):
        pytest.fail("psql runs deploy/postgres/roles.sql: install the PostgreSQL client "
                    "(Debian: postgresql-client)")
    return found


def as_role(url: str, role: str, password: str, schema: str | None = None) -> str:
    parts = urlsplit(url)
    netloc = f"{role}:{quote(password, safe='')}@{parts.hostname or '127.0.0.1'}" + (
        f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc, query=f"schema={schema}" if schema else ""))


@dataclass
class Database:
    admin: str
    runtime: str
    scaler: str      # the scaler's URL: no schema (KEDA connects with none)
    names: tuple[str, str, str]


async def _execute(url: str, *statements: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


@pytest.fixture(scope="module")
def database() -> Iterator[Database]:
    token = secrets.token_hex(4)
    names = (f"fleet_mig_{token}", f"fleet_rt_{token}", f"fleet_sc_{token}")
    password = secrets.token_urlsafe(16)
    try:
        with throwaway_database() as admin:
            done = subprocess.run([psql(), admin, "-X", "-q", "-v", f"migrator={names[0]}",
                                   "-v", f"runtime={names[1]}", "-v", f"scaler={names[2]}",
                                   "-f", str(ROLES_SQL)], capture_output=True, text=True,
                                  timeout=60)
            assert done.returncode == 0, done.stderr
            run_async(lambda: _execute(admin, *(f"ALTER ROLE \"{n}\" PASSWORD '{password}'"
                                                for n in names)))

            async def migrate() -> None:
                store = PostgresEventStore(as_role(admin, names[0], password, SCHEMA),
                                           pool_max=1)
                try:
                    status = await store.upgrade_schema()
                    assert status.version == status.latest
                finally:
                    await store.close()
            run_async(migrate)
            yield Database(admin, as_role(admin, names[1], password, SCHEMA),
                           as_role(admin, names[2], password), names)
    finally:
        run_async(lambda: _execute(server_url(), *(f'DROP ROLE IF EXISTS "{n}"'
                                                   for n in names)))


ROUTES = {"flow:heavy": "fleet.heavy", "tenant:noisy": "fleet.noisy"}


async def _backlog(url: str) -> None:
    """As the runtime role: queued starts on three routes, one held by a live lease,
    four timers due and two not yet, one run parked on a gate."""
    store = PostgresEventStore(url, migrate=False, pool_max=1)
    try:
        for i in range(7):
            await store.append(started(f"light-{i}", flow_id="light", tenant="acme"))
        for i in range(3):
            await store.append(started(f"heavy-{i}", flow_id="heavy", tenant="acme"))
        for i in range(2):
            await store.append(started(f"noisy-{i}", flow_id="light", tenant="noisy"))
        await store.append(started("held", flow_id="light", tenant="acme"))
        await store.acquire_fence("held", holder="w1", lease_ms=600_000)
        for i, due in enumerate((-60_000, -30_000, -1_000, -500, 3_600_000, 7_200_000)):
            eid = f"sleeper-{i}"
            await store.append(started(eid, flow_id="naps", tenant="acme"))
            await store.append(make_event(eid, 1, EventType.TIMER_SCHEDULED, {
                "timerId": "t", "dueAt": _now_ms() + due}))
            await store.append(make_event(eid, 2, EventType.EXECUTION_SUSPENDED, {
                "condition": {"on": "t", "kind": "timer"}}))
        await store.append(started("gated", flow_id="light", tenant="acme"))
        await store.append(make_event("gated", 1, EventType.EXECUTION_SUSPENDED))
    finally:
        await store.close()


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)


async def _as_keda(url: str, query: str) -> Any:
    """What KEDA's PostgreSQL scaler does: connect, ping (pgx sends an empty statement;
    asyncpg cannot, so ``SELECT 1``), run the query, read one value."""
    conn = await asyncpg.connect(url)
    try:
        assert await conn.fetchval("SELECT 1") == 1
        return await conn.fetchval(query)
    finally:
        await conn.close()


def test_each_rendered_query_answers_what_the_gauges_show_as_the_scaler_role(
        database: Database) -> None:
    run_async(lambda: _backlog(database.runtime))
    queries = postgres_queries()
    assert len(queries) == 2
    answers = {q: run_async(lambda q=q: _as_keda(database.scaler, q)) for q in queries}
    (worker,) = [q for q in queries if UNOWNED.fullmatch(q)]
    # The rendered query (no routes in the base): every queued start but the held one.
    assert answers[worker] == 12
    assert answers[TIMERS] == 4
    # The same function with routes, and the exporter's gauges over the same store.
    settings = FleetSettings(database_url=database.runtime, queue="fleet.drive")
    reader = BacklogReader(settings, lambda flow, tenant: route_queue(
        ROUTES, "fleet.drive", flow_id=flow, tenant=tenant))
    try:
        snapshot = reader.read()
    finally:
        reader.close()
    routes = json.dumps(ROUTES).replace("'", "''")
    for queue, expected in (("fleet.drive", 7), ("fleet.heavy", 3), ("fleet.noisy", 2)):
        query = f"SELECT fleet.fleet_scaler_unowned('{queue}', 'fleet.drive', '{routes}')"
        assert run_async(lambda q=query: _as_keda(database.scaler, q)) == expected, queue
        assert snapshot.unowned(queue) == expected, queue
    assert sum(r.timers_due for r in snapshot.rows) == answers[TIMERS]
    assert snapshot.parked == {"diverged": 0, "in-doubt": 0}


TABLES = ("events", "executions", "fences", "timers", "snapshots", "fleet_schema_version")


def test_the_scaler_role_reads_no_row_calls_nothing_that_does_and_creates_nothing(
        database: Database) -> None:
    async def refused() -> list[str]:
        conn = await asyncpg.connect(database.scaler)
        out = []
        try:
            # An attacker with these credentials sets the path the functions resolve by.
            await conn.execute(f"SET search_path TO {SCHEMA}")
            statements = [f"SELECT count(*) FROM {SCHEMA}.{t}" for t in TABLES]
            statements += [
                f"SELECT * FROM {SCHEMA}.fleet_backlog(0)",  # runs as its caller
                f"DELETE FROM {SCHEMA}.executions",
                f"INSERT INTO {SCHEMA}.fences (ekey, token) VALUES ('\\x00', 1)",
                f"UPDATE {SCHEMA}.fences SET lease_expires_at = 0",
                f"CREATE TABLE {SCHEMA}.stolen (x int)",
                "CREATE TEMP TABLE stolen (x int)",
                "CREATE TABLE public.stolen (x int)",
                f"ALTER FUNCTION {SCHEMA}.fleet_scaler_timers_due() OWNER TO CURRENT_USER",
                f"CREATE OR REPLACE FUNCTION {SCHEMA}.fleet_scaler_timers_due() RETURNS "
                "bigint LANGUAGE sql AS 'SELECT 0::bigint'"]
            for statement in statements:
                try:
                    await conn.execute(statement)
                except asyncpg.InsufficientPrivilegeError:
                    out.append(statement)
                except asyncpg.PostgresError as exc:
                    raise AssertionError(f"{statement}: {type(exc).__name__}: {exc}") from exc
            return out
        finally:
            await conn.close()

    assert run_async(refused) == [
        *(f"SELECT count(*) FROM {SCHEMA}.{t}" for t in TABLES),
        f"SELECT * FROM {SCHEMA}.fleet_backlog(0)", f"DELETE FROM {SCHEMA}.executions",
        f"INSERT INTO {SCHEMA}.fences (ekey, token) VALUES ('\\x00', 1)",
        f"UPDATE {SCHEMA}.fences SET lease_expires_at = 0",
        f"CREATE TABLE {SCHEMA}.stolen (x int)", "CREATE TEMP TABLE stolen (x int)",
        "CREATE TABLE public.stolen (x int)",
        f"ALTER FUNCTION {SCHEMA}.fleet_scaler_timers_due() OWNER TO CURRENT_USER",
        f"CREATE OR REPLACE FUNCTION {SCHEMA}.fleet_scaler_timers_due() RETURNS bigint "
        "LANGUAGE sql AS 'SELECT 0::bigint'"]


def test_only_the_two_scaler_functions_run_with_their_owners_rights(
        database: Database) -> None:
    async def definers() -> set[str]:
        conn = await asyncpg.connect(database.admin)
        try:
            rows = await conn.fetch("SELECT p.proname FROM pg_proc AS p WHERE p.prosecdef "
                                    "AND p.pronamespace = $1::regnamespace", SCHEMA)
            return {r["proname"] for r in rows}
        finally:
            await conn.close()

    # Every other function runs with the caller's rights: EXECUTE on it gives the
    # scaler nothing (it may touch no table); a new definer function must be added here.
    assert run_async(definers) == {"fleet_scaler_unowned", "fleet_scaler_timers_due"}
