"""Issue 26 on the worker fleet: ``fleet worker``, ``fleet timers`` and ``fleet recovery``
subprocesses on Postgres and Redis, driven through the ``Dispatcher``.

Cancellation reaches a step running in a worker, a sleep, a wait and a child (whose
cleanup runs too); a wait's timeout races its payload on the timer service; a child
whose worker is SIGKILLed is recovered and its result reaches the parent; a message
sent by a flow whose worker dies right after sending is delivered once; an update
retried with the same id gets the first answer.

Redis database 8 with queue names carrying a random token, and a throwaway Postgres
database: concurrent runs do not meet. Steps tell the test where they run through
marker files (``fleet_react_flows``).
"""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fleet_procs_kit import Proc, StoreView, nodename, process_env, stop_all, until, wait_ready
from fleet_react_flows import ALL
from postgres_server import throwaway_database
from redis_server import url_with_db

from fleet import ChildFailedError, ExecutionCancelledError
from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher
from fleet.workers import make_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REDIS_DB = 8
LEASE_MS = 4000
GRACE_MS = 1500


@dataclass
class Fleet:
    env: dict[str, str]
    settings: FleetSettings
    app: Any
    store: StoreView
    dispatcher: Dispatcher
    log_dir: Path
    marks: Path
    token: str
    procs: dict[str, Proc] = field(default_factory=dict)

    def start_worker(self, name: str) -> Proc:
        node = nodename(name, self.token)
        env = {**self.env, "FLEET_HEARTBEAT_DIR": str(self.log_dir / "hb" / name)}
        proc = Proc(name, ["worker", "--queues", self.settings.queue, "--concurrency", "8",
                           "-n", node, "--without-mingle", "--without-gossip"],
                    env, self.log_dir, node)
        self.procs[name] = proc
        return proc

    def start_service(self, name: str) -> Proc:
        env = {**self.env, "FLEET_HEARTBEAT_DIR": str(self.log_dir / "hb" / name)}
        proc = Proc(name, [name], env, self.log_dir)
        self.procs[name] = proc
        return proc

    def mark(self, name: str) -> list[int]:
        """The pids that wrote marker ``name`` (one line an effect), [] before any."""
        path = self.marks / name
        return [int(line) for line in path.read_text().split()] if path.exists() else []

    def worker_of(self, pid: int) -> str:
        return next(n for n, p in self.procs.items() if p.proc.pid == pid)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    token = secrets.token_hex(3)
    queue = f"react-{token}"
    broker = url_with_db(REDIS_DB)
    log_dir = tmp_path_factory.mktemp("fleet-react")
    marks = log_dir / "marks"
    marks.mkdir()
    with throwaway_database() as database_url:
        env = process_env({
            "FLEET_DATABASE_URL": database_url, "FLEET_BROKER_URL": broker,
            "FLEET_REDIS_URL": broker, "FLEET_QUEUE": queue, "FLEET_FLOWS": ALL,
            "FLEET_LEASE_MS": str(LEASE_MS), "FLEET_RECOVERY_GRACE_MS": str(GRACE_MS),
            "FLEET_RECOVERY_INTERVAL_S": "0.5", "FLEET_TIMER_INTERVAL_S": "0.2",
            "FLEET_EVENTS_STREAM": f"fleet-test:{token}:events",
            "FLEET_TEST_MARKS": str(marks)})
        # Were a cleanup ever run in this (the dispatcher's) process, it would mark here too.
        os.environ["FLEET_TEST_MARKS"] = str(marks)
        settings = FleetSettings(database_url=database_url, broker_url=broker,
                                 redis_url=broker, queue=queue, flows=ALL.split(","),
                                 lease_ms=LEASE_MS)
        app = make_app(settings)
        store = StoreView(settings)
        dispatcher = Dispatcher(settings)
        built = Fleet(env, settings, app, store, dispatcher, log_dir, marks, token)
        try:
            built.start_worker("a")
            built.start_worker("b")
            built.start_service("timers")
            built.start_service("recovery")
            for proc in list(built.procs.values()):
                wait_ready(proc, app)
            yield built
        finally:
            stop_all(built.procs.values())
            dispatcher.close()
            store.close()
            app.close()


def _types(fleet: Fleet, execution_id: str) -> list[str]:
    return [str(e.type) for e in fleet.store.read(execution_id)]


