"""The Postgres store's connections: the pool, the migrations on first use, typed errors.

``Database`` opens one asyncpg pool per store (shared with its snapshot store),
migrates it once and hands out ``Connections``: the store's queries run on
connections it keeps checked out of that pool, one per query at a time. asyncpg's
own ``pool.fetchrow`` acquires and releases a connection per call (a task and a
shielded release each): on a 3-step execution that cost more CPU than the queries
(decision 0029 measured it), so the store keeps its connections and hands them
over from a free list instead. ``translate`` turns what asyncpg or the server raised
into fleet's typed errors.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from fleet.kernel.errors import (
    ConfigurationError,
    DuplicateSequenceError,
    FleetError,
    MissingDependencyError,
    SchemaVersionError,
    StoreError,
    StoreUnavailableError,
    UnstorableValueError,
    ValidationError,
)
from fleet.kernel.store.pg_migrations import (
    MIGRATIONS,
    OLDEST_CODE,
    SCHEMA_VERSION,
    VERSION_TABLE,
    VERSION_TABLE_COMPAT,
)

try:
    import asyncpg as asyncpg  # type: ignore[import-untyped]  # (re-exported to postgres.py)
except ImportError as exc:  # pragma: no cover - exercised by the factory test
    raise MissingDependencyError("the Postgres store needs asyncpg: "
                                 "pip install 'fleet-durable[postgres]'") from exc

OWN_QUERY_KEYS = ("schema", "pool_min", "pool_max")

# What a stuck session may hold up is bounded (issue 25 item 10). An open transaction
# anywhere on the server holds the committed feed, and so the relay, back (decision
# 0020), and a row lock it holds stalls every write of that execution (a renewal
# too). fleet never leaves a transaction open between statements and its statements
# are short, so these end what is stuck, never what works: a migration lifts the two
# statement limits for its own transaction. A URL that names one (``?lock_timeout=2s``;
# ``0`` turns it off) sets it instead. deploy/postgres/roles.sql sets the idle limit
# for every session of the database, the statement limits for the runtime role.
SESSION_TIMEOUTS = {"idle_in_transaction_session_timeout": "60s", "statement_timeout": "60s",
                    "lock_timeout": "10s"}

CONNECTION_LOST: tuple[type[BaseException], ...] = (
    asyncpg.PostgresConnectionError, asyncpg.InterfaceError, OSError, TimeoutError,
    asyncpg.exceptions.OperatorInterventionError, asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.InternalClientError)  # a connection left in a broken state


def unavailable(exc: BaseException) -> StoreUnavailableError:
    return StoreUnavailableError(f"Postgres is unavailable: {type(exc).__name__}: {exc}")


def translate(exc: Exception) -> Exception:
    """A typed fleet error for whatever asyncpg or the server raised."""
    if isinstance(exc, FleetError):
        return exc
    if isinstance(exc, CONNECTION_LOST):
        return unavailable(exc)
    if isinstance(exc, (UnicodeError, OverflowError)):
        # The checks before a call refuse these first; a backstop, typed alike.
        return UnstorableValueError(f"Postgres cannot keep a value: {type(exc).__name__}: "
                                    f"{exc}")
    if isinstance(exc, asyncpg.PostgresError):
        state = str(getattr(exc, "sqlstate", "") or "")
        if state == "FL004":
            return ConfigurationError(
                f"{exc}: fleet's Postgres connections must run at READ COMMITTED. A "
                "connection pooler that drops startup parameters (PgBouncer in "
                "transaction mode) loses it; set default_transaction_isolation = "
                "'read committed' on the fleet role or connect directly")
        if state == "23505":
            return DuplicateSequenceError(f"Postgres refused a duplicate row: {exc}")
        if state in ("40001", "40P01", "55P03", "57014"):
            # serialization failure, deadlock, lock or statement timeout: nothing was written
            return StoreUnavailableError(f"Postgres gave up on the call ({state}): {exc}; "
                                         "nothing was written, retry")
        if state.startswith("22") or state == "54000":
            return ValidationError(f"Postgres refused a value: {exc}")
        return StoreError(f"Postgres failed ({state}): {exc}")
    return exc




def split_url(url: str) -> tuple[str, dict[str, str]]:
    """The URL asyncpg gets, and this module's own query options taken out of it."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    own = {k: v for k, v in query if k in OWN_QUERY_KEYS}
    rest = [(k, v) for k, v in query if k not in OWN_QUERY_KEYS]
    return urlunsplit(parts._replace(query=urlencode(rest))), own


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def keep_session(conn: Any) -> None:
    """Pool reset hook: fleet never changes session state, so no reset round trip."""


