"""The worker's parts in one process, on the memory store: the loop thread, the drive
outcomes (stepped aside, fenced out, idle), stats, routing and ``fleet.dispatch``.

``fleet.drive`` and ``fleet.dispatch`` under a real (in-process) Celery worker:
``test_celery_tasks.py``; the real-process versions: ``tests/integration/test_workers.py``
and ``test_dispatcher.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import worker_unit_flows as flows

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher, DriveRouter, check_routes, idempotent_execution_id
from fleet.dispatcher.remote import DispatchRequest
from fleet.dispatcher.routing import route_queue
from fleet.dispatcher.signing import DispatchRefusedError, DispatchVerifier
from fleet.host.loop import EventLoopThread, refuse_inside_loop
from fleet.kernel.errors import ConfigurationError
from fleet.kernel.flows import load_flow
from fleet.kernel.security import Principal
from fleet.workers.process import WorkerProcess
from fleet.workers.stats import (
    COUNTERS,
    SharedBoard,
    register_stats_source,
    unregister_stats_source,
)

FLOWS = ["worker_unit_flows:hold", "worker_unit_flows:double", "worker_unit_flows:gate"]


def _settings(**changes: Any) -> FleetSettings:
    base = {"database_url": "memory:", "broker_url": "memory://", "flows": FLOWS,
            "lease_ms": 60_000, "queue": "q-default"}
    base.update(changes)
    return FleetSettings(**base)


@pytest.fixture
def process() -> Iterator[WorkerProcess]:
    worker = WorkerProcess(_settings())
    worker.open()
    try:
        yield worker
    finally:
        worker.close()


def _start(process: WorkerProcess, flow_id: str, value: Any) -> str:
    handle = process.loop.run_coroutine(process.runtime.start(flow_id, value, drive=False))
    return handle.execution_id


# -- the loop thread ----------------------------------------------------------

def test_the_loop_thread_runs_coroutines_for_sync_callers() -> None:
    thread = EventLoopThread("unit-loop")
    thread.start()
    try:
        async def where() -> int:
            await asyncio.sleep(0)
            return threading.get_ident()

        async def boom() -> None:
            raise KeyError("inside")

        assert thread.run_coroutine(where()) == thread.ident
        with pytest.raises(KeyError, match="inside"):
            thread.run_coroutine(boom())
        with pytest.raises(TimeoutError):
            thread.run_coroutine(asyncio.sleep(5), timeout=0.05)
        # Many callers share the one loop.
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            idents = set(pool.map(lambda _: thread.run_coroutine(where()), range(32)))
        assert idents == {thread.ident}
    finally:
        thread.stop()
    assert not thread.is_alive()
    with pytest.raises(ConfigurationError):
        thread.run_coroutine(asyncio.sleep(0))


async def test_sync_twins_refuse_inside_a_running_loop() -> None:
    with pytest.raises(ConfigurationError, match="await the async form"):
        refuse_inside_loop("thing_sync")
    dispatcher = Dispatcher(_settings())
    with pytest.raises(ConfigurationError):
        dispatcher.start_sync("unit-double", 1)
    await dispatcher.aclose()


# -- drives -------------------------------------------------------------------

def test_a_drive_runs_to_the_end_of_the_run_and_says_how_it_stopped(
        process: WorkerProcess) -> None:
    done = _start(process, "unit-double", 21)
    assert process.drive(done) == "completed"
    assert process.drive(done) == "idle"  # already ended: nothing to do
    parked = _start(process, "unit-gate", 0)
    assert process.drive(parked) == "parked"
    assert process.drive("no-such-execution") == "not_found"
    stats = process.snapshot()
    assert stats["completed"] == 1
    assert stats["parked"] == 1
    assert stats["idle"] == 1
    assert stats["deliveries"] == 4
    assert stats["errors"] == 1
    assert stats["active"] == 0


def test_a_duplicate_delivery_steps_aside_and_a_fenced_out_run_is_counted(
        process: WorkerProcess) -> None:
    key = "fence-1"
    flows.STARTED[key], flows.RELEASE[key] = threading.Event(), threading.Event()
    eid = _start(process, "unit-hold", key)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(process.drive, eid)
        assert flows.STARTED[key].wait(5)
        assert process.drive(eid) == "stepped_aside"  # the lease is live
        # A successor takes the fence (as after a lease expiry); the run's next
        # write is refused.
        store = process.runtime.store
        process.loop.run_coroutine(store.acquire_fence(eid, holder="successor", lease_ms=1000))
        flows.RELEASE[key].set()
        assert first.result(5) == "fenced_out"
    events = process.loop.run_coroutine(store.read(eid))
    assert [str(e.type) for e in events] == ["EXECUTION_STARTED", "STEP_STARTED"]
    stats = process.snapshot()
    assert stats["fenced_out"] == 1
    assert stats["stepped_aside"] == 1
    assert stats["aborted"] == 1
    assert stats["completed"] == 0


# -- stats ----------------------------------------------------------------------

def test_stats_sources_and_the_prefork_board(process: WorkerProcess) -> None:
    register_stats_source("unit", lambda: {"outcomes_attached": 3, "stream_lag_ms": 1.5})
    register_stats_source("broken", lambda: 1 / 0)  # type: ignore[arg-type,return-value]
    try:
        snap = process.snapshot()
        assert snap["outcomes_attached"] == 3
        assert snap["stream_lag_ms"] == 1.5
    finally:
        unregister_stats_source("unit")
        unregister_stats_source("broken")
    board = SharedBoard(2)
    board.write_row(0, {"drives": 2, "completed": 2, "active": 1, "stream_lag_ms": 4.0})
    board.write_row(1, {"drives": 3, "parked": 1, "stream_lag_ms": 9.0})
    total = board.total()
    assert total["drives"] == 5
    assert total["completed"] == 2
    assert total["parked"] == 1
    assert total["active"] == 1
    assert total["stream_lag_ms"] == 9.0
    assert set(COUNTERS) <= set(total)


# -- routing, idempotency keys, flow specs -------------------------------------

def test_routes_flow_first_then_tenant_then_default() -> None:
    routes = check_routes({"flow:heavy": "q-heavy", "tenant:acme": "q-acme"})
    assert route_queue(routes, "q", flow_id="heavy", tenant="acme") == "q-heavy"
    assert route_queue(routes, "q", flow_id="light", tenant="acme") == "q-acme"
    assert route_queue(routes, "q", flow_id="light", tenant="other") == "q"
    assert route_queue(routes, "q") == "q"
    router = DriveRouter(routes, "q")
    assert router("fleet.drive", ["e"], {"flow_id": "heavy"}, {}) == {"queue": "q-heavy"}
    assert router("fleet.dispatch", [], {}, {}) == {"queue": "q"}
    assert router("other.task", [], {}, {}) is None
    for bad in ({"heavy": "q"}, {"flow:": "q"}, {"flow:x": ""}):
        with pytest.raises(ConfigurationError):
            check_routes(bad)


def test_idempotency_keys_are_scoped_to_tenant_and_flow() -> None:
    one = idempotent_execution_id("f", "k", "t1")
    assert one == idempotent_execution_id("f", "k", "t1")
    assert one != idempotent_execution_id("f", "k", "t2")
    assert one != idempotent_execution_id("g", "k", "t1")


def test_load_flow_names_what_is_wrong() -> None:
    assert load_flow("worker_unit_flows:double").flow_id == "unit-double"
    for spec, match in (("no-colon", "must look like"), ("no_such_module:x", "cannot import"),
                        ("worker_unit_flows:STARTED", "not a flow")):
        with pytest.raises(ConfigurationError, match=match):
            load_flow(spec)


# -- fleet.dispatch --------------------------------------------------------------

def test_dispatch_requests_are_validated_per_op() -> None:
    verifier = DispatchVerifier(None, allow_unsigned=True)

    def parse(args: list[Any], kwargs: dict[str, Any]) -> DispatchRequest:
        return DispatchRequest.model_validate(verifier.message_of(args, kwargs))

    assert parse([], {"op": "start", "flow_id": "f"}).op == "start"
    assert parse([{"op": "cancel", "execution_id": "e"}], {}).op == "cancel"
    for args, kwargs in (([], {"op": "resume", "execution_id": "e"}),
                         ([], {"op": "start"}), ([], {"op": "start", "flow_id": "f", "x": 1}),
                         ([1], {}), ([{"op": "cancel", "execution_id": "e"}], {"op": "x"})):
        with pytest.raises((ValueError, DispatchRefusedError)):
            parse(args, kwargs)
    who = DispatchRequest(op="start", flow_id="f", principal={"actor": "a", "tenant": "t"})
    assert who.who() == Principal("a", tenant="t")
