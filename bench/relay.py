"""The relay: lag from commit to a stream consumer, its throughput, its cost to the writers.

    .venv/bin/python -m bench.relay [--db URL] [--redis URL] [--seconds 10]
                                     [--rates 1000,5000] [--concurrency 64]

Real processes on the machine's Postgres and Redis, a database of its own:

* **writers**: one process (``python -m bench.relay writer``), ``--concurrency``
  executions at once, each appending events one after another through the
  group-commit store (``CoalescingEventStore``: what a loaded worker runs),
  paced to a rate or as fast as they go; each event's ack time (``append``
  returned, i.e. just after its commit) is recorded;
* **the relay**: ``fleet relay`` (Postgres LISTEN/NOTIFY wake-ups, default
  batch sizes);
* **a consumer**: an ``EventStreamConsumer`` (consumer group, at least once,
  no checkpoint) in this process, recording when each event arrives.

Last, the write path itself: one append's round trip (and a 32-append
group-commit flush) with schema 2's functions and schema 3's (the feed's
columns, the ordering guard, the doorbell), interleaved call by call.

Rows: the writers alone as fast as they go, then with the relay and the
consumer (the relay's cost to the writers: the ratio of the two, repeated and
interleaved; the relay's throughput beside the store's write rate in the same
run); the lag (consumer arrival minus the writer's ack, p50/p99/max) at each
paced rate; and the relay draining a backlog the writers left with no relay
running (its throughput alone). Every run checks the consumer got every event
exactly once. Prints a table and writes ``bench/results/relay.json`` with the
load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import FLEET, RESULTS, bench_redis_url, child_env, own_database

DEFAULT_DB = os.environ.get("FLEET_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
DEFAULT_REDIS = os.environ.get("FLEET_REDIS_URL", "redis://127.0.0.1:6379/0")
EVENTS_PER_EXECUTION = 20


def parse_rates(text: str) -> list[int]:
    try:
        rates = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated events/s") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated positive events/s")
    return rates


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.relay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", default=DEFAULT_DB, help="an admin URL of the Postgres server")
    parser.add_argument("--redis", default=DEFAULT_REDIS)
    parser.add_argument("--seconds", type=float, default=10.0, help="each run's writing time")
    parser.add_argument("--rates", type=parse_rates, default=[1000, 5000])
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2,
                        help="alone / with-relay pairs at full speed, interleaved")
    parser.add_argument("--backlog", type=int, default=40_000,
                        help="events the relay drains in the backlog row")
    return parser


# ------------------------------------------------------------------ the writer process
async def write(url: str, rate: float, seconds: float, concurrency: int,
                total: int, out: str) -> None:
    from fleet.kernel.store.coalescing import CoalescingEventStore
    from fleet.kernel.store.conformance import make_event, started
    from fleet.kernel.store.postgres import PostgresEventStore

    store = CoalescingEventStore(await PostgresEventStore(url, pool_max=8).open(),
                                 max_inflight=4)
    acks: list[tuple[str, float]] = []
    loop = asyncio.get_running_loop()
    began = loop.time()
    stop_at = began + seconds
    gap = 1.0 / rate if rate > 0 else 0.0
    next_at = began
    tag = secrets.token_hex(3)

    async def pace() -> None:
        nonlocal next_at
        if not gap:
            return
        slot = max(next_at, loop.time())
        next_at = slot + gap
        if slot > loop.time():
            await asyncio.sleep(slot - loop.time())

    def more() -> bool:
        return loop.time() < stop_at if not total else len(acks) < total

    async def run(slot: int) -> None:
        n = 0
        while more():
            x = f"{tag}-{slot}-{n}"
            n += 1
            for sequence in range(EVENTS_PER_EXECUTION):
                if not more():
                    return
                await pace()
                event = started(x) if sequence == 0 else make_event(
                    x, sequence, payload={"output": {"n": sequence, "pad": "x" * 200}})
                await store.append(event)
                acks.append((event.id, time.time()))

    await asyncio.gather(*(run(i) for i in range(concurrency)))
    elapsed = loop.time() - began
    await store.close()
    await asyncio.to_thread(Path(out).write_text, json.dumps({"elapsed": elapsed,
                                                              "acks": acks}))


# ------------------------------------------------------------------ the orchestration
class Run:
    """One database schema and stream: writers, maybe a relay, maybe a consumer."""

    def __init__(self, db: str, redis: str, tmp: Path, name: str) -> None:
        self.schema = f"relay_{name}_{secrets.token_hex(3)}"
        self.url = f"{db}?schema={self.schema}"
        self.redis = redis
        self.stream = f"bench:relay:{secrets.token_hex(4)}:events"
        self.tmp = tmp
        self.name = name
        self.relay: asyncio.subprocess.Process | None = None

    def env(self) -> dict[str, str]:
        return child_env(FLEET_DATABASE_URL=self.url, FLEET_REDIS_URL=self.redis,
                         FLEET_EVENTS_STREAM=self.stream,
                         FLEET_HEARTBEAT_DIR=str(self.tmp / f"beats-{self.name}"))

    async def migrate(self) -> None:
        from fleet.kernel.store.postgres import PostgresEventStore

        store = await PostgresEventStore(self.url, pool_max=1).open()
        await store.close()

    async def start_relay(self) -> None:
        beat = self.tmp / f"beats-{self.name}" / "fleet-relay.heartbeat"
        log = self.tmp / f"relay-{self.name}.log"
        with log.open("ab") as out:
            self.relay = await asyncio.create_subprocess_exec(
                FLEET, "relay", "-l", "WARNING", env=self.env(), stdout=out,
                stderr=asyncio.subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not beat.exists():
            if self.relay.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(log.read_text()[-3000:])
            await asyncio.sleep(0.05)

    async def stop_relay(self) -> None:
        if self.relay is not None and self.relay.returncode is None:
            self.relay.terminate()
            await asyncio.wait_for(self.relay.wait(), 30)

    async def writers(self, *, rate: float, seconds: float, concurrency: int,
                      total: int = 0) -> dict[str, Any]:
        out = self.tmp / f"acks-{self.name}-{secrets.token_hex(2)}.json"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.relay", "writer", "--url", self.url, "--rate",
            str(rate), "--seconds", str(seconds), "--concurrency", str(concurrency),
            "--total", str(total), "--out", str(out), env=self.env())
        if await proc.wait() != 0:
            raise RuntimeError(f"the writer process failed ({proc.returncode})")
        data: dict[str, Any] = json.loads(out.read_text())
        out.unlink()
        return data


class Arrivals:
    """A consumer group member recording when each event reaches it."""

    def __init__(self, redis: str, stream: str) -> None:
        self.redis_url = redis
        self.stream = stream
        self.seen: dict[str, float] = {}
        self.duplicates = 0

    async def __aenter__(self) -> Arrivals:
        import redis.asyncio as aioredis

        from fleet.streams.events import EventStreamConsumer

        self.client = aioredis.Redis.from_url(self.redis_url)

        async def handle(committed: Any) -> None:
            if committed.event.id in self.seen:
                self.duplicates += 1
            self.seen[committed.event.id] = time.time()

        self.consumer = EventStreamConsumer(self.client, handle, stream=self.stream,
                                            group="bench", consumer="c", block_ms=1000,
                                            count=500)
        await self.consumer.start()
        return self

    async def wait_for(self, ids: list[str], timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while any(i not in self.seen for i in ids[-200:]) or len(self.seen) < len(ids):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the consumer has {len(self.seen)} of {len(ids)} events")
            await asyncio.sleep(0.02)

    async def __aexit__(self, *exc: object) -> None:
        await self.consumer.stop()
        await self.client.delete(self.stream, f"{self.stream}:dead")
        await self.client.aclose()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def entries_added(redis: str, stream: str) -> int:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis)
    try:
        info = await client.xinfo_stream(stream)
        return int(info["entries-added"])
    except Exception:  # noqa: BLE001 - no stream yet
        return 0
    finally:
        await client.aclose()


async def full_speed_pair(db: str, redis: str, tmp: Path, args: argparse.Namespace,
                          i: int) -> tuple[float, float, dict[str, Any]]:
    """The writers as fast as they go alone, then beside the relay (no consumer: only the
    relay's cost); the relay's rate and its own CPU per event."""
    import psutil  # type: ignore[import-untyped]

    alone = Run(db, redis, tmp, f"alone{i}")
    await alone.migrate()
    solo = await alone.writers(rate=0, seconds=args.seconds, concurrency=args.concurrency)
    relayed = Run(db, redis, tmp, f"with{i}")
    await relayed.migrate()
    await relayed.start_relay()
    try:
        assert relayed.relay is not None
        proc = psutil.Process(relayed.relay.pid)
        cpu0 = sum(proc.cpu_times()[:2])
        data = await relayed.writers(rate=0, seconds=args.seconds,
                                     concurrency=args.concurrency)
        total = len(data["acks"])
        while await entries_added(redis, relayed.stream) < total:  # noqa: ASYNC110 - polls Redis
            await asyncio.sleep(0.02)
        # From the first commit to the last entry published (the writer's start-up,
        # before its first commit, is no time the relay could have worked).
        done = time.time() - min(t for _, t in data["acks"])
        cpu = sum(proc.cpu_times()[:2]) - cpu0
    finally:
        await relayed.stop_relay()
    rate = total / data["elapsed"]
    return len(solo["acks"]) / solo["elapsed"], rate, {
        "run": i + 1, "events": total, "writes_per_s": round(rate),
        "relay_events_per_s": round(total / done),
        "relay_cpu_us_per_event": round(cpu / total * 1e6, 1)}


async def full_speed_lag(db: str, redis: str, tmp: Path,
                         args: argparse.Namespace) -> dict[str, Any]:
    run = Run(db, redis, tmp, "fullspeed")
    await run.migrate()
    await run.start_relay()
    try:
        async with Arrivals(redis, run.stream) as arrivals:
            data = await run.writers(rate=0, seconds=args.seconds,
                                     concurrency=args.concurrency)
            ids = [eid for eid, _ in data["acks"]]
            await arrivals.wait_for(ids)
            row = lag_row("as fast as they go", data, arrivals)
            first = min(t for _, t in data["acks"])
            row["relay_events_per_s"] = round(len(ids) / (max(arrivals.seen.values())
                                                           - first))
            return row
    finally:
        await run.stop_relay()


def lag_row(label: str, data: dict[str, Any], arrivals: Arrivals) -> dict[str, Any]:
    acks = data["acks"]
    lags = [(arrivals.seen[eid] - t) * 1000 for eid, t in acks if eid in arrivals.seen]
    missing = sum(1 for eid, _ in acks if eid not in arrivals.seen)
    return {"load": label, "events": len(acks),
            "write_rate": round(len(acks) / data["elapsed"]),
            "lag_p50_ms": round(_pct(lags, 0.50), 2), "lag_p90_ms": round(_pct(lags, 0.90), 2),
            "lag_p99_ms": round(_pct(lags, 0.99), 2),
            "lag_max_ms": round(max(lags), 2), "missing": missing,
            "duplicates": arrivals.duplicates}


async def paced(db: str, redis: str, tmp: Path, rate: int,
                args: argparse.Namespace) -> dict[str, Any]:
    run = Run(db, redis, tmp, f"r{rate}")
    await run.migrate()
    await run.start_relay()
    try:
        async with Arrivals(redis, run.stream) as arrivals:
            data = await run.writers(rate=rate, seconds=args.seconds,
                                     concurrency=args.concurrency)
            await arrivals.wait_for([eid for eid, _ in data["acks"]])
            return lag_row(f"paced at {rate}/s", data, arrivals)
    finally:
        await run.stop_relay()


async def backlog(db: str, redis: str, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    run = Run(db, redis, tmp, "backlog")
    await run.migrate()
    data = await run.writers(rate=0, seconds=0, concurrency=args.concurrency,
                             total=args.backlog)
    async with Arrivals(redis, run.stream) as arrivals:
        began = time.time()
        await run.start_relay()
        try:
            ids = [eid for eid, _ in data["acks"]]
            await arrivals.wait_for(ids, timeout=600)
            drained = max(arrivals.seen.values()) - began
        finally:
            await run.stop_relay()
    return {"backlog": len(ids), "write_rate": round(len(ids) / data["elapsed"]),
            "drain_s": round(drained, 2), "relay_events_per_s": round(len(ids) / drained),
            "missing": sum(1 for i in ids if i not in arrivals.seen),
            "duplicates": arrivals.duplicates}


async def write_path_cost(db: str, calls: int = 400) -> dict[str, Any]:
    """One append's server round trip with schema 2's functions (no feed) and schema 3's
    (the feed's columns, the ordering guard, the doorbell), interleaved on one server."""
    import asyncpg

    from fleet.kernel.store.conformance import make_event, started
    from fleet.kernel.store.pg_migrations import MIGRATIONS, VERSION_TABLE
    from fleet.kernel.store.pg_queries import APPEND_MANY_SQL, APPEND_SQL, Write, many_columns

    conns: dict[str, Any] = {}
    for label, upto in (("schema 2 (no feed)", 2), ("schema 3 (feed)", 3)):
        conn = await asyncpg.connect(db, server_settings={
            "default_transaction_isolation": "read committed"})
        name = f"cost_{secrets.token_hex(3)}"
        await conn.execute(f'CREATE SCHEMA "{name}"; SET search_path = "{name}"')
        await conn.execute(VERSION_TABLE)
        for version, sql in MIGRATIONS:
            if version <= upto:
                await conn.execute(sql)
        conns[label] = (conn, name)
    single: dict[str, list[float]] = {k: [] for k in conns}
    many: dict[str, list[float]] = {k: [] for k in conns}
    try:
        for r in range(calls):
            for label, (conn, _) in conns.items():
                x = f"s{r}"
                for event in (started(x), make_event(x, 1)):
                    write = Write.of(x, [event], None)
                    began = time.perf_counter()
                    await conn.fetchrow(APPEND_SQL, write.key, x, None, *write.args())
                    single[label].append(time.perf_counter() - began)
                if r % 4 == 0:
                    items = [(i, Write.of(f"m{r}-{i}", [started(f"m{r}-{i}"), make_event(
                        f"m{r}-{i}", 1)], None), None) for i in range(32)]
                    columns = many_columns(items)
                    began = time.perf_counter()
                    await conn.fetchrow(APPEND_MANY_SQL, *columns)
                    many[label].append(time.perf_counter() - began)
    finally:
        for conn, name in conns.values():
            await conn.execute(f'DROP SCHEMA "{name}" CASCADE')
            await conn.close()
    return {label: {"append_ms_p50": round(statistics.median(single[label]) * 1000, 3),
                    "append_many_32x2_ms_p50": round(statistics.median(many[label]) * 1000,
                                                     3)}
            for label in conns}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="bench-relay-"))
    redis = bench_redis_url(args.redis)
    async with own_database(args.db) as db:
        alone: list[float] = []
        with_relay: list[float] = []
        relay_rows: list[dict[str, Any]] = []
        for i in range(args.repeat):
            solo, relayed, row = await full_speed_pair(db, redis, tmp, args, i)
            alone.append(solo)
            with_relay.append(relayed)
            relay_rows.append(row)
        rows = [await full_speed_lag(db, redis, tmp, args)]
        rows += [await paced(db, redis, tmp, rate, args) for rate in args.rates]
        drained = await backlog(db, redis, tmp, args)
        cost = await write_path_cost(db)
    result = {
        "command": "python -m bench.relay " + " ".join(sys.argv[1:]),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(), "seconds": args.seconds, "concurrency": args.concurrency,
        "writers_alone_events_per_s": [round(r) for r in alone],
        "writers_with_relay_events_per_s": [round(r) for r in with_relay],
        "writers_with_relay_ratio": round(statistics.median(with_relay)
                                          / statistics.median(alone), 3),
        "relay_beside_writers": relay_rows, "lag": rows, "backlog": drained,
        "write_path": cost}
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"\nrelay bench: {result['cpus']} cpus, load {result['load_average_before']} -> "
          f"{result['load_average_after']}, {result['concurrency']} executions writing, "
          f"{result['seconds']:g} s a run")
    print("the writers alone and beside the relay (no consumer), interleaved:")
    for alone, row in zip(result["writers_alone_events_per_s"],
                          result["relay_beside_writers"], strict=True):
        print(f"  run {row['run']}: alone {alone} events/s, with the relay "
              f"{row['writes_per_s']} events/s; the relay {row['relay_events_per_s']} "
              f"events/s, {row['relay_cpu_us_per_event']} us of its own CPU an event")
    print(f"  ratio (medians): {result['writers_with_relay_ratio']}")
    print("lag from the writer's ack to a consumer (an EventStreamConsumer, another process):")
    print(f"  {'load':<22}{'events':>8}{'writes/s':>10}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}"
          f"{'max ms':>9}{'miss':>6}{'dup':>5}")
    for row in result["lag"]:
        print(f"  {row['load']:<22}{row['events']:>8}{row['write_rate']:>10}"
              f"{row['lag_p50_ms']:>9}{row['lag_p90_ms']:>9}{row['lag_p99_ms']:>9}"
              f"{row['lag_max_ms']:>9}{row['missing']:>6}{row['duplicates']:>5}")
    b = result["backlog"]
    print(f"backlog: {b['backlog']} events written at {b['write_rate']}/s with no relay, "
          f"then drained by it at {b['relay_events_per_s']}/s (missing {b['missing']}, "
          f"duplicates {b['duplicates']})")
    for label, row in result["write_path"].items():
        print(f"one append, {label}: {row['append_ms_p50']} ms p50; a flush of 32 appends: "
              f"{row['append_many_32x2_ms_p50']} ms p50")


def writer_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.relay writer")
    parser.add_argument("--url", required=True)
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--total", type=int, default=0)
    parser.add_argument("--out", required=True)
    a = parser.parse_args(argv)
    asyncio.run(write(a.url, a.rate, a.seconds, a.concurrency, a.total, a.out))


if __name__ == "__main__":
    if sys.argv[1:2] == ["writer"]:
        writer_main(sys.argv[2:])
    else:
        arguments = build_parser().parse_args()
        outcome = asyncio.run(main(arguments))
        print_table(outcome)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "relay.json").write_text(json.dumps(outcome, indent=2) + "\n")
