"""The timer service's schedule ticks per second, beside plain durable timers.

Run: ``python -m bench.schedules [--n 200] [--rounds 10] [--db URL]``. Never run as a
test.

On Postgres (a database of its own, the store as every fleet process opens it:
group commit on), one ``TimerService`` in this process drives what it fires
(``enqueue=None``, the embedded mode), on a manual clock moved an hour per round:

- ``schedule``: ``--n`` schedules ``every=1h`` (``overlap="allow"``) of a one-step flow;
  a tick is the tick timer fired, the schedule's run driven (its log replayed, the
  plan, ``ctx.now``), the tick's run started and run to its end, and the schedule
  parked on its next tick (decision 0058);
- ``sleep``: ``--n`` executions of the same step after a ``ctx.sleep(3600)``: a plain
  durable timer fired and its run driven to its end, the peer a tick is measured
  against.

Each round times one ``TimerService.tick()`` and the runs it launched (until each
has completed; the notices a tick's run sends its schedule when it ends are not
waited for, as nothing waits for them). Rounds alternate the two modes. The schedules' logs grow a
wake per round until they continue as new (every ``TICKS_PER_RUN`` wakes), so
later rounds replay more: the table shows the median and the last round. Prints a
table and writes ``bench/results/schedules.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench._common import own_database
from fleet.config import FleetSettings
from fleet.host.kernel import open_store
from fleet.kernel.context import Context
from fleet.kernel.flows import flow
from fleet.kernel.runtime import Runtime
from fleet.kernel.schedule_flow import TICKS_PER_RUN
from fleet.timers.service import TimerService

RESULTS = Path(__file__).parent / "results"
HOUR_S = 3600.0


def _work(n: int) -> int:
    return n + 1


@flow("bench-tick", steps=["work"])
async def tick_flow(ctx: Context, n: int) -> int:
    return int(await ctx.step("work", _work, n))


@flow("bench-sleep", steps=["work"])
async def sleep_flow(ctx: Context, n: int) -> int:
    await ctx.sleep(HOUR_S)
    return int(await ctx.step("work", _work, n))


class Clock:
    def __init__(self) -> None:
        self.now = (time.time_ns() // 1_000_000) // 3_600_000 * 3_600_000

    def __call__(self) -> int:
        return self.now


async def settle(runtime: Runtime) -> None:
    """Until every run this runtime launched has stopped (notices included)."""
    while True:
        pending = [t for t in runtime.engine.background if not t.done()]
        if not pending:
            return
        await asyncio.wait(pending)


async def completed(runtime: Runtime, flow_id: str, count: int) -> None:
    """Until ``count`` executions of ``flow_id`` have completed (the index), not waiting
    for the background notices a child's end sends its parent (they retry with backoff
    while the parent is busy, and change nothing a run waits for here)."""
    while True:
        done = await runtime.store.list_executions(flow_id=flow_id, status="completed",
                                                   limit=count + 1)
        if len(done) >= count:
            return
        await asyncio.sleep(0.005)


async def round_of(runtime: Runtime, service: TimerService, clock: Clock, flow_id: str,
                   total: int) -> tuple[float, int]:
    clock.now += int(HOUR_S * 1000)
    fired = service.fired
    began = time.perf_counter()
    await service.tick()
    await completed(runtime, flow_id, total)
    return time.perf_counter() - began, service.fired - fired


class Mode:
    """One side of the comparison: its own database, runtime, clock and timer service."""

    def __init__(self, url: str) -> None:
        self.store = open_store(FleetSettings(database_url=url))
        self.clock = Clock()
        self.runtime = Runtime(self.store, flows=[tick_flow, sleep_flow], clock=self.clock,
                               local_timers=False, lease_ms=60_000)
        self.service = TimerService(self.runtime, interval_s=1.0, batch=500)

    async def close(self) -> None:
        await self.runtime.close()
        await self.store.close()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    admin = args.db or os.environ.get("FLEET_DATABASE_URL",
                                      "postgresql://postgres@127.0.0.1:5432/postgres")
    rows: dict[str, list[tuple[float, int]]] = {"schedule": [], "sleep": []}
    async with own_database(admin, "fleet_bench_ticks") as ticks_url, \
            own_database(admin, "fleet_bench_sleeps") as sleeps_url:
        modes = {"schedule": Mode(ticks_url), "sleep": Mode(sleeps_url)}
        ticks = modes["schedule"]
        for i in range(args.n):
            await ticks.runtime.schedule(f"bench-{i}", tick_flow, i, every=timedelta(hours=1),
                                         overlap="allow")
        await settle(ticks.runtime)
        for r in range(args.rounds):  # alternated, so a drifting machine moves both alike
            for name in (("schedule", "sleep") if r % 2 == 0 else ("sleep", "schedule")):
                side = modes[name]
                if name == "sleep":
                    for i in range(args.n):  # each parks on a timer due in an hour
                        await side.runtime.start("bench-sleep", i)
                    await settle(side.runtime)
                flow_id = "bench-tick" if name == "schedule" else "bench-sleep"
                rows[name].append(await round_of(side.runtime, side.service, side.clock,
                                                 flow_id, args.n * (r + 1)))
                await settle(side.runtime)  # untimed: the notices, before the next round
        for side in modes.values():
            await side.close()
    result: dict[str, Any] = {
        "command": f"python -m bench.schedules --n {args.n} --rounds {args.rounds}",
        "load_average": list(os.getloadavg()), "python": platform.python_version(),
        "n": args.n, "rounds": args.rounds, "ticks_per_run": TICKS_PER_RUN}
    for name, timed in rows.items():
        rates = [fired / elapsed for elapsed, fired in timed if elapsed > 0]
        assert all(fired == args.n for _, fired in timed), (name, timed)
        result[name] = {"per_s_median": statistics.median(rates), "per_s_last": rates[-1],
                        "per_s_each": [round(x, 1) for x in rates]}
    result["tick_cost_in_timers"] = (result["sleep"]["per_s_median"]
                                     / result["schedule"]["per_s_median"])
    return result


def show(result: dict[str, Any]) -> None:
    table = Table(title=f"timer service on Postgres: {result['n']} due at once, "
                        f"{result['rounds']} rounds (load {result['load_average'][0]:.1f})")
    for col in ("fired by the timer service", "per s (median)", "per s (last round)"):
        table.add_column(col, justify="right" if col != "fired by the timer service"
                         else "left")
    table.add_row("schedule ticks (a tick's run started and run)",
                  f"{result['schedule']['per_s_median']:,.0f}",
                  f"{result['schedule']['per_s_last']:,.0f}")
    table.add_row("plain timers (ctx.sleep, run to its end)",
                  f"{result['sleep']['per_s_median']:,.0f}",
                  f"{result['sleep']['per_s_last']:,.0f}")
    Console().print(table)
    print(f"a schedule tick costs {result['tick_cost_in_timers']:.2f} plain timers")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--n", type=int, default=200, help="schedules (and sleeps) per round")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--db", default=None, help="an admin URL of the Postgres server")
    parser.add_argument("--json", action="store_true", help="print the JSON too")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    outcome = asyncio.run(main(arguments))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "schedules.json").write_text(json.dumps(outcome, indent=2) + "\n")
    show(outcome)
    if arguments.json:
        print(json.dumps(outcome, indent=2))
