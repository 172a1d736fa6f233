"""What a Prometheus scrape of the fleet costs as parked runs pile up, and who waits for it.

    .venv/bin/python -m bench.metrics_scrape [--db URL] [--redis URL]
        [--sizes 20,2000,20000,100000] [--queued 2000,20000,100000] [--scrapes 10]
        [--every 1.1] [--tag before|after]

A real ``fleet flower`` process (basic auth) on a Postgres database of its own and
the benches' Redis database. Executions are written straight into the store: parked
on the divergence gate (the log a divergence park leaves, 4 events each) and queued
(a start no worker took: running, no lease, what ``fleet_executions_unowned``
counts). First the parked ones grow through ``--sizes`` with the first of
``--queued`` queued; then the queued ones grow through the rest of ``--queued``.
At each step, ``--scrapes`` scrapes ``--every`` seconds apart (a scrape's cost
without the exporter's one-second reuse of a read; Prometheus scrapes every 15 to
60 s) of:

* ``flower /metrics``: Flower's own ``/metrics`` (port 5555 in the manifests),
  with the basic-auth credentials;
* ``metrics port``: the fleet's exporter on ``FLEET_METRICS_PORT``, if this
  checkout's Flower serves one (decision 0046; absent before it).

While the scrapes run, a thread asks Flower's ``/healthcheck`` every 20 ms: its
worst and median answer times say whether Flower's event loop waits behind a
scrape (the probes Kubernetes sends are the same request). ``parked shown`` and
``unowned shown`` are what the scrape said (a scrape that is cheap and wrong is
no good); ``query`` is the store's ``backlog()`` alone, called from the bench
(median of 5), where the store has it.

Prints a table (milliseconds) and merges the run into
``bench/results/metrics_scrape.json`` under ``--tag``, with the command, the load
average before and after, and the versions. The peer is the code before decision
0046, run from an export of that commit with this script copied in::

    git archive 9066fe9 | tar -x -C /tmp/before && cp bench/metrics_scrape.py \
        /tmp/before/bench/ && (cd /tmp/before && PYTHONPATH=/tmp/before \
        /path/to/.venv/bin/python -m bench.metrics_scrape --tag before)
    # then copy the "before" entry of /tmp/before/bench/results/metrics_scrape.json
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
import tempfile
import threading
import time
import urllib.error
import urllib.request
from base64 import b64encode
from pathlib import Path
from typing import Any

from bench._common import (
    FLEET,
    RESULTS,
    ROOT,
    admin,
    bench_redis_url,
    child_env,
    free_port,
    package_version,
    with_database,
)

DEFAULT_DB = os.environ.get("FLEET_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
DEFAULT_REDIS = os.environ.get("FLEET_REDIS_URL", "redis://127.0.0.1:6379/0")
DIVERGED_GATE = "__fleet_diverged__"
USER, PASSWORD = "bench", "bench-pw"
FLOW_HASH = "sha256:" + "1f" * 32


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated counts") from None
    if not sizes or any(n < 0 for n in sizes) or sizes != sorted(sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: counts in increasing order")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.metrics_scrape", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", default=DEFAULT_DB, help="an admin URL of the Postgres server")
    parser.add_argument("--redis", default=DEFAULT_REDIS)
    parser.add_argument("--sizes", type=parse_sizes, default=[20, 2000, 20_000, 100_000],
                        help="parked executions at each step")
    parser.add_argument("--queued", type=parse_sizes, default=[2000, 20_000, 100_000],
                        help="queued executions: the first with every parked step, then "
                        "the rest with the most parked")
    parser.add_argument("--scrapes", type=int, default=10, help="scrapes per step and target")
    parser.add_argument("--every", type=float, default=1.1, help="seconds between scrapes")
    parser.add_argument("--tag", default="after", help="the key this run is saved under")
    return parser


# ------------------------------------------------------------------ the executions
def parked_log(execution_id: str, at: int) -> list[Any]:
    """The log a divergence park leaves: started, one step, suspended on the gate."""
    from fleet.kernel.events import EventEnvelope, EventType

    def event(seq: int, kind: EventType, payload: dict[str, Any]) -> EventEnvelope:
        return EventEnvelope(id=f"{execution_id}-{seq}", execution_id=execution_id,
                             sequence=seq, type=kind, timestamp=at + seq, payload=payload,
                             metadata={"kernel": True})
    return [event(0, EventType.EXECUTION_STARTED, {"flowId": "bench-parked", "flowVersion": 1,
                                                    "flowHash": FLOW_HASH}),
            event(1, EventType.STEP_STARTED, {"stepId": "a", "attempt": 1}),
            event(2, EventType.STEP_COMPLETED, {"stepId": "a", "attempt": 1, "output": 1}),
            event(3, EventType.EXECUTION_SUSPENDED, {"condition": {
                "on": DIVERGED_GATE, "kind": "diverged", "correlationKey": "skipped 1: a"}})]


def queued_log(execution_id: str, at: int) -> list[Any]:
    """A start no worker has taken: its first event only (status running, no lease)."""
    from fleet.kernel.events import EventEnvelope, EventType

    return [EventEnvelope(id=f"{execution_id}-0", execution_id=execution_id, sequence=0,
                          type=EventType.EXECUTION_STARTED, timestamp=at,
                          payload={"flowId": "bench-queued", "flowVersion": 1,
                                   "flowHash": FLOW_HASH},
                          metadata={"kernel": True})]


async def seed(url: str, kind: str, first: int, last: int, token: str) -> None:
    """Executions ``first .. last - 1`` of ``kind`` (parked or queued), 500 to a write."""
    from fleet.kernel.store.factory import open_postgres_event_store

    make = parked_log if kind == "parked" else queued_log
    store = open_postgres_event_store(url, migrate=True)
    try:
        now = int(time.time() * 1000)
        for start in range(first, last, 500):
            ids = range(start, min(start + 500, last))
            answers = await store.append_many([(make(f"{kind}-{token}-{i:07d}", now), None)
                                               for i in ids])
            refused = [a for a in answers if a is not None]
            if refused:
                raise refused[0]
    finally:
        await store.close()


async def query_ms(url: str) -> float | None:
    """The store's ``backlog()`` alone (median of 5, ms); None where it has none."""
    from fleet.kernel.store.factory import open_postgres_event_store

    try:
        from fleet.kernel.store.backlog import ReportsBacklog
    except ImportError:  # a checkout before decision 0046 (the "before" peer)
        return None
    store = open_postgres_event_store(url, pool_max=1)
    try:
        if not isinstance(store, ReportsBacklog):
            return None
        times = []
        for _ in range(5):
            began = time.perf_counter()
            await store.backlog(int(time.time() * 1000),
                                gates=[DIVERGED_GATE, "__fleet_indoubt__"])
            times.append((time.perf_counter() - began) * 1000)
        return round(statistics.median(times), 2)
    finally:
        await store.close()


