"""Executions/s of a 3-step flow on each store, sequential and concurrent.

Run: ``python -m bench.kernel [--n 2000] [--stores memory,sqlite]``. Prints a
table and writes ``bench/results/kernel.json``. Never run as a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleet.kernel.context import Context
from fleet.kernel.flows import flow
from fleet.kernel.runtime import Runtime
from fleet.kernel.store.factory import open_event_store
from fleet.kernel.store.spi import EventStore

RESULTS = Path(__file__).parent / "results"


def _noop(x: int) -> int:
    return x + 1


@flow("bench3", steps=["a", "b", "c"])
async def three_steps(ctx: Context, n: int) -> int:
    n = await ctx.step("a", _noop, n)
    n = await ctx.step("b", _noop, n)
    return int(await ctx.step("c", _noop, n))


async def _measure(store: EventStore, n: int, concurrency: int) -> float:
    runtime = Runtime(store, flows=[three_steps])
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            handle = await runtime.start("bench3", i)
            assert await handle.result() == i + 3

    # Warm up (JIT-free Python, but caches, pools and WAL files).
    await asyncio.gather(*(one(i) for i in range(min(50, n))))
    began = time.perf_counter()
    if concurrency == 1:
        for i in range(n):
            await one(i)
    else:
        await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.perf_counter() - began
    await runtime.close()
    return n / elapsed


def _url(kind: str, tmp: str) -> str:
    if kind == "memory":
        return "memory:"
    if kind == "sqlite":
        return f"sqlite:///{tmp}/bench-{time.monotonic_ns()}.db"
    if kind == "postgres":
        return os.environ.get("FLEET_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
    raise SystemExit(f"unknown store {kind!r}")


async def main_async(n: int, stores: list[str]) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in stores:
            for concurrency in (1, 32):
                store = open_event_store(_url(kind, tmp))
                try:
                    rate = await _measure(store, n, concurrency)
                finally:
                    await store.close()
                rows.append({"store": kind, "concurrency": concurrency, "executions": n,
                             "executions_per_s": round(rate, 1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=2000, help="executions per measurement")
    parser.add_argument("--stores", default="memory,sqlite")
    args = parser.parse_args()
    rows = asyncio.run(main_async(args.n, args.stores.split(",")))
    table = Table(title=f"3-step flow, {args.n} executions per row")
    for col in ("store", "concurrency", "executions/s"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(row["store"], str(row["concurrency"]), f"{row['executions_per_s']:,.0f}")
    Console().print(table)
    RESULTS.mkdir(exist_ok=True)
    out = {"benchmark": "kernel", "python": platform.python_version(),
           "machine": f"{os.cpu_count()} cpus", "rows": rows}
    (RESULTS / "kernel.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
