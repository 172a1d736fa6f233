"""The dispatcher against a real worker process, Redis (database 14) and Postgres.

Write first, then enqueue: start/resume/send/cancel from Python (async and the
sync twins), idempotent starts, and ``fleet.dispatch`` sent as a raw Celery
protocol-2 JSON message, the way a producer in another language sends it,
its answer read from the result backend's key.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from fleet_flows import ALL
from fleet_worker_kit import WorkerProcess, fleet_env, start_workers
from kombu import Connection, Exchange, Queue
from postgres_server import throwaway_database
from redis_server import url_with_db

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher, Send, Start
from fleet.dispatcher.signing import sign_dispatch
from fleet.kernel.errors import (
    ConfigurationError,
    ExecutionCancelledError,
    ExecutionNotFoundError,
    ValidationError,
    WaitTimeoutError,
)
from fleet.kernel.security import Principal
from fleet.workers import make_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REDIS_DB = 14
SECRET = "test-secret-for-the-dispatcher-tests"
KEYS = {"producer-1": {"client": "node-producer", "secret": SECRET, "tenants": ["*"]}}


@dataclass
class Fleet:
    settings: FleetSettings
    app: Any
    worker: WorkerProcess
    redis: redis.Redis


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    broker = url_with_db(REDIS_DB)
    client = redis.Redis.from_url(broker)  # never flushed: runs may share the server
    queue = f"fleet-d-{secrets.token_hex(3)}"
    with throwaway_database() as database_url:
        settings = FleetSettings(database_url=database_url, broker_url=broker, queue=queue,
                                 flows=ALL.split(","), lease_ms=1500)
        env = fleet_env(database_url=database_url, broker_url=broker, queue=queue, flows=ALL,
                        extra={"FLEET_TEST_RESULT_BACKEND": broker,
                               "FLEET_DISPATCH_KEYS": json.dumps(KEYS)})
        app = make_app(settings)
        (worker,) = start_workers([("dispatch", [queue])], env,
                                  tmp_path_factory.mktemp("dispatcher"), app,
                                  app_module="fleet_test_app")
        try:
            yield Fleet(settings, app, worker, client)
        finally:
            worker.stop()
            app.close()
            client.close()


async def _result(dispatcher: Dispatcher, execution_id: str, timeout: float = 30.0) -> Any:
    runtime = await dispatcher.runtime()
    return await asyncio.wait_for(runtime.result(execution_id), timeout)


async def _parked(dispatcher: Dispatcher, execution_id: str, timeout: float = 20.0) -> None:
    runtime = await dispatcher.runtime()
    deadline = time.monotonic() + timeout
    # Parked by a worker process: nothing here to await but the store.
    while (await runtime.load_state(execution_id, system=True)).status != "parked":
        if time.monotonic() > deadline:
            raise AssertionError(f"{execution_id} did not park")
        await asyncio.sleep(0.05)


async def _types(dispatcher: Dispatcher, execution_id: str) -> list[str]:
    return [str(e.type) for e in await (await dispatcher.runtime()).store.read(execution_id)]


async def test_a_repeated_start_returns_the_same_execution(fleet: Fleet) -> None:
    alice = Principal("alice", tenant="t1")
    async with Dispatcher(fleet.settings) as dispatcher:
        eid = f"order-{secrets.token_hex(4)}"
        first = await dispatcher.start("fleet-three", 1, principal=alice, execution_id=eid)
        again = await dispatcher.start("fleet-three", 1, principal=alice, execution_id=eid)
        assert first == again == eid
        assert await _result(dispatcher, eid) == 4
        late = await dispatcher.start("fleet-three", 1, principal=alice, execution_id=eid)
        assert late == eid

        keyed = await dispatcher.start("fleet-three", 2, principal=alice, idempotency_key="k-1")
        assert await dispatcher.start("fleet-three", 2, principal=alice,
                                      idempotency_key="k-1") == keyed
        other_tenant = await dispatcher.start("fleet-three", 2, idempotency_key="k-1",
                                              principal=Principal("bob", tenant="t2"))
        assert other_tenant != keyed
        assert await _result(dispatcher, keyed) == 5
        assert await _result(dispatcher, other_tenant) == 5
        with pytest.raises(ValidationError):
            await dispatcher.start("fleet-three", 2, execution_id="x", idempotency_key="k")
        for execution_id in (eid, keyed):
            types = await _types(dispatcher, execution_id)
            assert types.count("EXECUTION_STARTED") == 1
            assert types.count("EXECUTION_COMPLETED") == 1
            assert types.count("STEP_STARTED") == 3
        # The extra drives were harmless: they stepped aside or found nothing to do.
        assert dispatcher.enqueued == 6
    # The drive enqueued after the end finds nothing to do.
    for _ in range(100):
        stats = await asyncio.to_thread(fleet.worker.stats, fleet.app)
        if stats.get("idle", 0) >= 1:
            break
        await asyncio.sleep(0.1)
    assert stats["idle"] >= 1


async def test_resume_send_and_cancel_through_the_dispatcher(fleet: Fleet) -> None:
    owner = Principal("ops", tenant="acme")
    async with Dispatcher(fleet.settings) as dispatcher:
        gated = await dispatcher.start("fleet-gate", 1, principal=owner)
        await _parked(dispatcher, gated)
        await dispatcher.resume(gated, "approval", {"by": "boss"}, principal=owner)
        assert await _result(dispatcher, gated) == {"before": 2, "approved": {"by": "boss"}}

        waiting = await dispatcher.start("fleet-receive", 5, principal=owner)
        await _parked(dispatcher, waiting)
        assert await dispatcher.send(waiting, "ping", {"n": 1}, principal=owner) is True
        assert await _result(dispatcher, waiting) == {"before": 6, "message": {"n": 1}}

        doomed = await dispatcher.start("fleet-gate", 2, principal=owner)
        await _parked(dispatcher, doomed)
        await dispatcher.cancel(doomed, principal=owner, reason="no longer needed")
        with pytest.raises(ExecutionCancelledError):
            await _result(dispatcher, doomed)


async def test_sync_twins_run_outside_a_loop_and_refuse_inside_one(fleet: Fleet) -> None:
    dispatcher = Dispatcher(fleet.settings)
    with pytest.raises(ConfigurationError, match="sync twin"):
        dispatcher.start_sync("fleet-three", 1)

    def from_plain_code() -> tuple[str, str]:
        with Dispatcher(fleet.settings) as sync:
            eid = sync.start_sync("fleet-gate", 7)
            keyed = sync.start_sync("fleet-three", 1, idempotency_key="sync-key")
            assert sync.start_sync("fleet-three", 1, idempotency_key="sync-key") == keyed
            return eid, keyed

    gated, keyed = await asyncio.to_thread(from_plain_code)
    async with dispatcher:
        await _parked(dispatcher, gated)
        assert await _result(dispatcher, keyed) == 4

    def resume_from_plain_code() -> None:
        with Dispatcher(fleet.settings) as sync:
            sync.resume_sync(gated, "approval", True)

    await asyncio.to_thread(resume_from_plain_code)
    async with Dispatcher(fleet.settings) as dispatcher:
        assert await _result(dispatcher, gated) == {"before": 8, "approved": True}


def _publish_raw(broker: str, queue: str, body: str) -> str:
    """A ``fleet.dispatch`` message as any Celery client writes it: protocol 2, JSON."""
    task_id = str(uuid.uuid4())
    headers = {"lang": "js", "task": "fleet.dispatch", "id": task_id, "root_id": task_id,
               "parent_id": None, "group": None, "retries": 0, "eta": None, "expires": None,
               "timelimit": [None, None], "argsrepr": "", "kwargsrepr": "", "shadow": None,
               "origin": "node-producer", "ignore_result": False}
    with Connection(broker) as conn:
        conn.Producer().publish(
            body, exchange=queue, routing_key=queue, headers=headers,
            content_type="application/json", content_encoding="utf-8",
            correlation_id=task_id, declare=[Queue(queue, Exchange(queue), routing_key=queue)])
    return task_id


def _reply(client: redis.Redis, task_id: str, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        raw = client.get(f"celery-task-meta-{task_id}")
        if raw is not None:
            meta = json.loads(raw)
            assert meta["status"] == "SUCCESS", meta
            return dict(meta["result"])
        time.sleep(0.05)
    raise AssertionError(f"no answer to {task_id}")


def _message(kwargs: dict[str, Any] | None = None, args: list[Any] | None = None) -> str:
    return json.dumps([args or [], kwargs or {},
                       {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])


async def test_fleet_dispatch_from_a_raw_message_and_typed_errors_for_bad_ones(
        fleet: Fleet) -> None:
    broker, queue = fleet.settings.broker, fleet.settings.queue

    def send(kwargs: dict[str, Any] | None = None,
             args: list[Any] | None = None) -> dict[str, Any]:
        # Signed as decision 0018 says (a producer in any language computes the same).
        kwargs = sign_dispatch(kwargs, key_id="producer-1", secret=SECRET) if kwargs else None
        args = [sign_dispatch(a, key_id="producer-1", secret=SECRET) if isinstance(a, dict)
                else a for a in args] if args else None
        return _reply(fleet.redis, _publish_raw(broker, queue, _message(kwargs, args)))

    principal = {"actor": "billing", "tenant": "acme"}
    started = await asyncio.to_thread(send, {
        "op": "start", "flow_id": "fleet-gate", "input": 3, "principal": principal,
        "idempotency_key": "invoice-77"})
    assert started["ok"] is True, started
    assert started["enqueued"] is True
    eid = started["execution_id"]
    # One JSON object as the only positional argument works too.
    again = await asyncio.to_thread(send, None, [{
        "op": "start", "flow_id": "fleet-gate", "input": 3, "principal": principal,
        "idempotency_key": "invoice-77"}])
    assert again["execution_id"] == eid

    async with Dispatcher(fleet.settings) as dispatcher:
        await _parked(dispatcher, eid)
        resumed = await asyncio.to_thread(send, {
            "op": "resume", "execution_id": eid, "gate": "approval", "payload": "yes",
            "principal": principal})
        assert resumed["ok"] is True, resumed
        assert await _result(dispatcher, eid) == {"before": 4, "approved": "yes"}

    bad = await asyncio.to_thread(send, {"op": "launch", "flow_id": "fleet-gate"})
    assert bad["ok"] is False
    assert bad["error"]["code"] == "validation"
    assert bad["error"]["details"][0]["loc"] == ["op"]
    missing = await asyncio.to_thread(send, {"op": "resume", "execution_id": eid})
    assert missing["error"]["code"] == "validation"
    assert "gate" in missing["error"]["message"]
    unknown = await asyncio.to_thread(send, {"op": "start", "flow_id": "no-such-flow"})
    assert unknown["ok"] is False
    assert unknown["error"]["code"] == "flow_not_found"
    assert unknown["error"]["retryable"] is False
    finished = await asyncio.to_thread(send, {
        "op": "resume", "execution_id": eid, "gate": "approval", "principal": principal})
    assert finished["error"]["code"] == "execution_finished"
    mixed = await asyncio.to_thread(send, {"op": "cancel", "execution_id": eid}, [1])
    assert mixed["error"]["code"] == "dispatch_refused"
    assert mixed["error"]["details"] == [{"reason": "malformed"}]
    # The worker is still serving after the bad ones.
    fine = await asyncio.to_thread(send, {"op": "start", "flow_id": "fleet-three", "input": 0})
    async with Dispatcher(fleet.settings) as dispatcher:
        assert await _result(dispatcher, fine["execution_id"]) == 3
    assert fleet.worker.alive()


def _queued(client: redis.Redis, queue: str) -> list[tuple[str, Any]]:
    """(task, first argument) of each message on ``queue``, oldest first."""
    found = []
    for raw in reversed(client.lrange(queue, 0, -1)):
        message = json.loads(raw)
        args, _, _ = json.loads(base64.b64decode(message["body"]))
        found.append((message["headers"]["task"], args[0]))
    return found


async def test_drives_published_together_are_batched_and_all_driven(fleet: Fleet) -> None:
    """Decision 0030: the drives of one route published together go out as
    ``fleet.drives`` messages of at most ``FLEET_DRIVE_BATCH`` executions (one alone:
    ``fleet.drive``), each with its drive record; a worker drives every one."""
    idle = f"fleet-d-idle-{secrets.token_hex(3)}"  # no worker consumes it
    held = fleet.settings.model_copy(update={"queue": idle, "drive_batch": 16})
    try:
        async with Dispatcher(held) as dispatcher:
            ids = await dispatcher.start_many([Start("fleet-three", n) for n in range(40)])
            alone = await dispatcher.start("fleet-three", 40)
            records = await dispatcher.recent_drives([*ids, alone])
        queued = _queued(fleet.redis, idle)
        assert [task for task, _ in queued] == ["fleet.drives"] * 3 + ["fleet.drive"]
        assert [len(arg) for _, arg in queued[:3]] == [16, 16, 8]
        assert [i for _, arg in queued[:3] for i in arg] == ids  # in order, each once
        assert queued[3][1] == alone
        assert set(records) == {*ids, alone}  # decision 0019: a record per execution
        # drive_batch=1: one fleet.drive message per execution, as before.
        single = fleet.settings.model_copy(update={"queue": idle, "drive_batch": 1})
        fleet.redis.delete(idle)
        async with Dispatcher(single) as dispatcher:
            more = await dispatcher.start_many([Start("fleet-three", n) for n in range(3)])
        assert _queued(fleet.redis, idle) == [("fleet.drive", i) for i in more]
        # The worker's queue gets the batched messages: every execution is driven.
        for raw in [*reversed(fleet.redis.lrange(idle, 0, -1))]:
            fleet.redis.lpush(fleet.settings.queue, raw)
        async with Dispatcher(fleet.settings) as dispatcher:
            batched = await dispatcher.start_many([Start("fleet-three", n) for n in range(20)])
            for n, eid in enumerate([*batched, *more]):
                assert await _result(dispatcher, eid) == (n if n < 20 else n - 20) + 3
            for eid in ids:  # started on the idle queue, never driven
                state = await (await dispatcher.runtime()).load_state(eid, system=True)
                assert state.status == "running"
    finally:
        fleet.redis.delete(idle)


def test_the_worker_log_has_no_task_failure(fleet: Fleet) -> None:
    """Nothing above made the worker raise: every refusal was an answer."""
    log = fleet.worker.log()
    assert "raised unexpected" not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_wait_result_and_every_sync_twin_from_plain_code(fleet: Fleet) -> None:
    """Issue 15 item 3 (the dispatcher's half): wait for a state, a result, with sync twins
    for all of it, for executions a worker process drives."""
    owner = Principal("ops", tenant="acme")
    stranger = Principal("eve", tenant="other")
    with Dispatcher(fleet.settings) as dispatcher:
        gated = dispatcher.start_sync("fleet-gate", 1, principal=owner)
        parked = dispatcher.wait_sync(gated, until="parked", timeout=30, principal=owner)
        assert (parked.status, parked.waiting_on) == ("parked", "approval")
        with pytest.raises(WaitTimeoutError) as waited:
            dispatcher.wait_sync(gated, until="terminal", timeout=0.3, principal=owner)
        assert isinstance(waited.value, TimeoutError)
        assert "parked on 'approval'" in str(waited.value)
        with pytest.raises(WaitTimeoutError):
            dispatcher.result_sync(gated, timeout=0.3, principal=owner)
        with pytest.raises(ExecutionNotFoundError):  # may not read it: told there is none
            dispatcher.result_sync(gated, timeout=1, principal=stranger)
        with pytest.raises(ValidationError):
            dispatcher.wait_sync(gated, until="bogus", principal=owner)  # type: ignore[arg-type]
        with pytest.raises(ExecutionNotFoundError):
            dispatcher.wait_sync("no-such-execution", timeout=1)
        order = dispatcher.write_resume_sync(gated, "approval", "yes", principal=owner)
        dispatcher.publish_sync([order])
        assert dispatcher.result_sync(gated, timeout=30, principal=owner) == {
            "before": 2, "approved": "yes"}
        done = dispatcher.wait_sync(gated, timeout=1, principal=owner)
        assert done.status == "completed"

        receivers = dispatcher.start_many_sync([Start("fleet-receive", n, principal=owner)
                                                for n in (1, 2)])
        for eid in receivers:
            dispatcher.wait_sync(eid, until="parked", timeout=30, principal=owner)
        woke = dispatcher.send_many_sync([Send(eid, "ping", {"to": eid}, principal=owner)
                                          for eid in receivers])
        assert woke == [True, True]
        for n, eid in zip((1, 2), receivers, strict=True):
            assert dispatcher.result_sync(eid, timeout=30, principal=owner) == {
                "before": n + 1, "message": {"to": eid}}
        dispatcher.enqueue_drive_sync(receivers[0])  # a harmless extra: it finds it ended
