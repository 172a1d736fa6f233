"""``FLEET_*`` environment variables -> ``FleetSettings`` -> the store they configure.

The Postgres cases run against a real server (a throwaway database this module
creates and drops), so a pool size is checked by the connections the server
sees, the event limit by a refused write, and group commit by flushes that
carried more than one append.
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import asyncpg
import pydantic
import pytest

from fleet import Context, Runtime, flow
from fleet.config import FleetSettings
from fleet.host.kernel import open_store
from fleet.kernel.errors import ConfigurationError, PayloadTooLargeError
from fleet.kernel.events import EventType
from fleet.kernel.store.coalescing import CoalescingEventStore
from fleet.kernel.store.conformance import make_event, started
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.postgres import PostgresEventStore
from fleet.kernel.store.sqlite import SqliteEventStore

pytestmark = pytest.mark.integration

_ENV = ("FLEET_DATABASE_URL", "FLEET_PG_POOL_MIN", "FLEET_PG_POOL_MAX", "FLEET_MAX_EVENT_BYTES",
        "FLEET_GROUP_COMMIT", "FLEET_GROUP_COMMIT_MAX_BATCH", "FLEET_GROUP_COMMIT_MAX_WAIT_MS",
        "FLEET_GROUP_COMMIT_MAX_INFLIGHT")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The environment with none of this module's variables set by the caller's shell."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _double(x: int) -> int:
    return 2 * x


@flow("settings-two-steps", steps=["a", "b"])
async def two_steps(ctx: Context, n: int) -> int:
    n = await ctx.step("a", _double, n)
    return int(await ctx.step("b", _double, n))


async def _connections(url: str) -> int:
    """Connections the server has open to this database, other than the one asking."""
    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()"))
    finally:
        await conn.close()


async def test_postgres_with_group_commit_from_env(database_url: str,
                                                   env: pytest.MonkeyPatch) -> None:
    schema = f"env_{secrets.token_hex(4)}"
    env.setenv("FLEET_DATABASE_URL", f"{database_url}?schema={schema}")
    env.setenv("FLEET_PG_POOL_MIN", "2")
    env.setenv("FLEET_PG_POOL_MAX", "3")
    env.setenv("FLEET_MAX_EVENT_BYTES", "4096")
    env.setenv("FLEET_GROUP_COMMIT", "true")
    env.setenv("FLEET_GROUP_COMMIT_MAX_BATCH", "8")
    env.setenv("FLEET_GROUP_COMMIT_MAX_WAIT_MS", "2.5")
    env.setenv("FLEET_GROUP_COMMIT_MAX_INFLIGHT", "2")

    store = open_store(FleetSettings())
    assert isinstance(store, CoalescingEventStore)
    assert (store.max_batch, store.max_wait) == (8, 0.0025)
    inner = store.inner
    assert isinstance(inner, PostgresEventStore)
    assert inner.schema == schema
    try:
        await inner.open()
        assert await _connections(database_url) == 2  # pool_min, opened eagerly
        assert inner._db.pool.get_max_size() == 3

        # The size limit holds through the coalescing layer, before anything is written.
        await store.append(started("big"))
        with pytest.raises(PayloadTooLargeError):
            await store.append(make_event("big", 1, payload={"stepId": "s", "output":
                                                             "x" * 5000}))
        assert await store.head("big") == 0

        # Runs share flushes, and never use more than pool_max connections.
        runtime = Runtime(store, flows=[two_steps])
        handles = await asyncio.gather(*(runtime.start("settings-two-steps", i)
                                         for i in range(24)))
        assert await asyncio.gather(*(h.result(timeout=30) for h in handles)) == [
            4 * i for i in range(24)]
        await runtime.close()
        assert store.flushed > store.flushes
        assert await _connections(database_url) <= 3
        log = await store.read(handles[0].execution_id)
        assert log[-1].type == EventType.EXECUTION_COMPLETED
    finally:
        await store.close()


async def test_postgres_defaults_leave_the_url_options(database_url: str,
                                                       env: pytest.MonkeyPatch) -> None:
    schema = f"env_{secrets.token_hex(4)}"
    env.setenv("FLEET_DATABASE_URL", f"{database_url}?schema={schema}&pool_min=1&pool_max=5")
    store = open_store(FleetSettings())
    assert isinstance(store, CoalescingEventStore)  # group commit is on by default
    assert (store.max_batch, store.max_wait) == (256, 0.0)
    await store.close()
    env.setenv("FLEET_GROUP_COMMIT", "false")  # and off when asked
    store = open_store(FleetSettings())
    assert isinstance(store, PostgresEventStore)
    try:
        await store.open()
        assert (store._db.pool.get_min_size(), store._db.pool.get_max_size()) == (1, 5)
        await store.append(started("ok"))
        # The default limit (16 MiB) takes what the 4 KiB one above refused.
        await store.append(make_event("ok", 1, payload={"stepId": "s", "output": "x" * 5000}))
        assert await store.head("ok") == 1
    finally:
        await store.close()


async def test_pool_sizes_from_env_win_over_the_url(database_url: str,
                                                    env: pytest.MonkeyPatch) -> None:
    env.setenv("FLEET_DATABASE_URL", f"{database_url}?schema=env_w&pool_min=1&pool_max=5")
    env.setenv("FLEET_PG_POOL_MAX", "2")
    env.setenv("FLEET_GROUP_COMMIT", "false")
    store = open_store(FleetSettings())
    assert isinstance(store, PostgresEventStore)
    try:
        await store.open()
        assert store._db.pool.get_max_size() == 2
    finally:
        await store.close()


async def test_embedded_backends_from_env(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("FLEET_DATABASE_URL", f"sqlite:///{tmp_path / 'fleet.db'}")
    sqlite = open_store(FleetSettings())
    assert isinstance(sqlite, SqliteEventStore)
    await sqlite.close()

    env.setenv("FLEET_DATABASE_URL", "memory:")
    env.setenv("FLEET_GROUP_COMMIT", "1")
    coalesced = open_store(FleetSettings())
    assert isinstance(coalesced, CoalescingEventStore)
    assert isinstance(coalesced.inner, MemoryEventStore)
    assert (coalesced.max_batch, coalesced.max_wait) == (256, 0.0)
    await coalesced.append(started("m"))
    assert await coalesced.head("m") == 0
    await coalesced.close()


@pytest.mark.parametrize(("name", "value"), [
    ("FLEET_GROUP_COMMIT_MAX_BATCH", "0"), ("FLEET_GROUP_COMMIT_MAX_WAIT_MS", "-1"),
    ("FLEET_PG_POOL_MAX", "0"), ("FLEET_MAX_EVENT_BYTES", "0"), ("FLEET_GROUP_COMMIT", "maybe")])
def test_bad_values_are_refused_when_read(env: pytest.MonkeyPatch, name: str,
                                          value: str) -> None:
    env.setenv(name, value)
    with pytest.raises(pydantic.ValidationError, match=name.removeprefix("FLEET_").lower()):
        FleetSettings()


def test_inconsistent_pool_sizes_are_a_configuration_error(database_url: str,
                                                           env: pytest.MonkeyPatch) -> None:
    env.setenv("FLEET_DATABASE_URL", database_url)
    env.setenv("FLEET_PG_POOL_MIN", "5")
    env.setenv("FLEET_PG_POOL_MAX", "2")
    with pytest.raises(ConfigurationError, match="pool sizes"):
        open_store(FleetSettings())
