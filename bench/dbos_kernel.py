"""The same 3-step workload on DBOS Transact, for ``bench.kernel`` to compare against.

Run by ``bench.kernel`` in a child process (``python -m bench.dbos_kernel --url
URL --n N``): DBOS is a process-wide singleton with background threads, so it
gets a process of its own and never shares the interpreter (or the GIL) with
fleet's measurements. The child prints one JSON line: executions/s per API and
concurrency. The caller creates the database in ``--url`` and drops it.

Two ways of driving DBOS, both documented, so the comparison takes its better one:

- ``async``: ``@DBOS.workflow()`` ``async def`` calling three ``async``
  ``@DBOS.step()``s; ``await DBOS.start_workflow_async(...)`` then ``await
  handle.get_result()``, one after another or as 32 asyncio tasks at once (the
  shape fleet's rows have: start durably, await the result), on the event loop
  ``--loop`` names (``bench.kernel`` passes the one fleet's rows ran on);
- ``sync``: the plain-function workflow and steps; called directly one after
  another, or from 32 threads at once.

Needs the ``bench`` extra (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version

from dbos import DBOS, DBOSConfig

from fleet.host.loop import loop_name, run_loop


@DBOS.step()
async def step_a(n: int) -> int:
    return n + 1


@DBOS.step()
async def step_b(n: int) -> int:
    return n + 1


@DBOS.step()
async def step_c(n: int) -> int:
    return n + 1


@DBOS.workflow()
async def three_steps(n: int) -> int:
    n = await step_a(n)
    n = await step_b(n)
    return await step_c(n)


@DBOS.step()
def sync_a(n: int) -> int:
    return n + 1


@DBOS.step()
def sync_b(n: int) -> int:
    return n + 1


@DBOS.step()
def sync_c(n: int) -> int:
    return n + 1


@DBOS.workflow()
def sync_three_steps(n: int) -> int:
    return sync_c(sync_b(sync_a(n)))


async def measure_async(n: int, concurrency: int, first: int) -> tuple[float, str]:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            handle = await DBOS.start_workflow_async(three_steps, i)
            assert await handle.get_result() == i + 3

    await asyncio.gather(*(one(first - 1 - i) for i in range(min(50, n))))  # warm up
    began = time.perf_counter()
    if concurrency == 1:
        for i in range(first, first + n):
            await one(i)
    else:
        await asyncio.gather(*(one(i) for i in range(first, first + n)))
    return n / (time.perf_counter() - began), loop_name(asyncio.get_running_loop())


def measure_sync(n: int, concurrency: int) -> float:
    def one(i: int) -> None:
        assert sync_three_steps(i) == i + 3

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(min(50, n))))  # warm up (and start the threads)
        began = time.perf_counter()
        if concurrency == 1:
            for i in range(n):
                one(i)
        else:
            list(pool.map(one, range(n)))
        return n / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True, help="an existing, empty database")
    parser.add_argument("--n", type=int, default=500, help="workflows per measurement")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--loop", default=None, choices=("auto", "asyncio", "uvloop"),
                        help="the event loop of the async rows (default: fleet's)")
    args = parser.parse_args()
    config: DBOSConfig = {"name": "fleet-bench", "system_database_url": args.url,
                          "run_admin_server": False, "log_level": "WARNING"}
    DBOS(config=config)
    DBOS.launch()
    rows = []
    try:
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            rate, loop = run_loop(measure_async(args.n, concurrency, 1_000_000 * concurrency),
                            event_loop=args.loop)
            rows.append({"api": "async", "concurrency": concurrency, "executions": args.n,
                         "executions_per_s": round(rate, 1), "event_loop": loop})
            rate = measure_sync(args.n, concurrency)
            rows.append({"api": "sync", "concurrency": concurrency, "executions": args.n,
                         "executions_per_s": round(rate, 1)})
    finally:
        DBOS.destroy()
    print(json.dumps({"dbos_version": version("dbos"), "rows": rows}))


if __name__ == "__main__":
    main()
