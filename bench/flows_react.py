"""Child flows and cancellation on the fleet (issue 26): a parent with 10 children end to
end, and the latency from ``cancel`` to the flow's cleanup done.

Run: ``python -m bench.flows_react [--parents 40] [--children 10] [--in-flight 8]
[--cancels 40] [--workers 2] [--json]``. Never run as a test.

On one broker (Redis, the benches' database; queues of its own) and one Postgres
database of its own, with ``--workers`` ``fleet worker`` processes (threads, the
deployed defaults):

- **parent with children**: ``--parents`` executions of ``bench-parent``, each starting
  ``--children`` ``bench-child`` flows (one step each) and waiting for every one, with
  ``--in-flight`` parents at once through the ``Dispatcher``: seconds per parent (p50,
  p95), parents/s and executions/s. Beside it, the same number of child flows started
  flat by the dispatcher (no parent): what the orchestration costs.
- **cancel to cleanup**: ``--cancels`` executions of ``bench-cancellable`` parked on a
  gate, cancelled one at a time through the ``Dispatcher``; seconds from the call to
  ``EXECUTION_CANCELLED`` in Postgres (the delivery, the cleanup step and the end:
  a worker's drive), p50/p95; beside it ``force=True`` (written by the caller at once).

Prints tables and writes ``bench/results/flows_react.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncpg
from rich.console import Console
from rich.table import Table

from bench._common import RESULTS, admin, bench_redis_url, fleet_bench_parser, with_database
from bench.fleet import fleet_env, running_fleet


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _status(conn: asyncpg.Connection, execution_id: str) -> str | None:
    row = await conn.fetchval("SELECT status FROM executions WHERE execution_id = $1",
                              execution_id)
    return None if row is None else str(row)


async def _until(conn: asyncpg.Connection, execution_id: str, status: str,
                 timeout: float = 120.0) -> float:
    """Wait until ``execution_id`` is ``status``; the monotonic time it was seen so."""
    deadline = time.monotonic() + timeout
    while True:
        if await _status(conn, execution_id) == status:
            return time.monotonic()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{execution_id} is not {status} after {timeout} s")
        await asyncio.sleep(0.005)


async def parents_and_children(fleet: Any, args: argparse.Namespace) -> dict[str, Any]:
    sem = asyncio.Semaphore(args.in_flight)
    took: list[float] = []

    async def one(i: int) -> None:
        async with sem:
            began = time.monotonic()
            eid = await fleet.dispatcher.start("bench-parent", args.children)
            result = await fleet.dispatcher.result(eid, timeout=300)
            assert result == sum(range(1, args.children + 1)), result
            took.append(time.monotonic() - began)

    await asyncio.gather(*(one(i) for i in range(2)))  # warm-up
    took.clear()
    began = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(args.parents)))
    wall = time.monotonic() - began

    flat_n = args.parents * args.children
    flat_sem = asyncio.Semaphore(args.in_flight * args.children)

    async def flat(i: int) -> None:
        async with flat_sem:
            eid = await fleet.dispatcher.start("bench-child", i)
            await fleet.dispatcher.result(eid, timeout=300)

    began = time.monotonic()
    await asyncio.gather(*(flat(i) for i in range(flat_n)))
    flat_wall = time.monotonic() - began
    return {"parents": args.parents, "children_each": args.children,
            "in_flight": args.in_flight, "parent_p50_s": round(statistics.median(took), 3),
            "parent_p95_s": round(_p(took, 0.95), 3),
            "parents_per_s": round(args.parents / wall, 2),
            "executions_per_s": round(args.parents * (args.children + 1) / wall, 1),
            "flat_children_per_s": round(flat_n / flat_wall, 1),
            "children_in_parents_per_s": round(flat_n / wall, 1)}


async def cancel_latency(fleet: Any, conn: asyncpg.Connection, args: argparse.Namespace,
                         *, force: bool) -> list[float]:
    ids = [await fleet.dispatcher.start("bench-cancellable", i) for i in range(args.cancels)]
    for eid in ids:
        await _parked(conn, eid)
    took = []
    for eid in ids:
        began = time.monotonic()
        await fleet.dispatcher.cancel(eid, reason="bench", force=force)
        took.append(await _until(conn, eid, "cancelled") - began)
        if not force:
            steps = await conn.fetchval(
                "SELECT count(*) FROM events WHERE ekey = fleet_key($1) AND type = "
                "'STEP_COMPLETED'", eid)
            assert steps == 1, f"{eid} ended with {steps} cleanup steps, not 1"
    return took


async def _parked(conn: asyncpg.Connection, execution_id: str) -> None:
    await _until(conn, execution_id, "parked")


async def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    broker = bench_redis_url(args.redis)
    name = f"fleet_bench_{secrets.token_hex(4)}"
    await admin(args.db, f'CREATE DATABASE "{name}"')
    db = with_database(args.db, name)
    doc: dict[str, Any] = {
        "benchmark": "flows_react",
        "command": "python -m bench.flows_react " + " ".join(sys.argv[1:]),
        "python": platform.python_version(), "machine": f"{os.cpu_count()} cpus",
        "workers": args.workers, "loadavg_before": list(os.getloadavg())}
    try:
        with tempfile.TemporaryDirectory() as logs:
            queue = f"bench-react-{secrets.token_hex(3)}"
            env = fleet_env(db, broker, queue, documented=True)
            async with running_fleet(env, args.workers, Path(logs), pool="threads",
                                     concurrency=64, prefix="react") as fleet:
                console.log(f"{args.parents} parents x {args.children} children")
                doc["children"] = await parents_and_children(fleet, args)
                conn = await asyncpg.connect(db)
                try:
                    for force in (False, True):
                        console.log(f"{args.cancels} cancels (force={force})")
                        took = await cancel_latency(fleet, conn, args, force=force)
                        doc["cancel_force" if force else "cancel"] = {
                            "n": len(took), "p50_s": round(statistics.median(took), 4),
                            "p95_s": round(_p(took, 0.95), 4), "max_s": round(max(took), 4)}
                finally:
                    await conn.close()
    finally:
        await admin(args.db, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    doc["loadavg_after"] = list(os.getloadavg())
    return doc


def render(doc: dict[str, Any], console: Console) -> None:
    c = doc["children"]
    table = Table(title=f"a parent with {c['children_each']} children, end to end "
                        f"({c['parents']} parents, {c['in_flight']} in flight, "
                        f"{doc['workers']} workers)")
    for column in ("parent p50 s", "parent p95 s", "parents/s", "executions/s",
                   "children/s in parents", "children/s started flat"):
        table.add_column(column, justify="right")
    table.add_row(f"{c['parent_p50_s']:.3f}", f"{c['parent_p95_s']:.3f}",
                  f"{c['parents_per_s']:.1f}", f"{c['executions_per_s']:.0f}",
                  f"{c['children_in_parents_per_s']:.0f}", f"{c['flat_children_per_s']:.0f}")
    console.print(table)
    table = Table(title="cancel -> EXECUTION_CANCELLED (graceful: a worker delivers it and "
                        "runs the cleanup step)")
    for column in ("cancel", "n", "p50 s", "p95 s", "max s"):
        table.add_column(column, justify="right")
    for key, label in (("cancel", "graceful"), ("cancel_force", "force")):
        row = doc[key]
        table.add_row(label, str(row["n"]), f"{row['p50_s']:.4f}", f"{row['p95_s']:.4f}",
                      f"{row['max_s']:.4f}")
    console.print(table)


def main() -> None:
    parser = fleet_bench_parser(__doc__)
    parser.add_argument("--parents", type=int, default=40)
    parser.add_argument("--children", type=int, default=10)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--cancels", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    console = Console()
    doc = asyncio.run(run(args, console))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "flows_react.json").write_text(json.dumps(doc, indent=2) + "\n")
    render(doc, console)
    if args.json:
        print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
