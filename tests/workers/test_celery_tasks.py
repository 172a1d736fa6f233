"""``fleet.drive`` and ``fleet.dispatch`` run by a real Celery worker, in this process.

Celery's test worker (``celery.contrib.testing.worker.start_worker``, what pytest-celery's
fixtures use; no Docker): the app is the fleet's own (``make_app``), on Celery's in-memory
broker, the worker a threads pool in a thread of this process, for this module only.
The worker's signals open its ``WorkerProcess`` as they do in ``fleet worker``; the
store is a SQLite file that this test reads too. Messages go through kombu, the
tasks' arguments through JSON, replies through a result backend: what a unit test
with a stand-in app cannot show. The real-process versions (Redis, RabbitMQ,
prefork, SIGKILL) are in ``tests/integration/test_workers.py`` and
``test_dispatcher.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker

from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher
from fleet.dispatcher.routing import DISPATCH_TASK, DRIVE_TASK, DRIVES_TASK
from fleet.dispatcher.signing import sign_dispatch
from fleet.host.celery_api import signals
from fleet.kernel.store.spi import ExecutionSummary
from fleet.workers import make_app
from fleet.workers.process import WorkerProcess, local_process
from fleet.workers.tasks import MAX_BATCH

FLOWS = ["worker_unit_flows:double", "worker_unit_flows:gate"]
QUEUES = ["q-in-process", "q-in-process-doubles"]
SECRET = "unit-test-dispatch-key-0123456789"


@pytest.fixture(scope="module")
def in_process_settings(tmp_path_factory: pytest.TempPathFactory) -> FleetSettings:
    data = tmp_path_factory.mktemp("celery-worker")
    return FleetSettings(
        database_url=f"sqlite:///{data / 'fleet.db'}", broker_url="memory://",
        redis_url=None, flows=FLOWS, lease_ms=60_000,
        queue=QUEUES[0], routes={"flow:unit-double": QUEUES[1]}, worker_drives=4,
        heartbeat_dir=str(data / "beats"),
        dispatch_keys={"unit": {"client": "unit", "secret": SECRET, "tenants": ["*"]}})


@pytest.fixture(scope="module")
def in_process_app(in_process_settings: FleetSettings) -> Iterator[Any]:
    """The fleet's app (its tasks, routes, hooks) on the in-memory broker."""
    # The in-memory broker polls (1 s by default): poll often, the tests wait on it.
    app = make_app(in_process_settings, main="fleet-in-process",
                   result_backend="cache+memory://",
                   broker_transport_options={"polling_interval": 0.01})
    yield app
    app.close()


@pytest.fixture(scope="module")
def in_process_worker(in_process_app: Any) -> Iterator[Any]:
    """The worker, stopped when this module's tests are done, not at the session's end.

    Every ``memory://`` connection in the process shares one broker (kombu's memory
    transport keeps its queues and its broadcast exchanges in class attributes): a
    worker left running answers every later test's broadcast, and ``fleet status``
    on ``memory://`` in tests/cli counted it among its workers. The ping check needs
    Celery's own test task; the drives are the check here."""
    with start_worker(in_process_app, pool="threads", queues=QUEUES, concurrency=4,
                      perform_ping_check=False) as controller:
        yield controller


@pytest.fixture
def worker(in_process_worker: Any) -> WorkerProcess:
    """The ``WorkerProcess`` the module worker's ``worker_init`` opened."""
    process = local_process()
    assert process is not None, "worker_init did not open the worker process"
    return process


def _summary(process: WorkerProcess, execution_id: str) -> ExecutionSummary | None:
    return process.loop.run_coroutine(process.runtime.store.get_execution(execution_id))


def _wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _start_unenqueued(process: WorkerProcess, flow_id: str, value: Any) -> str:
    handle = process.loop.run_coroutine(process.runtime.start(flow_id, value, drive=False))
    return handle.execution_id


