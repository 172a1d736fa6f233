"""What running a sync step function in a thread costs (decision 0054): the thread hop.

Run: ``python -m bench.step_threads [--calls 20000] [--n 3000] [--rounds 5]
[--loop auto|uvloop|asyncio]``. Never run as a test.

Two tables, each mode measured in every round, the modes in turn within a round
(the median over rounds; a busy machine moves every mode alike):

- ``call``: one call of a trivial sync function, awaited from the loop: on the
  loop (``inline``, no hop: the floor), through fleet's ``StepThreads`` (what a
  sync step does), and through ``loop.run_in_executor`` on a dedicated
  ``ThreadPoolExecutor`` (the stdlib's way). Wall and CPU (user + system of the
  process, both threads) microseconds per call.
- ``flow``: ``bench.kernel``'s 3-step flow on the memory store (the kernel alone,
  no I/O to hide the hop behind), sequentially and ``--in-flight`` at once: the
  same flow with its sync steps in a thread (the default), with
  ``blocking=False`` (on the loop, as before 0054) and as ``async def`` steps.
  CPU ms per execution and executions/s; ``hop_us_per_step`` is (thread -
  inline) / 3 of the CPU.

Prints both tables and writes ``bench/results/step_threads.json`` (the command,
the load average, the loop, every round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleet.host.loop import loop_name, run_loop
from fleet.kernel.context import Context
from fleet.kernel.flows import FlowDefinition, flow
from fleet.kernel.runtime import Runtime
from fleet.kernel.step_threads import StepThreads
from fleet.kernel.store.memory import MemoryEventStore

RESULTS = Path(__file__).parent / "results"
CALL_MODES = ("inline", "step_threads", "run_in_executor")
FLOW_MODES = ("thread", "inline", "async")


def _noop(x: int) -> int:
    return x + 1


async def _async_noop(x: int) -> int:
    return x + 1


@flow("steps-thread", steps=["a", "b", "c"])
async def in_thread(ctx: Context, n: int) -> int:
    n = await ctx.step("a", _noop, n)
    n = await ctx.step("b", _noop, n)
    return int(await ctx.step("c", _noop, n))


@flow("steps-inline", steps=["a", "b", "c"])
async def inline(ctx: Context, n: int) -> int:
    n = await ctx.step("a", _noop, n, blocking=False)
    n = await ctx.step("b", _noop, n, blocking=False)
    return int(await ctx.step("c", _noop, n, blocking=False))


@flow("steps-async", steps=["a", "b", "c"])
async def in_loop(ctx: Context, n: int) -> int:
    n = await ctx.step("a", _async_noop, n)
    n = await ctx.step("b", _async_noop, n)
    return int(await ctx.step("c", _async_noop, n))


FLOWS: dict[str, FlowDefinition] = {"thread": in_thread, "inline": inline, "async": in_loop}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.step_threads",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000, help="calls per call row")
    parser.add_argument("--n", type=int, default=3_000, help="executions per flow row")
    parser.add_argument("--in-flight", type=int, default=32, help="the busy flow rows")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loop", choices=["auto", "uvloop", "asyncio"], default=None)
    parser.add_argument("--json", action="store_true", help="also print the document")
    return parser


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


async def _timed(run: Callable[[], Awaitable[None]], count: int) -> dict[str, float]:
    """Wall and CPU per unit of ``count`` for one awaited ``run()``."""
    wall, cpu = time.perf_counter(), _cpu()
    await run()
    wall, cpu = time.perf_counter() - wall, _cpu() - cpu
    return {"wall": wall / count, "cpu": cpu / count}


async def call_round(calls: int, pool: StepThreads,
                     executor: ThreadPoolExecutor) -> dict[str, dict[str, float]]:
    loop = asyncio.get_running_loop()

    async def inline_calls() -> None:
        for i in range(calls):
            _noop(i)

    async def step_thread_calls() -> None:
        for i in range(calls):
            await pool.run(_noop, (i,), {})

    async def executor_calls() -> None:
        for i in range(calls):
            await loop.run_in_executor(executor, _noop, i)

    runs = {"inline": inline_calls, "step_threads": step_thread_calls,
            "run_in_executor": executor_calls}
    return {mode: await _timed(runs[mode], calls) for mode in CALL_MODES}


async def flow_round(runtime: Runtime, n: int, in_flight: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for mode in FLOW_MODES:
        flow_id = FLOWS[mode].flow_id
        for concurrency in (1, in_flight):
            async def executions(flow_id: str = flow_id, concurrency: int = concurrency) -> None:
                semaphore = asyncio.Semaphore(concurrency)

                async def one(i: int) -> None:
                    async with semaphore:
                        handle = await runtime.start(flow_id, i)
                        assert await handle.result() == i + 3

                if concurrency == 1:
                    for i in range(n):
                        await one(i)
                else:
                    await asyncio.gather(*(one(i) for i in range(n)))

            out[f"{mode}@{concurrency}"] = await _timed(executions, n)
    return out


def _median(rounds: list[dict[str, dict[str, float]]], key: str, field: str) -> float:
    return statistics.median(r[key][field] for r in rounds)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    pool = StepThreads()
    executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="bench-executor")
    store = MemoryEventStore()
    runtime = Runtime(store, flows=list(FLOWS.values()))
    try:
        # Warm-up: every path once, the threads started.
        await call_round(min(args.calls, 2000), pool, executor)
        await flow_round(runtime, min(args.n, 300), args.in_flight)
        calls: list[dict[str, dict[str, float]]] = []
        flows: list[dict[str, dict[str, float]]] = []
        for _ in range(args.rounds):
            calls.append(await call_round(args.calls, pool, executor))
            flows.append(await flow_round(runtime, args.n, args.in_flight))
    finally:
        await runtime.close()
        await store.close()
        executor.shutdown()
    call_rows = {mode: {"wall_us": _median(calls, mode, "wall") * 1e6,
                        "cpu_us": _median(calls, mode, "cpu") * 1e6} for mode in CALL_MODES}
    flow_rows = {key: {"cpu_ms": _median(flows, key, "cpu") * 1e3,
                       "executions_per_s": 1 / _median(flows, key, "wall")}
                 for key in flows[0]}
    hop = {str(c): (flow_rows[f"thread@{c}"]["cpu_ms"] - flow_rows[f"inline@{c}"]["cpu_ms"])
           * 1e3 / 3 for c in (1, args.in_flight)}
    return {
        "command": " ".join(["python -m bench.step_threads", *sys.argv[1:]]),
        "event_loop": loop_name(asyncio.get_running_loop()),
        "load_average": list(os.getloadavg()), "cpus": os.cpu_count(),
        "python": platform.python_version(), "calls": args.calls, "n": args.n,
        "in_flight": args.in_flight, "rounds": args.rounds,
        "call": call_rows, "flow": flow_rows, "hop_us_per_step": hop,
        "round_data": {"call": calls, "flow": flows},
    }


def print_tables(doc: dict[str, Any], console: Console) -> None:
    calls = Table(title=f"one call of a trivial sync function ({doc['event_loop']}, "
                        f"median of {doc['rounds']} rounds)")
    for column in ("how", "wall us/call", "CPU us/call"):
        calls.add_column(column, justify="right" if column != "how" else "left")
    for mode, row in doc["call"].items():
        calls.add_row(mode, f"{row['wall_us']:.2f}", f"{row['cpu_us']:.2f}")
    console.print(calls)
    flows = Table(title="bench.kernel's 3-step flow, memory store")
    for column in ("steps", "at once", "CPU ms/execution", "executions/s"):
        flows.add_column(column, justify="right" if column != "steps" else "left")
    for key, row in doc["flow"].items():
        mode, concurrency = key.split("@")
        flows.add_row(mode, concurrency, f"{row['cpu_ms']:.3f}",
                      f"{row['executions_per_s']:,.0f}")
    console.print(flows)
    console.print("thread hop, CPU us per step (thread - inline) / 3: " + ", ".join(
        f"{v:.1f} at {k} in flight" for k, v in doc["hop_us_per_step"].items()))


def main() -> None:
    args = build_parser().parse_args()
    console = Console()
    doc = run_loop(main_async(args), event_loop=args.loop)
    print_tables(doc, console)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "step_threads.json").write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
