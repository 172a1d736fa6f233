"""Timers due at one instant: how late each fires with 1 and 2 timer-service replicas.

Each row is a fresh Postgres database and queue: ``--replicas`` ``fleet timers``
processes of a checkout (this one; with ``--peer DIR`` another, e.g. ``git archive
main | tar -x -C DIR``, beside it), ``--timers`` executions parked on timers that
all fall due at one instant while the replicas poll (default interval 0.25 s),
nothing consuming the drives. Figures, read from the store and the queue after
the last one fired: how late each ``TIMER_FIRED`` was written (its timestamp minus
its ``dueAt``: median, p99, max), when the last drive was on the queue (polled
every 20 ms, so up to 20 ms late), how many each replica fired, that each timer
fired once (``TIMER_FIRED`` per log, drives per execution), and the replicas' CPU.
Writes ``bench/results/timers[_<tag>].json`` with the command and load averages.

    python -m bench.timers                       # this checkout, 1 and 2 replicas
    python -m bench.timers --peer /tmp/main      # beside main's code (the "before")
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench._common import (
    RESULTS,
    ROOT,
    bench_redis_url,
    checkout_env,
    cpu_seconds,
    own_database,
    start_fleet_process,
    stop_fleet_processes,
)

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS = "redis://127.0.0.1:6379"
FLOWS = "timer_flows:timer_nap"


def _drive_ids(client: Any, queue: str) -> list[str]:
    ids: list[str] = []
    for raw in client.lrange(queue, 0, -1):
        args = json.loads(base64.b64decode(json.loads(raw)["body"]))[0]
        ids.extend(args[0] if isinstance(args[0], list) else [args[0]])
    return ids


async def _fired(url: str) -> list[tuple[bytes, int, int]]:
    """(execution key, TIMER_FIRED timestamp, its timer's dueAt) per TIMER_FIRED."""
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT f.ekey, f.timestamp AS at, (s.body::jsonb->'payload'->>'dueAt')::bigint "
            "AS due FROM events AS f JOIN events AS s ON s.ekey = f.ekey "
            "AND s.type = 'TIMER_SCHEDULED' WHERE f.type = 'TIMER_FIRED'")
        return [(bytes(r["ekey"]), int(r["at"]), int(r["due"])) for r in rows]
    finally:
        await conn.close()