def test_cancel_reaches_a_running_step_a_sleep_and_a_child(fleet: Fleet) -> None:
    d = fleet.dispatcher
    running = d.start_sync("react-step", "c1")
    until(lambda: fleet.mark("c1.long"), "the long step to start")
    sleeping = d.start_sync("react-sleep", "c2")
    fleet.store.until(sleeping, "parked")
    parent = d.start_sync("react-parent", {"tag": "c3"})
    fleet.store.until(parent, "parked")
    child = f"{parent}/child#0"
    fleet.store.until(child, "parked")

    for eid in (running, sleeping, parent):
        d.cancel_sync(eid, reason="test")
    for eid in (running, sleeping, parent, child):
        fleet.store.until(eid, "cancelled", timeout=60)
        with pytest.raises(ExecutionCancelledError):
            d.result_sync(eid, timeout=10)
    # Each flow's cleanup ran once; the long step ran once (never again after the cancel).
    assert len(fleet.mark("c1.cleanup")) == 1
    assert len(fleet.mark("c2.cleanup")) == 1
    assert len(fleet.mark("c3.child-cleanup")) == 1
    assert len(fleet.mark("c1.long")) == 1
    # Every cleanup ran in a worker: the dispatcher only writes and enqueues.
    workers = {p.proc.pid for p in fleet.procs.values()}
    for mark in ("c1.cleanup", "c2.cleanup", "c3.child-cleanup"):
        assert set(fleet.mark(mark)) <= workers, mark
    assert "STEP_CANCELLED" in _types(fleet, running)
    assert "TIMER_CANCELLED" in _types(fleet, sleeping)


def test_a_wait_with_a_timeout_races_its_payload_and_its_timer(fleet: Fleet) -> None:
    d = fleet.dispatcher
    answered = d.start_sync("react-wait", 60)
    fleet.store.until(answered, "parked")
    d.resume_sync(answered, "answer", {"ok": True})
    assert d.result_sync(answered, timeout=30) == {"answer": {"ok": True}}
    timed_out = d.start_sync("react-wait", 1.5)
    assert d.result_sync(timed_out, timeout=30) == {"timed_out": True}
    resolved = [e.payload for e in fleet.store.read(timed_out) if e.type == "FIRST_RESOLVED"]
    assert resolved == [{"name": "first#0", "index": 1}]


def test_an_update_retried_with_the_same_id_gets_the_first_answer(fleet: Fleet) -> None:
    d = fleet.dispatcher
    eid = d.start_sync("react-counter", 10)
    fleet.store.until(eid, "parked")
    assert d.update_sync(eid, "add", 5, update_id="u-1", timeout=30) == 15
    assert d.update_sync(eid, "add", 5, update_id="u-1", timeout=30) == 15
    assert _types(fleet, eid).count("MESSAGE_RECEIVED") == 1
    assert d.update_sync(eid, "add", 0, timeout=30) == 15
    assert d.result_sync(eid, timeout=30) == 15


def _kill_and_replace(fleet: Fleet, pid: int) -> None:
    name = fleet.worker_of(pid)
    fleet.procs[name].signal(signal.SIGKILL)
    fleet.procs[name].wait_exit(10)
    fleet.procs[name].stop()
    wait_ready(fleet.start_worker(f"{name}-again-{secrets.token_hex(2)}"), fleet.app)


def test_a_child_whose_worker_dies_is_recovered_and_reaches_its_parent(fleet: Fleet) -> None:
    d = fleet.dispatcher
    parent = d.start_sync("react-parent", {"tag": "k1", "crashy": "1"})
    (pid,) = until(lambda: fleet.mark("k1.work"), "the child's step to start")
    _kill_and_replace(fleet, pid)
    try:
        assert d.result_sync(parent, timeout=90) == {"child": "k1.work"}
    except ChildFailedError as failed:  # pragma: no cover - shown if it ever happens
        raise AssertionError(f"the child failed: {failed.error}") from failed
    assert len(fleet.mark("k1.work")) >= 2  # the recovery ran the step again
    assert "CHILD_ENDED" in _types(fleet, parent)


def test_a_message_sent_right_before_the_senders_worker_dies_arrives_once(
        fleet: Fleet) -> None:
    d = fleet.dispatcher
    inbox = d.start_sync("react-inbox", None)
    fleet.store.until(inbox, "parked")
    sender = d.start_sync("react-sender", {"target": inbox, "tag": "m1"})
    (pid,) = until(lambda: fleet.mark("m1.after"), "the step after the send to start")
    _kill_and_replace(fleet, pid)
    assert d.result_sync(sender, timeout=90) == "sent"
    assert d.result_sync(inbox, timeout=30) == {"from": sender}
    assert _types(fleet, inbox).count("MESSAGE_RECEIVED") == 1
    sent = [e for e in fleet.store.read(sender) if e.type == "MESSAGE_SENT"]
    assert len(sent) == 1
