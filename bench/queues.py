"""The cost of a queue's limit: starts/s and runs/s through limited queues beside none.

    .venv/bin/python -m bench.queues [--url URL] [--starts 1500] [--inflight 32] [--rounds 3]

One process, the kernel on Postgres as a fleet process opens it (group commit on), in
a schema of its own (dropped at the end). Two measures per case:

- ``starts/s``: ``start(..., drive=False)`` of a one-step flow, ``--inflight`` at once:
  what the dispatcher pays per start (a queued start is one queue pass more, in the
  store, and its park in the same write as its start);
- ``runs/s``: ``start(...)`` driven here, until every run completed: a binding limit
  adds a pass and a wake per run (the run that ends admits the next one).

The cases: no queue (the baseline; and with only 8 runs in flight, the parallelism a
limit of 8 allows, held by the caller), a queue without limits, a queue whose limit
never binds (``concurrency=10_000``), one that binds (``concurrency=8``), one per key
(``per_key_concurrency=1``, 100 keys). ``runs/s`` waits for each run's result. Prints
a table and writes ``bench/results/queues.json`` (with the load average: a shared
machine's figures move).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg

from fleet import Context, Queue, Runtime, flow
from fleet.kernel.store.factory import StoreOptions, open_event_store

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
RESULTS = Path(__file__).parent / "results" / "queues.json"


def work(n: int) -> int:
    return n


@flow("bench-queued")
async def queued(ctx: Context, n: int) -> int:
    return int(await ctx.step("work", work, n))


CASES: dict[str, tuple[Queue | None, Callable[[int], dict[str, Any]]]] = {
    "no queue": (None, lambda n: {}),
    # The same parallelism as "concurrency 8", held by the caller (8 starts in flight):
    # what a limit of 8 costs beyond running 8 at once.
    "no queue, 8 in flight": (None, lambda n: {}),
    "queue, no limits": (Queue("free"), lambda n: {"queue": "free"}),
    "concurrency 10000 (never binds)": (Queue("wide", concurrency=10_000),
                                        lambda n: {"queue": "wide"}),
    "concurrency 8 (binds)": (Queue("eight", concurrency=8), lambda n: {"queue": "eight"}),
    "per key 1, 100 keys": (Queue("keyed", per_key_concurrency=1),
                            lambda n: {"queue": "keyed", "key": f"k{n % 100}"}),
}


async def _gathered(count: int, inflight: int, make: Callable[[int], Any]) -> list[Any]:
    gate = asyncio.Semaphore(inflight)

    async def one(n: int) -> Any:
        async with gate:
            return await make(n)

    return await asyncio.gather(*(one(n) for n in range(count)))


async def _phase(url: str, queue: Queue | None, run: Callable[[Runtime], Any]) -> float:
    """``run(runtime)`` on a schema of its own (a phase never inherits another's slots);
    its seconds."""
    schema = f"bench_q_{secrets.token_hex(4)}"
    store = open_event_store(f"{url}?schema={schema}", StoreOptions(pool_max=10))
    try:
        rt = Runtime(store, flows=[queued], queues=[queue] if queue else [],
                     local_timers=False)
        await store.head("warm")  # the schema and the pool, before the clock starts
        begin = time.perf_counter()
        await run(rt)
        spent = time.perf_counter() - begin
        await rt.close()
        return spent
    finally:
        await store.close()
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()


async def measure(url: str, case: str, starts: int, inflight: int) -> dict[str, Any]:
    queue, kw = CASES[case]

    async def write(rt: Runtime) -> None:
        await _gathered(starts, inflight,
                        lambda n: rt.start("bench-queued", n, drive=False, **kw(n)))

    runs = max(starts // 3, 100)
    at_once = 8 if case == "no queue, 8 in flight" else inflight

    async def run_one(rt: Runtime, n: int) -> Any:
        return await (await rt.start("bench-queued", n, **kw(n))).result()

    async def drive(rt: Runtime) -> None:
        await _gathered(runs, at_once, lambda n: run_one(rt, n))

    written = starts / await _phase(url, queue, write)
    ran = runs / await _phase(url, queue, drive)
    return {"case": case, "starts_per_s": round(written), "runs_per_s": round(ran),
            "starts": starts, "runs": runs}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=os.environ.get("FLEET_DATABASE_URL", DEFAULT_URL))
    parser.add_argument("--starts", type=int, default=1500)
    parser.add_argument("--inflight", type=int, default=32)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    # Rounds alternate the cases, and each figure is the median of its rounds: on a
    # shared machine the load moves between rounds, not between cases of one round.
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in args.cases}
    for round_no in range(args.rounds):
        for case in args.cases:
            runs[case].append(await measure(args.url, case, args.starts, args.inflight))
            row = runs[case][-1]
            print(f"round {round_no + 1}: {case:<34}{row['starts_per_s']:>8} starts/s "
                  f"{row['runs_per_s']:>8} runs/s", flush=True)
    rows = []
    for case, measured in runs.items():
        rows.append({"case": case, "starts": args.starts, "runs": measured[0]["runs"],
                     "rounds": len(measured),
                     "starts_per_s": round(statistics.median(m["starts_per_s"]
                                                             for m in measured)),
                     "runs_per_s": round(statistics.median(m["runs_per_s"] for m in measured))})
    print(f"\n{'case (median of the rounds)':<34}{'starts/s':>9}{'runs/s':>9}")
    for row in rows:
        print(f"{row['case']:<34}{row['starts_per_s']:>9}{row['runs_per_s']:>9}")
    base = rows[0] if rows and rows[0]["case"] == "no queue" else None
    if base is not None:
        print("\nagainst no queue:")
        for row in rows[1:]:
            print(f"{row['case']:<34}{row['starts_per_s'] / base['starts_per_s']:>8.2f} x "
                  f"{row['runs_per_s'] / base['runs_per_s']:>13.2f} x")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "command": "python -m bench.queues " + " ".join(
            f"--{k} {v}" for k, v in (("starts", args.starts), ("inflight", args.inflight),
                                      ("rounds", args.rounds))),
        "loadavg": os.getloadavg(), "store": "postgres, group commit", "results": rows},
        indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