def _row(checkout: Path, replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    import redis

    broker = bench_redis_url(args.redis)
    queue = f"bench-timers-{secrets.token_hex(3)}"
    logs = Path(f"/tmp/bench-timers-{queue}")
    logs.mkdir(parents=True, exist_ok=True)

    async def run() -> dict[str, Any]:
        async with own_database(args.url, "fleet_bench_timers") as url:
            procs = [start_fleet_process(
                checkout, ["timers"], checkout_env(checkout, url=url, broker=broker,
                                                   queue=queue, flows=FLOWS,
                                                   beats=logs / f"beats-{n}"),
                logs / f"timers-{n}.log") for n in range(replicas)]
            try:
                return await _measure(url, checkout, procs, queue, broker, replicas, args)
            finally:
                stop_fleet_processes(procs)
                client = redis.Redis.from_url(broker)
                client.delete(queue)
                client.close()

    return asyncio.run(run())


async def _measure(url: str, checkout: Path, procs: list[Any], queue: str, broker: str,
                   replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    import redis

    # Ready: every replica wrote its heartbeat (it opened the store, made the schema).
    deadline = time.monotonic() + 60
    for n, (proc, _) in enumerate(procs):
        beats = Path(f"/tmp/bench-timers-{queue}") / f"beats-{n}"
        while not list(beats.glob("fleet-*.heartbeat")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"replica {n} did not start: see /tmp/bench-timers-{queue}")
            await asyncio.sleep(0.1)
    due_at = time.time() + args.lead
    env = checkout_env(checkout, url=url, broker=broker, queue=queue, flows=FLOWS,
                       beats=Path("/tmp"))
    parked = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", "import sys, timer_flows; "
         "timer_flows.park(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))",
         url, str(args.timers), repr(due_at)], env=env, capture_output=True, text=True,
        check=False, cwd=str(checkout))
    if parked.returncode != 0:
        raise SystemExit(f"parking failed:\n{parked.stderr[-3000:]}")
    if time.time() > due_at - 1:
        raise SystemExit(f"parking took {parked.stdout.strip()} s, past the due instant "
                         f"less 1 s: raise --lead")
    pids = [p.pid for p, _ in procs]
    cpu_before = cpu_seconds(pids)
    load_before = os.getloadavg()
    client = redis.Redis.from_url(broker)
    queued_at = None
    try:
        while time.time() < due_at + args.timeout:
            if len(_drive_ids(client, queue)) >= args.timers:
                queued_at = time.time()
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(1.0)  # a second firing would show within this
        drives = Counter(_drive_ids(client, queue))
    finally:
        client.close()
    cpu = cpu_seconds(pids) - cpu_before
    fired = await _fired(url)
    late = sorted(at - due for _, at, due in fired)
    per_log = Counter(key for key, _, _ in fired)
    # Who fired what: the TIMER_FIRED writer is not in the log; the replicas' stats are.
    row = {
        "checkout": str(checkout), "replicas": replicas, "timers": args.timers,
        "fired": len(fired), "logs_fired_twice": sum(1 for n in per_log.values() if n > 1),
        "drives": sum(drives.values()), "executions_driven_twice":
            sum(1 for n in drives.values() if n > 1),
        "late_ms_median": statistics.median(late) if late else None,
        "late_ms_p99": late[int(len(late) * 0.99) - 1] if late else None,
        "late_ms_max": late[-1] if late else None,
        "all_queued_after_s": None if queued_at is None else round(queued_at - due_at, 3),
        "replica_cpu_s": round(cpu, 3), "parking_s": float(parked.stdout.strip() or 0),
        "load_average_before": load_before, "load_average_after": os.getloadavg()}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timers", type=int, default=3000)
    parser.add_argument("--replicas", default="1,2", help="comma-separated replica counts")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--peer", type=Path, default=None,
                        help="another checkout run beside this one (e.g. main)")
    parser.add_argument("--lead", type=float, default=25.0,
                        help="seconds from the start of parking to the due instant")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--url", default=os.environ.get("FLEET_DATABASE_URL", DEFAULT_URL))
    parser.add_argument("--redis", default=os.environ.get("FLEET_REDIS_URL", DEFAULT_REDIS))
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    checkouts = [("this", ROOT)]
    if args.peer is not None:
        checkouts.insert(0, ("peer", args.peer.resolve()))
    counts = [int(c) for c in args.replicas.split(",")]
    load_start = os.getloadavg()
    rows: list[dict[str, Any]] = []
    print(f"{'row':6} {'replicas':>8} {'fired':>6} {'twice':>6} {'late p50':>9} "
          f"{'p99':>7} {'max':>7} {'queued':>8} {'CPU s':>6}  load")
    for r in range(args.rounds):
        for name, checkout in checkouts:
            for replicas in counts:
                row = {"row": name, "round": r + 1, **_row(checkout, replicas, args)}
                rows.append(row)
                queued = row["all_queued_after_s"]
                print(f"{name:6} {replicas:8} {row['fired']:6} "
                      f"{row['logs_fired_twice'] + row['executions_driven_twice']:6} "
                      f"{row['late_ms_median'] or 0:7.0f}ms {row['late_ms_p99'] or 0:5.0f}ms "
                      f"{row['late_ms_max'] or 0:5.0f}ms "
                      f"{'-' if queued is None else f'{queued:.2f}s':>8} "
                      f"{row['replica_cpu_s']:6.2f}  {row['load_average_before'][0]:.2f}",
                      flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"timers{'_' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps({
        "command": " ".join(["python -m bench.timers", *sys.argv[1:]]),
        "timers": args.timers, "peer": str(args.peer) if args.peer else None,
        "rows": rows, "load_average_before": load_start,
        "load_average": os.getloadavg()}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
