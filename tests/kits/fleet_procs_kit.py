"""A whole fleet as ``fleet ...`` subprocesses, and the test's own view of its store.

What the tests that run the fleet's commands as real processes share
(``integration/test_fleet_processes.py``, ``integration/test_fleet_page.py``,
``deploy/test_redis_acl_fleet.py``): ``Proc`` (one ``fleet worker`` / ``timers`` /
``recovery`` / ``attacher`` / ``relay`` / ``flower`` process, its log in a file),
waiting until one is ready, stopping them all, and ``StoreView`` (the store read
from a loop thread of the test's own). Each module keeps what is its own: which
settings, which command line, which Redis user.

(``fleet_worker_kit`` is the other kind: ``celery worker`` processes that a test
pauses, kills and restarts.)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from fleet.config import FleetSettings
from fleet.host.kernel import open_store
from fleet.host.loop import EventLoopThread
from fleet.kernel.events import EventEnvelope
from fleet.kernel.store.spi import EventStore, ExecutionSummary

KITS = Path(__file__).resolve().parent  # the flow modules the processes import
ROOT = KITS.parent.parent
FLEET = str(Path(sys.executable).with_name("fleet"))
T = TypeVar("T")


def until(check: Callable[[], T | None], what: str, timeout: float = 30.0,
          interval: float = 0.2) -> T:
    """``check()``'s first true value; fails naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def process_env(settings: Mapping[str, str]) -> dict[str, str]:
    """A fleet process's environment: this one without any ``FLEET_*`` / ``FLOWER_*``
    (the settings are the test's alone), ``settings``, the kits on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "FLOWER_"))}
    env.update(settings)
    env.update({"PYTHONPATH": os.pathsep.join([str(KITS), str(ROOT),
                                               env.get("PYTHONPATH", "")]),
                "C_FORCE_ROOT": "1"})  # root in the test container; Celery only warns
    return env


def nodename(name: str, token: str) -> str:
    """A worker's Celery node name, unique per run: a worker left over from another run
    never answers for this one (pings and inspect replies are keyed by node name)."""
    return f"{name}.{token}@{socket.gethostname()}"


class Proc:
    """One ``fleet ...`` subprocess, its log in a file of its own."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path,
                 nodename: str | None = None, skew_ms: int = 0) -> None:
        self.name = name
        self.env = env
        self.nodename = nodename
        # Unique per start: a process restarted under its name does not append.
        self.log_path = log_dir / f"{name}-{secrets.token_hex(2)}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.started_at = time.time()
        # skew_ms: its wall clock that far off the real one (the kits' ``skewed_clock``).
        command = [sys.executable, "-m", "skewed_clock", str(skew_ms)] if skew_ms else [FLEET]
        self.proc = subprocess.Popen([*command, *args], env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd=str(ROOT))

    @property
    def heartbeats(self) -> Path:
        return Path(self.env["FLEET_HEARTBEAT_DIR"])

    def beats(self) -> bool:
        """Whether it wrote a heartbeat since it started (a restart finds its old one)."""
        return any(p.stat().st_mtime >= self.started_at
                   for p in self.heartbeats.glob("fleet-*.heartbeat"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def wait_exit(self, timeout: float) -> None:
        """Until it exited (raises after ``timeout`` s)."""
        self.proc.wait(timeout)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (the graceful shutdown), SIGKILL after ``timeout`` s."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self._log.closed:
            self._log.close()

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def exited(self) -> AssertionError:
        return AssertionError(f"{self.name} exited:\n{self.log()[-4000:]}")


def serving(url: str, headers: Mapping[str, str] | None = None) -> bool:
    """Whether ``url`` answers 200 (Flower's ``/healthcheck``)."""
    try:
        request = urllib.request.Request(url, headers=dict(headers or {}))
        with urllib.request.urlopen(request, timeout=1) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def wait_ready(proc: Proc, control: Any = None, *, healthcheck: str | None = None,
               headers: Mapping[str, str] | None = None, timeout: float = 60.0) -> None:
    """Until ``proc`` is ready: a worker answers a ping through ``control`` (a Celery
    app on the same broker), Flower serves ``healthcheck``, a service beats."""
    def ready() -> bool:
        if not proc.alive():
            raise proc.exited()
        if proc.nodename is not None:
            return bool(control.control.ping(destination=[proc.nodename], timeout=0.5))
        if healthcheck is not None:
            return serving(healthcheck, headers)
        return proc.beats()
    try:
        until(ready, f"{proc.name} to be ready", timeout, interval=0.1)
    except AssertionError as exc:
        if not proc.alive():
            raise proc.exited() from exc
        raise AssertionError(f"{proc.name} not ready in {timeout} s:\n"
                             f"{proc.log()[-4000:]}") from exc


def stop_all(procs: Iterable[Proc]) -> None:
    """SIGTERM every one at once, then wait for each (they drain side by side)."""
    procs = list(procs)
    for proc in procs:
        if proc.alive():
            proc.proc.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.stop()


class StoreView:
    """The test's own view of the store, on a loop thread of its own."""

    def __init__(self, settings: FleetSettings, name: str = "test-store") -> None:
        self.loop = EventLoopThread(name)
        self.loop.start()
        self.store: EventStore = open_store(settings)

    def run(self, coro: Any) -> Any:
        return self.loop.run_coroutine(coro, timeout=30)

    def read(self, execution_id: str) -> list[EventEnvelope]:
        return list(self.run(self.store.read(execution_id)))

    def summary(self, execution_id: str) -> ExecutionSummary | None:
        row: ExecutionSummary | None = self.run(self.store.get_execution(execution_id))
        return row

    def status(self, execution_id: str) -> str | None:
        row = self.summary(execution_id)
        return None if row is None else str(row.status)

    def count(self) -> int:
        return len(self.run(self.store.list_executions(limit=10_000)))

    def until(self, execution_id: str, status: str, waiting_on: str | None = None,
              timeout: float = 30.0) -> ExecutionSummary:
        """Until the execution is ``status`` (waiting on ``waiting_on``, when given)."""
        deadline = time.monotonic() + timeout
        seen = None
        while time.monotonic() < deadline:
            row = self.summary(execution_id)
            seen = None if row is None else (row.status, row.waiting_on)
            if row is not None and row.status == status and (
                    waiting_on is None or row.waiting_on == waiting_on):
                return row
            time.sleep(0.05)
        raise AssertionError(f"{execution_id} is {seen}, not {status} {waiting_on or ''}, "
                             f"after {timeout} s: {[str(e.type) for e in self.read(execution_id)]}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self.store.close())
        self.loop.stop()
