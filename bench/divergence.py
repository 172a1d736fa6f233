"""What the replay-divergence detector costs (ADR 0113 D3 note 9, D4).

Run: ``python -m bench.divergence [--steps 1000] [--rounds 31] [--frames 100000]``.
Never run as a test.

Measurements, on the memory store so the detector's share is not hidden
behind I/O (on SQLite or Postgres the same absolute cost is a smaller share):

- ``replay``: a dry re-run of a recorded ``--steps``-step log parked on a gate,
  the way ``replay_check`` does it (a ``Run`` over the folded state: the
  detector is built from the fold, every step is served and marked visited,
  and the park is judged). The fold itself is done once, outside the timing.
- ``drive``: a full resume of the same execution: ``EXECUTION_RESUMED`` is
  appended, the log is folded, the body re-runs, one live step and
  ``EXECUTION_COMPLETED`` are written. A fresh copy of the log per round,
  made outside the timing.
- ``orphaned_frames`` over ``--frames`` dynamic ids (``agent#turn:<n>:tool:<j>``,
  ids matched by a prefix and by a regex family, and two orphaned families).

Each mode runs in every round, back to back in rotating order (ten dry
replays per drive round). The overhead is the median over rounds of
``time(mode) / time(off) - 1`` within the round, so a machine whose speed
drifts (other load) does not move it; the JSON also has the overhead of the
medians and of the minima. Target: <= 5%.
Prints a table and writes ``bench/results/divergence.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleet.kernel.context import Context
from fleet.kernel.divergence import DivergenceDetector
from fleet.kernel.errors import ExecutionParked
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.flows import FlowDefinition, flow
from fleet.kernel.fold import ExecutionState, fold_log
from fleet.kernel.journal import Journal
from fleet.kernel.migration import orphaned_frames
from fleet.kernel.runtime import Run, Runtime
from fleet.kernel.store.memory import MemoryEventStore

RESULTS = Path(__file__).parent / "results"
MODES = ("off", "warn", "fail")
TARGET_OVERHEAD = 0.05
REPLAY_PER_DRIVE = 10  # a dry replay is ~1 ms: ten of them per full drive round


async def _noop(i: int) -> int:  # async: no thread hop (decision 0054) in what is timed
    return i


def long_flow(steps: int) -> FlowDefinition:
    async def body(ctx: Context, _: Any) -> int:
        total = 0
        for i in range(steps):
            total += int(await ctx.step(f"s{i}", _noop, i))
        await ctx.wait("go")
        return total + int(await ctx.step("end", _noop, 1))
    return flow("long")(body)


async def record(definition: FlowDefinition) -> list[EventEnvelope]:
    store = MemoryEventStore()
    runtime = Runtime(store, flows=[definition], divergence="off")
    handle = await runtime.start("long", execution_id="bench")
    await runtime.close()
    while True:
        log = await store.read(handle.execution_id)
        if log and log[-1].type is EventType.EXECUTION_SUSPENDED:
            return log
        await asyncio.sleep(0.01)


async def replay_once(definition: FlowDefinition, state: ExecutionState, mode: str) -> float:
    store = MemoryEventStore()
    runtime = Runtime(store, flows=[definition], divergence=mode, local_timers=False)
    live = ExecutionState.from_dict(state.to_dict())  # untimed: the fold's copy
    began = time.perf_counter()
    journal = Journal(store, live, fence=None, clock=runtime.engine.clock, warner=runtime.warner)
    run = Run(runtime.engine, definition, journal)
    try:
        await definition.body(Context(run), live.input)
    except ExecutionParked:
        await run.before_new_work(EventType.EXECUTION_SUSPENDED, None)
    elapsed = time.perf_counter() - began
    assert (run.detector is None) if mode == "off" else (
        run.detector is not None and run.detector.settled)
    return elapsed


async def drive_once(definition: FlowDefinition, log: list[EventEnvelope], mode: str) -> float:
    store = MemoryEventStore()
    await store.append_batch(log)  # untimed
    runtime = Runtime(store, flows=[definition], divergence=mode, local_timers=False)
    began = time.perf_counter()
    handle = await runtime.resume("bench", "go", None)
    output = await handle.result()
    elapsed = time.perf_counter() - began
    assert output == sum(range(len(definition.steps) or 0)) or output > 0
    assert runtime.divergence_warnings == runtime.divergence_parked == 0
    return elapsed


def dynamic_frames(n: int) -> list[str]:
    frames = ["plan"]
    kinds = ("agent", "search", "hex", "lost", "gone")
    for i in range(n - 1):
        kind = kinds[i % len(kinds)]
        if kind == "agent":
            frames.append(f"agent#turn:{i // 8}:tool:{i % 8}")
        elif kind == "search":
            frames.append(f"search-{i}")
        elif kind == "hex":
            frames.append(f"x{i:06x}")
        else:
            frames.append(f"{kind}#{i}")
    return frames


def time_orphans(n: int, rounds: int) -> dict[str, Any]:
    async def body(ctx: Context, _: Any) -> None:
        return None
    definition = flow("orphans", steps=("plan", "agent"),
                      step_families=("search-", re.compile(r"x[0-9a-f]{6}")))(body)
    frames = dynamic_frames(n)
    times, orphans = [], []
    for _ in range(rounds):
        began = time.perf_counter()
        orphans = orphaned_frames(frames, definition)
        times.append(time.perf_counter() - began)
    median = statistics.median(times)
    return {"frames": n, "median_ms": round(median * 1000, 2),
            "frames_per_s": round(n / median), "orphan_families": [str(o) for o in orphans]}


def overhead(medians: dict[str, float]) -> dict[str, float]:
    return {m: round((medians[m] / medians["off"] - 1) * 100, 2) for m in MODES if m != "off"}


def paired_overhead(samples: dict[str, list[float]]) -> dict[str, float]:
    """Median over rounds of mode/off within the round (they ran back to back), so
    a machine whose speed drifts during the run does not move the figure."""
    return {m: round((statistics.median(a / b for a, b in zip(samples[m], samples["off"],
                                                              strict=True)) - 1) * 100, 2)
            for m in MODES if m != "off"}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    definition = long_flow(args.steps)
    log = await record(definition)
    state = fold_log(log)
    began = time.perf_counter()
    for _ in range(100):
        DivergenceDetector.for_state(state, "fail")
    build_us = (time.perf_counter() - began) / 100 * 1e6
    replay: dict[str, list[float]] = {m: [] for m in MODES}
    drive: dict[str, list[float]] = {m: [] for m in MODES}
    for warm in range(3):  # warm-up, discarded
        for mode in MODES:
            await replay_once(definition, state, mode)
            await drive_once(definition, log, mode)
        del warm
    for r in range(args.rounds * REPLAY_PER_DRIVE):
        order = MODES[r % 3:] + MODES[:r % 3]
        for mode in order:
            replay[mode].append(await replay_once(definition, state, mode))
        if r % REPLAY_PER_DRIVE == 0:
            for mode in order:
                drive[mode].append(await drive_once(definition, log, mode))
    sections: dict[str, Any] = {}
    for name, samples in (("replay", replay), ("drive", drive)):
        medians = {m: statistics.median(v) for m, v in samples.items()}
        fastest = {m: min(v) for m, v in samples.items()}
        sections[name] = {"rounds": len(samples["off"]),
                          "median_ms": {m: round(v * 1000, 3) for m, v in medians.items()},
                          "min_ms": {m: round(v * 1000, 3) for m, v in fastest.items()},
                          "overhead_pct": paired_overhead(samples),
                          "overhead_of_medians_pct": overhead(medians),
                          "overhead_of_minima_pct": overhead(fastest)}
    sections["detector_build_us"] = round(build_us, 1)
    sections["orphaned_frames"] = time_orphans(args.frames, 5)
    worst = max(max(sections[s]["overhead_pct"].values()) for s in ("replay", "drive"))
    return {"benchmark": "divergence", "python": platform.python_version(),
            "machine": platform.machine(), "steps": args.steps, "log_events": len(log),
            "rounds": args.rounds, "load_average": list(os.getloadavg()), **sections,
            "target_overhead_pct": TARGET_OVERHEAD * 100,
            "worst_overhead_pct": worst, "within_target": worst <= TARGET_OVERHEAD * 100}


def show(result: dict[str, Any]) -> None:
    table = Table(title=f"divergence detector on a {result['steps']}-step log "
                        f"({result['log_events']} events): medians; overhead = median "
                        "of paired ratios to off")
    for col in ("measurement", "off ms", "warn ms", "fail ms", "warn overhead",
                "fail overhead"):
        table.add_column(col, justify="right")
    for name in ("replay", "drive"):
        ms, pct = result[name]["median_ms"], result[name]["overhead_pct"]
        table.add_row(f"{name} (x{result[name]['rounds']})", f"{ms['off']:.3f}",
                      f"{ms['warn']:.3f}", f"{ms['fail']:.3f}", f"{pct['warn']:+.2f}%",
                      f"{pct['fail']:+.2f}%")
    orphans = result["orphaned_frames"]
    console = Console()
    console.print(table)
    console.print(f"detector build from the fold: {result['detector_build_us']:.0f} us; "
                  f"orphaned_frames over {orphans['frames']:,} frames: "
                  f"{orphans['median_ms']:.1f} ms ({orphans['frames_per_s']:,} frames/s), "
                  f"orphans {orphans['orphan_families']}")
    console.print(f"worst overhead {result['worst_overhead_pct']:+.2f}% "
                  f"(target <= {result['target_overhead_pct']:.0f}%): "
                  f"{'within' if result['within_target'] else 'OVER'} target")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--json", action="store_true", help="also print the JSON document")
    result = asyncio.run(main(parser.parse_args()))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "divergence.json").write_text(json.dumps(result, indent=2) + "\n")
    show(result)
    if parser.parse_args().json:
        print(json.dumps(result, indent=2))
