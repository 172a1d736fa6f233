"""Through the Dispatcher, on real Postgres, Redis and a worker process: an idempotent
start never hands back another tenant's execution, and derived ids cannot be squatted
(issue 10 item 2, decision 0024)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fleet_flows import ALL
from fleet_worker_kit import WorkerProcess, fleet_env, start_workers
from postgres_server import throwaway_database
from redis_server import url_with_db

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher, idempotent_execution_id
from fleet.kernel.errors import ExecutionConflictError, ReservedNameError
from fleet.kernel.security import Principal
from fleet.workers import make_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ALICE = Principal("alice", tenant="acme")
MALLORY = Principal("mallory", tenant="evil")


@dataclass
class Fleet:
    settings: FleetSettings
    worker: WorkerProcess


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    broker = url_with_db(14)
    queue = f"fleet-own-{secrets.token_hex(3)}"
    with throwaway_database() as database_url:
        settings = FleetSettings(database_url=database_url, broker_url=broker, queue=queue,
                                 flows=ALL.split(","), lease_ms=1500)
        env = fleet_env(database_url=database_url, broker_url=broker, queue=queue, flows=ALL)
        app = make_app(settings)
        (worker,) = start_workers([("own", [queue])], env,
                                  tmp_path_factory.mktemp("ownership"), app)
        try:
            yield Fleet(settings, worker)
        finally:
            worker.stop()
            app.close()


async def _result(dispatcher: Dispatcher, execution_id: str) -> Any:
    runtime = await dispatcher.runtime()
    return await asyncio.wait_for(runtime.result(execution_id), 30)


async def test_another_tenants_id_and_squatted_derived_ids_are_refused(fleet: Fleet) -> None:
    async with Dispatcher(fleet.settings) as dispatcher:
        runtime = await dispatcher.runtime()
        eid = f"order-{secrets.token_hex(4)}"
        assert await dispatcher.start("fleet-three", 1, principal=ALICE,
                                      execution_id=eid) == eid
        assert await _result(dispatcher, eid) == 4
        log = [e.to_dict() for e in await runtime.store.read(eid)]
        enqueued = dispatcher.enqueued

        with pytest.raises(ExecutionConflictError):
            await dispatcher.start("fleet-three", 1, principal=MALLORY, execution_id=eid)
        with pytest.raises(ExecutionConflictError):
            await dispatcher.start("fleet-whoami", "x", principal=ALICE, execution_id=eid)
        # A squatter cannot take the id alice's idempotency key names, nor a successor's.
        idem = idempotent_execution_id("fleet-three", "invoice-77", "acme")
        for squat in (idem, f"{eid}~1"):
            with pytest.raises(ReservedNameError):
                await dispatcher.start("fleet-three", 100, principal=MALLORY,
                                       execution_id=squat)
            assert await runtime.store.head(squat) is None
        assert dispatcher.enqueued == enqueued  # a refused start enqueues nothing
        assert [e.to_dict() for e in await runtime.store.read(eid)] == log

        keyed = await dispatcher.start("fleet-three", 2, principal=ALICE,
                                       idempotency_key="invoice-77")
        assert keyed == idem
        assert await _result(dispatcher, keyed) == 5
        summary = await runtime.store.get_execution(keyed)
        assert summary is not None
        assert (summary.owner, summary.tenant) == ("alice", "acme")
