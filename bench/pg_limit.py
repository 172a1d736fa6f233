"""The machine's limit for durable single-row writes: pgbench of one INSERT per transaction.

Used by ``bench.kernel`` to put fleet's appends/s against what the same server
does with the cheapest possible durable write: ``pgbench -n -f script -c N -j 2
-T seconds`` where the script is one ``INSERT`` into a throwaway table (its own
throwaway database, dropped afterwards). Each script run is one transaction and
one commit, as a plain fleet append is.
"""

from __future__ import annotations

import asyncio
import glob
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

SCRIPT = "INSERT INTO fleet_bench_insert (v) VALUES (1);\n"
_TPS = re.compile(r"^tps = ([0-9.]+) \(without initial connection time\)", re.MULTILINE)


def pgbench_binary() -> str | None:
    """``pgbench`` on PATH, else the newest under ``/usr/lib/postgresql/*/bin``."""
    found = shutil.which("pgbench")
    if found:
        return found
    local = sorted(glob.glob("/usr/lib/postgresql/*/bin/pgbench"))
    return local[-1] if local else None


def with_database(url: str, database: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + database))


async def _admin(url: str, sql: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def insert_tps(url: str, concurrencies: tuple[int, ...] = (1, 32),
                     seconds: int = 5) -> dict[int, float]:
    """Transactions/s of a single-row INSERT at each concurrency (``-j 2``).

    Raises:
        FileNotFoundError: no pgbench binary on this machine.
        subprocess.CalledProcessError: pgbench failed (its output is in the error).
    """
    binary = pgbench_binary()
    if binary is None:
        raise FileNotFoundError("pgbench is not installed (PATH, /usr/lib/postgresql/*/bin)")
    database = f"fleet_bench_pgbench_{secrets.token_hex(4)}"
    await _admin(url, f'CREATE DATABASE "{database}"')
    target = with_database(url, database)
    results: dict[int, float] = {}
    try:
        await _admin(target, "CREATE TABLE fleet_bench_insert (id bigserial PRIMARY KEY, "
                             "v int NOT NULL)")
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "insert.sql")
            await asyncio.to_thread(Path(script).write_text, SCRIPT)
            for clients in concurrencies:
                done = await asyncio.to_thread(
                    subprocess.run,
                    [binary, "-n", "-f", script, "-c", str(clients), "-j", "2", "-T",
                     str(seconds), target],
                    capture_output=True, text=True, check=True, timeout=seconds + 60)
                match = _TPS.search(done.stdout)
                if match is None:
                    raise subprocess.CalledProcessError(0, binary, done.stdout, done.stderr)
                results[clients] = float(match.group(1))
    finally:
        await _admin(url, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    return results


if __name__ == "__main__":
    print(asyncio.run(insert_tps(os.environ.get(
        "FLEET_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"))))
