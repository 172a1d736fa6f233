"""The client's CPU per execution with 32 executions at once on Postgres behind group commit.

One process, one ``Runtime``, ``bench.kernel``'s 3-step flow, ``CoalescingEventStore``
over ``PostgresEventStore`` (``--max-inflight`` flushes at once), on ``run_loop``
(fleet's loop and its garbage-collector policy, decision 0031). Each row is a child
process; the rows of a round run one after the other and rounds alternate, so a
noisy neighbour hits every row alike. Rows: this checkout with ``FLEET_GC=default``
and with ``auto`` (the default), and with ``--peer DIR`` the same flow on another
checkout (``git archive main | tar -x -C DIR``) beside them. Figures are medians
over ``--rounds``: executions/s, client CPU (``os.times`` user + system) per
execution over the measured window (after a warm-up of 500), the flush's latency
and size. Writes ``bench/results/kernel_c32[_<tag>].json`` with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"


async def _child(n: int, in_flight: int, max_inflight: int, url: str) -> dict[str, Any]:
    """One row: the figures of this process's checkout (whatever ``fleet`` imports)."""
    import asyncpg

    from bench.kernel import three_steps
    from fleet.kernel.runtime import Runtime
    from fleet.kernel.store.coalescing import CoalescingEventStore
    from fleet.kernel.store.postgres import PostgresEventStore

    schema = f"fleet_c32_{secrets.token_hex(4)}"
    store = CoalescingEventStore(await PostgresEventStore(url, schema=schema).open(),
                                 max_inflight=max_inflight)
    latencies: list[float] = []
    sizes: list[int] = []
    commit = store._commit

    async def timed(batch: Any) -> Any:
        began = time.perf_counter()
        try:
            return await commit(batch)
        finally:
            latencies.append(time.perf_counter() - began)
            sizes.append(len(batch))

    store._commit = timed  # type: ignore[method-assign]
    runtime = Runtime(store, flows=[three_steps])
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        async with gate:
            handle = await runtime.start("bench3", i)
            await handle.result()

    try:
        await asyncio.gather(*(one(i) for i in range(500)))
        latencies.clear()
        sizes.clear()
        before, began = os.times(), time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(10_000, 10_000 + n)))
        after, wall = os.times(), time.perf_counter() - began
    finally:
        await runtime.close()
        await store.close()
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        finally:
            await conn.close()
    cpu = after.user + after.system - before.user - before.system
    return {"executions_per_s": round(n / wall, 1),
            "cpu_ms_per_execution": round(cpu / n * 1000, 4),
            "flush_ms_median": round(statistics.median(latencies) * 1000, 3),
            "flush_size_mean": round(statistics.mean(sizes), 2), "flushes": len(sizes)}


def _run_row(checkout: Path, gc_policy: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(checkout), "FLEET_GC": gc_policy}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", "--n", str(args.n),
         "--in-flight", str(args.in_flight), "--max-inflight", str(args.max_inflight),
         "--url", args.url], cwd=checkout, env=env, capture_output=True, text=True,
        check=False, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"the row on {checkout} (FLEET_GC={gc_policy}) failed:\n"
                         f"{done.stderr[-4000:]}")
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(row["checkout"]) != checkout:  # the row must measure the checkout it names
        raise SystemExit(f"the row meant for {checkout} ran {row['checkout']}'s fleet")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=3000, help="executions measured per row")
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--max-inflight", type=int, default=4,
                        help="group commit's flushes at once")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--peer", type=Path, default=None,
                        help="another checkout run beside this one (FLEET_GC=auto)")
    parser.add_argument("--url", default=os.environ.get("FLEET_DATABASE_URL", DEFAULT_URL))
    parser.add_argument("--tag", default="", help="suffix of the results file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        # Run by path, this file's folder is first on sys.path and bench/fleet.py
        # would be ``fleet``: the checkout's own packages (PYTHONPATH) come first.
        if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
            del sys.path[0]
        import fleet
        from fleet.host.loop import run_loop

        row = run_loop(_child(args.n, args.in_flight, args.max_inflight, args.url))
        row["checkout"] = str(Path(fleet.__file__).resolve().parent.parent)
        print(json.dumps(row))
        return
    variants: list[tuple[str, Path, str]] = [("this, FLEET_GC=default", ROOT, "default"),
                                             ("this", ROOT, "auto")]
    if args.peer is not None:
        variants.insert(0, ("peer", args.peer.resolve(), "auto"))
    load_before = os.getloadavg()
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in variants}
    loads: list[tuple[float, float, float]] = []
    for r in range(args.rounds):
        for name, checkout, policy in variants:
            row = _run_row(checkout, policy, args)
            rounds[name].append(row)
            print(f"round {r + 1} {name:24} {row['executions_per_s']:7.0f}/s "
                  f"{row['cpu_ms_per_execution']:.3f} ms CPU/execution, flush "
                  f"{row['flush_ms_median']:.2f} ms x {row['flush_size_mean']:.1f}", flush=True)
        loads.append(os.getloadavg())
    medians = {name: {key: statistics.median(row[key] for row in found)
                      for key in found[0] if key != "checkout"}
               for name, found in rounds.items()}
    print(f"\n{'row':24} {'executions/s':>13} {'CPU ms/exec':>12} {'flush ms':>9} "
          f"{'flush size':>11}   (medians of {args.rounds})")
    for name, m in medians.items():
        print(f"{name:24} {m['executions_per_s']:13.0f} {m['cpu_ms_per_execution']:12.3f} "
              f"{m['flush_ms_median']:9.2f} {m['flush_size_mean']:11.1f}")
    first = next(iter(medians))
    for name, m in medians.items():
        if name != first:
            base = medians[first]
            print(f"{name} / {first}: CPU "
                  f"{m['cpu_ms_per_execution'] / base['cpu_ms_per_execution']:.3f}, "
                  f"executions/s {m['executions_per_s'] / base['executions_per_s']:.3f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"kernel_c32{'_' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps({
        "command": " ".join(["python -m bench.kernel_c32", *sys.argv[1:]]),
        "executions": args.n, "in_flight": args.in_flight, "max_inflight": args.max_inflight,
        "rounds": args.rounds, "peer": str(args.peer) if args.peer else None,
        "medians": medians, "rounds_by_row": rounds, "load_average_before": load_before,
        "load_average_by_round": loads, "load_average": os.getloadavg()}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
