"""The two common hosts submitting at once (issue 17 item 3): the examples, run as they ship.

``fleet.examples.web_sync`` (Flask under waitress, 64 request threads, the
sync API) and ``fleet.examples.web_async`` (Starlette under uvicorn, the
async API), each as its own process, against a real Postgres and Redis, with
two real ``fleet worker`` processes driving. Each app gets 300 orders from 64
concurrent clients, every one of them posted twice (a client's retry: the order
id is the idempotency key) and some again inside batches; every order is then
one execution that completed exactly once: one ``EXECUTION_STARTED``, each
step completed once, one ``EXECUTION_COMPLETED``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fleet_worker_kit import HERE, ROOT, free_port
from postgres_server import throwaway_database
from redis_server import url_with_db

from fleet.config import FleetSettings
from fleet.host.kernel import open_store

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

FLEET = str(Path(sys.executable).with_name("fleet"))
REDIS_DB = 9
ORDERS = 300
CLIENTS = 64


def _env(database_url: str, broker: str, queue: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update({"FLEET_DATABASE_URL": database_url, "FLEET_BROKER_URL": broker,
                "FLEET_QUEUE": queue, "FLEET_FLOWS": "fleet.examples.orders:order",
                "FLEET_PUBLISH_EVENTS": "false", "C_FORCE_ROOT": "1",
                "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])})
    return env


class Proc:
    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log_path = log
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=str(ROOT))

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str],
                                                                      Path]]:
    logs = tmp_path_factory.mktemp("web")
    queue = f"fleet-web-{secrets.token_hex(3)}"
    with throwaway_database() as database_url:
        env = _env(database_url, url_with_db(REDIS_DB), queue)
        workers = [Proc([FLEET, "worker", "--queues", queue, "--concurrency", "32",
                         "--hostname", f"web-{n}.{secrets.token_hex(3)}@%h"], env,
                        logs / f"worker-{n}.log") for n in range(2)]
        try:
            yield database_url, env, logs
        finally:
            for worker in workers:
                worker.stop()


def _wait_listening(port: int, proc: Proc, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise AssertionError(f"the app exited:\n{proc.log()[-3000:]}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"the app did not listen:\n{proc.log()[-3000:]}")


def _post(url: str, body: Any) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "X-Tenant": "shop", "X-User": "web"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.status == 202
        return json.loads(answer.read())


def _get(url: str) -> Any:
    request = urllib.request.Request(url, headers={"X-Tenant": "shop", "X-User": "web"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def submit(base: str, run: str) -> dict[str, str]:
    """300 orders from 64 client threads, each posted twice, 100 again in two batches;
    the execution id each order id got."""
    orders = [{"order_id": f"{run}-{n}", "amount": n, "quantity": 2} for n in range(ORDERS)]
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        singles = list(pool.map(lambda o: (o["order_id"], _post(f"{base}/orders", o)),
                                orders + orders))
        batches = list(pool.map(lambda chunk: _post(f"{base}/orders/batch", chunk),
                                [orders[:50] + orders[:5], orders[50:100]]))
    ids: dict[str, str] = {}
    for order_id, answer in singles:
        assert ids.setdefault(order_id, answer["execution_id"]) == answer["execution_id"]
    batch_ids = batches[0]["execution_ids"] + batches[1]["execution_ids"]
    assert batch_ids == [ids[o["order_id"]] for o in orders[:50] + orders[:5] + orders[50:100]]
    assert len(set(ids.values())) == ORDERS
    return ids


async def exactly_once(database_url: str, ids: dict[str, str]) -> None:
    store = open_store(FleetSettings(database_url=database_url))
    try:
        for order_id, execution_id in ids.items():
            events = await store.read(execution_id)
            types = Counter(str(e.type) for e in events)
            assert types["EXECUTION_STARTED"] == 1, (order_id, types)
            assert types["EXECUTION_COMPLETED"] == 1, (order_id, types)
            steps = Counter(e.payload["stepId"] for e in events
                            if str(e.type) == "STEP_COMPLETED")
            assert steps == {"reserve": 1, "charge": 1, "confirm": 1}, (order_id, steps)
            n = int(order_id.rsplit("-", 1)[1])
            assert events[-1].payload["output"]["charged"] == 2 * n
    finally:
        await store.close()


def wait_done(base: str, ids: dict[str, str]) -> None:
    deadline = time.monotonic() + 120
    pending = set(ids.values())
    while pending and time.monotonic() < deadline:
        for execution_id in list(pending):
            if _get(f"{base}/orders/{execution_id}?wait=0.2")["status"] == "completed":
                pending.discard(execution_id)
    assert not pending, f"{len(pending)} orders did not complete"


@pytest.mark.parametrize(("module", "extra"), [
    ("fleet.examples.web_sync", ["--threads", "64"]),
    ("fleet.examples.web_async", []),
])
def test_the_example_app_submits_hundreds_concurrently_and_each_runs_once(
        fleet: tuple[str, dict[str, str], Path], module: str, extra: list[str]) -> None:
    database_url, env, logs = fleet
    port = free_port()
    app = Proc([sys.executable, "-m", module, "--port", str(port), *extra], env,
               logs / f"{module}.log")
    try:
        _wait_listening(port, app)
        base = f"http://127.0.0.1:{port}"
        began = time.monotonic()
        ids = submit(base, module.rsplit(".", 1)[1])
        submitted = time.monotonic() - began
        wait_done(base, ids)
        print(f"{module}: {2 * ORDERS + 105} submissions of {ORDERS} orders in "
              f"{submitted:.1f} s; all completed after {time.monotonic() - began:.1f} s")
        asyncio.run(exactly_once(database_url, ids))
        with pytest.raises(urllib.error.HTTPError) as refused:  # a bad request: typed, 400
            _post(f"{base}/orders", {"order_id": "", "amount": 1})
        assert refused.value.code == 400
        assert json.loads(refused.value.read())["error"] == "validation"
    finally:
        app.stop()
    assert "Traceback" not in app.log()
