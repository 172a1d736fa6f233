"""Server time per group-commit flush on Postgres: schema version 5 against the current one.

    .venv/bin/python -m bench.pg_flush [--url URL] [--batches 200] [--items 15] [--repeat 3]

One connection calls ``fleet_append_many_leased`` and ``fleet_append_many`` the way
the coalescing store does, one flush after another (no concurrency: the server
time is the functions' own work, not lock waits nor a CPU shared with 32 clients):
``items`` executions per batch, each batch four flushes (the starts, two fenced
steps, the last step), the leased flavour taking the fence with the starts and
ending the lease with the last step, every other batch the plain flavour with no
fence. The same flushes run on three schemas of their own, in turn, ``repeat``
times:

- ``v5``: migrations 1-5 (before decision 0029's "Server cost per flush");
- ``v5 generic``: the same, its plpgsql functions altered to
  ``plan_cache_mode = force_generic_plan`` (how much of the difference that alone is);
- ``current``: every migration of this fleet.

Server time per call is ``pg_stat_user_functions.self_time / calls`` (the session
sets ``track_functions = pl``: needs a superuser); the round trip is the client's
median. Prints a table (medians over the repeats) and writes
``bench/results/pg_flush.json`` with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import time
from pathlib import Path
from typing import Any

import asyncpg

from fleet.kernel.store.conformance import make_event, started
from fleet.kernel.store.pg_migrations import MIGRATIONS, SCHEMA_VERSION, VERSION_TABLE
from fleet.kernel.store.pg_queries import APPEND_MANY_SQL, Write, many_columns

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
VARIANTS = ("v5", "v5 generic", "current")
# The leased flush as schema 5 and 6 take it (every variant has it; schema 7 added a
# flavour on the server's clock, decision 0044): holders, expiries, releases, now.
V6_MANY_LEASED_SQL = ("SELECT codes, details FROM fleet_append_many_leased("
                      + ", ".join(f"${i}" for i in range(1, 28)) + ")")


async def make_schema(url: str, variant: str) -> str:
    schema = f"bench_flush_{secrets.token_hex(4)}"
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f'CREATE SCHEMA "{schema}"; SET search_path = "{schema}"')
        await conn.execute(VERSION_TABLE)
        for version, sql in MIGRATIONS if variant == "current" else MIGRATIONS[:5]:
            await conn.execute(sql)
            await conn.execute("INSERT INTO fleet_schema_version (version) VALUES ($1)", version)
        if variant == "v5 generic":
            for (signature,) in await conn.fetch(
                    "SELECT p.oid::regprocedure::text FROM pg_proc AS p JOIN pg_language AS l "
                    "ON l.oid = p.prolang WHERE p.pronamespace = $1::regnamespace "
                    "AND l.lanname = 'plpgsql'", schema):
                await conn.execute(
                    f"ALTER FUNCTION {signature} SET plan_cache_mode = force_generic_plan")
    finally:
        await conn.close()
    return schema


async def flushes(url: str, schema: str, batches: int, items: int) -> dict[str, float]:
    """Run the flushes; the client's median round trip (ms) of each flavour."""
    conn = await asyncpg.connect(url, server_settings={"search_path": schema,
                                                        "track_functions": "pl"})
    spent: dict[str, list[float]] = {"leased": [], "plain": []}
    try:
        for batch in range(batches):
            ids = [f"x{batch}-{i}" for i in range(items)]
            leased = batch % 2 == 0
            tokens: dict[str, int] = {}
            for step in range(4):
                prepared = [(i, Write.of(x, [started(x) if step == 0 else make_event(x, step)],
                                         None), tokens.get(x)) for i, x in enumerate(ids)]
                columns = many_columns(prepared)
                begin = time.perf_counter()
                if leased:
                    take = step == 0
                    row = await conn.fetchrow(V6_MANY_LEASED_SQL, *columns,
                                              ["bench"] * items if take else None,
                                              [2**62] * items if take else None,
                                              None if take else [step == 3] * items, 0)
                else:
                    row = await conn.fetchrow(APPEND_MANY_SQL, *columns)
                spent["leased" if leased else "plain"].append(time.perf_counter() - begin)
                if set(row["codes"]) != {0}:
                    raise RuntimeError(f"a flush was refused: {row['codes']}")
                if leased and step == 0:
                    tokens = {write.execution_id: token for (_, write, _), token
                              in zip(prepared, row["details"], strict=True)}
    finally:
        await conn.close()  # its function statistics are reported when it ends
    return {flavour: statistics.median(times) * 1000 for flavour, times in spent.items()}


async def server_ms(url: str, schema: str) -> dict[str, float]:
    conn = await asyncpg.connect(url)
    try:
        for _ in range(50):  # the closed session's statistics arrive shortly after
            rows = await conn.fetch(
                "SELECT funcname, self_time / calls AS ms FROM pg_stat_user_functions "
                "WHERE schemaname = $1 AND funcname LIKE 'fleet_append_many%' AND calls > 0",
                schema)
            if len(rows) == 2:
                return {r["funcname"]: r["ms"] for r in rows}
            await asyncio.sleep(0.1)
            await conn.execute("SELECT pg_stat_clear_snapshot()")
        raise RuntimeError("no function statistics: track_functions needs a superuser")
    finally:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=os.environ.get("FLEET_DATABASE_URL", DEFAULT_URL))
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--items", type=int, default=15, help="requests per flush")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeat):
        for variant in VARIANTS:  # in turn, so the machine's noise falls on each
            schema = await make_schema(args.url, variant)
            client = await flushes(args.url, schema, args.batches, args.items)
            server = await server_ms(args.url, schema)
            runs[variant].append({
                "many_leased_server_ms": server["fleet_append_many_leased"],
                "many_server_ms": server["fleet_append_many"],
                "many_leased_round_trip_ms": client["leased"],
                "many_round_trip_ms": client["plain"]})
    rows: list[dict[str, Any]] = []
    for variant, found in runs.items():
        rows.append({"schema": variant, **{key: round(statistics.median(r[key] for r in found), 3)
                                           for key in found[0]}})
    base = rows[0]
    print(f"{args.items} requests a flush, {args.batches * 4} flushes a run, medians of "
          f"{args.repeat} (ms; server = pg_stat_user_functions self time per call)")
    print(f"{'schema':<12}{'leased server':>15}{'plain server':>14}{'leased rt':>11}"
          f"{'plain rt':>10}{'server vs v5':>14}")
    for row in rows:
        ratio = row["many_leased_server_ms"] / base["many_leased_server_ms"]
        print(f"{row['schema']:<12}{row['many_leased_server_ms']:>15.3f}"
              f"{row['many_server_ms']:>14.3f}{row['many_leased_round_trip_ms']:>11.3f}"
              f"{row['many_round_trip_ms']:>10.3f}{ratio:>13.2f}x")
    out = Path(__file__).parent / "results" / "pg_flush.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "schema_version": SCHEMA_VERSION, "items": args.items, "batches": args.batches,
        "repeat": args.repeat, "load_average": list(os.getloadavg()), "results": rows,
        "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
