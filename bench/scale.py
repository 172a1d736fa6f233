"""Scaling: fleet end to end with 1, 2 and 4 workers, and what saturates first.

Run: ``python -m bench.scale [--workers 1,2,4] [--n 2000] [--warmup 200] [--repeat 2]
[--pg-limit-s 5] [--env KEY=VALUE ...] [--json]``. Never run as a test.

Each step starts ``--workers`` ``fleet worker`` processes (threads pool, every
setting as ``docs/operations.md`` deploys it, as ``bench.fleet``'s documented
row: ``FLEET_WORKER_DRIVES=64``, 30 s lease) on one Redis (database 12, a
queue of its own) and one Postgres database of its own, and starts ``--n``
executions of the 3-step ``bench-three`` through the async ``Dispatcher`` in
this process (64 starts in flight, as ``bench.fleet``), counted complete in
Postgres. Steps are interleaved ``--repeat`` times (1, 2, 4, 1, 2, 4) so drift
on a shared machine hits every step.

For each run, over the measured batch only:

- **executions/s**;
- **Postgres**: commits/s of the run's database (``pg_stat_database.xact_commit``
  deltas) and commits per execution, against the server's limit for one-row
  durable commits measured in the same run (``bench.pg_limit``: pgbench of one
  INSERT per transaction, 32 clients); the CPU of the database's backends;
- **broker**: Redis commands/s (``INFO stats``; the server is shared, so an
  upper bound) and ``redis-server``'s CPU;
- **workers**: each worker process's CPU from ``/proc`` (a Python process's
  event loop and Celery's consumer each hold the GIL: one core is its ceiling);
- **dispatcher**: this process's CPU;
- **machine**: busy share of all cores from ``/proc/stat`` (every process,
  other users' too) and the load average.

The verdict names the resource nearest its ceiling: the machine's cores (busy
share), one worker process's core, Postgres commits (share of the pgbench
limit), Redis's one core. On a shared machine the cores are usually it; so
each run also gives fleet's own cores and each part's share of fleet's CPU
per execution (workers, Postgres, dispatcher, Redis): what would saturate
first on a machine of its own. Writes ``bench/results/scale.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from bench._common import RESULTS, bench_redis_url, cpu_seconds, fleet_bench_parser, own_database
from bench.fleet import fleet_env, running_fleet
from bench.pg_limit import insert_tps


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores since boot (``/proc/stat``)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])
    return float(total - idle), float(total)


def process_cpu(names: tuple[str, ...]) -> float:
    """CPU seconds so far of every process whose name starts with one of ``names``."""
    import psutil  # type: ignore[import-untyped]

    total = 0.0
    for proc in psutil.process_iter(["name"]):
        with contextlib.suppress(psutil.Error):
            if (proc.info["name"] or "").startswith(names):
                t = proc.cpu_times()
                total += t.user + t.system
    return total


def backend_cpu(database: str) -> float:
    """CPU seconds so far of the Postgres backends connected to ``database``."""
    import psutil

    total = 0.0
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(proc.info["cmdline"] or [])
            if cmd.startswith("postgres:") and f" {database} " in f"{cmd} ":
                t = proc.cpu_times()
                total += t.user + t.system
    return total


def fleet_share(row: dict[str, Any]) -> dict[str, float]:
    """Each part's share of fleet's own CPU per execution (what grows first on a machine
    of its own)."""
    cpu = row["cpu_ms_per_execution"]
    total = sum(cpu.values()) or 1.0
    return {k: round(v / total, 2) for k, v in cpu.items()}


def verdict(row: dict[str, Any]) -> tuple[str, float]:
    """The resource nearest its ceiling, and how near (0..1)."""
    shares = {
        "machine CPU (all cores busy)": row["machine_busy"],
        "one worker process's core": row["worker_core_max"],
        "Postgres commits (pgbench limit)": row["pg_commits_share_of_limit"],
        "Redis (one core)": row["redis_core"],
    }
    name = max(shares, key=lambda k: shares[k])
    return name, shares[name]


async def one_run(args: argparse.Namespace, db: str, database: str, broker: str,
                  count: int, log_dir: Path, extra: dict[str, str]) -> dict[str, Any]:
    queue = f"bench-scale-{secrets.token_hex(3)}"
    env = fleet_env(db, broker, queue, drives=64, documented=True)
    env.update(extra)
    rclient = redis.Redis.from_url(broker)
    try:
        async with running_fleet(env, count, log_dir, pool="threads", concurrency=64,
                                 prefix=f"scale{count}-") as fleet:
            pids = [w.proc.pid for w in fleet.workers]

            async def commits() -> int:
                return int(await fleet.conn.fetchval(
                    "SELECT xact_commit FROM pg_stat_database WHERE datname = $1", database))

            await fleet.batch(args.warmup)
            per_worker0 = [cpu_seconds([p]) for p in pids]
            own0, pg0, redis0 = time.process_time(), backend_cpu(database), \
                process_cpu(("redis-server",))
            busy0, total0 = machine_busy()
            commits0 = await commits()
            cmds0 = int(rclient.info("stats")["total_commands_processed"])
            load = os.getloadavg()[0]
            elapsed = await fleet.batch(args.n)
            # CPU, first: read over the batch alone, as ``elapsed`` is (the idle
            # second below would dilute the machine's busy share).
            busy1, total1 = machine_busy()
            per_worker = [cpu_seconds([p]) - c for p, c in zip(pids, per_worker0,
                                                                strict=True)]
            own = time.process_time() - own0
            pg = backend_cpu(database) - pg0
            redis_cpu = process_cpu(("redis-server",)) - redis0
            cmds1 = int(rclient.info("stats")["total_commands_processed"])
            # pg_stat_database is updated when a backend's transaction ends and
            # reported at most every 0.5 s (PGSTAT_MIN_INTERVAL in 15): let it land.
            await asyncio.sleep(1.0)
            commits1 = await commits()
    finally:
        rclient.close()
    rate = args.n / elapsed
    # The commits counter also saw the 1 s wait and the count queries: about 50 of them.
    commit_rate = (commits1 - commits0) / elapsed
    return {
        "workers": count, "executions_per_s": round(rate, 1), "load_1min": round(load, 2),
        "elapsed_s": round(elapsed, 2),
        "pg_commits_per_s": round(commit_rate, 1),
        "pg_commits_per_execution": round((commits1 - commits0) / args.n, 2),
        "cpu_ms_per_execution": {
            "workers": round(sum(per_worker) / args.n * 1000, 2),
            "postgres": round(pg / args.n * 1000, 2),
            "dispatcher": round(own / args.n * 1000, 2),
            "redis": round(redis_cpu / args.n * 1000, 2)},
        "worker_cores": [round(c / elapsed, 2) for c in per_worker],
        "worker_core_max": round(max(per_worker) / elapsed, 2),
        "postgres_cores": round(pg / elapsed, 2),
        "redis_core": round(redis_cpu / elapsed, 2),
        "redis_commands_per_s": round((cmds1 - cmds0) / elapsed),
        "machine_busy": round((busy1 - busy0) / (total1 - total0), 2),
        # fleet's own processes, in cores: the rest of the busy machine is other users'.
        "fleet_cores": round((sum(per_worker) + pg + own + redis_cpu) / elapsed, 2),
    }


async def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    broker = bench_redis_url(args.redis)
    counts = [int(c) for c in args.workers.split(",")]
    extra = dict(item.split("=", 1) for item in args.env)
    doc: dict[str, Any] = {
        "benchmark": "scale", "command": "python -m bench.scale " + " ".join(sys.argv[1:]),
        "python": platform.python_version(), "machine": f"{os.cpu_count()} cpus",
        "executions": args.n, "warmup": args.warmup, "repeat": args.repeat,
        "settings": {"pool": "threads", "drives_per_worker": 64,
                     "env": "documented (bench.fleet), defaults otherwise", "extra": extra},
        "loadavg_before": list(os.getloadavg()), "runs": []}
    console.log(f"Postgres commit limit: pgbench, one-row INSERT, 32 clients, "
                f"{args.pg_limit_s} s")
    limit = (await insert_tps(args.db, (32,), args.pg_limit_s))[32]
    doc["pg_commit_limit_per_s"] = round(limit)
    doc["pg_commit_limit_load_1min"] = round(os.getloadavg()[0], 2)
    async with own_database(args.db, "fleet_scale") as db:
        database = db.rsplit("/", 1)[1]
        with tempfile.TemporaryDirectory() as logs:
            for round_ in range(args.repeat):
                for count in counts:
                    console.log(f"round {round_ + 1}/{args.repeat}: {count} worker(s)")
                    row = await one_run(args, db, database, broker, count, Path(logs), extra)
                    row["round"] = round_ + 1
                    row["pg_commits_share_of_limit"] = round(row["pg_commits_per_s"] / limit,
                                                             2)
                    row["saturated_first"], row["saturation"] = verdict(row)
                    row["fleet_cpu_share"] = fleet_share(row)
                    doc["runs"].append(row)
    doc["loadavg_after"] = list(os.getloadavg())
    doc["summary"] = summarize(doc["runs"], counts)
    return doc


def summarize(runs: list[dict[str, Any]], counts: list[int]) -> list[dict[str, Any]]:
    """Per worker count: the best run, every run, and speed-up over the first count's best."""
    best = {c: max((r for r in runs if r["workers"] == c),
                   key=lambda r: r["executions_per_s"]) for c in counts}
    base = best[counts[0]]["executions_per_s"]
    return [{"workers": c, "executions_per_s": best[c]["executions_per_s"],
             "runs": [r["executions_per_s"] for r in runs if r["workers"] == c],
             "runs_load_1min": [r["load_1min"] for r in runs if r["workers"] == c],
             "x_first": round(best[c]["executions_per_s"] / base, 2),
             "saturated_first": best[c]["saturated_first"],
             "saturation": best[c]["saturation"],
             "fleet_cores": best[c]["fleet_cores"],
             "fleet_cpu_share": best[c]["fleet_cpu_share"],
             "cpu_ms_per_execution": best[c]["cpu_ms_per_execution"]} for c in counts]