@dataclass(frozen=True, slots=True)
class SchemaStatus:
    """Where a database's fleet schema stands (``fleet db status`` / ``fleet db upgrade``).

    Attributes:
        version: The schema version the database holds (0: no fleet schema yet).
        latest: The newest version this fleet knows (``SCHEMA_VERSION``).
        applied: The migrations this call applied, oldest first (empty for a status).
        schema: The Postgres schema holding the tables (None: the ``search_path``).
        oldest_code: The oldest code (by the schema version it knows) that may run
            against the database: the largest ``oldest_code`` its migrations
            recorded (decision 0049; 0 when it has no schema yet).
    """

    version: int
    latest: int
    applied: tuple[int, ...] = ()
    schema: str | None = None
    oldest_code: int = 0

    @property
    def compatible(self) -> bool:
        """Whether this code may run against the database as it is (after ``pending``):
        not newer, or newer and declaring this code compatible (a rollback)."""
        return self.version <= self.latest or self.oldest_code <= self.latest

    @property
    def pending(self) -> tuple[int, ...]:
        """Migrations this fleet would apply (none when the database is newer)."""
        return tuple(range(self.version + 1, self.latest + 1))

    @property
    def state(self) -> str:
        """``current``, ``behind`` (``fleet db upgrade`` applies ``pending``) or ``newer``."""
        if self.version > self.latest:
            return "newer"
        return "behind" if self.version < self.latest else "current"


