"""Where the kernel's CPU goes per execution: cProfile over ``bench.kernel``'s 3-step flow.

Run: ``python -m bench.kernel_profile [--store memory|postgres] [--n 2000] [--top 25]``.
Never run as a test. Runs the flow sequentially (one execution at a time, the
way ``bench.kernel``'s sequential row does), after a warm-up; prints the process
CPU time per execution (user and system, ``os.times``, without the profiler; the
system part is mostly socket calls), then a second pass under cProfile timed by
process CPU (waiting is not in it) and its top functions by own time; writes
``bench/results/kernel_profile_<store>.json``. On Postgres the CPU is the
client's (this process): the server's work is not in it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import secrets
import time
from pathlib import Path
from typing import Any

from bench.kernel import DEFAULT_URL, three_steps
from fleet.kernel.runtime import Runtime
from fleet.kernel.store.factory import open_event_store
from fleet.kernel.store.spi import EventStore

RESULTS = Path(__file__).parent / "results"


async def _open(kind: str, url: str, schema: str) -> EventStore:
    if kind == "memory":
        return open_event_store("memory:")
    from fleet.kernel.store.postgres import PostgresEventStore

    return await PostgresEventStore(url, schema=schema).open()


async def _run(runtime: Runtime, n: int, base: int) -> None:
    for i in range(n):
        handle = await runtime.start("bench3", base + i)
        assert await handle.result() == base + i + 3


async def measure(kind: str, n: int, url: str, top: int) -> dict[str, Any]:
    schema = f"fleet_prof_{secrets.token_hex(4)}"
    store = await _open(kind, url, schema)
    runtime = Runtime(store, flows=[three_steps])
    try:
        await _run(runtime, 100, 0)  # warm-up
        t0, wall0 = os.times(), time.perf_counter()
        await _run(runtime, n, 1000)
        t1 = os.times()
        wall = time.perf_counter() - wall0
        user, system = t1.user - t0.user, t1.system - t0.system
        profiler = cProfile.Profile(time.process_time)  # CPU, not waiting
        profiler.enable()
        await _run(runtime, n, 10**6)
        profiler.disable()
    finally:
        await runtime.close()
        await store.close()
        if kind != "memory":
            import asyncpg

            conn = await asyncpg.connect(url)
            try:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            finally:
                await conn.close()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    rows = []
    for (file, line, name), (_cc, calls, tottime, cumtime, _) in sorted(
            stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]:  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}({name})", "calls_per_exec":
                     round(calls / n, 2), "own_us_per_exec": round(tottime / n * 1e6, 1),
                     "cum_us_per_exec": round(cumtime / n * 1e6, 1)})
    return {"store": kind, "executions": n,
            "cpu_ms_per_execution": round((user + system) / n * 1000, 3),
            "user_ms_per_execution": round(user / n * 1000, 3),
            "system_ms_per_execution": round(system / n * 1000, 3),
            "wall_ms_per_execution": round(wall / n * 1000, 3), "top": rows,
            "load_average": os.getloadavg(), "pstats": out.getvalue()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default="memory", choices=("memory", "postgres"))
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--url", default=os.environ.get("FLEET_DATABASE_URL", DEFAULT_URL))
    parser.add_argument("--tag", default="", help="suffix of the results file")
    args = parser.parse_args()
    doc = asyncio.run(measure(args.store, args.n, args.url, args.top))
    print(doc["pstats"])
    print(f"{args.store}: {doc['cpu_ms_per_execution']} ms CPU per execution (user "
          f"{doc['user_ms_per_execution']}, system {doc['system_ms_per_execution']}; "
          f"{doc['wall_ms_per_execution']} ms wall), load {doc['load_average'][0]:.1f}")
    RESULTS.mkdir(exist_ok=True)
    doc.pop("pstats")
    name = f"kernel_profile_{args.store}{'_' + args.tag if args.tag else ''}.json"
    (RESULTS / name).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