def render(doc: dict[str, Any], console: Console) -> None:
    table = Table(title=f"fleet end to end by worker count ({doc['executions']} executions "
                        f"of 3 steps; Postgres commit limit {doc['pg_commit_limit_per_s']}/s)")
    for column in ("workers", "round", "load", "exec/s", "pg commits/s", "commits/exec",
                   "share of pg limit", "machine busy", "fleet cores", "worker cores",
                   "pg cores",
                   "redis core", "cpu ms/exec w/pg/d/r", "nearest ceiling"):
        table.add_column(column, justify="left" if column == "nearest ceiling" else "right")
    for r in doc["runs"]:
        cpu = r["cpu_ms_per_execution"]
        table.add_row(str(r["workers"]), str(r["round"]), f"{r['load_1min']:.1f}",
                      f"{r['executions_per_s']:.0f}", f"{r['pg_commits_per_s']:.0f}",
                      f"{r['pg_commits_per_execution']:.1f}",
                      f"{r['pg_commits_share_of_limit']:.0%}", f"{r['machine_busy']:.0%}",
                      f"{r['fleet_cores']:.2f}",
                      " ".join(f"{c:.2f}" for c in r["worker_cores"]),
                      f"{r['postgres_cores']:.2f}", f"{r['redis_core']:.2f}",
                      f"{cpu['workers']:.1f}/{cpu['postgres']:.1f}/{cpu['dispatcher']:.1f}/"
                      f"{cpu['redis']:.1f}",
                      f"{r['saturated_first']} ({r['saturation']:.0%})")
    console.print(table)


def main() -> None:
    parser = fleet_bench_parser(__doc__)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--pg-limit-s", type=int, default=5)
    parser.add_argument("--env", action="append", default=[],
                        help="KEY=VALUE for the workers beside the documented settings")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    console = Console(width=200)
    doc = asyncio.run(run(args, console))
    render(doc, console)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scale.json").write_text(json.dumps(doc, indent=1) + "\n")
    if args.json:
        print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
