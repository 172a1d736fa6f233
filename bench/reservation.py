"""What the reservation bound costs (decision 0046): one worker draining a burst.

    .venv/bin/python -m bench.reservation [--db URL] [--redis URL] [--n 4000]
                                          [--drives 64] [--repeat 3]

Real processes on a Postgres database of its own and the benches' Redis database:
one worker (threads pool, ``--drives`` drives at once), then ``--n`` starts of a
3-step flow published at once (``Dispatcher.start_many``: ``fleet.drives`` messages of
16), and the time until the last one completed. Rows, alternated round by round:

* **bound**: ``fleet worker`` as shipped (it takes a message only while it holds
  fewer than ``--drives`` drives not yet done);
* **unbound**: the same app without ``ReservationStep``
  (``bench.reservation_worker``), which takes up to ``--drives`` messages of 16.

Also the most drives the worker held at once (sampled every 50 ms from kombu's
``unacked`` hash in Redis). Prints a table and writes ``bench/results/reservation.json``
with the load average before and after.
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
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench._common import (
    FLEET,
    RESULTS,
    ROOT,
    admin,
    bench_redis_url,
    child_env,
    with_database,
)

DEFAULT_DB = os.environ.get("FLEET_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
DEFAULT_REDIS = os.environ.get("FLEET_REDIS_URL", "redis://127.0.0.1:6379/0")
FLOWS = "bench.fleet_flows:three"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.reservation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", default=DEFAULT_DB, help="an admin URL of the Postgres server")
    parser.add_argument("--redis", default=DEFAULT_REDIS)
    parser.add_argument("--n", type=int, default=4000, help="executions per round")
    parser.add_argument("--drives", type=int, default=64, help="the worker's drives at once")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of each, alternated")
    return parser


def held_drives(client: Any, queue: str) -> int:
    """Drives in the messages a worker took from ``queue`` and has not acknowledged."""
    total = 0
    for raw in client.hvals("unacked"):
        message, _, routing_key = json.loads(raw)
        if routing_key != queue:
            continue
        body = json.loads(base64.b64decode(message["body"]))
        total += len(body[0][0]) if message["headers"]["task"] == "fleet.drives" else 1
    return total


def one_round(kind: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    import redis

    from fleet.config import FleetSettings
    from fleet.dispatcher.broker import producer_app
    from fleet.dispatcher.dispatcher import Dispatcher, Start
    from fleet.host.kernel import open_store
    from fleet.services.status import execution_counts

    token = secrets.token_hex(3)
    queue, broker = f"fleet.resv-{token}", bench_redis_url(args.redis)
    name = f"fleet_bench_resv_{token}"
    asyncio.run(admin(args.db, f'CREATE DATABASE "{name}"'))
    url = with_database(args.db, name)
    try:
        env = child_env(FLEET_DATABASE_URL=url, FLEET_BROKER_URL=broker, FLEET_REDIS_URL=broker,
                        FLEET_QUEUE=queue, FLEET_FLOWS=FLOWS,
                        FLEET_STATS_PREFIX=f"fleet-bench:{token}:stats:")
        subprocess.run([FLEET, "db", "upgrade"], env=env, check=True, capture_output=True)
        node = f"resv-{token}@bench"
        worker_args = ["--queues", queue, "--concurrency", str(args.drives), "-n", node,
                       "--without-mingle", "--without-gossip", "--loglevel", "WARNING"]
        argv = ([FLEET, "worker", *worker_args] if kind == "bound"
                else [sys.executable, "-m", "bench.reservation_worker", *worker_args])
        with open(log_dir / f"{kind}-{token}.log", "ab") as log:
            worker = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      cwd=str(ROOT))
        settings = FleetSettings(database_url=url, broker_url=broker, redis_url=broker,
                                 queue=queue, flows=[FLOWS])
        app = producer_app(settings, main="bench-resv")
        client = redis.Redis.from_url(broker)
        dispatcher = Dispatcher(settings)
        peak = [0]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.05):
                peak[0] = max(peak[0], held_drives(client, queue))

        async def completed() -> int:
            store = open_store(settings)
            try:
                return (await execution_counts(store))[0].get("completed", 0)
            finally:
                await store.close()
        try:
            deadline = time.monotonic() + 60
            while not app.control.ping(destination=[node], timeout=0.5):
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the {kind} worker did not start: see {log_dir}")
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            began = time.monotonic()
            dispatcher.start_many_sync([Start("bench-three", i) for i in range(args.n)])
            while asyncio.run(completed()) < args.n:
                time.sleep(0.05)
            took = time.monotonic() - began
        finally:
            stop.set()
            dispatcher.close()
            app.close()
            client.close()
            worker.terminate()
            worker.wait(60)
    finally:
        asyncio.run(admin(args.db, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    return {"kind": kind, "seconds": round(took, 3), "per_s": round(args.n / took, 1),
            "peak_held": peak[0], "load": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-resv-"))
    load_before = os.getloadavg()
    rows = []
    print(f"{'round':>5}  {'worker':<8} {'seconds':>8} {'executions/s':>13} "
          f"{'most drives held':>17} {'load':>6}")
    for i in range(args.repeat):
        for kind in (("bound", "unbound") if i % 2 == 0 else ("unbound", "bound")):
            row = one_round(kind, args, log_dir)
            rows.append({"round": i + 1, **row})
            print(f"{i + 1:>5}  {kind:<8} {row['seconds']:>8.2f} {row['per_s']:>13.1f} "
                  f"{row['peak_held']:>17} {row['load']:>6.2f}", flush=True)
    summary = {kind: {"median_per_s": statistics.median(r["per_s"] for r in rows
                                                          if r["kind"] == kind),
                      "most_held": max(r["peak_held"] for r in rows if r["kind"] == kind)}
               for kind in ("bound", "unbound")}
    print(json.dumps(summary))
    result = {"command": " ".join(["python -m bench.reservation", *sys.argv[1:]]),
              "load_before": [round(x, 2) for x in load_before],
              "load_after": [round(x, 2) for x in os.getloadavg()],
              "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "n": args.n, "drives": args.drives, "rows": rows, "summary": summary}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "reservation.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"load average {result['load_before']} -> {result['load_after']}")


if __name__ == "__main__":
    main()
