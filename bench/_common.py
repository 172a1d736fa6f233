"""What the end-to-end benches share: worker processes, a database of their own, the run's facts.

``bench.fleet`` and ``bench.temporal`` start real worker processes (``celery
worker`` or ``fleet worker``) against the machine's Redis and a Postgres
database created for the run; the helpers for that live here so both measure
fleet the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BIN = Path(sys.executable).parent
CELERY = str(BIN / "celery")
FLEET = str(BIN / "fleet")
# The benches' Redis database: queues and streams of their own, never the tests' 0.
REDIS_DB = 12


def bench_redis_url(base: str) -> str:
    """``base`` (``redis://host:port`` with or without a database) on ``REDIS_DB``."""
    base = base.rstrip("/")
    if base.count("/") > 2:
        base = base.rsplit("/", 1)[0]
    return f"{base}/{REDIS_DB}"


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without any ``FLEET_*`` (a child reads only what the
    bench sets), the checkout on ``PYTHONPATH``, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update({"PYTHONPATH": str(ROOT), "C_FORCE_ROOT": "1"})
    env.update(extra)
    return env


# ----------------------------------------------------------------- processes
class Worker:
    """A Celery worker subprocess (``celery worker`` or ``fleet worker``), named
    ``nodename``; ready when it answers a ping."""

    def __init__(self, argv: list[str], env: dict[str, str], log_dir: Path, *, name: str,
                 nodename: str) -> None:
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd=str(ROOT))
        self.name = name
        self.nodename = nodename

    def wait_ready(self, pinger: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log_path.read_text()[-3000:]}")
            if pinger.control.ping(destination=[self.nodename], timeout=0.5):
                return
        raise RuntimeError(f"{self.name} not ready:\n{self.log_path.read_text()[-3000:]}")

    def memory(self) -> tuple[float, float, int]:
        """(RSS MB, PSS MB, processes) of the worker and its children."""
        import psutil  # type: ignore[import-untyped]

        procs = [psutil.Process(self.proc.pid)]
        procs += procs[0].children(recursive=True)
        rss = pss = 0
        for p in procs:
            info = p.memory_full_info()
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
        return rss / 2**20, pss / 2**20, len(procs)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGQUIT)
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
        self._log.close()


@contextlib.contextmanager
def worker_processes(count: int, argv_for: Callable[[str], list[str]], env: dict[str, str],
                     log_dir: Path, *, broker: str, prefix: str) -> Iterator[list[Worker]]:
    """``count`` workers, ``argv_for(nodename)`` each; yielded once all answer a ping,
    stopped (SIGTERM, then harder) on the way out."""
    import secrets

    from celery import Celery  # type: ignore[import-untyped]

    started = []
    for i in range(count):
        name = f"{prefix}{i}-{secrets.token_hex(2)}"
        nodename = f"{name}@{socket.gethostname()}"
        started.append(Worker(argv_for(nodename), env, log_dir, name=name, nodename=nodename))
    pinger = Celery("bench-ping", broker=broker, set_as_current=False)
    try:
        for w in started:
            w.wait_ready(pinger)
        yield started
    finally:
        pinger.close()
        for w in started:
            w.stop()


@contextlib.contextmanager
def workers(count: int, app: str, queue: str, env: dict[str, str], log_dir: Path, *,
            pool: str, concurrency: int, prefix: str) -> Iterator[list[Worker]]:
    """``celery -A app worker`` processes on ``queue`` (gossip, mingle and heartbeats off)."""
    def argv(nodename: str) -> list[str]:
        return [CELERY, "-A", app, "worker", "-P", pool, "-c", str(concurrency), "-Q", queue,
                "-n", nodename, "-l", "WARNING", "--without-mingle", "--without-gossip",
                "--without-heartbeat"]

    broker = env.get("FLEET_BROKER_URL") or env.get("FLEET_REDIS_URL") or env["BENCH_BROKER"]
    with worker_processes(count, argv, env, log_dir, broker=broker, prefix=prefix) as started:
        yield started


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and their children so far."""
    import psutil

    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    t = p.cpu_times()
                    total += t.user + t.system
    return total


# ------------------------------------------------------------------ Postgres
async def admin(url: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def with_database(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


@contextlib.asynccontextmanager
async def own_database(admin_url: str, prefix: str = "fleet_bench") -> AsyncIterator[str]:
    """A database created for this run on ``admin_url``'s server (its URL); dropped after."""
    import secrets

    name = f"{prefix}_{secrets.token_hex(4)}"
    await admin(admin_url, f'CREATE DATABASE "{name}"')
    try:
        yield with_database(admin_url, name)
    finally:
        await admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ------------------------------------------------------------------- the run
def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# ------------------------------------------- fleet processes of a checkout (--peer)
def checkout_env(checkout: Path, *, url: str, broker: str, queue: str, flows: str,
                 beats: Path) -> dict[str, str]:
    """The environment of a ``fleet ...`` process of ``checkout`` (this one or a
    ``--peer``): only the bench's ``FLEET_*``, and ``bench/`` on the path for the
    benches' top-level flow modules (``timer_flows``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update({"PYTHONPATH": os.pathsep.join([str(checkout), str(ROOT / "bench")]),
                "FLEET_DATABASE_URL": url, "FLEET_BROKER_URL": broker,
                "FLEET_REDIS_URL": broker, "FLEET_QUEUE": queue, "FLEET_FLOWS": flows,
                "FLEET_HEARTBEAT_DIR": str(beats), "C_FORCE_ROOT": "1"})
    return env


def start_fleet_process(checkout: Path, argv: list[str], env: dict[str, str],
                        log_path: Path) -> tuple[subprocess.Popen[bytes], Any]:
    """``python -m fleet.cli <argv>`` of ``checkout``, its output in ``log_path``."""
    log = open(log_path, "ab")  # noqa: SIM115 - closed by stop_fleet_processes
    proc = subprocess.Popen([sys.executable, "-m", "fleet.cli", *argv], env=env, stdout=log,
                            stderr=subprocess.STDOUT, cwd=str(checkout))
    return proc, log


def stop_fleet_processes(procs: list[tuple[subprocess.Popen[bytes], Any]],
                         timeout: float = 30.0) -> None:
    """SIGTERM them all at once, then wait for each (SIGKILL past ``timeout``)."""
    for proc, _ in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, log in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def fleet_bench_parser(doc: str | None, **kw: Any) -> argparse.ArgumentParser:
    """The argument parser of a benchmark that runs a fleet: ``--db`` (a Postgres URL
    whose user may create databases; ``FLEET_BENCH_ADMIN_URL``) and ``--redis``
    (``FLEET_REDIS_URL``), its description the first line of ``doc``."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0], **kw)
    parser.add_argument("--db", default=os.environ.get(
        "FLEET_BENCH_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
        help="a Postgres URL whose user may create databases")
    parser.add_argument("--redis", default=os.environ.get("FLEET_REDIS_URL",
                                                          "redis://127.0.0.1:6379"))
    return parser
