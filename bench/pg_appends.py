"""Fenced appends per second on Postgres, with and without group commit.

    .venv/bin/python -m bench.pg_appends [--url URL] [--rounds 30] [--pool-max 10]

Two workloads, each on the plain ``PostgresEventStore`` and wrapped in
``CoalescingEventStore``:

- ``1 writer``: one execution, fenced appends one after another (latency bound);
- ``32 executions``: 32 executions at once, each making 5 separate fenced
  appends one after another (what 32 concurrent runs do to the store), repeated
  over ``rounds`` sets of fresh executions.

Only the appends are timed (the start event and the fence are set up first).
Runs in a schema of its own, dropped at the end. Prints a table and writes
``bench/results/pg_appends.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import asyncpg

from fleet.kernel.store.coalescing import CoalescingEventStore
from fleet.kernel.store.conformance import make_event, started
from fleet.kernel.store.postgres import PostgresEventStore
from fleet.kernel.store.spi import EventStore

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"


async def one_writer(store: EventStore, tag: str, appends: int) -> float:
    x = f"{tag}-solo"
    await store.append(started(x))
    grant = await store.acquire_fence(x, holder="bench", lease_ms=600_000)
    begin = time.perf_counter()
    for sequence in range(1, appends + 1):
        await store.append(make_event(x, sequence), fence=grant.token)
    return appends / (time.perf_counter() - begin)


async def concurrent(store: EventStore, tag: str, executions: int, each: int,
                     rounds: int) -> float:
    spent = 0.0
    for r in range(rounds):
        ids = [f"{tag}-{r}-{i}" for i in range(executions)]
        await asyncio.gather(*(store.append(started(x)) for x in ids))
        grants = await asyncio.gather(*(store.acquire_fence(x, holder="bench",
                                                            lease_ms=600_000) for x in ids))

        async def run(x: str, token: int) -> None:
            for sequence in range(1, each + 1):
                await store.append(make_event(x, sequence), fence=token)

        begin = time.perf_counter()
        await asyncio.gather(*(run(x, g.token) for x, g in zip(ids, grants, strict=True)))
        spent += time.perf_counter() - begin
    return executions * each * rounds / spent


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=os.environ.get("FLEET_DATABASE_URL", DEFAULT_URL))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--solo", type=int, default=2000, help="appends of the 1-writer case")
    parser.add_argument("--pool-max", type=int, default=10)
    parser.add_argument("--inflight", type=int, default=4, help="group commit: flushes at once")
    parser.add_argument("--wait-ms", type=float, default=0.0, help="group commit: max wait")
    args = parser.parse_args()
    schema = f"bench_{secrets.token_hex(4)}"
    rows: list[dict[str, Any]] = []
    try:
        for label, coalesce in (("plain", False), ("group commit", True)):
            inner = await PostgresEventStore(args.url, schema=schema, pool_min=args.pool_max,
                                             pool_max=args.pool_max).open()
            store: EventStore = inner
            if coalesce:
                store = CoalescingEventStore(inner, max_batch=256, max_wait_ms=args.wait_ms,
                                             max_inflight=args.inflight)
            tag = "c" if coalesce else "p"
            await concurrent(store, f"{tag}-warm", 32, 5, 2)  # warm the pool and caches
            solo = await one_writer(store, tag, args.solo)
            extra = ""
            if isinstance(store, CoalescingEventStore):
                store.flushes = store.flushed = 0
            wide = await concurrent(store, tag, 32, 5, args.rounds)
            if isinstance(store, CoalescingEventStore):
                extra = (f"{store.flushed / max(store.flushes, 1):.1f} appends/flush at c32 "
                         f"(inflight {args.inflight}, wait {args.wait_ms} ms)")
            rows.append({"store": label, "one_writer_appends_per_s": round(solo),
                         "c32_appends_per_s": round(wide), "note": extra})
            await store.close()
    finally:
        conn = await asyncpg.connect(args.url)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()
    print(f"{'store':<14}{'1 writer':>14}{'32 executions':>16}  note")
    for row in rows:
        print(f"{row['store']:<14}{row['one_writer_appends_per_s']:>10} /s "
              f"{row['c32_appends_per_s']:>12} /s  {row['note']}")
    out = Path(__file__).parent / "results" / "pg_appends.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"pool_max": args.pool_max, "rounds": args.rounds,
                               "inflight": args.inflight, "wait_ms": args.wait_ms,
                               "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