class Database:
    """One pool, opened lazily and migrated once; shared by an event and a snapshot store."""

    def __init__(self, url: str, *, pool_min: int | None, pool_max: int | None,
                 schema: str | None, connect_timeout: float, migrate: bool) -> None:
        dsn, own = split_url(url)
        self.dsn = dsn
        # The URL's own server settings (asyncpg passes a query's other keys as such).
        self._url_settings = {k for k, _ in parse_qsl(urlsplit(dsn).query)}
        self.schema = schema if schema is not None else own.get("schema")
        try:
            self.pool_min = pool_min if pool_min is not None else int(own.get("pool_min", 1))
            self.pool_max = pool_max if pool_max is not None else int(own.get("pool_max", 10))
        except ValueError as exc:
            raise ConfigurationError(f"pool_min / pool_max in the URL must be integers: "
                                     f"{exc}") from exc
        if not 0 <= self.pool_min <= self.pool_max or self.pool_max < 1:
            raise ConfigurationError(f"pool sizes need 0 <= pool_min <= pool_max >= 1, got "
                                     f"{self.pool_min} and {self.pool_max}")
        self.connect_timeout = connect_timeout
        self.migrate = migrate
        self.pool: Any = None
        self.users = 1
        self.closed = False
        self._opening: asyncio.Lock | None = None

    async def ready(self) -> Any:
        if self.pool is not None:
            return self.pool
        if self.closed:
            raise StoreError("the Postgres store is closed")
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self.pool is None:
                self.pool = await self._open()
        return self.pool

    def server_settings(self) -> dict[str, str]:
        settings = {"default_transaction_isolation": "read committed", "jit": "off"}
        settings.update({k: v for k, v in SESSION_TIMEOUTS.items()
                         if k not in self._url_settings})
        if self.schema:
            settings["search_path"] = quote_ident(self.schema)
        return settings

    async def _open(self) -> Any:
        try:
            pool = await asyncpg.create_pool(
                self.dsn, min_size=self.pool_min, max_size=self.pool_max,
                timeout=self.connect_timeout, server_settings=self.server_settings(),
                reset=keep_session)
        except Exception as exc:
            raise translate(exc) from exc
        try:
            async with pool.acquire() as conn:
                await self._check_and_migrate(conn)
        except BaseException:
            await pool.close()
            raise
        return Connections(pool, self.pool_max)

    async def schema_status(self, *, upgrade: bool) -> SchemaStatus:
        """The schema version on a connection of its own (no pool); migrate first if asked."""
        try:
            conn = await asyncpg.connect(self.dsn, timeout=self.connect_timeout,
                                         server_settings=self.server_settings())
        except Exception as exc:
            raise translate(exc) from exc
        try:
            applied = await self._check_and_migrate(conn, force=True) if upgrade else ()
            version = await self._version(conn)
            oldest = await self._oldest_code(conn)
        except Exception as exc:
            raise translate(exc) from exc
        finally:
            await conn.close()
        return SchemaStatus(version, SCHEMA_VERSION, applied, self.schema, oldest)

    async def _check_and_migrate(self, conn: Any, *, force: bool = False) -> tuple[int, ...]:
        """Refuse a newer schema; apply missing migrations (if allowed); what was applied."""
        try:
            encoding = await conn.fetchval("SHOW server_encoding")
            if str(encoding).upper() not in ("UTF8", "UTF-8"):
                raise ConfigurationError(f"the database encoding is {encoding}; fleet needs "
                                         "UTF8 to keep ids and payloads exactly")
            current = await self._version(conn)
            if current > SCHEMA_VERSION:
                await self._refuse_newer(conn, current)
                return ()
            if current < SCHEMA_VERSION:
                if not (self.migrate or force):
                    raise SchemaVersionError(f"the database schema is version {current}, "
                                             f"this fleet needs {SCHEMA_VERSION}: run "
                                             "`fleet db upgrade`")
                return await self._migrate(conn)
        except Exception as exc:
            raise translate(exc) from exc
        return ()

    async def _refuse_newer(self, conn: Any, current: int) -> None:
        """A newer schema runs only if every migration above this code declares it
        compatible (decision 0049); otherwise a clear refusal."""
        oldest = await self._oldest_code(conn)
        if oldest <= SCHEMA_VERSION:
            return
        raise SchemaVersionError(
            f"the database schema is version {current} and needs fleet code that knows "
            f"version {oldest} or later; this fleet knows up to {SCHEMA_VERSION}: upgrade "
            "fleet (a rollback can only go back to code the schema declares compatible: "
            "`fleet db status` shows oldest_code; see docs/operations.md, Rolling back)")

    async def _oldest_code(self, conn: Any) -> int:
        """The database's ``oldest_code`` (decision 0049): a row of a migration applied
        before the column existed counts as its own version."""
        if await conn.fetchval("SELECT to_regclass('fleet_schema_version')") is None:
            return 0
        has = await conn.fetchval(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = "
            "to_regclass('fleet_schema_version') AND attname = 'oldest_code' "
            "AND NOT attisdropped")
        column = "coalesce(oldest_code, version)" if has else "version"
        return int(await conn.fetchval(
            f"SELECT coalesce(max({column}), 0) FROM fleet_schema_version"))

    async def _version(self, conn: Any) -> int:
        if await conn.fetchval("SELECT to_regclass('fleet_schema_version')") is None:
            return 0
        return int(await conn.fetchval(
            "SELECT coalesce(max(version), 0) FROM fleet_schema_version"))

    async def _migrate(self, conn: Any) -> tuple[int, ...]:
        applied: list[int] = []
        async with conn.transaction(isolation="read_committed"):
            # Serialise migrators of this schema across processes.
            # A migration may wait for another and rewrite whole tables: no limit of
            # SESSION_TIMEOUTS's applies to it.
            await conn.execute("SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0")
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))",
                               f"fleet-migrate:{self.schema or ''}")
            if self.schema:
                await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(self.schema)}")
            await conn.execute(VERSION_TABLE)
            current = await self._version(conn)
            if current > SCHEMA_VERSION:
                await self._refuse_newer(conn, current)
                return ()
            await conn.execute(VERSION_TABLE_COMPAT)
            for version, sql in MIGRATIONS:
                if version > current:
                    await conn.execute(sql)
                    await conn.execute("INSERT INTO fleet_schema_version (version, oldest_code) "
                                       "VALUES ($1, $2)", version, OLDEST_CODE[version])
                    applied.append(version)
            # Rows applied before decision 0049 learn what this code knows of them.
            await conn.execute(
                "UPDATE fleet_schema_version AS s SET oldest_code = u.c "
                "FROM unnest($1::integer[], $2::integer[]) AS u(v, c) "
                "WHERE s.version = u.v AND s.oldest_code IS NULL",
                list(OLDEST_CODE), list(OLDEST_CODE.values()))
        return tuple(applied)

    async def release(self) -> None:
        self.users -= 1
        if self.users > 0 or self.closed:
            return
        self.closed = True
        pool, self.pool = self.pool, None
        if pool is not None:
            await pool.close()