# --------------------------------------------------------------------- the scrapes
def get(url: str, headers: dict[str, str] | None = None, timeout: float = 60.0
        ) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class Prober(threading.Thread):
    """Asks ``url`` every ``every_s`` and keeps each answer's time (ms)."""

    def __init__(self, url: str, every_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.url, self.every_s = url, every_s
        self.times: list[float] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            began = time.perf_counter()
            get(self.url, timeout=30)
            self.times.append((time.perf_counter() - began) * 1000)
            self.stopping.wait(self.every_s)


def timed_scrapes(url: str, headers: dict[str, str], count: int, every: float, probe: str
                  ) -> dict[str, Any]:
    """``count`` scrapes of ``url``, ``every`` s apart (ms), /healthcheck probed meanwhile."""
    status, body = get(url, headers)
    if status != 200:
        return {"status": status, "error": body[:300].decode(errors="replace")}
    prober = Prober(probe)
    prober.start()
    times = []
    try:
        for _ in range(count):
            time.sleep(every)
            began = time.perf_counter()
            status, body = get(url, headers)
            times.append((time.perf_counter() - began) * 1000)
            assert status == 200, (status, body[:300])
    finally:
        prober.stopping.set()
        prober.join(30)
    probes = prober.times or [0.0]
    return {"status": 200, "scrape_ms": [round(t, 2) for t in times],
            "scrape_p50_ms": round(statistics.median(times), 2),
            "scrape_max_ms": round(max(times), 2),
            "healthcheck_p50_ms": round(statistics.median(probes), 2),
            "healthcheck_max_ms": round(max(probes), 2), "healthchecks": len(probes),
            "bytes": len(body), "parked_reported": shown(body, "fleet_executions_parked",
                                                         gate="diverged"),
            "unowned_reported": shown(body, "fleet_executions_unowned", flow="bench-queued")}


def shown(body: bytes, name: str, **labels: str) -> float | None:
    """The sample ``name{labels}`` in a scrape (None: not there)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return float(sample.value)
    return None


def wait_serving(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flower exited:\n{log.read_text()[-3000:]}")
        try:
            if get(url, timeout=1)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"flower not serving:\n{log.read_text()[-3000:]}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    token = secrets.token_hex(3)
    redis = bench_redis_url(args.redis)
    rows: list[dict[str, Any]] = []
    name = f"fleet_bench_metrics_{token}"
    asyncio.run(admin(args.db, f'CREATE DATABASE "{name}"'))
    url = with_database(args.db, name)
    load_before = os.getloadavg()
    try:
        asyncio.run(seed(url, "parked", 0, 0, token))  # the schema
        port, metrics_port = free_port(), free_port()
        log = Path(tempfile.mkdtemp(prefix="bench-metrics-")) / "flower.log"
        env = child_env(FLEET_DATABASE_URL=url, FLEET_REDIS_URL=redis, FLEET_BROKER_URL=redis,
                        FLEET_QUEUE=f"fleet.bench-{token}",
                        FLEET_STATS_PREFIX=f"fleet-bench:{token}:stats:",
                        FLEET_METRICS_PORT=str(metrics_port),
                        FLOWER_BASIC_AUTH=f"{USER}:{PASSWORD}")
        with open(log, "ab") as out:
            flower = subprocess.Popen(
                [FLEET, "flower", f"--port={port}", "--address=127.0.0.1"], env=env,
                stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT))
        base = f"http://127.0.0.1:{port}"
        auth = {"Authorization": "Basic " + b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
        try:
            wait_serving(flower, f"{base}/healthcheck", log)
            have = {"parked": 0, "queued": 0}
            steps = [(p, args.queued[0]) for p in args.sizes]
            steps += [(args.sizes[-1], q) for q in args.queued[1:]]
            for parked, queued in steps:
                for kind, want in (("parked", parked), ("queued", queued)):
                    asyncio.run(seed(url, kind, have[kind], want, token))
                    have[kind] = want
                query = asyncio.run(query_ms(url))
                for target, scrape_url, headers in (
                        ("flower /metrics", f"{base}/metrics", auth),
                        ("metrics port", f"http://127.0.0.1:{metrics_port}/metrics", {})):
                    try:
                        result = timed_scrapes(scrape_url, headers, args.scrapes, args.every,
                                               f"{base}/healthcheck")
                    except OSError as exc:  # nothing listens there (before decision 0046)
                        result = {"status": None, "error": f"{type(exc).__name__}: {exc}"}
                    rows.append({"parked": parked, "queued": queued, "target": target,
                                 "query_ms": query, **result})
                    print_row(rows[-1])
        finally:
            flower.terminate()
            try:
                flower.wait(20)
            except subprocess.TimeoutExpired:
                flower.kill()
                flower.wait(10)
    finally:
        asyncio.run(admin(args.db, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    return {"command": " ".join(["python -m bench.metrics_scrape", *sys.argv[1:]]),
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": {n: package_version(n) for n in ("flower", "prometheus-client",
                                                         "asyncpg")},
            "scrapes": args.scrapes, "every_s": args.every, "rows": rows}


HEADER = (f"{'parked':>7} {'queued':>7}  {'target':<16} {'query':>6} {'scrape p50':>10} "
          f"{'scrape max':>10} {'health p50':>10} {'health max':>10} {'parked shown':>12} "
          f"{'unowned shown':>13}")


def print_row(row: dict[str, Any]) -> None:
    if row.get("status") != 200:
        print(f"{row['parked']:>7} {row['queued']:>7}  {row['target']:<16} "
              f"{'(' + str(row.get('error', row.get('status')))[:60] + ')'}", flush=True)
        return
    query = "-" if row["query_ms"] is None else f"{row['query_ms']:.1f}"
    print(f"{row['parked']:>7} {row['queued']:>7}  {row['target']:<16} {query:>6} "
          f"{row['scrape_p50_ms']:>10.1f} {row['scrape_max_ms']:>10.1f} "
          f"{row['healthcheck_p50_ms']:>10.1f} {row['healthcheck_max_ms']:>10.1f} "
          f"{row['parked_reported']!s:>12} {row['unowned_reported']!s:>13}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    print("milliseconds; health = Flower's /healthcheck asked every 20 ms during the scrapes; "
          "query = the store's backlog() alone")
    print(HEADER)
    result = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "metrics_scrape.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    saved[args.tag] = result
    path.write_text(json.dumps(saved, indent=1) + "\n")
    print(f"load average {result['load_before']} -> {result['load_after']}; "
          f"saved under {args.tag!r} in {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
