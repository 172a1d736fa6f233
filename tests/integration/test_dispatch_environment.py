"""Signed fleet.dispatch binds its fleet, a reward key is no dispatch key, and another
tenant's execution answers as one that does not exist (issue 25 item 11; decision 0045).

A production worker (``FLEET_ENVIRONMENT=prod``) whose ring shares a key with staging,
as rings copied between environments do, and which also holds a bare secret (the reward
key-file format ``{"producer": "secret"}``, which the ring's shorthand read as a key for
every tenant and for no principal at all). Against a real worker, real Redis and real
Postgres: a message signed for staging, one that names no environment, one whose
environment was changed after signing, and any message under the bare key are refused
with their reason, write nothing and are counted; a message signed for prod acts.

On main before this change (no environment at all) a message signed with the shared key
in staging resumed production's execution, and the bare key cancelled it with no
principal.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery_wire import message, publish_raw, reply
from fleet_flows import ALL
from fleet_worker_kit import WorkerProcess, fleet_env, start_workers
from postgres_server import throwaway_database
from redis_server import url_with_db

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher
from fleet.dispatcher.signing import sign_dispatch
from fleet.kernel.security import Principal
from fleet.workers import make_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REDIS_DB = 10
SHARED = "shared-by-staging-and-prod-0123456789"
REWARD = "crm-reward-key-0123456789abcdef"
GLOBEX = "globex-key-0123456789abcdef0123"
KEYS = {"shop-1": {"client": "shop", "secret": SHARED, "tenants": ["acme"]},
        "globex-1": {"client": "globex-shop", "secret": GLOBEX, "tenants": ["globex"]},
        "crm": REWARD}  # a reward producer's key, pasted in its own format
OWNER = Principal("shop-user", tenant="acme")
AS_OWNER = {"actor": "shop-user", "tenant": "acme"}


@dataclass
class Prod:
    settings: FleetSettings
    app: Any
    worker: WorkerProcess
    redis: redis.Redis


@pytest.fixture(scope="module")
def prod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prod]:
    broker = url_with_db(REDIS_DB)
    client = redis.Redis.from_url(broker)
    queue = f"fleet-env-{secrets.token_hex(3)}"
    logs: Path = tmp_path_factory.mktemp("environment")
    with throwaway_database() as database_url:
        settings = FleetSettings(database_url=database_url, broker_url=broker, queue=queue,
                                 flows=ALL.split(","), lease_ms=1500, environment="prod")
        env = fleet_env(database_url=database_url, broker_url=broker, queue=queue, flows=ALL,
                        extra={"FLEET_TEST_RESULT_BACKEND": broker,
                               "FLEET_DISPATCH_KEYS": json.dumps(KEYS),
                               "FLEET_ENVIRONMENT": "prod"})
        app = make_app(settings)
        (worker,) = start_workers([("prod", [queue])], env, logs, app,
                                  app_module="fleet_test_app")
        try:
            yield Prod(settings, app, worker, client)
        finally:
            worker.stop()
            app.close()
            client.close()


def send(prod: Prod, kwargs: dict[str, Any]) -> dict[str, Any]:
    task_id = publish_raw(prod.settings.broker, prod.settings.queue, "fleet.dispatch",
                          message(kwargs))
    return reply(prod.redis, task_id)


async def parked(prod: Prod) -> tuple[str, list[str]]:
    async with Dispatcher(prod.settings) as dispatcher:
        eid = await dispatcher.start("fleet-gate", 1, principal=OWNER)
        await dispatcher.wait(eid, until="parked", timeout=30, principal=OWNER)
        runtime = await dispatcher.runtime()
        return eid, [e.to_json() for e in await runtime.store.read(eid)]


async def log_of(prod: Prod, execution_id: str) -> list[str]:
    async with Dispatcher(prod.settings) as dispatcher:
        runtime = await dispatcher.runtime()
        return [e.to_json() for e in await runtime.store.read(execution_id)]


async def test_only_a_message_signed_for_this_fleet_acts(prod: Prod) -> None:
    eid, before = await parked(prod)
    resume = {"op": "resume", "execution_id": eid, "gate": "approval", "payload": "yes",
              "principal": AS_OWNER}
    moved = sign_dispatch(resume, key_id="shop-1", secret=SHARED, environment="staging")
    moved["env"] = "prod"  # re-labelled after signing
    attacks = [
        ("wrong_environment", sign_dispatch(resume, key_id="shop-1", secret=SHARED,
                                            environment="staging")),
        ("wrong_environment", sign_dispatch(resume, key_id="shop-1", secret=SHARED)),
        ("bad_signature", moved),
        ("malformed", sign_dispatch(resume, key_id="shop-1", secret=SHARED, environment="")),
    ]
    for reason, kwargs in attacks:
        answer = await asyncio.to_thread(send, prod, kwargs)
        assert answer["ok"] is False, (reason, answer)
        assert answer["error"]["details"] == [{"reason": reason}], (reason, answer)
        assert answer["error"]["retryable"] is False
    assert await log_of(prod, eid) == before  # nothing written
    stats = await asyncio.to_thread(prod.worker.stats, prod.app)
    assert stats["dispatch_refused"] >= len(attacks)
    assert "fleet.dispatch refused (wrong_environment)" in prod.worker.log()

    ours = sign_dispatch(resume, key_id="shop-1", secret=SHARED, environment="prod")
    answer = await asyncio.to_thread(send, prod, ours)
    assert answer["ok"] is True, answer
    async with Dispatcher(prod.settings) as dispatcher:
        assert await dispatcher.result(eid, timeout=30, principal=OWNER) == {
            "before": 2, "approved": "yes"}


async def test_a_reward_key_in_the_dispatch_ring_speaks_for_nobody(prod: Prod) -> None:
    eid, before = await parked(prod)
    for principal in (None, AS_OWNER, {"actor": "ops", "tenant": "globex"}):
        cancel = sign_dispatch({"op": "cancel", "execution_id": eid, "principal": principal},
                               key_id="crm", secret=REWARD, environment="prod")
        answer = await asyncio.to_thread(send, prod, cancel)
        assert answer["ok"] is False, answer
        assert answer["error"]["details"] == [{"reason": "unknown_key"}], answer
        assert "bare secret" in answer["error"]["message"]
    assert await log_of(prod, eid) == before


async def test_another_tenants_execution_answers_as_one_that_does_not_exist(
        prod: Prod) -> None:
    """Issue 25 item 11: a globex client resuming, sending to or cancelling acme's
    execution hears exactly what it hears for an id with no log; the denial is still
    audited on the log (resume, cancel) and counted."""
    eid, before = await parked(prod)
    ghost = f"no-such-{secrets.token_hex(4)}"
    stranger = {"actor": "buyer", "tenant": "globex"}

    def ask(execution_id: str, op: str) -> dict[str, Any]:
        request: dict[str, Any] = {"op": op, "execution_id": execution_id,
                                   "principal": stranger}
        if op == "resume":
            request.update(gate="approval", payload="yes")
        elif op == "send":
            request.update(key="note", payload=1)
        return send(prod, sign_dispatch(request, key_id="globex-1", secret=GLOBEX,
                                        environment="prod"))

    for op in ("resume", "send", "cancel"):
        theirs, nothing = (await asyncio.to_thread(ask, eid, op),
                           await asyncio.to_thread(ask, ghost, op))
        assert theirs["ok"] is False, theirs
        assert theirs["error"]["code"] == "execution_not_found", theirs
        for answer, execution_id in ((theirs, eid), (nothing, ghost)):
            answer["error"]["message"] = answer["error"]["message"].replace(
                execution_id, "<id>")
            answer["execution_id"] = "<id>"
        assert theirs == nothing, op
    after = await log_of(prod, eid)
    assert after[:len(before)] == before
    audited = [json.loads(e)["payload"] for e in after[len(before):]]
    assert [(a["op"], a["actor"], a["tenant"]) for a in audited] == [
        ("resume", "buyer", "globex"), ("cancel", "buyer", "globex")]