# asyncpg's pool lends a proxy whose every method call is one more Python call (it
# checks that it is still lent, then calls its connection); while the store holds a
# proxy it calls the connection behind it (decision 0031). Where a later asyncpg has
# no ``_con`` slot, the proxy itself is called, as before.
_BEHIND = "_con" in getattr(asyncpg.pool.PoolConnectionProxy, "__slots__", ())


def _usable(conn: Any) -> bool:
    """Whether a kept connection can still take a query (not closed, nor taken back)."""
    try:
        raw = conn._con if _BEHIND else conn
        return raw is not None and not raw.is_closed()
    except asyncpg.InterfaceError:
        return False  # the pool took it back when its connection closed


class Connections:
    """The store's connections: kept checked out of the asyncpg pool, one query each at a time.

    ``run`` (and ``fetch``/``fetchrow``/``fetchval``/``execute``) takes an idle
    connection (the most recently used), or check a new one out of the pool while fewer than
    ``size`` are held, or wait for one. A connection whose query failed other
    than with a server error (a lost link, a cancellation mid-query: its state is
    unknown) is terminated and handed back to the pool, which replaces it.
    """

    __slots__ = ("_closed", "_held", "_idle", "_waiters", "pool", "size")

    def __init__(self, pool: Any, size: int) -> None:
        self.pool = pool
        self.size = max(1, size)
        self._idle: list[Any] = []
        self._held = 0
        self._waiters: deque[asyncio.Future[Any]] = deque()
        self._closed = False

    def _idle_one(self) -> Any:
        """An idle connection that can take a query, or None (no coroutine: the common case)."""
        idle = self._idle
        while idle:
            conn = idle.pop()
            if _usable(conn):
                return conn
            self._drop(conn)  # its link died while idle (a restart): the pool replaces it
        return None

    async def _take(self) -> Any:
        while True:
            conn = self._idle_one()
            if conn is not None:
                return conn
            if self._held < self.size:
                self._held += 1
                try:
                    return await self.pool.acquire()
                except BaseException:
                    self._held -= 1
                    self._wake()
                    raise
            waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                conn = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                    self._give(waiter.result())  # handed over as we were cancelled
                raise
            if conn is not None:
                return conn
            # None: a connection was dropped, so there is room to check one out.

    def _give(self, conn: Any) -> None:
        if self._closed:
            self._drop(conn)
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self._idle.append(conn)

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _drop(self, conn: Any) -> None:
        self._held -= 1
        try:
            conn.terminate()  # asyncpg hands a terminated connection's slot back to the pool
        except asyncpg.InterfaceError:
            pass  # the pool took it back already (its connection closed)
        finally:
            self._wake()

    async def run(self, method: str, query: str, args: tuple[Any, ...]) -> Any:
        """``method`` (``fetch``, ``fetchrow``, ``fetchval`` or ``execute``) of ``query``
        with ``args`` on a kept connection; the store's one call per query."""
        conn = self._idle_one() or await self._take()
        try:
            raw = conn._con if _BEHIND else conn
            if raw is None:  # taken back by the pool since (its connection closed)
                raise asyncpg.InterfaceError(f"cannot call Connection.{method}(): connection "
                                             "has been released back to the pool")
            result = await getattr(raw, method)(query, *args)
        except asyncpg.PostgresError:
            self._give(conn)  # the server refused the statement; the session is fine
            raise
        except BaseException:
            self._drop(conn)
            raise
        self._give(conn)
        return result

    async def fetch(self, query: str, *args: Any) -> Any:
        return await self.run("fetch", query, args)

    async def fetchrow(self, query: str, *args: Any) -> Any:
        return await self.run("fetchrow", query, args)

    async def fetchval(self, query: str, *args: Any) -> Any:
        return await self.run("fetchval", query, args)

    async def execute(self, query: str, *args: Any) -> Any:
        return await self.run("execute", query, args)

    def get_min_size(self) -> int:
        return int(self.pool.get_min_size())

    def get_max_size(self) -> int:
        return int(self.pool.get_max_size())

    async def expire_connections(self) -> None:
        """After a lost link: drop the idle connections; the pool replaces them all."""
        idle, self._idle = self._idle, []
        for conn in idle:
            self._drop(conn)
        await self.pool.expire_connections()

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            self._held -= 1
            await self.pool.release(conn)
        await self.pool.close()
