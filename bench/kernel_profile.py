"""Where the kernel's CPU goes per execution: cProfile over ``bench.kernel``'s 3-step flow.

Run: ``python -m bench.kernel_profile [--store memory|postgres] [--n 2000] [--top 25]
[--repeat 3] [--loop auto|asyncio|uvloop] [--tag TAG]``. Never run as a test.

Runs the flow sequentially (one execution at a time, the way ``bench.kernel``'s
sequential row does), after a warm-up, and measures the process CPU time per
execution (user and system, ``os.times``, without the profiler; the system part
is mostly socket calls) ``--repeat`` times on each event loop, interleaved (uvloop,
asyncio, uvloop, ...: a burst of load from elsewhere hits both alike), each
round on a fresh loop, store and runtime; the figure is the median of the rounds.
``--loop`` (default: what fleet's own processes run on, ``FLEET_EVENT_LOOP`` or
``auto``: ``fleet.host.loop``) is the loop reported first and the one profiled:
a last pass under cProfile timed by process CPU (waiting is not in it) gives the
top functions by own time (cProfile inflates tiny calls; a sampling profiler,
``py-spy record -- python -m bench.kernel_profile ...``, shows where real time
goes). Writes ``bench/results/kernel_profile_<store>[_<tag>].json``. On Postgres
the CPU is the client's (this process): the server's work is not in it.

The wait tax (Postgres only). Each of an execution's 4 writes waits for a commit,
and the kernel charges a process for going idle and waking up (more on a shared
virtual machine, whose other tenants evict its caches meanwhile: tens to hundreds
of microseconds a wait). A calibration row runs the same flow on the memory
store with each write waiting as long as a Postgres write took (``asyncio.sleep``)
and reports its CPU beside the memory store's without waiting: the difference is
what the waits alone cost this process on this machine at this load, a part of
the Postgres figure no change to fleet's code removes (decision 0031). Beside it,
the CPU of one bare asyncpg round trip (``SELECT 1``) on each loop: what the
loop itself costs per write. And the same flow with ``--in-flight`` executions
at once (32), on each loop: the waits overlap, the process seldom sleeps, and
the CPU per execution is the code's own (store calls are not batched: the store
is opened without group commit, as in every row here).
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
import statistics
import time
from pathlib import Path
from typing import Any

from bench.kernel import DEFAULT_URL, three_steps
from fleet.host.loop import loop_factory, loop_name, run_loop
from fleet.kernel.runtime import Runtime
from fleet.kernel.store.factory import open_event_store
from fleet.kernel.store.spi import EventStore

RESULTS = Path(__file__).parent / "results"
WARMUP = 100


async def _open(kind: str, url: str, schema: str) -> EventStore:
    if kind == "memory":
        return open_event_store("memory:")
    from fleet.kernel.store.postgres import PostgresEventStore

    return await PostgresEventStore(url, schema=schema).open()


async def _drop(kind: str, url: str, schema: str) -> None:
    if kind == "memory":
        return
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


class WaitingStore:
    """The memory store, each write waiting ``wait_s`` first (the calibration row)."""

    def __init__(self, inner: EventStore, wait_s: float) -> None:
        self.inner = inner
        self.wait_s = wait_s

    async def append(self, event: Any, *, fence: int | None = None) -> None:
        await asyncio.sleep(self.wait_s)
        await self.inner.append(event, fence=fence)

    async def append_batch(self, events: Any, *, fence: int | None = None) -> None:
        await asyncio.sleep(self.wait_s)
        await self.inner.append_batch(events, fence=fence)

    async def append_acquiring(self, events: Any, **options: Any) -> Any:
        await asyncio.sleep(self.wait_s)
        return await self.inner.append_acquiring(events, **options)  # type: ignore[attr-defined]

    async def append_releasing(self, events: Any, **options: Any) -> Any:
        await asyncio.sleep(self.wait_s)
        return await self.inner.append_releasing(events, **options)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _run(runtime: Runtime, n: int, base: int, in_flight: int = 1) -> None:
    async def one(i: int) -> None:
        handle = await runtime.start("bench3", base + i)
        assert await handle.result() == base + i + 3

    if in_flight == 1:
        for i in range(n):
            await one(i)
        return
    sem = asyncio.Semaphore(in_flight)

    async def held(i: int) -> None:
        async with sem:
            await one(i)

    await asyncio.gather(*(held(i) for i in range(n)))


async def _round(kind: str, n: int, url: str, profiler: cProfile.Profile | None = None,
                 wait_s: float = 0.0, in_flight: int = 1) -> dict[str, Any]:
    """One measurement on a fresh store and runtime: CPU (or a profile) of ``n`` executions."""
    schema = f"fleet_prof_{secrets.token_hex(4)}"
    store = await _open(kind, url, schema)
    runtime = Runtime(WaitingStore(store, wait_s) if wait_s else store,  # type: ignore[arg-type]
                      flows=[three_steps])
    try:
        await _run(runtime, WARMUP, 0)
        t0, wall0 = os.times(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        await _run(runtime, n, 1000, in_flight)
        if profiler is not None:
            profiler.disable()
        t1 = os.times()
        wall = time.perf_counter() - wall0
    finally:
        await runtime.close()
        await store.close()
        await _drop(kind, url, schema)
    user, system = t1.user - t0.user, t1.system - t0.system
    return {"event_loop": loop_name(asyncio.get_running_loop()),
            "cpu_ms_per_execution": round((user + system) / n * 1000, 3),
            "user_ms_per_execution": round(user / n * 1000, 3),
            "system_ms_per_execution": round(system / n * 1000, 3),
            "wall_ms_per_execution": round(wall / n * 1000, 3)}


async def _round_trip_us(url: str, n: int = 3000) -> float:
    """Process CPU (microseconds) of one bare asyncpg round trip on the running loop."""
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        for _ in range(200):
            await conn.fetchval("SELECT 1")
        began = time.process_time()
        for _ in range(n):
            await conn.fetchval("SELECT 1")
        return round((time.process_time() - began) / n * 1e6, 1)
    finally:
        await conn.close()


def _median(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("cpu_ms_per_execution", "user_ms_per_execution", "system_ms_per_execution",
            "wall_ms_per_execution")
    summary: dict[str, Any] = {key: round(statistics.median(r[key] for r in rounds), 3)
                               for key in keys}
    summary["cpu_ms_rounds"] = [r["cpu_ms_per_execution"] for r in rounds]
    return summary


def measure(kind: str, n: int, url: str, top: int, loop: str | None,
            repeat: int, in_flight: int) -> dict[str, Any]:
    probe = loop_factory(loop)()
    chosen = loop_name(probe)
    probe.close()
    loops = [chosen] + [other for other in ("uvloop", "asyncio") if other != chosen]
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in loops}
    load_before = os.getloadavg()
    for _ in range(repeat):
        for name in loops:
            try:
                factory = loop_factory(name)
            except Exception:  # noqa: BLE001 - uvloop not installed: asyncio alone
                continue
            with asyncio.Runner(loop_factory=factory) as runner:
                rounds[name].append(runner.run(_round(kind, n, url)))
    busy: dict[str, list[dict[str, Any]]] = {name: [] for name in rounds if rounds[name]}
    if in_flight > 1:
        for _ in range(repeat):
            for name in busy:
                busy[name].append(run_loop(_round(kind, n, url, in_flight=in_flight),
                                           event_loop=name))
    calibration: dict[str, Any] = {}
    if kind == "postgres":
        # Each write waits as long as a Postgres write took (4 per execution).
        wait_s = statistics.median(r["wall_ms_per_execution"] for r in rounds[chosen]) / 4000
        runs: dict[str, list[dict[str, Any]]] = {"memory": [], "memory_waiting": []}
        for _ in range(repeat):
            for label, wait in (("memory", 0.0), ("memory_waiting", wait_s)):
                runs[label].append(run_loop(_round("memory", n, url, wait_s=wait),
                                            event_loop=chosen))
        idle, waiting = _median(runs["memory"]), _median(runs["memory_waiting"])
        trips: dict[str, list[float]] = {name: [] for name in rounds if rounds[name]}
        for _ in range(repeat):
            for name in trips:
                trips[name].append(run_loop(_round_trip_us(url), event_loop=name))
        calibration = {"select_1_cpu_us_by_loop": {name: statistics.median(found)
                                                   for name, found in trips.items()},
                       "wait_ms_per_write": round(wait_s * 1000, 3), "memory": idle,
                       "memory_waiting": waiting, "wait_tax_ms_per_execution": round(
                           waiting["cpu_ms_per_execution"] - idle["cpu_ms_per_execution"], 3)}
    profiler = cProfile.Profile(time.process_time)  # CPU, not waiting
    profiled = run_loop(_round(kind, n, url, profiler), event_loop=chosen)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    rows = []
    for (file, line, name), (_cc, calls, tottime, cumtime, _) in sorted(
            stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]:  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}({name})", "calls_per_exec":
                     round(calls / n, 2), "own_us_per_exec": round(tottime / n * 1e6, 1),
                     "cum_us_per_exec": round(cumtime / n * 1e6, 1)})
    total_calls = sum(calls for (_cc, calls, *_rest) in stats.stats.values())  # type: ignore[attr-defined]
    by_loop = {name: _median(found) for name, found in rounds.items() if found}
    return {"store": kind, "executions": n, "repeat": repeat, "event_loop": chosen,
            **{k: v for k, v in by_loop[chosen].items() if k != "cpu_ms_rounds"},
            "by_loop": by_loop, "in_flight": in_flight, "in_flight_by_loop": {
                name: _median(found) for name, found in busy.items() if found},
            "profiled_cpu_ms_per_execution":
            profiled["cpu_ms_per_execution"], "calls_per_execution": round(total_calls / n, 1),
            "wait_calibration": calibration, "top": rows, "load_average_before": load_before,
            "load_average": os.getloadavg(),
            "pstats": out.getvalue()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default="memory", choices=("memory", "postgres"))
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--repeat", type=int, default=3,
                        help="CPU rounds per event loop (the figure is their median)")
    parser.add_argument("--loop", default=None, choices=("auto", "asyncio", "uvloop"),
                        help="the loop reported first and profiled (default: fleet's, "
                        "FLEET_EVENT_LOOP or auto)")
    parser.add_argument("--in-flight", type=int, default=32,
                        help="executions at once in the busy rows (1: none)")
    parser.add_argument("--url", default=os.environ.get("FLEET_DATABASE_URL", DEFAULT_URL))
    parser.add_argument("--tag", default="", help="suffix of the results file")
    args = parser.parse_args()
    doc = measure(args.store, args.n, args.url, args.top, args.loop, args.repeat,
                  args.in_flight)
    print(doc["pstats"])
    print(f"{doc['calls_per_execution']} Python calls per execution under cProfile")
    for name, row in doc["by_loop"].items():
        print(f"{args.store} on {name}: {row['cpu_ms_per_execution']} ms CPU per execution "
              f"(median of {args.repeat}: {row['cpu_ms_rounds']}; user "
              f"{row['user_ms_per_execution']}, system {row['system_ms_per_execution']}; "
              f"{row['wall_ms_per_execution']} ms wall)")
    for name, row in doc["in_flight_by_loop"].items():
        print(f"{args.store} on {name}, {args.in_flight} at once: {row['cpu_ms_per_execution']}"
              f" ms CPU per execution (median of {args.repeat}: {row['cpu_ms_rounds']}; "
              f"{row['wall_ms_per_execution']} ms wall per execution)")
    cal = doc["wait_calibration"]
    if cal:
        idle = cal["memory"]["cpu_ms_per_execution"]
        waiting = cal["memory_waiting"]["cpu_ms_per_execution"]
        print(f"wait tax on {doc['event_loop']}: memory store {idle} ms CPU per execution, "
              f"{waiting} ms with each of its writes waiting {cal['wait_ms_per_write']} ms as "
              f"a Postgres write did: {cal['wait_tax_ms_per_execution']} ms of CPU per "
              "execution is the waits' own")
        print("one bare asyncpg round trip (SELECT 1), CPU: " + ", ".join(
            f"{name} {us} us" for name, us in cal["select_1_cpu_us_by_loop"].items()))
    print(f"load average {doc['load_average_before'][0]:.1f} before, "
          f"{doc['load_average'][0]:.1f} after")
    RESULTS.mkdir(exist_ok=True)
    doc.pop("pstats")
    name = f"kernel_profile_{args.store}{'_' + args.tag if args.tag else ''}.json"
    (RESULTS / name).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