class _Returned:
    """What each task returned, by task id, as the worker saw it (``task_postrun``):
    ``fleet.drive`` keeps no result in a backend."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.arrived = threading.Condition()

    def __call__(self, task_id: str | None = None, retval: Any = None, **_: Any) -> None:
        with self.arrived:
            self.values[str(task_id)] = retval
            self.arrived.notify_all()

    def wait(self, task_id: str, timeout: float = 10.0) -> Any:
        with self.arrived:
            assert self.arrived.wait_for(lambda: task_id in self.values, timeout), task_id
            return self.values[task_id]


def test_the_drive_task_says_how_the_run_ended(in_process_app: Any,
                                               worker: WorkerProcess) -> None:
    app = in_process_app
    returned = _Returned()
    signals.task_postrun.connect(returned, weak=False)

    def drive(execution_id: str, queue: str = QUEUES[0]) -> Any:
        return returned.wait(app.send_task(DRIVE_TASK, args=[execution_id], queue=queue).id)

    # The result, in words (what Flower shows: issue 14 item 5).
    done = _start_unenqueued(worker, "unit-double", 21)
    assert drive(done, QUEUES[1]) == "completed"
    assert drive(done) == "nothing to do (completed)"  # a second delivery
    parked = _start_unenqueued(worker, "unit-gate", 0)
    said = drive(parked)
    assert said.startswith("parked on ")
    assert said.endswith("(gate)")
    assert drive("no-such-execution") == "no execution 'no-such-execution'"
    signals.task_postrun.disconnect(returned)
    summary = _summary(worker, done)
    assert summary is not None
    assert summary.status == "completed"
    assert worker.loop.run_coroutine(worker.runtime.result(done)) == 42


def test_the_drives_task_drives_each_and_refuses_a_forged_batch(
        in_process_app: Any, worker: WorkerProcess) -> None:
    app = in_process_app
    returned = _Returned()
    signals.task_postrun.connect(returned, weak=False)

    def drives(execution_ids: Any, queue: str = QUEUES[0]) -> Any:
        sent = app.send_task(DRIVES_TASK, args=[execution_ids], queue=queue,
                             kwargs={"flow_id": None, "tenant": None})
        return returned.wait(sent.id)

    try:
        done = [_start_unenqueued(worker, "unit-double", n) for n in (1, 2, 3)]
        parked = _start_unenqueued(worker, "unit-gate", 0)
        before = worker.counters.deliveries
        # Each execution once (a repeated id is one drive), in the order given.
        said = drives([*done, parked, done[0], "no-such-execution"])
        # How each run ended, in words, beside its id (what Flower shows).
        assert said[:3] == [f"{e}: completed" for e in done]
        assert said[3].startswith(f"{parked}: parked on ")
        assert said[3].endswith("(gate)")
        assert said[4] == "no-such-execution: no execution 'no-such-execution'"
        assert len(said) == 5
        assert worker.counters.deliveries - before == 5
        assert [worker.loop.run_coroutine(worker.runtime.result(e)) for e in done] == [2, 4, 6]
        # Delivered again: nothing to do.
        assert drives(done) == [f"{e}: nothing to do (completed)" for e in done]
        # Forged or mangled: refused whole, nothing driven, the worker goes on.
        fresh = _start_unenqueued(worker, "unit-double", 9)
        before = worker.counters.deliveries
        for forged in (fresh, [], [fresh, 7], [fresh, ""], [fresh] * (MAX_BATCH + 1),
                       {"ids": [fresh]}, ["x" * 2000]):
            assert drives(forged) == ["refused"], forged
        assert worker.counters.deliveries == before
        summary = _summary(worker, fresh)
        assert summary is not None
        assert summary.status == "running"
        assert drives([fresh]) == [f"{fresh}: completed"]
    finally:
        signals.task_postrun.disconnect(returned)


class _Deliveries:
    """Each ``fleet.drive`` the worker took: its arguments and the queue it came from."""

    def __init__(self) -> None:
        self.seen: list[tuple[list[Any], dict[str, Any], str | None]] = []

    def __call__(self, task: Any = None, args: Any = None, kwargs: Any = None,
                 **_: Any) -> None:
        if task is not None and task.name == DRIVE_TASK:
            info = task.request.delivery_info or {}
            self.seen.append((list(args or []), dict(kwargs or {}), info.get("routing_key")))


def test_fleet_dispatch_writes_then_enqueues_a_drive_the_worker_runs(
        in_process_app: Any, worker: WorkerProcess) -> None:
    app = in_process_app
    deliveries = _Deliveries()
    signals.task_prerun.connect(deliveries, weak=False)

    def dispatch(**request: Any) -> dict[str, Any]:
        signed = sign_dispatch(request, key_id="unit", secret=SECRET)  # decision 0018
        reply: dict[str, Any] = app.send_task(DISPATCH_TASK, kwargs=signed).get(
            timeout=10, interval=0.01)
        return reply

    who = {"actor": "a", "tenant": "t"}
    started = dispatch(op="start", flow_id="unit-double", input=4, principal=who,
                       idempotency_key="celery-k")
    assert started["ok"], started
    assert started["enqueued"]
    eid = started["execution_id"]
    _wait_for(lambda: (s := _summary(worker, eid)) is not None and s.status == "completed")
    # Routed by its flow (FLEET_ROUTES), with what routes it in the message.
    assert ([eid], {"flow_id": "unit-double", "tenant": "t"}, QUEUES[1]) in deliveries.seen
    # Idempotent: the same key names the same execution; nothing new is written.
    again = dispatch(op="start", flow_id="unit-double", input=4, principal=who,
                     idempotency_key="celery-k")
    assert again["execution_id"] == eid
    # Refusals are answered, not raised: the worker goes on.
    refused = dispatch(op="resume", execution_id=eid, gate="go", principal=who)
    assert (refused["ok"], refused["error"]["code"]) == (False, "execution_finished")
    denied = dispatch(op="cancel", execution_id=eid, principal={"actor": "mallory",
                                                                "tenant": "t"})
    assert denied["error"]["code"] == "access_denied"
    assert dispatch(op="nope")["error"]["code"] == "validation"
    assert dispatch(op="start", flow_id="missing")["error"]["code"] == "flow_not_found"
    # A gate: parked by the worker, answered through fleet.dispatch, driven on.
    gated = dispatch(op="start", flow_id="unit-gate", input=0)
    gid = gated["execution_id"]
    _wait_for(lambda: (s := _summary(worker, gid)) is not None and s.status == "parked")
    woke = dispatch(op="send", execution_id=gid, key="k")
    assert (woke["ok"], woke["woke"], woke["enqueued"]) == (True, False, False)
    resumed = dispatch(op="resume", execution_id=gid, gate="go", payload="yes")
    assert resumed["ok"], resumed
    _wait_for(lambda: (s := _summary(worker, gid)) is not None and s.status == "completed")
    signals.task_prerun.disconnect(deliveries)
    assert [a for a, _, queue in deliveries.seen if queue == QUEUES[0]].count([gid]) == 2


def test_the_client_dispatcher_reaches_the_worker_without_the_workers_app(
        in_process_settings: FleetSettings, worker: WorkerProcess) -> None:
    # Dispatcher(settings): its own store and its own producer app on the same broker.
    with Dispatcher(in_process_settings) as dispatcher:
        eid = dispatcher.start_sync("unit-double", 5)
        assert "fleet.drive" not in dispatcher.app.tasks  # a producer: no worker tasks
    _wait_for(lambda: (s := _summary(worker, eid)) is not None and s.status == "completed")
