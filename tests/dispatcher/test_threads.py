"""The sync twins from many threads at once, from a fresh dispatcher (issue 17 item 1).

A threaded WSGI server's first burst of requests: 64 threads call a brand-new
``Dispatcher``'s sync API at the same moment (a barrier), on the memory, SQLite
and Postgres stores, with a real Redis broker (a queue of its own that nobody
consumes: the test counts what was published). Every call returns, every
start is written once and published once. Then closing while calls are in
flight: each call completes or is refused with ``DispatcherClosedError``, none
hangs, and what a call said it wrote is in the store.

On the main branch before this change the first test failed: the concurrent
first calls each made their own loop thread; most raised "bound to a different
event loop" / "store belongs to another event loop", some hung.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from postgres_server import throwaway_database
from redis_server import url_with_db

from fleet import DispatcherClosedError, Principal
from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher, Start
from fleet.kernel.store.factory import open_event_store

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

THREADS = 64
FLOWS = "fleet_flows:three"
REDIS_DB = 12


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "memory":
        yield "memory:"
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fleet.db'}"
    else:
        with throwaway_database() as url:
            yield url


@pytest.fixture
def broker() -> Iterator[tuple[str, str, redis.Redis]]:
    url = url_with_db(REDIS_DB)
    queue = f"fleet-threads-{secrets.token_hex(4)}"
    client = redis.Redis.from_url(url)
    try:
        yield url, queue, client
    finally:
        client.delete(queue)
        client.close()


def published_ids(client: redis.Redis, queue: str) -> list[str]:
    """The execution id of every drive waiting in ``queue`` (``fleet.drive``, or several in
    a ``fleet.drives``: decision 0030)."""
    ids = []
    for raw in client.lrange(queue, 0, -1):
        first = json.loads(base64.b64decode(json.loads(raw)["body"]))[0][0]
        ids.extend(first if isinstance(first, list) else [first])
    return ids


def hammer(threads: int, call: Any) -> tuple[list[Any], list[BaseException], int]:
    """``call(i)`` in ``threads`` threads released together; (results, errors, hung)."""
    barrier = threading.Barrier(threads)
    results: list[Any] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        barrier.wait()
        try:
            value = call(i)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertions
            with lock:
                errors.append(exc)
        else:
            with lock:
                results.append(value)

    workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + 60
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
    return results, errors, sum(worker.is_alive() for worker in workers)


async def stored(database_url: str, ids: list[str]) -> dict[str, int | None]:
    store = open_event_store(database_url)
    try:
        return {eid: await store.head(eid) for eid in ids}
    finally:
        await store.close()


def test_64_threads_on_a_fresh_dispatchers_sync_api(
        database_url: str, broker: tuple[str, str, redis.Redis]) -> None:
    url, queue, client = broker
    settings = FleetSettings(database_url=database_url, broker_url=url, queue=queue,
                             flows=[FLOWS])
    dispatcher = Dispatcher(settings)
    try:
        def start(i: int) -> str:
            if i % 4 == 3:  # some repeat an idempotency key another thread also sends
                return dispatcher.start_sync("fleet-three", i, idempotency_key=f"k-{i % 8}",
                                             principal=Principal("web", tenant="t"))
            return dispatcher.start_sync("fleet-three", i, execution_id=f"t-{i}")

        results, errors, hung = hammer(THREADS, start)
        assert hung == 0
        assert errors == []
        assert len(results) == THREADS
        assert len(set(results)) == THREADS - 16 + 2  # 16 keyed calls name 2 executions
        # Every execution's drive was published (calls in flight together are written and
        # published as one group, where a repeated key is one drive).
        published = published_ids(client, queue)
        assert set(published) == set(results)
        assert len(published) <= THREADS
        # A second burst on the now-warm dispatcher, mixing the other twins.
        more, errors, hung = hammer(THREADS, lambda i: dispatcher.start_many_sync(
            [Start("fleet-three", i, execution_id=f"m-{i}-{j}") for j in range(3)]))
        assert (hung, errors) == (0, [])
        flat = [eid for batch in more for eid in batch]
        assert sorted(flat) == sorted(f"m-{i}-{j}" for i in range(THREADS)
                                               for j in range(3))
        assert dispatcher.enqueued == len(published) + 3 * THREADS
        assert dispatcher.enqueue_failed == 0
        if database_url != "memory:":
            heads = asyncio.run(stored(database_url, sorted(set(results) | set(flat))))
            assert set(heads.values()) == {0}
    finally:
        dispatcher.close()


def test_closing_while_calls_are_in_flight_completes_or_refuses_them(
        broker: tuple[str, str, redis.Redis], tmp_path: Path) -> None:
    url, queue, client = broker
    database_url = f"sqlite:///{tmp_path / 'fleet.db'}"
    settings = FleetSettings(database_url=database_url, broker_url=url, queue=queue,
                             flows=[FLOWS])
    dispatcher = Dispatcher(settings, close_timeout=10)
    started: list[str] = []
    closer = threading.Timer(0.3, dispatcher.close)

    def keep_starting(i: int) -> int:
        refused = 0
        for n in range(10_000):
            try:
                started.append(dispatcher.start_sync("fleet-three", n,
                                                     execution_id=f"c-{i}-{n}"))
            except DispatcherClosedError:
                refused += 1
                return refused
        return refused

    closer.start()
    began = time.monotonic()
    results, errors, hung = hammer(THREADS, keep_starting)
    took = time.monotonic() - began
    closer.join()
    assert hung == 0
    assert errors == []
    assert results == [1] * THREADS  # every thread was refused once, after the close
    assert took < 30
    with pytest.raises(DispatcherClosedError, match="closed"):
        dispatcher.start_sync("fleet-three", 1)
    with pytest.raises(DispatcherClosedError):
        dispatcher.wait_sync("c-0-0", timeout=1)
    # Every start a call answered is durable and was published.
    heads = asyncio.run(stored(database_url, started))
    assert started
    assert set(heads.values()) == {0}
    assert set(started) <= set(published_ids(client, queue))
    dispatcher.close()  # closing twice is fine


async def test_close_refuses_async_calls_after_it_and_waits_for_those_in_flight(
        broker: tuple[str, str, redis.Redis], tmp_path: Path) -> None:
    url, queue, _ = broker
    settings = FleetSettings(database_url=f"sqlite:///{tmp_path / 'a.db'}", broker_url=url,
                             queue=queue, flows=[FLOWS])
    dispatcher = Dispatcher(settings)
    in_flight = [asyncio.ensure_future(dispatcher.start("fleet-three", i)) for i in range(32)]
    await asyncio.sleep(0)
    await dispatcher.aclose()
    ids = await asyncio.gather(*in_flight, return_exceptions=True)
    done = [i for i in ids if isinstance(i, str)]
    refused = [i for i in ids if isinstance(i, DispatcherClosedError)]
    assert len(done) + len(refused) == 32
    assert done  # those that had begun were let finish
    with pytest.raises(DispatcherClosedError):
        await dispatcher.start("fleet-three", 1)
