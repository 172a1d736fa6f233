"""A PostgreSQL server for the tests, and throwaway databases on it.

Which server: ``FLEET_DATABASE_URL`` when it is set and answers; otherwise
127.0.0.1:5432 when it answers; otherwise one this module starts with the
local binaries (``/usr/lib/postgresql/*/bin``: initdb and pg_ctl) in a
temporary directory, stopped when the test process exits. Under CI
(``CI=true``) a ``FLEET_DATABASE_URL`` that does not answer fails the run
rather than being replaced, and no server at all fails it too: tests that
need Postgres never skip.

Every module that uses it gets its own database (``fleet_test_<random>``),
dropped at the end, so runs never see each other's data.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import glob
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

T = TypeVar("T")
LOCAL_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
_server: str | None = None
_lock = threading.Lock()


def run_async(make: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion on a private loop in a private thread.

    Sync fixtures use it, so the admin work never touches the loop a test runs on.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(make())  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + database))


def _answers(url: str) -> bool:
    async def probe() -> None:
        conn = await asyncpg.connect(url, timeout=3)
        await conn.close()

    try:
        run_async(probe)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
        return False
    return True


# The session's server is the one named when the tests began: a test that points the
# CLI at a SQLite file (monkeypatching FLEET_DATABASE_URL) before the first Postgres
# test of the run must not make that file "the server".
_CONFIGURED = os.environ.get("FLEET_DATABASE_URL")


def server_url() -> str:
    """A URL of a reachable server (its admin database), found or started once."""
    global _server
    with _lock:
        if _server is None:
            _server = _find_or_start()
        return _server


def _find_or_start() -> str:
    configured = _CONFIGURED
    if configured:
        if _answers(configured):
            return configured
        if os.environ.get("CI") == "true":
            pytest.fail(f"FLEET_DATABASE_URL={configured!r} does not answer; under CI the "
                        "Postgres tests fail rather than skip or substitute a server")
    if _answers(LOCAL_URL):
        return LOCAL_URL
    try:
        return _start_own()
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        pytest.fail(f"no PostgreSQL server: none answers at FLEET_DATABASE_URL or "
                    f"127.0.0.1:5432, and starting one failed: {exc}")


def postgres_binaries() -> str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise RuntimeError("no initdb under /usr/lib/postgresql/*/bin")
    return os.path.dirname(found[-1])


def psql() -> str:
    """psql, as an operator runs deploy/postgres/roles.sql; missing fails (never skips)."""
    found = shutil.which("psql")
    if found is None:
        try:
            candidate = os.path.join(postgres_binaries(), "psql")
        except RuntimeError:
            candidate = ""
        if not os.path.exists(candidate):
            pytest.fail("psql runs deploy/postgres/roles.sql: install the PostgreSQL client "
                        "(Debian: postgresql-client)")
        found = candidate
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class OwnServer:
    """A throwaway cluster in a temporary directory (used as a fallback and by the
    restart test, which must not restart a server others are using)."""

    def __init__(self) -> None:
        self.bin = postgres_binaries()
        self.dir = tempfile.mkdtemp(prefix="fleet-pg-")
        self.data = os.path.join(self.dir, "data")
        self.port = free_port()
        self.prefix: list[str] = []
        if os.geteuid() == 0:  # initdb refuses to run as root
            self.prefix = ["runuser", "-u", "postgres", "--"]
            shutil.chown(self.dir, "postgres", "postgres")
        self._run("initdb", "-D", self.data, "-U", "postgres", "-A", "trust", "-E", "UTF8",
                  "--locale=C.UTF-8")
        self.start()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self.prefix, os.path.join(self.bin, tool), *args], check=True,
                       capture_output=True, timeout=120)

    def _ctl(self, action: str, *extra: str) -> None:
        options = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 "
                   "-c fsync=off -c max_connections=50")
        self._run("pg_ctl", action, "-D", self.data, "-w", "-t", "60", "-o", options,
                  "-l", os.path.join(self.dir, "log"), *extra)

    def start(self) -> None:
        self._ctl("start")

    def restart(self) -> None:
        self._ctl("restart", "-m", "fast")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self._run("pg_ctl", "stop", "-D", self.data, "-m", "immediate", "-w")
        shutil.rmtree(self.dir, ignore_errors=True)


def _start_own() -> str:
    server = OwnServer()
    atexit.register(server.stop)
    return server.url


@contextlib.contextmanager
def throwaway_database(admin_url: str | None = None, *,
                       settings: dict[str, str] | None = None) -> Iterator[str]:
    """Create ``fleet_test_<random>`` (with database-level ``settings``), yield its URL,
    drop it."""
    admin = admin_url or server_url()
    name = f"fleet_test_{secrets.token_hex(6)}"

    async def create() -> None:
        conn = await asyncpg.connect(admin)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
            for key, value in (settings or {}).items():
                await conn.execute(f'ALTER DATABASE "{name}" SET {key} = '
                                   f"'{value}'")
        finally:
            await conn.close()

    async def drop() -> None:
        conn = await asyncpg.connect(admin)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    run_async(create)
    try:
        yield with_database(admin, name)
    finally:
        run_async(drop)
