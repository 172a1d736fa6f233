"""The recovery sweeper under a backlog: how many runs it re-drives that were only queued.

Each row is a fresh Postgres database and queue: one ``fleet worker`` and one
``fleet recovery`` of a checkout (this one; with ``--peer DIR`` another, e.g. ``git
archive main | tar -x -C DIR``, beside it), every setting at its default (the sweep
every 2 s, a 5 s grace), then ``--runs`` starts of a one-step flow (the step waits
0.5 s) published at once through the dispatcher: a backlog the worker drains in tens
of seconds. No process dies, so every drive the sweeper sends is a duplicate of a
drive that was queued or held. Figures, from the processes' own counters in Redis
(decision 0022) once every run completed: the sweeper's re-drives (``redriven``),
what it found queued or held, the worker's deliveries (drives taken) against the
runs, and the drain time. Writes ``bench/results/sweeper[_<tag>].json``.

    python -m bench.sweeper --peer /tmp/main      # before and after, 2,000 runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._common import (
    RESULTS,
    ROOT,
    bench_redis_url,
    checkout_env,
    own_database,
    start_fleet_process,
    stop_fleet_processes,
)

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS = "redis://127.0.0.1:6379"
FLOWS = "timer_flows:slow"


def _counters(client: Any, role: str, pids: set[int]) -> dict[str, float]:
    """The summed counters of ``role``'s processes among ``pids`` (their Redis reports)."""
    total: dict[str, float] = {}
    for key in client.zrange("fleet:stats:index", 0, -1):
        report = client.hgetall(key)
        if report.get(b"role") != role.encode() or int(report.get(b"pid", 0)) not in pids:
            continue
        for name, value in json.loads(report[b"counters"]).items():
            if isinstance(value, (int, float)):
                total[name] = total.get(name, 0) + value
    return total


async def _completed(url: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval(
            "SELECT count(*) FROM executions WHERE status = 'completed'"))
    finally:
        await conn.close()


def _row(checkout: Path, args: argparse.Namespace) -> dict[str, Any]:
    import redis

    broker = bench_redis_url(args.redis)
    queue = f"fleet.bench-sweep-{secrets.token_hex(3)}"
    logs = Path(f"/tmp/bench-sweeper-{queue}")
    logs.mkdir(parents=True, exist_ok=True)

    async def run() -> dict[str, Any]:
        async with own_database(args.url, "fleet_bench_sweep") as url:
            node = f"bench-sweep-{secrets.token_hex(2)}@{socket.gethostname()}"
            names = ("worker", "recovery")
            procs = [start_fleet_process(checkout, argv, checkout_env(
                checkout, url=url, broker=broker, queue=queue, flows=FLOWS,
                beats=logs / f"beats-{name}"), logs / f"{name}.log")
                for name, argv in zip(names, (["worker", "-n", node, "--without-mingle",
                                               "--without-gossip"], ["recovery"]),
                                      strict=True)]
            try:
                return await _measure(url, checkout, list(zip(names, procs, strict=True)),
                                      queue, broker, logs, args)
            finally:
                stop_fleet_processes(procs)
                client = redis.Redis.from_url(broker)
                client.delete(queue)
                client.close()

    return asyncio.run(run())


async def _measure(url: str, checkout: Path, procs: list[Any], queue: str, broker: str,
                   logs: Path, args: argparse.Namespace) -> dict[str, Any]:
    import redis

    deadline = time.monotonic() + 90
    for name, (proc, _) in procs:
        while not list((logs / f"beats-{name}").glob("fleet-*.heartbeat")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{name} did not start: see {logs}")
            await asyncio.sleep(0.2)
    await asyncio.sleep(3)  # the worker consuming, the sweeper past its first ticks
    load_before = os.getloadavg()
    began = time.monotonic()
    env = checkout_env(checkout, url=url, broker=broker, queue=queue, flows=FLOWS, beats=logs)
    sent = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", "import sys, timer_flows; "
                         "timer_flows.dispatch(int(sys.argv[1]))", str(args.runs)],
        env=env, capture_output=True, text=True, check=False, cwd=str(checkout))
    if sent.returncode != 0:
        raise SystemExit(f"dispatching failed:\n{sent.stderr[-3000:]}")
    done_at = None
    while time.monotonic() - began < args.timeout:
        if await _completed(url) >= args.runs:
            done_at = time.monotonic()
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(4)  # the processes report every 2 s
    client = redis.Redis.from_url(broker)
    try:
        pids = {p.pid for _, (p, _) in procs}
        sweeper = _counters(client, "recovery", pids)
        worker = _counters(client, "worker", pids)
    finally:
        client.close()
    return {
        "checkout": str(checkout), "runs": args.runs,
        "completed": await _completed(url),
        "drain_s": None if done_at is None else round(done_at - began, 2),
        "dispatch_s": float(sent.stdout.strip() or 0),
        "redriven": sweeper.get("redriven", 0), "queued": sweeper.get("queued", 0),
        "held": sweeper.get("held"), "examined": sweeper.get("examined", 0),
        "worker_deliveries": worker.get("deliveries", 0),
        "worker_stepped_aside": worker.get("stepped_aside", 0),
        "load_average_before": load_before, "load_average_after": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--peer", type=Path, default=None,
                        help="another checkout run beside this one (e.g. main)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--url", default=os.environ.get("FLEET_DATABASE_URL", DEFAULT_URL))
    parser.add_argument("--redis", default=os.environ.get("FLEET_REDIS_URL", DEFAULT_REDIS))
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    checkouts = [("this", ROOT)]
    if args.peer is not None:
        checkouts.insert(0, ("peer", args.peer.resolve()))
    load_start = os.getloadavg()
    rows: list[dict[str, Any]] = []
    print(f"{'row':6} {'runs':>6} {'drain s':>8} {'re-driven':>10} {'queued':>7} "
          f"{'held':>6} {'deliveries':>11} {'stepped aside':>14}  load")
    for r in range(args.rounds):
        for name, checkout in checkouts:
            row = {"row": name, "round": r + 1, **_row(checkout, args)}
            rows.append(row)
            held = "-" if row["held"] is None else f"{row['held']:.0f}"
            print(f"{name:6} {row['completed']:6} {row['drain_s'] or 0:8.1f} "
                  f"{row['redriven']:10.0f} {row['queued']:7.0f} {held:>6} "
                  f"{row['worker_deliveries']:11.0f} {row['worker_stepped_aside']:14.0f}  "
                  f"{row['load_average_before'][0]:.2f}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"sweeper{'_' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps({
        "command": " ".join(["python -m bench.sweeper", *sys.argv[1:]]),
        "runs": args.runs, "peer": str(args.peer) if args.peer else None, "rows": rows,
        "load_average_before": load_start, "load_average": os.getloadavg()}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
