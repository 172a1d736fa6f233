"""Signed fleet.dispatch against a real worker, real Redis and real Flower (issue 10 item 3).

Attacks as the issue found them: a plain Celery client (a raw protocol-2
message on the queue) claiming another tenant's principal, with no signature,
a forged or tampered one, an expired one, a replay, a key of another tenant,
an oversized or malformed message; Flower's ``POST
/api/task/async-apply/fleet.dispatch`` (``FLOWER_UNAUTHENTICATED_API=true``).
Each is refused with its reason, writes nothing (the victim's log is
unchanged, no execution appears), is counted in the worker's stats, logged
with its reason, and delivered once (never retried). Signed messages under
either key of a rotation go through. And forged ``fleet.drive`` messages change
nothing.

On the main branch before this change the first test failed at its first
message: the unsigned cancel of another tenant's execution succeeded.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery_wire import message, publish_raw, reply
from fleet_flows import ALL
from fleet_worker_kit import WorkerProcess, fleet_env, flower, start_workers
from postgres_server import throwaway_database
from redis_server import url_with_db

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher
from fleet.dispatcher.signing import sign_dispatch
from fleet.kernel.security import Principal
from fleet.workers import make_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REDIS_DB = 10
ACME_1 = "acme-key-one-0123456789abcdef"
ACME_2 = "acme-key-two-0123456789abcdef"
KEYS = {"acme-1": {"client": "shop", "secret": ACME_1, "tenants": ["acme"]},
        "acme-2": {"client": "shop", "secret": ACME_2, "tenants": ["acme"]}}
VICTIM = Principal("vic", tenant="globex")
ACME = {"actor": "shop-user", "tenant": "acme"}


@dataclass
class Fleet:
    settings: FleetSettings
    app: Any
    worker: WorkerProcess
    redis: redis.Redis
    env: dict[str, str]
    logs: Path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    broker = url_with_db(REDIS_DB)
    client = redis.Redis.from_url(broker)
    queue = f"fleet-sign-{secrets.token_hex(3)}"
    logs = tmp_path_factory.mktemp("signing")
    with throwaway_database() as database_url:
        settings = FleetSettings(database_url=database_url, broker_url=broker, queue=queue,
                                 flows=ALL.split(","), lease_ms=1500)
        env = fleet_env(database_url=database_url, broker_url=broker, queue=queue, flows=ALL,
                        extra={"FLEET_TEST_RESULT_BACKEND": broker,
                               "FLEET_DISPATCH_KEYS": json.dumps(KEYS),
                               "FLEET_DISPATCH_MAX_BYTES": "65536"})
        app = make_app(settings)
        (worker,) = start_workers([("signing", [queue])], env, logs, app,
                                  app_module="fleet_test_app")
        try:
            yield Fleet(settings, app, worker, client, env, logs)
        finally:
            worker.stop()
            app.close()
            client.close()


def send(fleet: Fleet, kwargs: dict[str, Any] | None = None,
         args: list[Any] | None = None) -> tuple[str, dict[str, Any]]:
    task_id = publish_raw(fleet.settings.broker, fleet.settings.queue, "fleet.dispatch",
                          message(kwargs, args))
    return task_id, reply(fleet.redis, task_id)


async def events(fleet: Fleet, execution_id: str) -> list[str]:
    async with Dispatcher(fleet.settings) as dispatcher:
        runtime = await dispatcher.runtime()
        return [e.to_json() for e in await runtime.store.read(execution_id)]


async def parked_victim(fleet: Fleet) -> str:
    async with Dispatcher(fleet.settings) as dispatcher:
        eid = await dispatcher.start("fleet-gate", 1, principal=VICTIM)
        await dispatcher.wait(eid, until="parked", timeout=30, principal=VICTIM)
        return eid


def signed(request: dict[str, Any], *, kid: str = "acme-1", secret: str = ACME_1,
           **options: Any) -> dict[str, Any]:
    return sign_dispatch(request, key_id=kid, secret=secret, **options)


async def test_every_forgery_is_refused_counted_logged_and_writes_nothing(fleet: Fleet) -> None:
    victim = await parked_victim(fleet)
    before = await events(fleet, victim)
    as_victim = {"actor": "vic", "tenant": "globex"}
    cancel = {"op": "cancel", "execution_id": victim, "principal": as_victim}
    resume = {"op": "resume", "execution_id": victim, "gate": "approval", "payload": "no",
              "principal": ACME}
    tampered = signed(resume)
    tampered["payload"] = "yes"
    hour_ago = time.time_ns() // 1_000_000 - 3_600_000
    attacks: list[tuple[str, dict[str, Any] | None, list[Any] | None]] = [
        ("unsigned", cancel, None),
        ("unsigned", {**cancel, "principal": None}, None),
        ("bad_signature", signed(cancel, secret="forged-secret-0123456789abcdef"), None),
        ("unknown_key", signed(cancel, kid="globex-1"), None),
        ("expired", signed(cancel, now_ms=hour_ago), None),
        ("bad_signature", tampered, None),
        ("out_of_scope", signed(cancel), None),  # an acme key claiming a globex principal
        ("out_of_scope", signed({**cancel, "principal": None}), None),
        ("oversized", signed({"op": "start", "flow_id": "fleet-three", "principal": ACME,
                              "input": "x" * 100_000}), None),
        ("malformed", None, [1, 2, 3]),
        ("malformed", signed({**cancel, "principal": ACME}), [{"op": "cancel"}]),
        ("bad_signature", {**signed(cancel), "signature": "é" * 64}, None),
    ]
    refused_ids = []
    for reason, kwargs, args in attacks:
        task_id, answer = await asyncio.to_thread(send, fleet, kwargs, args)
        assert answer["ok"] is False, (reason, answer)
        assert answer["error"]["code"] == "dispatch_refused", (reason, answer)
        assert answer["error"]["details"] == [{"reason": reason}], answer
        assert answer["error"]["retryable"] is False
        refused_ids.append(task_id)
    # A replay: the first delivery is carried out (its principal may not resume a
    # globex run: the kernel refuses it), the second is refused before the kernel.
    replay = signed({"op": "start", "flow_id": "fleet-three", "input": 1, "principal": ACME})
    _, first = await asyncio.to_thread(send, fleet, replay)
    assert first["ok"] is True, first
    task_id, again = await asyncio.to_thread(send, fleet, replay)
    assert again["error"]["details"] == [{"reason": "replayed"}]
    refused_ids.append(task_id)

    assert await events(fleet, victim) == before  # nothing was written
    async with Dispatcher(fleet.settings) as dispatcher:
        runtime = await dispatcher.runtime()
        acme = await runtime.store.list_executions(tenant="acme", limit=100)
        assert [row.execution_id for row in acme] == [replay["execution_id"]]
    stats = await asyncio.to_thread(fleet.worker.stats, fleet.app)
    assert stats["dispatch_refused"] == len(attacks) + 1
    log = fleet.worker.log()
    for reason in {reason for reason, _, _ in attacks} | {"replayed"}:
        assert f"fleet.dispatch refused ({reason})" in log, reason
    for task_id in refused_ids:  # answered once: never retried, never redelivered
        assert len(re.findall(rf"fleet\.dispatch\[{task_id}\] received", log)) == 1
    assert "Traceback" not in log


async def test_signed_messages_under_either_key_of_a_rotation_act(fleet: Fleet) -> None:
    _, started = await asyncio.to_thread(send, fleet, signed(
        {"op": "start", "flow_id": "fleet-gate", "input": 4, "principal": ACME}))
    assert started["ok"] is True, started
    eid = started["execution_id"]
    async with Dispatcher(fleet.settings) as dispatcher:
        owner = Principal("shop-user", tenant="acme")
        await dispatcher.wait(eid, until="parked", timeout=30, principal=owner)
        _, resumed = await asyncio.to_thread(send, fleet, signed(
            {"op": "resume", "execution_id": eid, "gate": "approval", "payload": "ok",
             "principal": ACME}, kid="acme-2", secret=ACME_2))
        assert resumed["ok"] is True, resumed
        assert await dispatcher.result(eid, timeout=30, principal=owner) == {
            "before": 5, "approved": "ok"}


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return dict(json.loads(answer.read()))


async def test_flower_async_apply_cannot_act_as_anyone(fleet: Fleet) -> None:
    victim = await parked_victim(fleet)
    before = await events(fleet, victim)
    with flower(fleet.env, fleet.logs, app_module="fleet_test_app") as base:
        url = f"{base}/api/task/async-apply/fleet.dispatch"
        for kwargs, reason in (
                ({"op": "cancel", "execution_id": victim,
                  "principal": {"actor": "vic", "tenant": "globex"}}, "unsigned"),
                (signed({"op": "cancel", "execution_id": victim,
                         "principal": {"actor": "vic", "tenant": "globex"}},
                        secret="not-the-key-0123456789abcdef"), "bad_signature")):
            posted = await asyncio.to_thread(_post, url, {"kwargs": kwargs})
            answer = await asyncio.to_thread(reply, fleet.redis, posted["task-id"])
            assert answer["ok"] is False
            assert answer["error"]["details"] == [{"reason": reason}]
    assert await events(fleet, victim) == before


async def test_forged_drives_change_nothing(fleet: Fleet, tmp_path: Path) -> None:
    """``fleet.drive`` carries no principal: forging one of another tenant's parked,
    finished or running execution must not change its answer."""
    parked = await parked_victim(fleet)
    marker, release = tmp_path / "marker", tmp_path / "release"
    async with Dispatcher(fleet.settings) as dispatcher:
        finished = await dispatcher.start("fleet-three", 1, principal=VICTIM)
        assert await dispatcher.result(finished, timeout=30, principal=VICTIM) == 4
        running = await dispatcher.start("fleet-hold", {"marker": str(marker),
                                                        "release": str(release)},
                                         principal=VICTIM)
        for _ in range(400):
            if marker.exists():
                break
            await asyncio.sleep(0.05)
        assert marker.exists()
        logs = {eid: await events(fleet, eid) for eid in (parked, finished)}

        def forge() -> None:
            for eid in (parked, finished, running) * 3:
                publish_raw(fleet.settings.broker, fleet.settings.queue, "fleet.drive",
                            message({"flow_id": "fleet-three", "tenant": "acme"}, [eid]))

        await asyncio.to_thread(forge)
        await asyncio.sleep(2.0)  # the forged drives were taken and done
        for eid, log in logs.items():
            assert await events(fleet, eid) == log
        release.write_text("go")
        result = await dispatcher.result(running, timeout=30, principal=VICTIM)
        assert result["hold"] == "signing"
    types = [json.loads(e)["type"] for e in await events(fleet, running)]
    assert types.count("EXECUTION_COMPLETED") == 1
    assert types.count("STEP_COMPLETED") == 2  # hold and after, once each
