"""Real Celery worker (and Flower) processes for the fleet integration tests.

``WorkerProcess`` starts ``celery -A <app module> worker`` as a subprocess with
the fleet's settings in its environment, waits until it answers a control
ping, and can pause (SIGSTOP), resume (SIGCONT), kill (SIGKILL) or stop it
(SIGTERM: a warm shutdown). Its log goes to a file the test can read.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import redis

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CELERY = str(Path(sys.executable).with_name("celery"))
FLEET = str(Path(sys.executable).with_name("fleet"))


def fleet_env(*, database_url: str, broker_url: str, queue: str, flows: str,
              routes: Mapping[str, str] | None = None, lease_ms: int = 1500,
              worker_drives: int = 16, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a fleet process (``FLEET_*`` plus the test flows on the path)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update({
        "FLEET_DATABASE_URL": database_url, "FLEET_BROKER_URL": broker_url,
        "FLEET_QUEUE": queue, "FLEET_FLOWS": flows, "FLEET_ROUTES": json.dumps(routes or {}),
        "FLEET_LEASE_MS": str(lease_ms), "FLEET_WORKER_DRIVES": str(worker_drives),
        "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")]),
        # The worker runs as root in the test container; Celery only warns.
        "C_FORCE_ROOT": "1"})
    env.update(extra or {})
    return env


class WorkerProcess:
    """One ``celery worker`` subprocess (``fleet worker`` with ``fleet_cli``)."""

    def __init__(self, name: str, env: Mapping[str, str], queues: list[str], log_dir: Path, *,
                 app_module: str = "fleet.workers.main", pool: str | None = None,
                 concurrency: int | None = None, quiet: bool = True,
                 fleet_cli: bool = False) -> None:
        self.name = name
        # Unique per process: a worker left over from another run must never
        # answer for this one (inspect replies are keyed by node name).
        self.nodename = f"{name}.{secrets.token_hex(3)}@{socket.gethostname()}"
        self.log_path = log_dir / f"{name}.log"
        env = dict(env)
        env["FLEET_TEST_WORKER_NAME"] = name
        if fleet_cli:  # the operator's command: the app of the FLEET_* settings
            args = [FLEET, "worker", "--queues", ",".join(queues), "-n", self.nodename,
                    "--loglevel", "INFO"]
            if pool is not None:
                args += ["--pool", pool]
        else:
            args = [CELERY, "-A", app_module, "worker", "-Q", ",".join(queues),
                    "-n", self.nodename, "-l", "INFO"]
            if pool is not None:  # else the app's pool (FLEET_WORKER_POOL, threads by default)
                args += ["-P", pool]
        if concurrency is not None:
            args += ["--concurrency" if fleet_cli else "-c", str(concurrency)]
        if quiet:
            args += ["--without-mingle", "--without-gossip", "--without-heartbeat"]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=str(ROOT))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, app: Any, timeout: float = 30.0) -> None:
        """Until the worker answers a ping through ``app``.

        A ping whose connection the broker closed (a restarted broker: the
        app's pooled connection is stale) raises a connection error; the next
        one reconnects, so that counts as "not yet", like no answer.
        """
        errors = (*connection_errors(app), OSError, redis.exceptions.ConnectionError)
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            if not self.alive():
                raise AssertionError(f"worker {self.name} exited:\n{self.log()[-4000:]}")
            try:
                if app.control.ping(destination=[self.nodename], timeout=0.5):
                    return
            except errors as exc:
                last = exc
                time.sleep(0.1)
        raise AssertionError(f"worker {self.name} did not answer a ping in {timeout} s "
                             f"(last error: {last!r}):\n{self.log()[-4000:]}")

    def stats(self, app: Any, timeout: float = 3.0) -> dict[str, Any]:
        """``stats()["fleet"]`` of this worker, through ``celery inspect stats``."""
        reply = app.control.inspect(destination=[self.nodename], timeout=timeout).stats() or {}
        return dict(reply.get(self.nodename, {}).get("fleet", {}))

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def stop(self, warm: float = 3.0) -> None:
        """SIGTERM (a warm shutdown); after ``warm`` s SIGQUIT (cold); then SIGKILL.

        An idle worker on AMQP sits in its event loop until its next timer
        (about 10 s) before it notices a SIGTERM; the tests do not wait for that.
        """
        if self.alive():
            self.signal(signal.SIGCONT)
            for sig, wait in ((signal.SIGTERM, warm), (signal.SIGQUIT, 10.0)):
                self.signal(sig)
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            else:
                self.kill()
        self._log.close()

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")


def connection_errors(app: Any) -> tuple[type[BaseException], ...]:
    """What the app's broker transport raises for a lost connection."""
    with app.connection_for_write() as conn:
        return (*tuple(conn.connection_errors), ConnectionError)


def start_workers(specs: list[tuple[str, list[str]]], env: Mapping[str, str], log_dir: Path,
                  app: Any, **options: Any) -> list[WorkerProcess]:
    """Start several workers at once (they boot in parallel), then wait for each."""
    workers = [WorkerProcess(name, env, queues, log_dir, **options) for name, queues in specs]
    try:
        for worker in workers:
            worker.wait_ready(app)
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def flower(env: Mapping[str, str], log_dir: Path,
           app_module: str = "fleet.workers.main") -> Iterator[str]:
    """A Flower process with its HTTP API open; yields its base URL."""
    port = free_port()
    env = dict(env)
    env["FLOWER_UNAUTHENTICATED_API"] = "true"
    log_path = log_dir / "flower.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([CELERY, "-A", app_module, "flower", f"--port={port}",
                                 "--address=127.0.0.1", "--inspect_timeout=1000"],
                                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                if proc.poll() is not None:
                    raise AssertionError(f"flower exited:\n{log_path.read_text()[-4000:]}")
                try:
                    with urllib.request.urlopen(f"{base}/healthcheck", timeout=1) as reply:
                        if reply.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"flower did not start:\n{log_path.read_text()[-4000:]}")
                time.sleep(0.2)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def get_json(url: str, timeout: float = 15.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def get_text(url: str, timeout: float = 15.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return str(reply.read().decode())
