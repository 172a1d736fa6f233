"""Submissions per second: the dispatcher beside Celery's own ``apply_async``, same broker.

Run: ``python -m bench.submit [--n 3000] [--repeat 3] [--json]``. Never run as a test.

What a web app pays to hand work to the fleet, measured in one run on one
Redis broker (database 12, queues of its own, deleted after) and one Postgres
database of its own (``fleet_bench_<hex>``, dropped at the end), with the
settings the docs deploy (default pool, events stream setting as shipped; the
dispatcher's own writes do not publish to it). No worker runs: only the
submission is timed (each message is counted on its queue afterwards).

- **dispatcher, single**: ``await Dispatcher.start`` with 64 in flight (async),
  and ``start_sync`` from 64 threads (sync): a durable start (one store round
  trip) and a drive published from the loop.
- **dispatcher, batch of 100**: ``start_many`` (one round trip per batch, one
  pipeline publish), async with 64 batches in flight and sync from 64 threads.
- **celery apply_async**: ``chain(a.s(n), b.s(), c.s()).apply_async()`` (the
  same 3-step chain ``bench.fleet`` runs, ``bench.chain_app``), from 64 threads
  and from 8 (Celery's best is kept), on the same broker. Not durable.

Rows run interleaved ``--repeat`` times; the best of each is kept (the machine
is shared). Targets (issue 17): single >= 1x Celery, batches of 100 >= 3x.
Prints a table and writes ``bench/results/submit.json`` with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib
import json
import os
import platform
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from bench._common import RESULTS, admin, bench_redis_url, fleet_bench_parser, with_database
from bench.fleet_flows import ALL as FLOWS
from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher, Start

IN_FLIGHT = 64
BATCH = 100
TARGETS = {"single_x_celery": 1.0, "batch_x_celery": 3.0}


def settings(db: str, broker: str, queue: str) -> FleetSettings:
    """What ``docs/operations.md`` and the manifests deploy (no tuning)."""
    return FleetSettings(database_url=db, broker_url=broker, redis_url=broker, queue=queue,
                         flows=FLOWS.split(","))


async def dispatcher_async(db: str, broker: str, n: int, batch: int) -> float:
    queue = f"bench-submit-{secrets.token_hex(3)}"
    async with Dispatcher(settings(db, broker, queue)) as dispatcher:
        sem = asyncio.Semaphore(IN_FLIGHT)

        async def single(i: int) -> None:
            async with sem:
                await dispatcher.start("bench-three", i)

        async def many(i: int) -> None:
            async with sem:
                await dispatcher.start_many([Start("bench-three", i * batch + j)
                                             for j in range(batch)])

        await asyncio.gather(*(single(i) for i in range(50)))  # connect, warm up
        began = time.perf_counter()
        if batch == 1:
            await asyncio.gather(*(single(i) for i in range(n)))
        else:
            await asyncio.gather(*(many(i) for i in range(n // batch)))
        took = time.perf_counter() - began
        assert dispatcher.enqueue_failed == 0
    _check_and_drop(broker, queue, 50 + n)
    return n / took


def dispatcher_sync(db: str, broker: str, n: int, batch: int) -> float:
    queue = f"bench-submit-{secrets.token_hex(3)}"
    with Dispatcher(settings(db, broker, queue)) as dispatcher:
        def single(i: int) -> None:
            dispatcher.start_sync("bench-three", i)

        def many(i: int) -> None:
            dispatcher.start_many_sync([Start("bench-three", i * batch + j)
                                        for j in range(batch)])

        timed = _threads(IN_FLIGHT, single if batch == 1 else many,
                         n if batch == 1 else n // batch, warmup=single)
        assert dispatcher.enqueue_failed == 0
    _check_and_drop(broker, queue, 50 + n)
    return n / timed


def celery_apply_async(broker: str, n: int, threads: int) -> float:
    queue = f"bench-submit-chain-{secrets.token_hex(3)}"
    os.environ.update({"BENCH_BROKER": broker, "BENCH_QUEUE": queue, "BENCH_DONE_URL": broker})
    chain_app = importlib.reload(importlib.import_module("bench.chain_app"))
    try:
        timed = _threads(threads, chain_app.submit, n, warmup=chain_app.submit)
    finally:
        chain_app.app.close()
    _check_and_drop(broker, queue, 50 + n)
    return n / timed


def _threads(threads: int, call: Callable[[int], Any], calls: int, *,
             warmup: Callable[[int], Any]) -> float:
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(warmup, range(50)))
        began = time.perf_counter()
        list(pool.map(call, range(calls)))
        return time.perf_counter() - began


def _check_and_drop(broker: str, queue: str, expected: int) -> None:
    client = redis.Redis.from_url(broker)
    try:
        queued = client.llen(queue)
        assert queued == expected, f"{queue}: {queued} messages, expected {expected}"
        client.delete(queue, f"_kombu.binding.{queue}")
    finally:
        client.close()


async def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    broker = bench_redis_url(args.redis)
    name = f"fleet_bench_{secrets.token_hex(4)}"
    await admin(args.db, f'CREATE DATABASE "{name}"')
    db = with_database(args.db, name)
    rows: dict[str, list[float]] = {}
    plan: list[tuple[str, Callable[[], Any]]] = [
        ("celery apply_async, 64 threads", lambda: asyncio.to_thread(
            celery_apply_async, broker, args.n, 64)),
        ("celery apply_async, 8 threads", lambda: asyncio.to_thread(
            celery_apply_async, broker, args.n, 8)),
        ("dispatcher single, async (64 in flight)", lambda: dispatcher_async(
            db, broker, args.n, 1)),
        ("dispatcher single, sync (64 threads)", lambda: asyncio.to_thread(
            dispatcher_sync, db, broker, args.n, 1)),
        (f"dispatcher batch of {BATCH}, async (64 in flight)", lambda: dispatcher_async(
            db, broker, args.n * 4, BATCH)),
        (f"dispatcher batch of {BATCH}, sync (64 threads)", lambda: asyncio.to_thread(
            dispatcher_sync, db, broker, args.n * 4, BATCH)),
    ]
    try:
        for round_ in range(args.repeat):
            for label, make in plan:
                console.log(f"round {round_ + 1}/{args.repeat}: {label}")
                rows.setdefault(label, []).append(await make())
    finally:
        await admin(args.db, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    celery = max(max(rows[label]) for label in rows if label.startswith("celery"))
    table = []
    for label, rates in rows.items():
        row: dict[str, Any] = {"row": label, "submissions_per_s": round(max(rates)),
                               "runs": [round(r) for r in rates]}
        if not label.startswith("celery"):
            row["x_celery"] = round(max(rates) / celery, 2)
        table.append(row)
    return {"benchmark": "submit", "command": "python -m bench.submit " + " ".join(sys.argv[1:]),
            "python": platform.python_version(), "machine": f"{os.cpu_count()} cpus",
            "loadavg_before_after": [list(LOAD_BEFORE), list(os.getloadavg())],
            "n_single": args.n, "n_batch": args.n * 4, "batch": BATCH, "in_flight": IN_FLIGHT,
            "repeat": args.repeat, "targets": TARGETS, "celery_best_per_s": round(celery),
            "rows": table}


def render(doc: dict[str, Any], console: Console) -> None:
    table = Table(title=f"submissions/s (best of {doc['repeat']}; load "
                        f"{doc['loadavg_before_after'][0][0]:.1f} -> "
                        f"{doc['loadavg_before_after'][1][0]:.1f} on {doc['machine']})")
    for column in ("row", "submissions/s", "x celery"):
        table.add_column(column, justify="left" if column == "row" else "right")
    for row in doc["rows"]:
        table.add_row(row["row"], str(row["submissions_per_s"]), str(row.get("x_celery", "")))
    console.print(table)


LOAD_BEFORE = os.getloadavg()


def main() -> None:
    parser = fleet_bench_parser(__doc__)
    parser.add_argument("--n", type=int, default=3000, help="single submissions per row "
                        "(batch rows submit 4x as many)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    console = Console()
    doc = asyncio.run(run(args, console))
    render(doc, console)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "submit.json").write_text(json.dumps(doc, indent=1) + "\n")
    if args.json:
        print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
